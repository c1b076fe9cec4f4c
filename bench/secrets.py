"""What adding a secret costs: a request to an intercepted host beside one through a tunnel.

The egress proxy serves in a process of its own (as in a kernel's companion), an HTTPS origin on
127.0.0.1 with its own CA in this one; requests go through the proxy to the same origin, once as
a host of a secret (TLS ended and made anew by the proxy, the placeholder replaced, the response
scrubbed) and once as a plain allowed host (tunnelled). Per request on one kept-alive connection,
and per connection (each request a new TLS handshake, to the proxy and upstream), the figures
are the client's wall time and the proxy process's CPU (/proc/<pid>/stat, utime + stime) per
request, all in one run. With --kernels, kernel start (cold, `--network hosts`) with and without
a secret is timed too (needs `--secret`, i.e. the launcher side of secrets).

    python -m bench.secrets [--count N] [--kernels K]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import tempfile
import time
from pathlib import Path

import requests

from sandbox_kernel.confine.egress.proxy import Connection, EgressProxy
from sandbox_kernel.confine.egress.rules import EgressRules
from sandbox_kernel.confine.egress.secret import Secret
from tests.network_servers import Origin, self_signed

TICK = os.sysconf("SC_CLK_TCK")
PLACEHOLDER = "sk-sandbox-BENCH-placeholder"


class _Discard:
    def __call__(self, entry: Connection) -> None:
        pass

    def flush(self) -> None:
        pass


def _serve(sock: socket.socket, port: int, upstream_ca: bytes, ca_out: str) -> None:
    rules = EgressRules.parse("hosts", ["localhost", "127.0.0.1"], [f"127.0.0.1:{port}"])
    proxy = EgressProxy(rules, "bench", _Discard(), secrets=[
        Secret("BENCH", "sk-real-value-for-the-bench", ("localhost",), PLACEHOLDER)],
        upstream_ca=upstream_ca)
    assert proxy.ca is not None
    Path(ca_out).write_bytes(proxy.ca.certificate_pem() + upstream_ca)
    asyncio.run(proxy.serve(sock))


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _measure(url: str, proxy: str, trusted: str, count: int, pid: int,
             fresh: bool) -> tuple[float, float]:
    """Wall and proxy CPU seconds per request, over count requests."""
    headers = {"Authorization": f"Bearer {PLACEHOLDER}"}
    session = requests.Session()
    session.get(url, headers=headers, proxies={"https": proxy}, verify=trusted, timeout=10)
    cpu, start = _cpu(pid), time.perf_counter()
    for _ in range(count):
        if fresh:
            session.close()
            session = requests.Session()
        answer = session.get(url, headers=headers, proxies={"https": proxy}, verify=trusted,
                             timeout=10)
        assert answer.status_code == 200, answer.reason
    wall = time.perf_counter() - start
    return wall / count, (_cpu(pid) - cpu) / count


def requests_rows(count: int) -> None:
    """Print the per-request and per-handshake rows, intercepted beside tunnelled."""
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        cert, key = self_signed(directory, ["localhost"])
        origin = Origin(directory, (cert, key), echo=True)
        sock = socket.create_server(("127.0.0.1", 0))
        trusted = str(directory / "trusted.pem")
        context = multiprocessing.get_context("fork")
        server = context.Process(target=_serve, daemon=True,
                                 args=(sock, origin.port, cert.read_bytes(), trusted))
        server.start()
        while not os.path.exists(trusted) or not os.path.getsize(trusted):
            time.sleep(0.05)
        proxy = f"http://127.0.0.1:{sock.getsockname()[1]}"
        print(f"{count} requests each; ms per request (client wall, proxy CPU)")
        print(f"{'':36} {'intercepted':>18} {'tunnelled':>18} {'added':>14}")
        try:
            for fresh, label in ((False, "one kept-alive connection"),
                                 (True, "a new connection (TLS handshakes)")):
                got = {host: _measure(f"https://{host}:{origin.port}/", proxy, trusted,
                                      count, server.pid or 0, fresh)
                       for host in ("localhost", "127.0.0.1")}
                (wall, cpu), (tunnel_wall, tunnel_cpu) = got["localhost"], got["127.0.0.1"]
                print(f"{label:36} {wall * 1e3:8.2f} {cpu * 1e3:8.2f}  "
                      f"{tunnel_wall * 1e3:8.2f} {tunnel_cpu * 1e3:8.2f}  "
                      f"{(wall - tunnel_wall) * 1e3:6.2f} {(cpu - tunnel_cpu) * 1e3:6.2f}")
        finally:
            server.kill()
            origin.close()


def kernel_rows(kernels: int) -> None:
    """Print a cold kernel's start, with and without a secret (median of kernels starts)."""
    import statistics

    from sandbox_kernel.client import Sandbox
    from sandbox_kernel.policy import SandboxPolicy

    os.environ["BENCH_SECRET"] = "sk-real-value-for-the-bench"  # noqa: S105 (a bench's own)
    plain = {"network": "hosts", "allow_hosts": ["localhost"]}
    cases = {"without a secret": plain,
             "with a secret": {**plain, "secrets": ["BENCH_SECRET=localhost"]}}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(kernels):
        for name, settings in cases.items():  # interleaved: the load drifts for both alike
            start = time.perf_counter()
            with Sandbox(None, policy=SandboxPolicy(**settings), cold_start=True) as sb:
                assert sb.run("1").error is None
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"kernel start and a first run, {name:18} {statistics.median(values) * 1e3:8.1f} "
              f"ms (median of {kernels})")


def main() -> None:
    """Print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200, help="requests per row")
    parser.add_argument("--kernels", type=int, default=0, help="kernel starts per case")
    options = parser.parse_args()
    requests_rows(options.count)
    if options.kernels:
        kernel_rows(options.kernels)


if __name__ == "__main__":
    main()
