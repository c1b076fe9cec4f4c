"""The fork server's pools of one-shot kernels, one per network policy, and their readiness.

Which runs may take a one-shot kernel is decided here (`pool_for`), and whether the pool can be
had (`had`: asked of the fork server off the event loop, once at a time; a pool that could not
be had is not asked for again for ASK_AGAIN seconds, its runs take ZMQ kernels meanwhile).
fresh.py's runner is the one caller. Like all of hosting/ it imports nothing of the [server]
extra, so `sandbox-kernel mcp` runs with the [mcp] extra alone (tests/test_extras.py).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

from ..client import CallerLimits, oneshot
from ..launch.oneshot import OneShotPool, OneShotUnavailable
from .events import json_line, log
from .network import Network, policy_name, split

PROBE_TIMEOUT = 30.0  # s: readiness's `pass` on a one-shot kernel
ASK_AGAIN = 30.0  # s: a pool the fork server could not give is asked for again after this


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
        self._asking: dict[bool, asyncio.Future[bool]] = {}
        self._refused_at: dict[bool, float] = {}  # when the fork server last could not give it

    def pool_for(self, network: Network) -> OneShotPool | None:
        """The pool for this run, or None when it needs a ZMQ kernel: its own allowlist, or a
        policy with credentials (no pool is made for it)."""
        allowed, hosts = split(network)
        return None if hosts is not None else self.pools.get(allowed)

    def prepare(self) -> None:
        """Ask for every pool now (starting the fork server), so the first run finds it full."""
        for pool in self.pools.values():
            pool.path = pool.ask()

    async def had(self, network: bool) -> bool:
        """Whether the network's pool is had from the fork server, asking for it if not (once
        at a time; not again within ASK_AGAIN seconds of a refusal)."""
        pool = self.pools[network]
        if pool.path:
            return True
        loop = asyncio.get_running_loop()
        if loop.time() - self._refused_at.get(network, -ASK_AGAIN) < ASK_AGAIN:
            return False
        if network not in self._asking or self._asking[network].done():
            self._asking[network] = asyncio.ensure_future(self._ask(network))
        return await asyncio.shield(self._asking[network])

    async def _ask(self, network: bool) -> bool:
        pool = self.pools[network]
        try:
            pool.path = await asyncio.to_thread(pool.ask)
            return True
        except OneShotUnavailable as exc:
            self._refused_at[network] = asyncio.get_running_loop().time()
            log.warning(json_line(event="one_shot_unavailable", policy=policy_name(network),
                                  error=str(exc), retry_after=ASK_AGAIN))
            return False

    async def close(self) -> None:
        """Stop asking for pools (the fork server, stopped by the kernel source, ends them)."""
        for asking in self._asking.values():
            asking.cancel()
        await asyncio.gather(*self._asking.values(), return_exceptions=True)

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
