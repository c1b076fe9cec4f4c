"""Bounded request bodies: a declared or streamed body past the limit gets 413.

An answer sent while the client is still sending its body must not be lost: a server that
closes a connection with unread data makes the kernel send a reset, and the client (still
writing) sees "connection reset" instead of the 413. So before any answer goes out with part
of the body unread, the rest is read and thrown away — within DRAIN_BYTES and DRAIN_SECONDS,
so a client cannot hold the service with an endless body. A client that asked for
`Expect: 100-continue` has sent nothing yet: it gets the 413 at once, and sends nothing.
"""

from __future__ import annotations

import asyncio
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import Metrics

DRAIN_BYTES = 64 * 2**20  # beyond this a refused body is not read: the connection is cut
DRAIN_SECONDS = 10.0


class BodyTooLarge(HTTPException):
    """The body grew past the limit while it was read (an HTTPException, so FastAPI's body
    parsing passes it on as a 413 instead of calling it a parse error)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes (--max-body)")


class _Body:
    """How much of one request's body has been read, and reading the rest."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        self.declared = int(declared) if declared is not None and declared.isdigit() else None
        self.receive = receive
        self.seen = 0
        self.asked = False  # whether the body was asked for (a 100 Continue went out)
        # A request without a body (no length, not chunked) has nothing left to read.
        self.done = not (self.declared or b"transfer-encoding" in headers)
        self.expects_continue = headers.get(b"expect", b"").lower() == b"100-continue"

    def count(self, message: Message) -> None:
        self.asked = True
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            self.done = self.done or not message.get("more_body", False)
        else:  # the client is gone
            self.done = True

    async def drain(self) -> None:
        """Read and discard the rest of the body, within DRAIN_BYTES and DRAIN_SECONDS."""
        if self.done or (self.expects_continue and not self.asked):
            return
        if self.declared is not None and self.declared > DRAIN_BYTES:
            return  # too much to read: the answer is sent and the connection cut
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_SECONDS
        try:
            while not self.done and self.seen <= DRAIN_BYTES:
                self.count(await asyncio.wait_for(self.receive(), deadline - loop.time()))
        except asyncio.TimeoutError:
            pass


class BodyLimit:
    """ASGI middleware: refuse bodies larger than `limit` bytes, declared or not; read what is
    left of a body before answering, so the client reads the answer."""

    def __init__(self, app: ASGIApp, limit: int, metrics: Metrics) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, or refuse it with 413 once its body is over the limit."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _Body(scope, receive)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(body, send)
            return
        started = False

        async def counting_receive() -> Message:
            message = await receive()
            body.count(message)
            if body.seen > self.limit:
                raise BodyTooLarge(self.limit)
            return message

        async def draining_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                await body.drain()  # e.g. a 401 or a 413 sent before the body was read
            await send(message)

        try:
            await self.app(scope, counting_receive, draining_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(body, send)

    async def _refuse(self, body: _Body, send: Send) -> None:
        self.metrics.denials.labels(reason="body_too_large").inc()
        await body.drain()
        content = json.dumps({"detail": f"the request body is larger than {self.limit} bytes "
                              "(--max-body)"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(content)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": content})
