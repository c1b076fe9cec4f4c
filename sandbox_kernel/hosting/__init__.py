"""Handing kernels to many callers: what a multi-tenant face needs, written once.

Between the faces (service/, mcp/) and client/ + launch/ (DESIGN.md §13's last paragraph):
kernel sources (sources.py: warm ZMQ pools; oneshots.py: the fork server's one-shot pools;
network.py: the one rule that makes a network choice a policy), the fresh run (fresh.py: a
one-shot kernel else a ZMQ kernel, one fallback, bounded, its output budget), admission and
fair shares (admission.py), and the snapshot store (store.py, snapshots.py). A face translates
its protocol to these and back; a feature both faces offer is written here once.

Nothing here imports a face or the [server] extra's packages (fastapi, starlette,
sse_starlette, prometheus_client): the MCP server runs with the [mcp] extra alone. Metrics are
a face's: hosting exposes counts and callbacks (`Store(refused=...)`, `Admission.in_flight`)
the service turns into Prometheus metrics.
"""
