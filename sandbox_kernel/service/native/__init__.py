"""The native API, `/api/v1`: one router per resource (executions, sessions, files).

Routes take what they need as typed dependencies (`..deps`); `SessionError` and
`KernelUnavailable` become HTTP answers in the app's exception handlers (`..errors`).
"""

from fastapi import APIRouter

from . import execute, files, sessions, snapshots

router = APIRouter(prefix="/api/v1", tags=["native"])
for _resource in (execute, sessions, snapshots, files):
    router.include_router(_resource.router)

__all__ = ["router"]
