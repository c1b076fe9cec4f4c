"""Connections that send nothing cost a bounded time and never take the place of requests.

uvicorn gives a new connection no deadline until its first response (its keep-alive timer starts
only after one), and its `limit_concurrency` counts connections as well as requests: about 150
connections that never sent a byte made every later request a 503 for as long as they stayed
open. Here a connection must complete a request's head within `--head-timeout` seconds of being
accepted (nginx's client_header_timeout, against slowloris), or it is closed; and once more
connections are open and idle than `--max-idle-connections` allows, the oldest of them are closed
to make room.
Requests themselves are bounded by the service's own admission (`runs.Admission`), not by
counting sockets, so `limit_concurrency` is not used.

The class extends whichever HTTP protocol uvicorn would pick (h11, or httptools where it is
installed) through its `connection_made` / `connection_lost` hooks only.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol


class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol with a deadline for the first request and a cap on idle ones."""

    head_timeout = 10.0  # seconds from accept to a complete request head
    max_idle = 512  # connections kept open that are not in a request
    _order = itertools.count()

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
