"""The native API, `/api/v1`: one-shot executions, sessions, streamed output, files.

An execution answers the client's `Execution` as JSON, or, when the request accepts
`text/event-stream`, as server-sent events: `stdout`, `stderr`, `display` while the code runs,
then `result` or `error`, then `done` carrying the whole execution.

Files move through the session's own kernel (a small function run with the caller's path and
bytes), not through the scratch directory from outside: the scratch is a private mount of the
kernel, and a service that followed paths (and symlinks) the kernel's code planted there would
read and write with the service's rights. Inside the kernel the same operation can reach only
what the kernel's own code could, under its Landlock rules.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import posixpath
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator, BaseModel, Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.responses import JSONResponse, Response

from ..client import AsyncSandbox, Execution, ExecutionError
from .auth import ApiKey
from .kernels import KernelUnavailable
from .runs import (
    Busy,
    OutputBudget,
    OutputLimit,
    RunRecord,
    bounded,
    callbacks,
    client_left,
    output_limited,
    unless_disconnected,
)
from .sessions import Session, SessionError
from .validation import sendable

router = APIRouter(prefix="/api/v1", tags=["native"])
bearer = HTTPBearer(auto_error=False, description="An API key from the keys file.")
SSE = "text/event-stream"
FILE_HELPER = "__sandbox_files__"
FILE_TIMEOUT = 60.0  # seconds a file transfer may take inside the kernel


# --- shapes --------------------------------------------------------------------------------

class ExecuteRequest(BaseModel):
    """Code to run; with `inputs`, the code's `main(**inputs)` is called and its dict returned."""

    code: Annotated[str, AfterValidator(sendable)] = Field(description="Python source.")
    inputs: Annotated[dict[str, Any] | None, AfterValidator(sendable)] = Field(
        None, description="main()'s arguments by name; omit to run the code as a cell.")
    timeout: float | None = Field(
        None, gt=0, description="Seconds the execution may run (default: the service's "
        "--worker-timeout; at most --max-timeout).")


class OneShotRequest(ExecuteRequest):
    network: bool = Field(False, description="Run on a kernel that may open network sockets.")


class SessionRequest(BaseModel):
    network: bool = Field(False, description="Let the session's kernel open network sockets.")
    idle_timeout: float | None = Field(
        None, gt=0, description="Seconds idle before the session is closed (default: "
        "--session-idle-timeout; at most --max-session-idle-timeout).")


class ErrorShape(BaseModel):
    name: str
    value: str
    traceback: list[str]


class ExecutionShape(BaseModel):
    """Everything one execution produced, each kind of output kept apart."""

    result: dict[str, Any] | None = Field(None, description="main()'s returned dict.")
    text: str | None = Field(None, description="text/plain of the result or last expression.")
    stdout: str
    stderr: str
    logs: list[dict[str, str]] = Field(description="Stream chunks in arrival order.")
    displays: list[dict[str, Any]] = Field(description="Display MIME bundles in order.")
    error: ErrorShape | None = None
    duration: float
    state_lost: bool = Field(description="The kernel had to be restarted: variables are gone.")


class SessionShape(BaseModel):
    id: str
    network: bool
    policy: str
    idle_timeout: float
    created: float
    idle_seconds: float
    busy: bool
    alive: bool
    dead_reason: str | None


class FileShape(BaseModel):
    path: str
    size: int


# --- helpers -------------------------------------------------------------------------------

def service_of(request: Request) -> Any:
    return request.app.state.service


async def api_key(request: Request,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
                  ) -> ApiKey:
    """The bearer key of the request; 401 without a known one."""
    service = service_of(request)
    token = f"Bearer {credentials.credentials}" if credentials else None
    key = service.bearer_keys.find(token)
    if key is None:
        service.metrics.denials.labels(reason="bad_key").inc()
        raise HTTPException(401, "a valid API key is required: Authorization: Bearer <key>",
                            headers={"WWW-Authenticate": "Bearer"})
    request.state.key_id = key.id
    return key


Key = Annotated[ApiKey, Depends(api_key)]


def _timeout(service: Any, asked: float | None) -> float:
    config = service.config
    if asked is None:
        return float(config.worker_timeout)
    if asked > config.max_timeout:
        raise HTTPException(400, f"timeout {asked:g} s is above this service's limit of "
                            f"{config.max_timeout:g} s (--max-timeout)")
    return asked


