"""Connections that send nothing cost a bounded time and never take the place of requests.

uvicorn gives a new connection no deadline until its first response (its keep-alive timer starts
only after one), and its `limit_concurrency` counts connections as well as requests: about 150
connections that never sent a byte made every later request a 503 for as long as they stayed
open. Here a connection must complete a request's head within `--head-timeout` seconds of being
accepted (nginx's client_header_timeout, against slowloris), or it is closed; and once more
connections are open and idle than `--max-idle-connections` allows, the oldest of them are closed
to make room.
A request uvicorn cannot parse, or whose head is past HEAD_LIMIT (16 KiB, h11's bound for what it
buffers; httptools, which uvicorn prefers where it is installed, has none and would buffer a
header of any size), is answered 400 with a JSON message, as every route words its errors
(uvicorn's own is plain text), and closed. Closing a socket whose peer is still sending resets
it, and the reset can destroy the 400 before the client reads it. So that close lingers, as
nginx's lingering_close does: what was written is sent, the write side is shut, and what the
client still sends is read and dropped, until it closes or `linger` seconds pass.
Requests themselves are bounded by the service's own admission (`runs.Admission`), not by
counting sockets, so `limit_concurrency` is not used.

The class extends whichever HTTP protocol uvicorn would pick (httptools, which the [server] extra
installs because it parses in C; else h11) through its methods `connection_made`,
`connection_lost`, `data_received` and `send_400_response` only.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

UNPARSED = ("the request is not valid HTTP/1.1, or its head (request line and headers) is too "
            "large: a head past 16 KiB may be refused so; send a smaller one")
HEAD_LIMIT = 16 * 1024  # bytes of one request head, its blank line included (h11's default)
HEAD_END = b"\r\n\r\n"


class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol with a deadline for the first request and a cap on idle ones."""

    head_timeout = 10.0  # seconds from accept to a complete request head
    max_idle = 512  # connections kept open that are not in a request
    linger = 2.0  # seconds a refused request's connection reads and drops what still comes
    _order = itertools.count()
    _draining = False
    _head_seen = 0  # bytes of the coming request's head received so far
    _head_tail = b""  # its last bytes, where an end of head split between reads begins

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the request-head deadline and make room among idle connections."""
        self.accepted = next(self._order)
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout, self._close_if_no_request)
        self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the head deadline of a connection that closed."""
        self._head_timer.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request uvicorn cannot parse: a 400 saying so, and a lingering close."""
        body = json.dumps({"detail": UNPARSED}).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                             % (len(body), body))
        self._draining = True
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()  # the peer's EOF then closes it (eof_received)
        self.loop.call_later(self.linger, self.transport.close)

    def data_received(self, data: bytes) -> None:
        """Bytes of a request; after a 400, the rest of the refused one, dropped."""
        if self._draining:
            return
        if self._idle() and self._head_too_large(data):
            self.send_400_response("the request head is too large")
            return
        super().data_received(data)

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the head these bytes continue (outside a request: the next one's) is past
        HEAD_LIMIT; counted before the parser sees them, so none buffers more than that."""
        end = self._head_end(data)
        size = self._head_seen + (len(data) if end < 0 else end)
        if size > HEAD_LIMIT:
            return True
        if end < 0:
            self._head_seen = size
            self._head_tail = (self._head_tail + data[-(len(HEAD_END) - 1):])[1 - len(HEAD_END):]
        else:  # the head ends here: the next one counts from zero
            self._head_seen, self._head_tail = 0, b""
        return False

    def _head_end(self, data: bytes) -> int:
        """Where in data the head ends (just past its blank line), or -1; the blank line may
        have begun in the bytes before."""
        if self._head_tail:
            at = (self._head_tail + data[:len(HEAD_END) - 1]).find(HEAD_END)
            if at >= 0:
                return at + len(HEAD_END) - len(self._head_tail)
        at = data.find(HEAD_END)
        return -1 if at < 0 else at + len(HEAD_END)

    def _idle(self) -> bool:
        """Not inside a request: none has started, or the last one has been answered."""
        return self.cycle is None or self.cycle.response_complete

    def _close_if_no_request(self) -> None:
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        idle = sorted((c for c in self.connections if isinstance(c, GuardedHTTPProtocol)
                       and c is not self and c._idle() and not c.transport.is_closing()),
                      key=lambda connection: connection.accepted)
        for connection in idle[:max(0, len(idle) - self.max_idle)]:
            connection.transport.close()


def protocol(head_timeout: float, max_idle: int) -> type[Any]:
    """The protocol class uvicorn is given, with this service's bounds."""
    return type("ServiceHTTPProtocol", (GuardedHTTPProtocol,),
                {"head_timeout": head_timeout, "max_idle": max_idle})
