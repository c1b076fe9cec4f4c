"""The kernel managers and clients behind Sandbox and AsyncSandbox: jupyter_client's, minus waste.

jupyter_client wraps `start_kernel` and `shutdown_kernel` in `in_pending_state`, which keeps
the manager's `ready` future and then sleeps 10 ms "to ensure tests can capture the state".
A fork-served kernel starts in ~50 ms and a one-shot kernel is killed in ~1 ms: those two
pauses were a fifth of a fresh-kernel request, time in which neither the client nor the kernel
does anything (measured: 21.7 → 27.2 fresh-kernel requests/s on 2 cores). These managers keep
the `ready` bookkeeping around jupyter_client's own method bodies and leave out the sleep.

Their clients stop only the channels that were opened: jupyter_client's stop_channels asks each
of the five channels whether it runs, and asking creates the channel: a sandbox, which opens
shell and IOPub only, created and connected stdin, heartbeat and control sockets at every close,
just to close them (the kernel's I/O threads answering the handshakes on their way out).
For the same reason their control socket is connected when first used (_ControlWhenUsed),
and their client shares the manager's session (_OneSession). A kill (`shutdown_kernel(now=True)`)
sends no SIGINT first (_killed_without_interrupt).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.client import KernelClient
from jupyter_client.manager import AsyncKernelManager, KernelManager, _get_future
from jupyter_core.utils import run_sync
from traitlets import DottedObjectName, Type

Method = Callable[..., Coroutine[Any, Any, Any]]


def _without_pause(decorated: Method) -> Method:
    """jupyter_client's method under in_pending_state's bookkeeping, minus its sleep."""
    body: Method | None = getattr(decorated, "__wrapped__", None)
    if body is None:  # a jupyter_client that no longer wraps it: nothing to leave out
        return decorated

    @functools.wraps(body)
    async def settled(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._attempted_start or not self._ready:
            self._ready = _get_future()
        try:
            out = await body(self, *args, **kwargs)
        except Exception as exc:
            self._ready.set_exception(exc)
            raise
        if self.owns_kernel:
            self._ready.set_result(None)
        return out

    return settled


class _NeverOpened:
    """Stands in for a channel nobody opened while jupyter_client stops the channels."""

    @staticmethod
    def is_alive() -> bool:
        return False


_OPTIONAL_CHANNELS = ("_stdin_channel", "_hb_channel", "_control_channel")


def _stop_opened_channels(client: KernelClient) -> None:
    """jupyter_client's stop_channels, without first creating the channels never opened."""
    unopened = [name for name in _OPTIONAL_CHANNELS if getattr(client, name) is None]
    for name in unopened:
        setattr(client, name, _NeverOpened)
    try:
        KernelClient.stop_channels(client)
    finally:
        for name in unopened:
            setattr(client, name, None)


class SandboxKernelClient(BlockingKernelClient):  # type: ignore[misc]
    """BlockingKernelClient that stops only the channels it opened."""

    stop_channels = _stop_opened_channels


class AsyncSandboxKernelClient(AsyncKernelClient):  # type: ignore[misc]
    """AsyncKernelClient that stops only the channels it opened."""

    stop_channels = _stop_opened_channels


class _ControlWhenUsed:
    """The manager's control socket is connected when a request goes out on it, not at start.

    jupyter_client connects it in post_start_kernel, and again (if needed) before each
    request it sends on it (a shutdown request, a message-mode interrupt). A sandbox whose
    kernel is killed at the end (`close(now=True)`, the service's every request) never sends
    one: the socket, and the handshake the kernel's control thread answered, were waste.
    """

    _starting = False

    def _connect_control_socket(self) -> None:
        if not self._starting:
            super()._connect_control_socket()  # type: ignore[misc]

    async def _async_post_start_kernel(self, **kw: Any) -> None:
        self._starting = True
        try:
            await super()._async_post_start_kernel(**kw)  # type: ignore[misc]
        finally:
            self._starting = False


