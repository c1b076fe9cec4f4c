"""Where the warm pools were: hosting/pool.py holds them (a pool of Sandboxes sits above the
client, #46); this name stays importable for callers who wrote
`from sandbox_kernel.launch.pool import KernelPool`, as the README once did.

The one import from launch/ up to hosting/, allowed by name in tests/test_layers.py
(`ALIASES`); nothing in the package imports this module.
"""

from __future__ import annotations

from ..hosting.pool import KernelPool, PoolClosed, PoolStartError, SandboxPool

__all__ = ["KernelPool", "PoolClosed", "PoolStartError", "SandboxPool"]
