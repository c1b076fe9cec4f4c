"""Snapshots of a session and pausing it (needs --state-dir): the routes of pausing.py."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from starlette.responses import Response

from ...hosting.network import network_of, policy_name
from ...hosting.pausing import Pausing
from ...hosting.store import Stored
from ..core import Service
from ..deps import Key, OwnedSession, ServiceDep
from .schemas import PausedShape, SnapshotShape

router = APIRouter()


def pausing_of(service: Service) -> Pausing:
    """The service's pausing; 404 naming the flag when it has no state dir."""
    if service.pausing is None:
        raise HTTPException(404, "snapshots and pausing are off on this service: the operator "
                            "enables them with --state-dir")
    return service.pausing


def snapshot_shape(item: Stored) -> dict[str, Any]:
    """A stored snapshot as the API shows it."""
    manifest = item.record["manifest"]
    return {"id": item.id, "bytes": item.size, "saved": manifest.get("saved", []),
            "skipped": manifest.get("skipped", []), "session": item.record["session"],
            "policy": policy_name(network_of(item.record["network"])),
            "saved_at": item.record["saved_at"]}


@router.post("/sessions/{session_id}/snapshots", status_code=201, response_model=SnapshotShape,
             summary="Snapshot the session's variables and files; the session keeps running",
             responses={409: {"description": "session busy"},
                        413: {"description": "above --max-snapshot-size"}})
async def snapshot_session(session: OwnedSession, service: ServiceDep) -> Any:
    """Save the session's user state as a new snapshot of this key's."""
    stored, _ = await pausing_of(service).snapshot(session)
    return snapshot_shape(stored)


@router.get("/snapshots", response_model=list[SnapshotShape], summary="This key's snapshots")
async def list_snapshots(key: Key, service: ServiceDep) -> Any:
    """The snapshots this API key made."""
    return [snapshot_shape(item) for item in pausing_of(service).store.snapshots(key.id)]


@router.delete("/snapshots/{snapshot_id}", status_code=204, summary="Delete a snapshot")
async def delete_snapshot(snapshot_id: str, key: Key, service: ServiceDep) -> Response:
    """Delete one of this key's snapshots (sessions restored from it are not affected)."""
    pausing_of(service).store.delete_snapshot(key.id, snapshot_id)
    return Response(status_code=204)


@router.post("/sessions/{session_id}/pause", response_model=PausedShape,
             summary="Pause the session: snapshot it and stop its kernel",
             responses={409: {"description": "session busy"},
                        413: {"description": "above --max-snapshot-size"}})
async def pause_session(session: OwnedSession, service: ServiceDep) -> Any:
    """Free the session's kernel; its next request resumes it, state restored."""
    size = await pausing_of(service).pause(session)
    return {"id": session.id, "paused": True, "bytes": size}
