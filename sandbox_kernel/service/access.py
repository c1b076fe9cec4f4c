"""One structured log line and one metrics sample per request.

The line says who (the key id, never the key), what (method, route template), how it ended
(status, duration) and on which kernel; never the code, the inputs or the output.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..hosting.events import json_line

if TYPE_CHECKING:  # types only: the MCP server imports hosting/, which has neither installed
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from .metrics import Metrics

log = logging.getLogger("sandbox_kernel.service.access")
__all__ = ["AccessLog", "json_line", "route_of"]


def route_of(scope: Scope) -> str:
    """The matched route's template (bounded label values), or "unmatched"."""
    # FastAPI 0.165 keeps an included router's routes as they were declared (`/execute`) and
    # puts the template with its prefixes (`/api/v1/execute`) in the route context it matched.
    context = scope.get("fastapi", {}).get("effective_route_context")
    route = context if context is not None else scope.get("route")
    return str(getattr(route, "path", None) or "unmatched")


class AccessLog:
    """ASGI middleware: log and count every HTTP request when its response is done."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, then log it and count it by route and status."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = {"code": 0}

        async def send_recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
        finally:
            self._record(scope, status["code"] or 499, time.monotonic() - started)

    def _record(self, scope: Scope, status: int, duration: float) -> None:
        route = route_of(scope)
        state: dict[str, Any] = scope.get("state") or {}
        record = state.get("record")
        kernel = state.get("kernel_id") or getattr(record, "kernel_id", "") or None
        metrics = self.metrics
        metrics.labelled(metrics.requests, route, str(status)).inc()
        metrics.labelled(metrics.duration, route).observe(duration)
        log.info(json_line(method=scope.get("method"), route=route, status=status,
                           duration=round(duration, 4), key=state.get("key_id"),
                           kernel=kernel, session=state.get("session_id")))