def _wants_events(request: Request) -> bool:
    return SSE in request.headers.get("accept", "")


def _session(request: Request, key: ApiKey, session_id: str) -> Session:
    try:
        session = service_of(request).sessions.get(key, session_id)
    except SessionError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    request.state.session_id = session.id
    request.state.kernel_id = session.kernel_id
    return session


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


class _Stream:
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
            try:
                execution = work.result()
            except KernelUnavailable as exc:
                execution = Execution(error=ExecutionError("KernelUnavailable", str(exc)))
            except SessionError as exc:  # the status line is sent: say it in the stream
                execution = Execution(error=ExecutionError("SessionGone", str(exc)),
                                      state_lost=True)
            for event in _final_events(execution):
                yield event
        finally:  # the client left, or the stream is done
            if getter is not None and not getter.done():
                getter.cancel()
            if not work.done():
                self.abandon(work)

    def response(self, work: asyncio.Task[Execution]) -> Response:
        """The event stream of work (keep-alive comments every 15 s)."""
        return EventSourceResponse(self.events(work), ping=15)


# --- one-shot ------------------------------------------------------------------------------

@router.post("/execute", response_model=ExecutionShape,
             summary="Run code (or main() with inputs) on a fresh kernel",
             responses={200: {"content": {SSE: {}}}, 503: {"description": "too many runs"}})
async def execute(body: OneShotRequest, request: Request, key: Key) -> Response:
    service = service_of(request)
    timeout = _timeout(service, body.timeout)
    if body.network and not service.config.enable_network:
        raise HTTPException(403, "network access is disabled on this service (--enable-network)")
    try:
        release = service.admission.enter()
    except Busy:
        service.metrics.denials.labels(reason="too_many_requests").inc()
        raise HTTPException(503, "too many runs in flight; try again later",
                            headers={"Retry-After": "1"}) from None
    record = RunRecord()
    request.state.record = record

    async def work(on_output: Any = None) -> Execution:
        try:
            execution, _ = await service.runner.run(
                body.code, network=body.network, timeout=timeout, inputs=body.inputs,
                record=record, on_output=on_output)
            service.count_run("native", execution)
            return execution
        finally:
            release()

    if _wants_events(request):
        stream = _Stream()
        return stream.response(asyncio.ensure_future(work(stream)))
    try:
        execution = await unless_disconnected(request, work())
    except KernelUnavailable as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": "5"}) from None
    if execution is None:
        return Response(status_code=499)
    return ExecutionJSON(execution.to_dict())


# --- sessions ------------------------------------------------------------------------------

@router.post("/sessions", status_code=201, response_model=SessionShape,
             summary="Open a session: a kernel of its own whose state persists")
async def create_session(body: SessionRequest, request: Request, key: Key) -> Any:
    service = service_of(request)
    config = service.config
    if body.network and not config.enable_network:
        raise HTTPException(403, "network access is disabled on this service (--enable-network)")
    idle = config.session_idle_timeout if body.idle_timeout is None else body.idle_timeout
    if idle > config.max_session_idle_timeout:
        raise HTTPException(400, f"idle_timeout {idle:g} s is above this service's limit of "
                            f"{config.max_session_idle_timeout:g} s")
    try:
        session = await service.sessions.create(key, body.network, idle)
    except SessionError as exc:
        service.metrics.denials.labels(reason="session_limit").inc()
        raise HTTPException(exc.status, str(exc)) from None
    except KernelUnavailable as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": "5"}) from None
    request.state.session_id = session.id
    request.state.kernel_id = session.kernel_id
    return session.describe()


@router.get("/sessions", response_model=list[SessionShape], summary="This key's sessions")
async def list_sessions(request: Request, key: Key) -> Any:
    return [s.describe() for s in service_of(request).sessions.owned_by(key.id)]


@router.get("/sessions/{session_id}", response_model=SessionShape, summary="One session")
async def get_session(session_id: str, request: Request, key: Key) -> Any:
    return _session(request, key, session_id).describe()


@router.delete("/sessions/{session_id}", status_code=204, summary="Close a session")
async def delete_session(session_id: str, request: Request,
                         key: Key) -> Response:
    session = _session(request, key, session_id)
    service_of(request).sessions.delete(session)
    return Response(status_code=204)


@router.post("/sessions/{session_id}/interrupt", status_code=204,
             summary="Interrupt the session's running execution")
