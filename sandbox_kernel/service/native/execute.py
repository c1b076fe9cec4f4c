"""Executions: one-shot on a fresh kernel (`/execute`), or in a session's kernel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from starlette.responses import Response

from ...client import AsyncSandbox, Execution
from ...client.sandbox import install_code
from ...errors import OutputLimitExceeded
from ...hosting.admission import Busy, tenant_of
from ...hosting.fresh import OutputBudget, RunRecord, bounded, callbacks, output_limited
from ...hosting.sessions import Session
from ..core import Service
from ..deps import Key, ServiceDep, run_timeout, session_of
from ..disconnects import client_left, unless_disconnected
from ..openapi import EVENT_STREAM
from .schemas import (
    ExecuteRequest,
    ExecutionShape,
    InstallRequest,
    OneShotRequest,
    network_choice,
)
from .stream import EventStream, ExecutionJSON, wants_events

router = APIRouter()


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

    async def work(on_output: Any = None) -> Execution:
        try:
            execution, _ = await service.runner.run(
                body.code, network=network, timeout=timeout, tenant=tenant, inputs=body.inputs,
                record=record, on_output=on_output)
            service.count_run("native", execution)
            return execution
        finally:
            release()

    if wants_events(request):
        stream = EventStream()
        return stream.response(asyncio.ensure_future(work(stream)))
    execution = await unless_disconnected(request, work())
    if execution is None:
        return Response(status_code=499)
    return ExecutionJSON(execution)


async def _session_run(service: Service, session: Session, sandbox: AsyncSandbox,
                       body: ExecuteRequest, timeout: float, on_output: Any = None) -> Execution:
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
                        on_stderr=on["stderr"], on_display=on["display"], raw_result=True),
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

    if wants_events(request):
        stream = EventStream(abandon=left)
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
    request_body = ExecuteRequest(code=code, inputs=None, timeout=body.timeout)
    return await execute_in_session(session_id, request_body, request, key, service)
