"""The fork server's pools of one-shot kernels, per network policy and preload set, and their
readiness.

Which runs may take a one-shot kernel is decided here (`pool_for`), and whether the pool can be
had (`had`: asked of the fork server off the event loop, once at a time; a pool that could not
be had is not asked for again for ASK_AGAIN seconds, its runs take ZMQ kernels meanwhile).

On a runtime whose modules are preloaded, each network policy has a lean pool (its zygote holds
none of them: what a run importing nothing pays for) and, as runs need them, pools whose fork
server preloads a set of them (launch/imports.py reads the code and chooses the set). A run
whose set has no pool yet runs on the lean one while the set's pool is asked for; at most
`max_preloaded` such pools live at once, the least recently used one retired (its fork server
stopped) to make room.
fresh.py's runner is the one caller. Like all of hosting/ it imports nothing of the [server]
extra, so `sandbox-kernel mcp` runs with the [mcp] extra alone (tests/test_extras.py).
"""

from __future__ import annotations

import asyncio
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..client import CallerLimits, oneshot
from ..launch.forkserver import ForkServerClient
from ..launch.imports import PreloadSets
from ..launch.oneshot import OneShotPool, OneShotUnavailable, default_process
from .events import json_line, log
from .network import Network, policy_name, split

PROBE_TIMEOUT = 30.0  # s: readiness's `pass` on a one-shot kernel
ASK_AGAIN = 30.0  # s: a pool the fork server could not give is asked for again after this
DEFAULT_MAX_PRELOADED = 3  # pools of preload sets at once, over every network policy
PreloadKey = tuple[bool, tuple[str, ...]]  # (network allowed, modules its fork server preloads)


class OneShots:
    """The fork server's pools of one-shot kernels, one per network policy of the service."""

    def __init__(self, options: dict[bool, dict[str, Any]], size: int,
                 sets: PreloadSets | None = None,
                 max_preloaded: int = DEFAULT_MAX_PRELOADED, process: str = "") -> None:
        """sets: the runtime's preload sets (the lean pools then preload only their base);
        max_preloaded: pools of preload sets alive at once (0: every run on the lean pool);
        process: the one-shot process every pool runs (launch/oneshot.py; "": the default)."""
        self.sets, self.max_preloaded, self.size = sets, max_preloaded, size
        self.process = process or default_process()
        self.options = options
        # A policy with credentials (secrets.py) runs on ZMQ kernels: their companion gets the
        # vault, which a one-shot kernel, made before its request, cannot yet be given.
        self.pools = {network: OneShotPool(kwargs["policy"], size,
                                           python=kwargs.get("python") or sys.executable,
                                           preload=sets.lean() if sets is not None
                                           else tuple(kwargs.get("preload", ())),
                                           process=self.process)
                      for network, kwargs in options.items()
                      if not kwargs["policy"].holds_credentials()}
        # The pools of preload sets, least recently used first; the ones being asked for.
        self.preloaded: OrderedDict[PreloadKey, OneShotPool] = OrderedDict()
        self._asking_set: dict[PreloadKey, asyncio.Future[None]] = {}
        self.limits = {network: CallerLimits.from_policy(kwargs["policy"].as_dict())
                       for network, kwargs in options.items()}
        # Per policy name: whether a one-shot kernel of it has run code here, and the latest
        # probe's error; readiness counts these beside the ZMQ kernels' starts.
        self.health: dict[str, dict[str, Any]] = {
            policy_name(network): {"started": False, "error": None} for network in self.pools}
        self._asking: dict[bool, asyncio.Future[bool]] = {}
        # when the fork server last could not give it
        self._refused_at: dict[bool | PreloadKey, float] = {}

    def pool_for(self, network: Network, code: str = "") -> OneShotPool | None:
        """The pool for this run, or None when it needs a ZMQ kernel: its own allowlist, or a
        policy with credentials (no pool is made for it). With preload sets: the pool of the
        set the code needs if it is had, else the lean pool (and the set's is asked for)."""
        allowed, hosts = split(network)
        lean = None if hosts is not None else self.pools.get(allowed)
        if lean is None or self.sets is None or not self.max_preloaded or not code:
            return lean
        preload = self.sets.choose(code, [key[1] for key, pool in self.preloaded.items()
                                          if key[0] == allowed and pool.path])
        if preload == lean.preload:
            return lean
        key = (allowed, preload)
        pool = self.preloaded.get(key)
        if pool is not None and pool.path:
            self.preloaded.move_to_end(key)
            return pool
        if key not in self._asking_set and (pool is None or self._may_ask(key)):
            self._asking_set[key] = asyncio.ensure_future(self._ask_set(key))
        return lean

    def _may_ask(self, key: PreloadKey) -> bool:
        loop = asyncio.get_running_loop()
        return loop.time() - self._refused_at.get(key, -ASK_AGAIN) >= ASK_AGAIN

    async def _ask_set(self, key: PreloadKey) -> None:
        """Have the pool of a preload set (retiring the least recently used one if need be)."""
        network, preload = key
        try:
            pool = self.preloaded.get(key)
            if pool is None:
                while len(self.preloaded) >= self.max_preloaded:
                    await self._retire(next(iter(self.preloaded)))
                base = self.pools[network]
                pool = self.preloaded[key] = OneShotPool(base.policy, self.size,
                                                         python=base.python, preload=preload,
                                                         process=self.process)
            pool.path = await asyncio.to_thread(pool.ask)
            log.info(json_line(event="one_shot_pool_ready", policy=policy_name(network),
                               preload=list(preload)))
        except OneShotUnavailable as exc:
            self._refused_at[key] = asyncio.get_running_loop().time()
            log.warning(json_line(event="one_shot_unavailable", policy=policy_name(network),
                                  preload=list(preload), error=str(exc), retry_after=ASK_AGAIN))
        finally:
            self._asking_set.pop(key, None)

    async def _retire(self, key: PreloadKey) -> None:
        """Drop a preload set's pool and stop its fork server, unless another pool or the ZMQ
        kernels' source uses that server (a run on it already finishes: the server's grace)."""
        pool = self.preloaded.pop(key)
        keys = {(p.python, tuple(p.preload)) for p in [*self.pools.values(),
                                                       *self.preloaded.values()]}
        keys |= {(kwargs.get("python") or sys.executable, tuple(kwargs.get("preload", ())))
                 for kwargs in self.options.values()}
        if (pool.python, tuple(pool.preload)) not in keys:
            await asyncio.to_thread(ForkServerClient(python=pool.python,
                                                     preload=pool.preload).stop_server)
        log.info(json_line(event="one_shot_pool_retired", policy=policy_name(key[0]),
                           preload=list(key[1])))

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
        """Stop asking for pools and stop the fork servers of every pool: the preload sets'
        and the lean ones' (on a runtime with preload sets, the lean pools' server is not the
        kernel source's, which stops its own). A run on one already finishes: it no longer
        needs its server (kernel/oneshot_io.py take_connection)."""
        asked: list[asyncio.Future[Any]] = [*self._asking.values(),
                                            *self._asking_set.values()]
        for asking in asked:
            asking.cancel()
        await asyncio.gather(*asked, return_exceptions=True)
        while self.preloaded:
            await self._retire(next(iter(self.preloaded)))
        for python, preload in {(pool.python, tuple(pool.preload))
                                for pool in self.pools.values()}:
            await asyncio.to_thread(ForkServerClient(python=python, preload=preload).stop_server)

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