async def interrupt(session_id: str, request: Request, key: Key) -> Response:
    session = _session(request, key, session_id)
    if session.dead is not None:
        raise HTTPException(410, f"session {session.id}'s kernel is gone: {session.dead}")
    await session.sandbox.interrupt()
    return Response(status_code=204)


async def _session_run(service: Any, session: Session, sandbox: AsyncSandbox, body: ExecuteRequest,
                       timeout: float, on_output: Any = None) -> Execution:
    """Run in the session's kernel; if even the client's restart does not end it, it is lost.

    Raises SessionError(410) when the kernel cannot be reached any more (its restart failed,
    or the session was deleted under the run).
    """
    record = RunRecord(kernel_id=session.kernel_id)
    on = callbacks(record, OutputBudget(service.config.max_output_total), on_output)
    # A kernel restarted by a call whose client had left: this call is the first to hear of it.
    lost_unseen, session.lost_unseen = session.lost_unseen, False
    try:
        execution, lost = await bounded(
            sandbox.run(body.code, body.inputs, timeout=timeout, on_stdout=on["stdout"],
                        on_stderr=on["stderr"], on_display=on["display"]),
            timeout, 2 * service.config.kernel_grace + service.restart_allowance, record,
            service.runner.stopping)
    except OutputLimit as exc:
        service.background(sandbox.interrupt())
        execution, lost = output_limited(record, str(exc), state_lost=False), False
    except Exception as exc:
        service.sessions.mark_dead(session, f"the connection to its kernel failed ({exc})")
        raise SessionError(410, f"session {session.id}'s kernel is gone: {session.dead}; "
                           "delete the session and create a new one") from exc
    if lost:
        service.sessions.mark_dead(session, "it did not stop after its time limit")
    execution.state_lost = execution.state_lost or lost_unseen
    service.count_run("session", execution)
    return execution


def _stop_when_abandoned(service: Any, sandbox: AsyncSandbox) -> Callable[[Any], None]:
    """What to do when a session execution's client leaves: interrupt the code, and let the
    run end by itself (it is bounded by its deadline), holding the session until it has.

    Cancelling the run instead could stop the kernel's client half-way through restarting a
    lost kernel (its sockets closed, no new ones yet), breaking the session for its next call.
    """
    client = sandbox.client

    async def interrupt() -> None:
        # Only the kernel the run began on: once the run has restarted a lost kernel (a new
        # client), a SIGINT would hit the new kernel while it starts. The check and the signal
        # happen without a suspension point in between.
        if sandbox.client is client and client.channels_running:
            with contextlib.suppress(Exception):  # it ended meanwhile
                await sandbox.interrupt()

    return lambda _work: service.background(interrupt())


@router.post("/sessions/{session_id}/execute", response_model=ExecutionShape,
             summary="Run code (or main() with inputs) in the session's kernel",
             responses={200: {"content": {SSE: {}}}, 409: {"description": "session busy"},
                        410: {"description": "the session's kernel died"}})
async def execute_in_session(session_id: str, body: ExecuteRequest, request: Request,
                             key: Key) -> Response:
    service = service_of(request)
    session = _session(request, key, session_id)
    timeout = _timeout(service, body.timeout)
    try:
        sandbox = await service.sessions.acquire(session)
    except SessionError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    abandon = _stop_when_abandoned(service, sandbox)
    caller_left = False

    async def work(on_output: Any = None) -> Execution:
        try:
            execution = await _session_run(service, session, sandbox, body, timeout, on_output)
            session.lost_unseen = session.lost_unseen or (caller_left and execution.state_lost)
            return execution
        finally:
            service.sessions.release(session)

    def left(task: asyncio.Task[Execution]) -> None:
        nonlocal caller_left
        caller_left = True
        abandon(task)

    if _wants_events(request):
        stream = _Stream(abandon=left)
        return stream.response(service.background(work(stream)))
    task = service.background(work())  # not the request's task: it must not be cancelled
    if await client_left(request, task):
        left(task)
        return Response(status_code=499)
    try:
        execution = task.result()
    except SessionError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    return ExecutionJSON(execution.to_dict())


# --- files ---------------------------------------------------------------------------------

