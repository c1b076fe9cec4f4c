"""The service's domain errors as HTTP answers, registered once by `create_app`.

A route raises `SessionError` or lets `KernelUnavailable` through; these handlers give the
answer FastAPI's own `HTTPException` would (`{"detail": ...}`), so every route says it alike.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import KernelUnavailable
from ..hosting.sessions import SessionError
from ..hosting.store import StoreError

KERNEL_RETRY_AFTER = "5"  # seconds: about what a fresh kernel takes to start on a busy host


async def session_error(request: Request, exc: Exception) -> Response:
    """A session or snapshot request that cannot be carried out: the status the error
    carries."""
    assert isinstance(exc, SessionError | StoreError)
    return JSONResponse({"detail": str(exc)}, status_code=exc.status)


async def kernel_unavailable(request: Request, exc: Exception) -> Response:
    """No kernel could be had: 503, to be tried again shortly."""
    assert isinstance(exc, KernelUnavailable)
    return JSONResponse({"detail": str(exc)}, status_code=503,
                        headers={"Retry-After": KERNEL_RETRY_AFTER})
