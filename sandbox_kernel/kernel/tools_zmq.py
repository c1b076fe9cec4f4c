"""The tool bridge on a ZMQ kernel's stdin channel (kernel/tools.py has the rest, ZMQ-free)."""

from __future__ import annotations

import time
from typing import Any

import zmq

from .tools import CONNECT_WAIT, REPLY, ToolUnavailable


class StdinTransport:
    """A ZMQ kernel's stdin channel: requests routed to the client that sent the execute_request."""

    def __init__(self, session: Any, socket: Any, ident: Any) -> None:
        self.session, self.socket, self.ident = session, socket, ident

    def send(self, msg: dict[str, Any]) -> None:
        """Send, refusing at once (ROUTER_MANDATORY) rather than drop it when the client has
        no stdin channel; one that is still connecting gets CONNECT_WAIT seconds."""
        give_up = time.monotonic() + CONNECT_WAIT
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            while True:
                try:
                    self.session.send(self.socket, msg, ident=self.ident)
                    return
                except zmq.ZMQError as exc:
                    waiting = exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN)
                    if not waiting or time.monotonic() > give_up:
                        raise ToolUnavailable(
                            "no client serves tools on this kernel's stdin channel (a client "
                            "that serves tools opens it: see docs/tools.md)") from None
                time.sleep(0.01)
        finally:
            self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)

    def receive(self, timeout: float) -> list[dict[str, Any]]:
        """Every reply queued within timeout seconds (badly signed messages skipped)."""
        replies: list[dict[str, Any]] = []
        if not zmq.select([self.socket], [], [], timeout)[0]:
            return replies
        while True:
            try:
                _, msg = self.session.recv(self.socket, mode=zmq.NOBLOCK)
            except ValueError:  # not signed with the session's key, or not a message
                continue
            if msg is None:
                return replies
            if msg["header"].get("msg_type") == REPLY:
                replies.append(msg)
