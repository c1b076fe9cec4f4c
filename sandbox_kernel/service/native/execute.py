"""Executions: one-shot on a fresh kernel (`/execute`), or in a session's kernel."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from starlette.responses import Response

from ...client import AsyncSandbox, Execution
from ...client.sandbox import install_code
from ...client.tools import Toolbox
from ...errors import OutputLimitExceeded
from ...hosting.admission import Busy, tenant_of
from ...hosting.fresh import OutputBudget, RunRecord, bounded, callbacks, output_limited
from ...hosting.keys import ApiKey
from ...hosting.sessions import Session
from ...hosting.tools import Declared, DeskRun, ToolAnswerError
from .. import deps
from ..core import Service
from ..deps import Key, ServiceDep, run_timeout, session_of
from ..direct import DirectRoute, json_body, serve_directly
from ..disconnects import client_left, unless_disconnected
from ..openapi import EVENT_STREAM
from .schemas import (
    ExecuteRequest,
    ExecutionShape,
    InstallRequest,
    OneShotRequest,
    ToolAnswer,
    network_choice,
)
from .stream import EventStream, ExecutionJSON, wants_events

router = APIRouter(route_class=DirectRoute)
NO_STREAM = ("the caller declared tools but did not take the run's event stream (Accept: "
             "text/event-stream), where tool calls are served: ask for the stream to call them")


@router.post("/execute", response_model=ExecutionShape,
             summary="Run code (or main() with inputs) on a fresh kernel",
             responses={200: EVENT_STREAM, 503: {"description": "too many runs"}})
async def execute(body: OneShotRequest, request: Request, key: Key,
                  service: ServiceDep) -> Response:
    """Run code on a fresh kernel; the answer, or a stream of events, says what it did."""
    timeout = run_timeout(service, body.timeout)
    network = network_choice(body.network)
    if network and not service.config.enable_network:
        raise HTTPException(403, "network access is disabled on this service (--enable-network)")
    tenant = tenant_of(key.id)
    try:
        release = service.admission.enter(tenant)
    except Busy as busy:
        service.metrics.denials.labels(reason="too_many_requests").inc()
        why = (f"API key {key.id!r} has its limit of {service.admission.requests_cap} runs in "
               "flight (--max-requests-per-key)" if busy.per_tenant
               else "too many runs in flight")
        raise HTTPException(503, f"{why}; try again later",
                            headers={"Retry-After": "1"}) from None
    record = RunRecord()
    request.state.record = record
    stream = EventStream() if wants_events(request) else None
    toolbox, desk_run = _tools(service, key, body, stream)

    async def work(on_output: Any = None) -> Execution:
        try:
            execution, _ = await service.runner.run(
                body.code, network=network, timeout=timeout, tenant=tenant, inputs=body.inputs,
                record=record, on_output=on_output, tools=toolbox)
            service.count_run("native", execution)
            return execution
        finally:
            release()
            if desk_run is not None:
                service.tool_desk.close(desk_run)

    if stream is not None:
        return stream.response(asyncio.ensure_future(work(stream)))
    execution = await unless_disconnected(request, work())
    if execution is None:
        return Response(status_code=499)
    return ExecutionJSON(execution)


async def _execute_directly(request: Request) -> Response | None:
    """execute() for a request with a known key and a valid JSON body, the values found as
    FastAPI finds them (deps, OneShotRequest); None for any other (direct.py)."""
    running = await deps.service(request)
    key = deps.known_key(running, await deps.bearer(request))
    raw = None if key is None else await json_body(request)
    if key is None or raw is None:
        return None
    try:  # FastAPI's reading: json.loads, then the model on what it gave
        body = OneShotRequest.model_validate(json.loads(raw), from_attributes=True)
    except Exception:  # not JSON, not a request: FastAPI's answer says which
        return None
    return await execute(body, request, deps.taken(request, key), running)


serve_directly(execute, _execute_directly)


def _tools(service: Service, key: ApiKey, body: ExecuteRequest, stream: EventStream | None,
           ) -> tuple[Toolbox | None, DeskRun | None]:
    """The run's declared tools: served through its event stream (each call a `tool_call`
    event, waiting for the caller's answer on the run's route), or, without a stream, each
    call failing at once saying why; and the desk's run, to close when the run ends."""
    if not body.tools:
        return None, None
    declared = [Declared(tool.name, tool.description, tool.parameters, tool.returns)
                for tool in body.tools]
    desk = service.tool_desk
    if stream is None:
        return desk.unserved(declared, NO_STREAM), None
    limit = min(body.tool_timeout or service.config.max_tool_timeout,
                service.config.max_tool_timeout)
    run = desk.open(key.id)
    return desk.grant(run, declared, limit, lambda call: stream("tool_call", call)), run


