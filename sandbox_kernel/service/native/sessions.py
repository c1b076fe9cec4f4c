"""Sessions: a kernel of the caller's own whose state persists between executions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from starlette.responses import Response

from ...hosting.pausing import describe_paused
from ...hosting.sessions import SessionError
from ...secrets import SecretError
from ..deps import Key, ServiceDep
from .schemas import SessionRequest, SessionShape, network_choice

router = APIRouter()


@router.post("/sessions", status_code=201, response_model=SessionShape,
             summary="Open a session: a kernel of its own whose state persists")
async def create_session(body: SessionRequest, request: Request, key: Key,
                         service: ServiceDep) -> Any:
    """Open a session on a fresh kernel, within the key's and the service's limits."""
    config = service.config
    network = network_choice(body.network)
    restore = None
    if body.snapshot is not None:  # a fork: the snapshot's network, its state restored
        from .snapshots import pausing_of

        network, restore = pausing_of(service).restorable(
            key.id, body.snapshot, network if "network" in body.model_fields_set else None)
    if network and not config.enable_network:
        raise HTTPException(403, "network access is disabled on this service (--enable-network)")
    idle = config.session_idle_timeout if body.idle_timeout is None else body.idle_timeout
    if idle > config.max_session_idle_timeout:
        raise HTTPException(400, f"idle_timeout {idle:g} s is above this service's limit of "
                            f"{config.max_session_idle_timeout:g} s")
    try:
        session = await service.sessions.create(key, network, idle, restore,
                                                secrets=body.secrets)
    except SessionError:  # a limit: counted here, answered by the app's handler
        service.metrics.denials.labels(reason="session_limit").inc()
        raise
    except SecretError as exc:  # its message names the secret and the fix, never a value
        raise HTTPException(400, str(exc)) from None
    request.state.session_id = session.id
    request.state.kernel_id = session.kernel_id
    return {**session.describe(), "restore": session.restore_report()}


@router.get("/sessions", response_model=list[SessionShape], summary="This key's sessions")
async def list_sessions(key: Key, service: ServiceDep) -> Any:
    """The sessions this API key holds, live and paused."""
    live = service.sessions.owned_by(key.id)
    pausing = service.pausing
    paused = [] if pausing is None else pausing.store.paused_of(key.id)
    known = {s.id for s in live}
    return [s.describe() for s in live] + [describe_paused(p) for p in paused
                                           if p.id not in known]


@router.get("/sessions/{session_id}", response_model=SessionShape, summary="One session")
async def get_session(session_id: str, key: Key, service: ServiceDep) -> Any:
    """One session of this API key (a paused one is described, not resumed)."""
    pausing = service.pausing
    if service.sessions.find(key.id, session_id) is None and pausing is not None:
        paused = pausing.paused(key, session_id)
        if paused is not None:
            return describe_paused(paused)
    return service.sessions.get(key, session_id).describe()


@router.delete("/sessions/{session_id}", status_code=204, summary="Close a session")
async def delete_session(session_id: str, key: Key, service: ServiceDep) -> Response:
    """Close a session and shut its kernel down (a paused one: its snapshot is deleted)."""
    pausing = service.pausing
    if service.sessions.find(key.id, session_id) is None and pausing is not None \
            and pausing.paused(key, session_id) is not None:
        pausing.store.lease(session_id, key.id)  # 409 while another instance runs it
        pausing.drop(session_id)
        return Response(status_code=204)
    service.sessions.delete(service.sessions.get(key, session_id))
    return Response(status_code=204)


@router.post("/sessions/{session_id}/interrupt", status_code=204,
             summary="Interrupt the session's running execution")
async def interrupt(session_id: str, key: Key, service: ServiceDep) -> Response:
    """Interrupt the session's running execution (KeyboardInterrupt in the code); a paused
    session runs nothing and stays paused."""
    pausing = service.pausing
    if service.sessions.find(key.id, session_id) is None and pausing is not None \
            and pausing.paused(key, session_id) is not None:
        pausing.store.lease(session_id, key.id)  # 409 if another instance runs it now
        pausing.store.release(session_id)
        return Response(status_code=204)
    session = service.sessions.get(key, session_id)
    if session.dead is not None:
        raise HTTPException(410, f"session {session.id}'s kernel is gone: {session.dead}")
    await session.sandbox.interrupt()
    return Response(status_code=204)
