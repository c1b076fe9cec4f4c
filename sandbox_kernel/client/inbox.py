"""A client's IOPub socket read frame by frame, and whether libzmq refused a frame.

While a run grants tools, the inbox also serves its tool calls (client/tools.py's StdinDesk):
the stdin socket and the desk's wake-up fd join the poll, requests are taken and answers sent
between IOPub messages, on the thread (or loop) that reads IOPub.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq
import zmq.asyncio

from .receive import Refusals, watch_connection


def ready_frames(socket: Any) -> list[Any] | None:
    """The frames of a message already queued on this socket, else None (without waiting).

    A run's messages arrive in bursts (busy, streams, result, idle): taking what is queued
    before polling saves a poll per message.
    """
    try:
        return socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)  # type: ignore[no-any-return]
    except zmq.Again:
        return None


async def ready_frames_async(socket: Any) -> list[Any] | None:
    """ready_frames for an asyncio socket: a non-blocking read's future is already done, so
    awaiting it costs no turn of the event loop."""
    try:
        return await socket.recv_multipart(  # type: ignore[no-any-return]
            flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None


def queued_reply(client: Any, frames: list[Any] | None) -> dict[str, Any] | None:
    """The shell reply in these frames, parsed as the client's get_shell_msg would."""
    if frames is None:
        return None
    _idents, parts = client.session.feed_identities(frames, copy=False)
    return client.session.deserialize(parts, copy=False)  # type: ignore[no-any-return]


class Inbox:
    """A client's IOPub socket read frame by frame, and whether libzmq refused a frame."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.socket = client.iopub_channel.socket
        self.monitor = watch_connection(self.socket)
        self.refusals = Refusals()
        self.poller = self._poller()
        self.desk: Any = None  # the run's tool calls (client/tools.py), while it has tools

    def serve(self, desk: Any) -> None:
        """Serve a run's tool calls while receiving (None: stop serving them)."""
        if self.desk is not None:
            self.poller.unregister(self.desk.socket)
            self.poller.unregister(self.desk.wake_fd)
        self.desk = desk
        if desk is not None:
            self.poller.register(desk.socket, zmq.POLLIN)
            self.poller.register(desk.wake_fd, zmq.POLLIN)

    def _desk_events(self, events: dict[Any, int]) -> None:
        """Tool requests taken and finished answers sent, for what the poll reported."""
        if self.desk.wake_fd in events:
            self.desk.send_answers()
        if self.desk.socket in events:
            self.desk.take_ready()

    def _poller(self) -> Any:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        return poller

    def receive(self, timeout: float) -> list[Any] | None:
        """The next message's frames, or None after `timeout` seconds without one."""
        frames = ready_frames(self.socket)
        if frames is not None:
            return frames
        give_up = time.monotonic() + timeout
        while True:
            events = dict(self.poller.poll(max(give_up - time.monotonic(), 0) * 1000))
            if self.monitor in events:
                self.refusals.note(self.monitor.recv_multipart())
            if self.socket in events:
                return self.socket.recv_multipart(copy=False)  # type: ignore[no-any-return]
            if self.desk is None or not events or time.monotonic() >= give_up:
                return None
            self._desk_events(events)

    @property
    def refused(self) -> bool:
        """Whether libzmq refused a frame past the caller's size limit (see Refusals)."""
        return self.refusals.refused

    def watch(self, timeout: float) -> None:
        """Take the connection's events for up to `timeout` seconds (messages stay queued)."""
        if self.monitor.poll(timeout * 1000):
            self.refusals.note(self.monitor.recv_multipart())

    def close(self) -> None:
        """Stop watching the socket."""
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is already closed
        self.monitor.close(linger=0)


class AsyncInbox(Inbox):
    """The asyncio twin of Inbox (an asyncio client's sockets).

    Queued messages are read without a turn of the event loop (see ready_frames_async), so a
    kernel that floods its output (40,000 one-byte messages) would hold the loop for as long
    as its queue takes to drain: other requests of a service waited seconds. Every TURN_AFTER
    seconds of back-to-back reading, receive gives the loop a turn.
    """

    TURN_AFTER = 0.002  # seconds

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.turn_taken = time.monotonic()

    async def watch(self, timeout: float) -> None:  # type: ignore[override]
        """Take the connection's events for up to `timeout` seconds (messages stay queued)."""
        if await self.monitor.poll(timeout * 1000):
            self.refusals.note(await self.monitor.recv_multipart())

    def _poller(self) -> Any:
        poller = zmq.asyncio.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        return poller

    async def receive(self, timeout: float) -> list[Any] | None:  # type: ignore[override]
        """The next message's frames, or None after `timeout` seconds without one."""
        if time.monotonic() - self.turn_taken > self.TURN_AFTER:
            await asyncio.sleep(0)  # the other tasks' turn
            self.turn_taken = time.monotonic()
        frames = await ready_frames_async(self.socket)
        if frames is not None:
            return frames
        self.turn_taken = time.monotonic()  # the poll below waits: a turn for the others
        give_up = self.turn_taken + timeout
        while True:
            events = dict(await self.poller.poll(max(give_up - time.monotonic(), 0) * 1000))
            if self.monitor in events:
                self.refusals.note(await self.monitor.recv_multipart())
            if self.socket in events:
                return await self.socket.recv_multipart(  # type: ignore[no-any-return]
                    copy=False)
            if self.desk is None or not events or time.monotonic() >= give_up:
                return None
            self._desk_events(events)