async def _session_run(service: Service, session: Session, sandbox: AsyncSandbox,
                       body: ExecuteRequest, timeout: float, on_output: Any = None,
                       tools: Toolbox | None = None) -> Execution:
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
                        on_stderr=on["stderr"], on_display=on["display"], raw_result=True,
                        tools=tools),
            timeout, 2 * service.config.kernel_grace + service.restart_allowance, record,
            service.runner.stopping)
    except OutputLimitExceeded as exc:
        service.background(sandbox.interrupt())
        execution, lost = output_limited(record, exc, state_lost=False), False
    except Exception as exc:
        service.sessions.mark_dead(session, f"the connection to its kernel failed ({exc})")
        raise service.sessions.gone(session) from exc
    if lost:
        service.sessions.mark_dead(session, "it did not stop after its time limit")
    execution.state_lost = execution.state_lost or lost_unseen
    service.count_run("session", execution)
    return execution


def _stop_when_abandoned(service: Service, sandbox: AsyncSandbox) -> Callable[[Any], None]:
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

    def abandon(_work: Any) -> None:
        service.background(interrupt())

    return abandon


@router.post("/sessions/{session_id}/execute", response_model=ExecutionShape,
             summary="Run code (or main() with inputs) in the session's kernel",
             responses={200: EVENT_STREAM, 409: {"description": "session busy"},
                        410: {"description": "the session's kernel died"}})
async def execute_in_session(session_id: str, body: ExecuteRequest, request: Request,
                             key: Key, service: ServiceDep) -> Response:
    """Run code in a session's kernel, which keeps variables and files between runs."""
    session = await session_of(request, service, key, session_id)
    timeout = run_timeout(service, body.timeout, in_session=True)
    sandbox = await service.sessions.acquire(session)
    abandon = _stop_when_abandoned(service, sandbox)
    caller_left = False
    stream = EventStream(abandon=lambda task: left(task)) if wants_events(request) else None
    toolbox, desk_run = _tools(service, key, body, stream)

    async def work(on_output: Any = None) -> Execution:
        try:
            execution = await _session_run(service, session, sandbox, body, timeout, on_output,
                                           toolbox)
            session.lost_unseen = session.lost_unseen or (caller_left and execution.state_lost)
            return execution
        finally:
            service.sessions.release(session)
            if desk_run is not None:
                service.tool_desk.close(desk_run)

    def left(task: asyncio.Task[Execution]) -> None:
        nonlocal caller_left
        caller_left = True
        abandon(task)

    if stream is not None:
        return stream.response(service.background(work(stream)))
    task = service.background(work())  # not the request's task: it must not be cancelled
    if await client_left(request, task):
        left(task)
        return Response(status_code=499)
    return ExecutionJSON(task.result())


@router.post("/sessions/{session_id}/packages", response_model=ExecutionShape,
             summary="Install packages (wheels) into the session's kernel, for its next "
             "executions to import",
             responses={409: {"description": "session busy"},
                        410: {"description": "the session's kernel died"}})
async def install_in_session(session_id: str, body: InstallRequest, request: Request,
                             key: Key, service: ServiceDep) -> Response:
    """`%pip install` in the session: its error (PackageInstallError) says why it failed."""
    try:
        code = install_code(body.packages, body.upgrade)
    except ValueError as exc:  # not a requirement the %pip magic takes: the caller's to fix
        raise HTTPException(422, str(exc)) from None
    request_body = ExecuteRequest(code=code, inputs=None, timeout=body.timeout, tools=None,
                                  tool_timeout=None)
    return await execute_in_session(session_id, request_body, request, key, service)


@router.post("/runs/{run_id}/tool_calls/{call_id}", status_code=204,
             summary="Answer a tool call of a run (its tool_call event): {result} or {error}",
             responses={404: {"description": "no such run of this key, or no such call"},
                        409: {"description": "answered already, or the run is held by another "
                              "instance (named)"},
                        410: {"description": "the call's deadline passed, or the run ended"},
                        413: {"description": "the result is larger than a call may return"}})
async def answer_tool_call(run_id: str, call_id: str, body: ToolAnswer, key: Key,
                           service: ServiceDep) -> Response:
    """Settle the call: the code's call returns the result, or raises ToolError with the
    error; once per call, within its deadline, by the API key that started the run."""
    given = {name: getattr(body, name) for name in body.model_fields_set}
    try:
        service.tool_desk.answer(key.id, run_id, call_id, given)
    except ToolAnswerError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    return Response(status_code=204)
