"""Where fresh kernels come from, and the record of every kernel the service holds.

`KernelSource` is the one seam between the service and the ways to get a kernel: `get(network)`
returns a started AsyncSandbox of that network policy that no one has used. `ReadyKernels` is
today's source: it starts AsyncSandboxes itself and keeps a few started ones ready per policy.
The warm pool / fork server of `sandbox_kernel.launch` plugs in here instead (see `make_source`).

`Kernels` wraps the source: it counts the kernels out, closes them in the background so a
response never waits for a shutdown, and at shutdown closes everything still out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from ..client import AsyncSandbox
from ..policy import SandboxPolicy

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


def policy_name(network: bool) -> str:
    return "network" if network else "offline"


class ReadyKernels:
    """Starts AsyncSandboxes, keeping `size` started ones ready for each network policy."""

    def __init__(self, base: SandboxPolicy, networks: tuple[bool, ...], size: int,
                 grace: float, startup_timeout: float = 60.0) -> None:
        self.base, self.size, self.grace = base, size, grace
        self.startup_timeout = startup_timeout
        self.networks = networks
        self._ready: dict[bool, asyncio.Queue[AsyncSandbox]] = {
            network: asyncio.Queue() for network in networks}
        self._starting: dict[bool, int] = dict.fromkeys(networks, 0)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def _policy(self, network: bool) -> SandboxPolicy:
        values = self.base.as_dict()
        values["allow_network"] = network
        return SandboxPolicy(**values)

    async def _start_one(self, network: bool) -> AsyncSandbox:
        sandbox = AsyncSandbox(kernel_name=None, policy=self._policy(network),
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


def make_source(base: SandboxPolicy, networks: tuple[bool, ...], pool_size: int,
                grace: float) -> KernelSource:
    """The kernel source the service uses: the one place to swap in launch/'s pool."""
    return ReadyKernels(base, networks, pool_size, grace)


def kernel_id(sandbox: AsyncSandbox) -> str:
    """The kernel's id for logs (jupyter_client's kernel id)."""
    return str(getattr(sandbox.manager, "kernel_id", None) or "")


class Kernels:
    """Every kernel the service holds: handed out by the source, closed through here."""

    def __init__(self, source: KernelSource) -> None:
        self.source = source
        self.live: set[AsyncSandbox] = set()
        self._closing: set[asyncio.Task[None]] = set()

    async def get(self, network: bool) -> AsyncSandbox:
        """A fresh kernel, counted as live until `discard`."""
        sandbox = await self.source.get(network)
        self.live.add(sandbox)
        return sandbox

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
