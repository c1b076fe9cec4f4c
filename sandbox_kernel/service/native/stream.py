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
from starlette.responses import Response

from ...client import ErrorInfo, Execution
from ...client.collect import info_of
from ...errors import KernelUnavailable
from ...hosting.sessions import SessionError

SSE = "text/event-stream"


def wants_events(request: Request) -> bool:
    """Whether the client asked for server-sent events."""
    return SSE in request.headers.get("accept", "")


def _with_result(fields: dict[str, Any], execution: Execution) -> bytes:
    """fields as JSON (non-ASCII escaped: kernel output may hold lone surrogates, which UTF-8
    cannot carry), its "result" the kernel's JSON bytes as they came when the run kept them
    (Execution.result_json: checked, never parsed into objects by the service)."""
    raw = execution.result_json
    encoded = json.dumps({"result": None if raw is not None else execution.result, **fields},
                         separators=(",", ":")).encode("ascii")
    if raw is None:
        return encoded
    head = b'{"result":null'
    return b"".join((b'{"result":', raw, encoded[len(head):]))


def execution_json(execution: Execution) -> bytes:
    """The whole execution as the JSON the API answers with."""
    fields = execution.to_dict()
    del fields["result"]
    return _with_result(fields, execution)


class ExecutionJSON(Response):
    """An execution as JSON (see execution_json)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        """The execution as JSON bytes, its main() result passed on as the kernel sent it."""
        return execution_json(content)


class JSONEvent(ServerSentEvent):
    """An event whose data is JSON text, encoded in one join.

    ServerSentEvent.encode splits the data at line breaks and copies it through a StringIO:
    for a 13 MB result that held the event loop ~0.2 s per event. JSON holds CR or LF only as
    whitespace between tokens (never raw inside a string), so as spaces they keep the event
    one `data:` line with the same meaning.
    """

    def __init__(self, name: str, payload: bytes) -> None:
        super().__init__(event=name)
        self.payload = payload

    def encode(self) -> bytes:
        """The event's bytes on the wire."""
        data = self.payload
        if b"\n" in data or b"\r" in data:
            data = data.replace(b"\r", b" ").replace(b"\n", b" ")
        sep = self._sep.encode()
        return b"".join((b"event: ", str(self.event).encode(), sep, b"data: ", data, sep, sep))


def _event(name: str, data: Any) -> ServerSentEvent:
    return JSONEvent(name, json.dumps(data).encode())


def _final_events(execution: Execution) -> list[ServerSentEvent]:
    events = []
    if execution.error is not None:
        events.append(_event("error", execution.to_dict()["error"]))
    elif execution.result_json is not None or execution.result is not None \
            or execution.text is not None:
        result = _with_result({"text": execution.text}, execution)
        events.append(JSONEvent("result", result))
    events.append(JSONEvent("done", execution_json(execution)))
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
        """Queue one output event for the stream."""
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
        return Execution(error=info_of(exc))
    except SessionError as exc:
        return Execution(error=ErrorInfo("SessionGone", str(exc)), state_lost=True)
