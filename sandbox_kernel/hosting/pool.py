"""Warm pools: N started kernels waiting, so a fresh kernel is a queue pop (hosting/sources.py
fills its kernel sources from them; callers of the client use them directly).

    async with KernelPool(size=4, policy=SandboxPolicy()) as pool:
        sandbox = await pool.get()      # started, never handed out before; the caller owns it
        try:
            ex = await sandbox.run(code, inputs={...})
        finally:
            await sandbox.close()

The pool refills in the background after every hand-out, a moment later (`refill_delay`): a
replacement's start (a fork, and tens of milliseconds of CPU) would otherwise compete with the
first call of the kernel just handed out, on the same cores and, for `KernelPool`, in the same
event loop. A pool that is already refilling goes on without pausing, and `KernelPool` starts up
to `parallel` kernels at once (by default one per CPU this process may use). Kernels are not
warmed up before they are handed out: a kernel's first run now costs about what a later one
does (kernel/kernel.py), and a warm-up `pass` cost more CPU (kernel and launcher) than it saved.
`SandboxPool` is the same for the synchronous `Sandbox`, with a thread doing the refilling one
kernel at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from typing import Any

from ..client import AsyncSandbox, Sandbox

log = logging.getLogger(__name__)
_RETRY_SECONDS = 1.0  # after a kernel failed to start, before trying again
REFILL_DELAY = 0.025  # seconds: a small call on a handed-out kernel takes a few milliseconds


class PoolClosed(RuntimeError):
    """The pool was closed: it hands out no more kernels."""


class PoolStartError(RuntimeError):
    """A kernel of the pool did not start; the message says why (the pool keeps trying)."""


def _failure(exc: Exception) -> PoolStartError:
    log.warning("sandbox-kernel pool: a kernel did not start: %s", exc)
    error = PoolStartError(f"a kernel of the pool did not start: {exc}")
    error.__cause__ = exc
    return error


class _PoolSettings:
    """What both pools are given: how many kernels, the refill pause, the sandboxes' options."""

    def __init__(self, size: int = 2, *, refill_delay: float = REFILL_DELAY,
                 **sandbox_options: Any) -> None:
        if size < 1:
            raise ValueError(f"a pool holds at least one kernel, not {size}")
        if not refill_delay >= 0:
            raise ValueError(f"refill_delay is a number of seconds >= 0, not {refill_delay!r}")
        self.size = size
        self.refill_delay = refill_delay  # after a hand-out, before an idle pool starts refilling
        self.sandbox_options = sandbox_options  # the sandbox's: kernel_name, policy, preload...


async def _close_quietly(sandbox: AsyncSandbox) -> None:
    with contextlib.suppress(Exception):
        await sandbox.close()


async def start_sandbox(**sandbox_options: Any) -> AsyncSandbox:
    """A new AsyncSandbox, started; one whose start fails or is cancelled is closed again."""
    sandbox = AsyncSandbox(**sandbox_options)
    try:
        await sandbox.start()
    except BaseException:
        await asyncio.shield(_close_quietly(sandbox))
        raise
    return sandbox


