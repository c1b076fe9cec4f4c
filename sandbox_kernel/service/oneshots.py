"""The fork server's pools of one-shot kernels, one per network policy, and their readiness.

Shared by the service's runs (runs.py) and the MCP server (mcp/kernels.py): it imports nothing
of the [server] extra, so `sandbox-kernel mcp` runs with the [mcp] extra alone
(tests/test_extras.py installs each extra by itself to keep it so).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

from ..client import CallerLimits, oneshot
from ..launch.oneshot import OneShotPool
from .kernels import Network, NetworkChoice, policy_name

PROBE_TIMEOUT = 30.0  # s: readiness's `pass` on a one-shot kernel


class OneShots:
    """The fork server's pools of one-shot kernels, one per network policy of the service."""

    def __init__(self, options: dict[bool, dict[str, Any]], size: int) -> None:
        # A policy with credentials (secrets.py) runs on ZMQ kernels: their companion gets the
        # vault, which a one-shot kernel, made before its request, cannot yet be given.
        self.pools = {network: OneShotPool(kwargs["policy"], size,
                                           python=kwargs.get("python") or sys.executable,
                                           preload=tuple(kwargs.get("preload", ())))
                      for network, kwargs in options.items()
                      if not kwargs["policy"].holds_credentials()}
        self.limits = {network: CallerLimits.from_policy(kwargs["policy"].as_dict())
                       for network, kwargs in options.items()}
        # Per policy name: whether a one-shot kernel of it has run code here, and the latest
        # probe's error; readiness counts these beside the ZMQ kernels' starts.
        self.health: dict[str, dict[str, Any]] = {
            policy_name(network): {"started": False, "error": None} for network in self.pools}

    def pool_for(self, network: Network) -> OneShotPool | None:
        """The pool for this run, or None when it needs a ZMQ kernel (its own allowlist)."""
        if isinstance(network, NetworkChoice) and network.mode == "hosts":
            return None
        return self.pools.get(bool(network))

    def prepare(self) -> None:
        """Ask for every pool now (starting the fork server), so the first run finds it full."""
        for pool in self.pools.values():
            pool.path = pool.ask()

    async def probe(self, stopped: Callable[[], bool], retry: float = 2.0) -> None:
        """Run `pass` on a one-shot kernel of each pool until one has answered (proof that its
        layers apply here), keeping each failure's reason for /ready; until stopped()."""
        for network, pool in self.pools.items():
            state = self.health[policy_name(network)]
            while not state["started"] and not stopped():
                try:
                    execution = await oneshot.run(pool, "pass", None, PROBE_TIMEOUT,
                                                  limits=self.limits[network])
                    error = execution.error
                    state["error"] = None if error is None else f"{error.name}: {error.value}"
                except Exception as exc:  # whatever stops it is what /ready must say
                    state["error"] = f"{type(exc).__name__}: {exc}"
                state["started"] = state["error"] is None
                if not state["started"]:
                    await asyncio.sleep(retry)
