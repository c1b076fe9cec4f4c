"""Where fresh kernels come from, and the record of every kernel the service holds.

`KernelSource` is the one seam between the service and the ways to get a kernel: `get(network)`
returns a started AsyncSandbox of that network policy that no one has used. Two sources:

- `ReadyKernels` starts AsyncSandboxes itself and keeps a few started ones ready per policy;
- `PoolSource` takes them from warm pools with launch/'s `KernelPool` interface (`await get()`,
  `ready`, `start()`, `await close()`, `sandbox_options`), one pool per network policy.

`make_source` picks one: the one place to change how the service gets kernels.

`Kernels` wraps the source: it bounds the wait for a kernel, counts the kernels out, closes them
in the background so a response never waits for a shutdown, and at shutdown closes them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from ..client import AsyncSandbox
from ..policy import SandboxPolicy
from .access import json_line

log = logging.getLogger("sandbox_kernel.service")


class KernelSource(Protocol):
    """Hands out started, never-used kernels."""

    async def start(self) -> None:
        """Begin filling (may return before any kernel is ready)."""

    async def get(self, network: bool) -> AsyncSandbox:
        """A started kernel with network allowed or not; raises RuntimeError if none can start."""

    def ready(self) -> dict[str, int]:
        """Started kernels waiting to be handed out, per policy name ("offline", "network")."""

    async def close(self) -> None:
        """Shut down every kernel not handed out."""


class KernelUnavailable(RuntimeError):
    """No kernel could be had: it did not start, or not in time."""


def policy_name(network: bool) -> str:
    return "network" if network else "offline"


def with_network(base: SandboxPolicy, network: bool,
                 network_env: dict[str, str] | None = None) -> SandboxPolicy:
    """The base policy with network allowed or not; network kernels also get network_env."""
    values = base.as_dict()
    values["allow_network"] = network
    if network and network_env:
        values["env"] = {**values["env"], **network_env}
    return SandboxPolicy(**values)


class ReadyKernels:
    """Starts AsyncSandboxes, keeping `size` started ones ready for each network policy."""

    def __init__(self, base: SandboxPolicy, networks: tuple[bool, ...], size: int,
                 grace: float, startup_timeout: float = 60.0,
                 network_env: dict[str, str] | None = None) -> None:
        self.base, self.size, self.grace = base, size, grace
        self.network_env = network_env
        self.startup_timeout = startup_timeout
        self.networks = networks
        self._ready: dict[bool, asyncio.Queue[AsyncSandbox]] = {
            network: asyncio.Queue() for network in networks}
        self._starting: dict[bool, int] = dict.fromkeys(networks, 0)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def _start_one(self, network: bool) -> AsyncSandbox:
        policy = with_network(self.base, network, self.network_env)
        sandbox = AsyncSandbox(kernel_name=None, policy=policy,
                               startup_timeout=self.startup_timeout, grace=self.grace)
        try:
            await sandbox.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(sandbox.close())
            raise
        return sandbox

    async def start(self) -> None:
        for network in self.networks:
            self._refill(network)

    def _refill(self, network: bool) -> None:
        missing = self.size - self._ready[network].qsize() - self._starting[network]
        for _ in range(max(0, missing)):
            self._starting[network] += 1
            task = asyncio.get_running_loop().create_task(self._fill_one(network))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _fill_one(self, network: bool) -> None:
        try:
            sandbox = await self._start_one(network)
        except Exception as exc:  # the next get() starts one itself and reports the cause
            log.warning("a %s kernel for the pool did not start: %s", policy_name(network), exc)
            return
        finally:
            self._starting[network] -= 1
        if self._closed:
            await sandbox.close()
        else:
            self._ready[network].put_nowait(sandbox)

    async def get(self, network: bool) -> AsyncSandbox:
        if network not in self._ready:
            raise RuntimeError(f"no {policy_name(network)} kernels are configured")
        queue = self._ready[network]
        sandbox = queue.get_nowait() if not queue.empty() else None
        self._refill(network)
        if sandbox is not None and await sandbox.manager.is_alive():
            return sandbox
        if sandbox is not None:
            await sandbox.close()
        return await self._start_one(network)

    def ready(self) -> dict[str, int]:
        return {policy_name(n): q.qsize() for n, q in self._ready.items()}

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        closing = []
        for queue in self._ready.values():
            while not queue.empty():
                closing.append(queue.get_nowait().close())
        await asyncio.gather(*closing, return_exceptions=True)


class PoolSource:
    """Kernels from one warm pool per network policy (launch/'s KernelPool interface).

    When a pool has nothing ready, the kernel is started here with the pool's own options rather
    than waiting for the pool's refill, so a burst of runs starts kernels side by side.
    """

    def __init__(self, pools: dict[bool, Any]) -> None:
        self.pools = pools

    async def start(self) -> None:
        for pool in self.pools.values():
            pool.start()

    async def get(self, network: bool) -> AsyncSandbox:
        pool = self.pools.get(network)
        if pool is None:
            raise RuntimeError(f"no {policy_name(network)} kernels are configured")
        if pool.ready:
            sandbox: AsyncSandbox = await pool.get()
            return sandbox
        sandbox = AsyncSandbox(**pool.sandbox_options)
        try:
            await sandbox.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(sandbox.close())
            raise
        return sandbox

    def ready(self) -> dict[str, int]:
        return {policy_name(network): pool.ready for network, pool in self.pools.items()}

    async def close(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self.pools.values()),
                             return_exceptions=True)


def make_source(base: SandboxPolicy, networks: tuple[bool, ...], pool_size: int,
                grace: float, network_env: dict[str, str] | None = None) -> KernelSource:
    """The kernel source the service uses: launch/'s warm pools when present, else our own."""
    try:
        from ..launch.pool import KernelPool  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        KernelPool = None
    if KernelPool is None or pool_size < 1:
        return ReadyKernels(base, networks, pool_size, grace, network_env=network_env)
    return PoolSource({network: KernelPool(size=pool_size, kernel_name=None, grace=grace,
                                           policy=with_network(base, network, network_env))
                       for network in networks})


def kernel_id(sandbox: AsyncSandbox) -> str:
    """The kernel's id for logs (jupyter_client's kernel id)."""
    return str(getattr(sandbox.manager, "kernel_id", None) or "")


class Kernels:
    """Every kernel the service holds: handed out by the source, closed through here."""

    def __init__(self, source: KernelSource, start_timeout: float = 60.0) -> None:
        self.source = source
        self.start_timeout = start_timeout
        self.live: set[AsyncSandbox] = set()
        self._closing: set[asyncio.Task[None]] = set()

    async def get(self, network: bool) -> AsyncSandbox:
        """A fresh kernel, counted as live until `discard`; KernelUnavailable if none comes.

        A kernel that fails to start (not one that is slow to) is tried once more: on a loaded
        host a start can fail once; a host that cannot run the policy fails both, fast.
        """
        try:
            sandbox = await self._get(network)
        except KernelUnavailable as first:
            if first.__cause__ is None:  # it timed out: the caller has waited long enough
                raise
            log.warning(json_line(event="kernel_start_failed", policy=policy_name(network),
                                  error=str(first), retrying=True))
            sandbox = await self._get(network)
        self.live.add(sandbox)
        return sandbox

    async def _get(self, network: bool) -> AsyncSandbox:
        try:
            return await asyncio.wait_for(self.source.get(network), self.start_timeout)
        except asyncio.TimeoutError:
            raise KernelUnavailable(f"no {policy_name(network)} kernel started within "
                                    f"{self.start_timeout:g} s") from None
        except Exception as exc:
            raise KernelUnavailable(f"the {policy_name(network)} kernel did not start: "
                                    f"{exc}") from exc

    def discard(self, sandbox: AsyncSandbox) -> None:
        """Shut a kernel down in the background; safe to call from a cancelled task."""
        if sandbox not in self.live:
            return
        self.live.discard(sandbox)
        task = asyncio.get_running_loop().create_task(self._close(sandbox))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close(sandbox: AsyncSandbox) -> None:
        try:
            await sandbox.close()
        except Exception as exc:
            log.warning("closing kernel %s failed: %s", kernel_id(sandbox), exc)

    @property
    def closing(self) -> int:
        return len(self._closing)

    async def close(self) -> None:
        """Shut down every kernel: those out, those closing, those the source keeps ready."""
        for sandbox in list(self.live):
            self.discard(sandbox)
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self.source.close()
