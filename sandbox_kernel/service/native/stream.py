"""How an execution is answered: as JSON, or as server-sent events while it runs.

Events: `stdout`, `stderr`, `display` while the code runs, then `result` or `error`, then
`done` carrying the whole execution.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.responses import JSONResponse, Response

from ...client import ErrorInfo, Execution
from ..kernels import KernelUnavailable
from ..sessions import SessionError

SSE = "text/event-stream"


def wants_events(request: Request) -> bool:
    """Whether the client asked for server-sent events."""
    return SSE in request.headers.get("accept", "")


class ExecutionJSON(JSONResponse):
    """JSON with non-ASCII escaped: kernel output may hold lone surrogates, which UTF-8 cannot."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _event(name: str, data: Any) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(data), event=name)


def _final_events(execution: Execution) -> list[ServerSentEvent]:
    events = []
    if execution.error is not None:
        events.append(_event("error", execution.to_dict()["error"]))
    elif execution.result is not None or execution.text is not None:
        events.append(_event("result", {"result": execution.result, "text": execution.text}))
    events.append(_event("done", execution.to_dict()))
    return events


def _cancel(work: asyncio.Task[Execution]) -> None:
    work.cancel()


class EventStream:
    """Collects output callbacks into a queue the SSE generator drains; `abandon` is what
    becomes of the work when the client leaves before it ended (cancelled by default)."""

    def __init__(self, abandon: Callable[[asyncio.Task[Execution]], None] = _cancel) -> None:
        self.queue: asyncio.Queue[ServerSentEvent] = asyncio.Queue()
        self.abandon = abandon

    def __call__(self, name: str, payload: Any) -> None:
        self.queue.put_nowait(_event(name, payload))

    async def events(self, work: asyncio.Task[Execution]) -> AsyncIterator[ServerSentEvent]:
        """Output events while work runs, then the final ones; cancels work if abandoned."""
        getter: asyncio.Future[ServerSentEvent] | None = None
        try:
            while not (work.done() and self.queue.empty()):
                getter = asyncio.ensure_future(self.queue.get())
                await asyncio.wait({getter, work}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            for event in _final_events(_outcome(work)):
                yield event
        finally:  # the client left, or the stream is done
            if getter is not None and not getter.done():
                getter.cancel()
            if not work.done():
                self.abandon(work)

    def response(self, work: asyncio.Task[Execution]) -> Response:
        """The event stream of work (keep-alive comments every 15 s)."""
        return EventSourceResponse(self.events(work), ping=15)


def _outcome(work: asyncio.Task[Execution]) -> Execution:
    """The finished work's execution; its errors said as one, since the status line (200) is
    already sent and the app's exception handlers cannot answer any more."""
    try:
        return work.result()
    except KernelUnavailable as exc:
        return Execution(error=ErrorInfo("KernelUnavailable", str(exc)))
    except SessionError as exc:
        return Execution(error=ErrorInfo("SessionGone", str(exc)), state_lost=True)