def _killed_without_interrupt(shutdown: Method) -> Method:
    """shutdown_kernel, minus the SIGINT it sends before a kill (now=True).

    jupyter_client interrupts every kernel it shuts down, to stop code that runs, and then kills
    it at once when now=True: the signal only woke a kernel about to be killed (one still
    starting, a pool's at close, could end in a KeyboardInterrupt half-way and print it on its
    way out). A graceful shutdown keeps the interrupt.
    """
    @functools.wraps(shutdown)
    async def shutdown_kernel(self: Any, now: bool = False, restart: bool = False) -> Any:
        self._killing = now
        try:
            return await shutdown(self, now=now, restart=restart)
        finally:
            self._killing = False

    return shutdown_kernel


class _NoInterruptBeforeKill:
    """Skips the interrupt while _killed_without_interrupt's shutdown kills the kernel."""

    _killing = False

    async def _async_interrupt_kernel(self) -> None:
        if not self._killing:
            await super()._async_interrupt_kernel()  # type: ignore[misc]


class _OneSession:
    """The sandbox's own client shares the manager's Session instead of a clone of it.

    jupyter_client clones it so that two readers of one kernel's IOPub in a process do not
    share a replay history (a message both receive would read as a replay to the second).
    A sandbox has one client per kernel, and the manager itself reads only its control
    replies; the clone (a Session built, every trait copied) was a tenth of a millisecond
    to a millisecond of every fresh kernel's start. Other clients (manager.client()) still
    get a clone.
    """

    _sharing = False

    def sandbox_client(self, **kwargs: Any) -> Any:
        """The sandbox's one client of this kernel, on the manager's own session."""
        self._sharing = True
        try:
            return self.client(**kwargs)  # type: ignore[attr-defined]
        finally:
            self._sharing = False

    def get_connection_info(self, session: bool = False) -> Any:
        if not (session and self._sharing):
            return super().get_connection_info(session=session)  # type: ignore[misc]
        info = super().get_connection_info(session=False)  # type: ignore[misc]
        for name in ("signature_scheme", "key"):  # what the session carries
            info.pop(name, None)
        info["session"] = self.session  # type: ignore[attr-defined]
        return info


class SandboxKernelManager(_OneSession, _ControlWhenUsed, _NoInterruptBeforeKill,  # type: ignore[misc]
                           KernelManager):
    """KernelManager whose start and shutdown return as soon as their work is done."""

    client_class = DottedObjectName("sandbox_kernel.client.managers.SandboxKernelClient")

    _async_start_kernel = _without_pause(KernelManager._async_start_kernel)
    _async_shutdown_kernel = _killed_without_interrupt(
        _without_pause(KernelManager._async_shutdown_kernel))
    start_kernel = run_sync(_async_start_kernel)
    shutdown_kernel = run_sync(_async_shutdown_kernel)
    post_start_kernel = run_sync(_ControlWhenUsed._async_post_start_kernel)


class AsyncSandboxKernelManager(_OneSession, _ControlWhenUsed,  # type: ignore[misc]
                                _NoInterruptBeforeKill, AsyncKernelManager):
    """AsyncKernelManager whose start and shutdown return as soon as their work is done."""

    client_class = DottedObjectName("sandbox_kernel.client.managers.AsyncSandboxKernelClient")
    # AsyncKernelManager declares its own client_factory, whose default is AsyncKernelClient
    # whatever client_class says (that is only observed when it changes).
    client_factory = Type(AsyncSandboxKernelClient, klass=AsyncKernelClient)

    _async_start_kernel = SandboxKernelManager._async_start_kernel
    _async_shutdown_kernel = SandboxKernelManager._async_shutdown_kernel
    start_kernel = _async_start_kernel
    shutdown_kernel = _async_shutdown_kernel
    post_start_kernel = _ControlWhenUsed._async_post_start_kernel