class KernelPool(_PoolSettings):
    """Keeps `size` started AsyncSandbox kernels ready; `await get()` takes one."""

    def __init__(self, size: int = 2, *, refill_delay: float = REFILL_DELAY,
                 parallel: int | None = None, **sandbox_options: Any) -> None:
        """parallel: kernels started at once at the most (default: the CPUs usable here)."""
        super().__init__(size, refill_delay=refill_delay, **sandbox_options)
        if parallel is not None and parallel < 1:
            raise ValueError(f"parallel is at least one kernel, not {parallel}")
        self.parallel = parallel or len(os.sched_getaffinity(0))
        # A start failure takes a kernel's place, so that a waiting get() hears of it.
        self._ready: asyncio.Queue[AsyncSandbox | PoolStartError] = asyncio.Queue()
        self._wanted = asyncio.Event()
        self._starting = 0  # kernels this pool is starting right now
        self._waiting = 0  # get() calls waiting for one
        self._filler: asyncio.Task[None] | None = None
        self._starts: set[asyncio.Task[None]] = set()
        self._failed = False  # a start failed since the filler last looked
        self._closed = False
        self._kernels = 0  # of the queue, the started kernels (not the failures)
        self.started = 0  # kernels this pool has started, ever
        self.last_error = ""  # why its latest start failed; "" once one started after it

    async def __aenter__(self) -> KernelPool:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Begin filling the pool in the background (get() does this too)."""
        if self._filler is None and not self._closed:
            self._filler = asyncio.create_task(self._fill())
            self._wanted.set()

    @property
    def ready(self) -> int:
        """Started kernels waiting to be handed out (a failed start is never one)."""
        return self._kernels

    @property
    def coming(self) -> int:
        """Kernels handed out soonest by this pool: those ready, and those starting that no
        get() waits for yet. A kernel half-way through its start comes sooner than a new one."""
        return self._ready.qsize() + max(0, self._starting - self._waiting)

    async def get(self) -> AsyncSandbox:
        """A started kernel of its own for the caller, who must close it; waits if none is ready."""
        if self._closed:
            raise PoolClosed("the kernel pool is closed")
        self.start()
        self._waiting += 1
        self._wanted.set()  # a waiter: refill now, without the pause after a hand-out
        try:
            sandbox = await self._ready.get()  # each kernel is in the queue once: handed out once
        finally:
            self._waiting -= 1
        self._wanted.set()
        if isinstance(sandbox, PoolStartError):
            raise sandbox
        self._kernels -= 1
        return sandbox

    async def get_soonest(self) -> AsyncSandbox:
        """The pool's kernel when one is coming, else one started now with the pool's options.

        Rather than waiting behind other callers for the refill, a burst starts kernels side by
        side; the caller owns (and closes) the kernel either way.
        """
        if self.coming:
            return await self.get()
        return await start_sandbox(**self.sandbox_options)

    async def _fill(self) -> None:
        """Start kernels until the pool holds `size` (plus one per waiting get()), several at
        once: one start uses about one core, and a pool refilled one kernel at a time left the
        others idle while a steady stream of runs waited for each start in turn."""
        filled = False  # the first fill starts at once: nothing was handed out to make room for
        while not self._closed:
            await self._wanted.wait()
            if self._failed:  # a kernel could not start: pause before trying again
                self._failed = False
                await asyncio.sleep(_RETRY_SECONDS)
            elif filled and not self._waiting:
                await asyncio.sleep(self.refill_delay)  # the handed-out kernel's call first
            filled = True
            self._wanted.clear()
            while not self._closed and self._missing() > 0 and self._starting < self.parallel:
                self._starting += 1
                start = asyncio.create_task(self._start_one())
                self._starts.add(start)
                start.add_done_callback(self._starts.discard)

    def _missing(self) -> int:
        """Kernels to start: the pool's size and every waiting get(), less what is coming."""
        return self.size + self._waiting - self._ready.qsize() - self._starting

    async def _start_one(self) -> None:
        """Start one kernel and queue it (or its failure, for a waiting get() to hear of)."""
        sandbox = None
        try:
            # Made inside the try: options a sandbox refuses (a kernelspec and a policy both)
            # reach the waiting get() as its PoolStartError, rather than leaving it waiting.
            sandbox = AsyncSandbox(**self.sandbox_options)
            await sandbox.start()
        except asyncio.CancelledError:  # close() while it starts: it must not live on
            if sandbox is not None:
                await asyncio.shield(_close_quietly(sandbox))
            raise
        except Exception as exc:  # a kernel that cannot start: tell a taker, go on
            if sandbox is not None:
                await _close_quietly(sandbox)
            failure = _failure(exc)
            self.last_error = str(exc)
            self._ready.put_nowait(failure)
            self._failed = True
            return
        finally:
            self._starting -= 1
            self._wanted.set()  # the filler counts again
        self.started += 1
        self.last_error = ""
        if self._closed:
            await sandbox.close()
        else:
            self._kernels += 1
            self._ready.put_nowait(sandbox)

    async def close(self) -> None:
        """Stop refilling and shut down every kernel not handed out."""
        self._closed = True
        for task in (self._filler, *self._starts):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        while not self._ready.empty():
            waiting = self._ready.get_nowait()
            if not isinstance(waiting, PoolStartError):
                self._kernels -= 1
                await waiting.close()


class SandboxPool(_PoolSettings):
    """Keeps `size` started Sandbox kernels ready; `get()` takes one. A thread refills it."""

    def __init__(self, size: int = 2, *, refill_delay: float = REFILL_DELAY,
                 **sandbox_options: Any) -> None:
        super().__init__(size, refill_delay=refill_delay, **sandbox_options)
        self._ready: queue.Queue[Sandbox | PoolStartError] = queue.Queue()
        self._wanted = threading.Event()
        self._closed = threading.Event()
        self._filler = threading.Thread(target=self._fill, name="sandbox-pool", daemon=True)
        self._filler.start()
        self._wanted.set()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def ready(self) -> int:
        """Started kernels waiting to be handed out (a failed start is never one)."""
        return sum(not isinstance(waiting, PoolStartError) for waiting in list(self._ready.queue))

    def get(self, timeout: float | None = None) -> Sandbox:
        """A started kernel of its own for the caller, who must close it."""
        if self._closed.is_set():
            raise PoolClosed("the kernel pool is closed")
        try:
            sandbox = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no kernel was ready within {timeout} s") from None
        self._wanted.set()
        if isinstance(sandbox, PoolStartError):
            raise sandbox
        return sandbox

    def _fill(self) -> None:
        filled = False  # the first fill starts at once: nothing was handed out to make room for
        while not self._closed.is_set():
            self._wanted.wait()
            if filled:
                self._closed.wait(self.refill_delay)  # the handed-out kernel's call first
            filled = True
            self._wanted.clear()
            while not self._closed.is_set() and self._ready.qsize() < self.size:
                sandbox = None
                try:
                    sandbox = Sandbox(**self.sandbox_options)  # inside: see _start_one
                    sandbox.start()
                except Exception as exc:
                    with contextlib.suppress(Exception):
                        if sandbox is not None:
                            sandbox.close()
                    self._ready.put(_failure(exc))
                    self._wanted.clear()  # try again once a taker has heard of it
                    self._closed.wait(_RETRY_SECONDS)
                    break
                if self._closed.is_set():
                    sandbox.close()
                    return
                self._ready.put(sandbox)

    def close(self) -> None:
        """Stop refilling and shut down every kernel not handed out."""
        self._closed.set()
        self._wanted.set()
        self._filler.join()
        while not self._ready.empty():
            waiting = self._ready.get_nowait()
            if not isinstance(waiting, PoolStartError):
                waiting.close()