_FILE_CODE = f'''
def {FILE_HELPER}(op, path, data=None, limit=0):
    import base64, os
    home = os.path.realpath(os.path.expanduser("~"))
    target = os.path.realpath(os.path.join(home, path))
    if os.path.commonpath([home, target]) != home:
        raise PermissionError(f"{{path}} leads outside the scratch directory")
    if op == "write":
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as file:
            file.write(base64.b64decode(data))
        return {{"path": path, "size": os.path.getsize(target)}}
    size = os.path.getsize(target)
    if size > limit:
        raise ValueError(f"{{path}} is {{size}} bytes, above the {{limit}}-byte limit")
    with open(target, "rb") as file:
        content = file.read(limit + 1)
    return {{"path": path, "size": len(content), "data": base64.b64encode(content).decode()}}
'''


def scratch_path(path: str) -> str:
    """A relative path inside the scratch directory, or 400."""
    if not path or "\x00" in path or len(path) > 1024:
        raise HTTPException(400, "the file path must be 1-1024 characters without NUL")
    try:
        sendable(path)
    except ValueError as exc:
        raise HTTPException(400, f"the file path {exc}") from None
    normal = posixpath.normpath(path)
    if path.startswith("/") or normal == "." or normal.startswith("..") \
            or ".." in path.split("/"):
        raise HTTPException(400, f"{path!r} is not a path inside the session's scratch "
                            "directory: give it relative, without '..'")
    return normal


_FILE_ERRORS = {"FileNotFoundError": 404, "IsADirectoryError": 400, "NotADirectoryError": 400,
                "PermissionError": 403, "ValueError": 413, "FileExistsError": 409}


async def _file_op(request: Request, key: ApiKey, session_id: str, inputs: dict) -> dict:
    service = service_of(request)
    session = _session(request, key, session_id)
    timeout = min(service.config.max_timeout, FILE_TIMEOUT)
    try:
        async with service.sessions.using(session) as sandbox:
            execution, lost = await bounded(
                sandbox.run(_FILE_CODE, inputs, timeout=timeout, entrypoint=FILE_HELPER),
                timeout, 2 * service.config.kernel_grace + service.restart_allowance,
                RunRecord(), service.runner.stopping)
            if lost:
                service.sessions.mark_dead(session, "it did not stop after its time limit")
    except SessionError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    except Exception as exc:
        # Deleted or culled while the operation ran, or its kernel's restart failed: the
        # session cannot be trusted to work again.
        if session.dead is None:
            service.sessions.mark_dead(session, f"the connection to its kernel failed ({exc})")
        raise HTTPException(410, f"session {session.id}'s kernel is gone: {session.dead}"
                            ) from None
    if execution.error is not None:
        status = _FILE_ERRORS.get(execution.error.name, 500)
        text = f"{execution.error.name}: {execution.error.value}"
        raise HTTPException(status, text.encode("utf-8", "replace").decode("utf-8"))
    if not isinstance(execution.result, dict):
        raise HTTPException(502, "the kernel did not answer the file operation")
    return execution.result


@router.put("/sessions/{session_id}/files/{path:path}", status_code=201,
            response_model=FileShape, summary="Upload a file (the raw body) to the scratch")
async def upload(session_id: str, path: str, request: Request,
                 key: Key) -> Any:
    service = service_of(request)
    limit = service.config.max_file_bytes
    relative = scratch_path(path)
    content = bytearray()
    async for chunk in request.stream():
        content += chunk
        if len(content) > limit:
            raise HTTPException(413, f"the file is larger than {limit} bytes (--max-file)")
    result = await _file_op(request, key, session_id, {
        "op": "write", "path": relative, "data": base64.b64encode(bytes(content)).decode()})
    return {"path": relative, "size": int(result.get("size", -1))}


@router.get("/sessions/{session_id}/files/{path:path}", summary="Download a file from the scratch",
            responses={200: {"content": {"application/octet-stream": {}}}})
async def download(session_id: str, path: str, request: Request,
                   key: Key) -> Response:
    limit = service_of(request).config.max_file_bytes
    result = await _file_op(request, key, session_id,
                            {"op": "read", "path": scratch_path(path), "limit": limit})
    data = result.get("data")
    # Never trust the kernel: its answer is checked here, not only by the code that made it.
    if not isinstance(data, str) or len(data) > 4 * (limit // 3 + 1):
        raise HTTPException(502, "the kernel's answer is not a file within the size limit")
    try:
        content = base64.b64decode(data, validate=True)
    except ValueError:
        raise HTTPException(502, "the kernel's answer is not base64") from None
    return Response(content, media_type="application/octet-stream")
