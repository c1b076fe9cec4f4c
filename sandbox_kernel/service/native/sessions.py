"""Sessions: a kernel of the caller's own whose state persists between executions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from starlette.responses import Response

from ..deps import Key, OwnedSession, ServiceDep
from ..sessions import SessionError
from .schemas import SessionRequest, SessionShape, network_choice

router = APIRouter()


@router.post("/sessions", status_code=201, response_model=SessionShape,
             summary="Open a session: a kernel of its own whose state persists")
async def create_session(body: SessionRequest, request: Request, key: Key,
                         service: ServiceDep) -> Any:
    """Open a session on a fresh kernel, within the key's and the service's limits."""
    config = service.config
    network = network_choice(body.network)
    if network and not config.enable_network:
        raise HTTPException(403, "network access is disabled on this service (--enable-network)")
    idle = config.session_idle_timeout if body.idle_timeout is None else body.idle_timeout
    if idle > config.max_session_idle_timeout:
        raise HTTPException(400, f"idle_timeout {idle:g} s is above this service's limit of "
                            f"{config.max_session_idle_timeout:g} s")
    try:
        session = await service.sessions.create(key, network, idle)
    except SessionError:  # a limit: counted here, answered by the app's handler
        service.metrics.denials.labels(reason="session_limit").inc()
        raise
    request.state.session_id = session.id
    request.state.kernel_id = session.kernel_id
    return session.describe()


@router.get("/sessions", response_model=list[SessionShape], summary="This key's sessions")
async def list_sessions(key: Key, service: ServiceDep) -> Any:
    """The sessions this API key holds."""
    return [s.describe() for s in service.sessions.owned_by(key.id)]


@router.get("/sessions/{session_id}", response_model=SessionShape, summary="One session")
async def get_session(session: OwnedSession) -> Any:
    """One session of this API key."""
    return session.describe()


@router.delete("/sessions/{session_id}", status_code=204, summary="Close a session")
async def delete_session(session: OwnedSession, service: ServiceDep) -> Response:
    """Close a session and shut its kernel down."""
    service.sessions.delete(session)
    return Response(status_code=204)


@router.post("/sessions/{session_id}/interrupt", status_code=204,
             summary="Interrupt the session's running execution")
async def interrupt(session: OwnedSession) -> Response:
    """Interrupt the session's running execution (KeyboardInterrupt in the code)."""
    if session.dead is not None:
        raise HTTPException(410, f"session {session.id}'s kernel is gone: {session.dead}")
    await session.sandbox.interrupt()
    return Response(status_code=204)
