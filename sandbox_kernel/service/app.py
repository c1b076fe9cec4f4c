"""The ASGI application: the service's routers, its error mapping, and the operational routes."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from starlette.responses import JSONResponse, Response

from .. import __version__
from ..errors import KernelUnavailable
from ..hosting.sessions import SessionError
from ..hosting.sources import KernelSource
from ..hosting.store import StoreError
from ..policy import SandboxPolicy
from . import dify, native, openapi
from .access import AccessLog
from .config import ServiceConfig
from .core import Service
from .deps import ServiceDep
from .errors import kernel_unavailable, session_error
from .limits import BodyLimit
from .validation import invalid_request


def create_app(config: ServiceConfig | None = None, policy: SandboxPolicy | None = None,
               source: KernelSource | None = None) -> FastAPI:
    """The service as an ASGI app (uvicorn: `sandbox_kernel.service.app:create_app --factory`)."""
    service = Service(config or ServiceConfig(), policy or SandboxPolicy(), source)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    # Swagger UI's page and assets come from the fastapi-offline package: /docs works offline.
    app = FastAPIOffline(
        title="sandbox-kernel service", version=__version__, lifespan=lifespan, redoc_url=None,
        description="Runs untrusted Python in sandboxed Jupyter kernels. `/v1/sandbox/*`: "
        "dify-sandbox's API (X-Api-Key). `/api/v1/*`: sessions, executions, server-sent "
        "events, files (Authorization: Bearer).")
    app.state.service = service  # read only by deps.service
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    # The domain's errors become HTTP answers here, once; the event stream, whose status line
    # is already sent when they happen, and the dify routes, whose answers are gin's, keep theirs.
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(SessionError, session_error)
    app.add_exception_handler(StoreError, session_error)
    app.add_exception_handler(KernelUnavailable, kernel_unavailable)
    app.include_router(dify.router)
    app.include_router(native.router)
    app.include_router(operations)
    # Outermost last: the access log sees even the 413s of the body limit.
    app.add_middleware(BodyLimit, limit=service.config.max_body_bytes, metrics=service.metrics)
    app.add_middleware(AccessLog, metrics=service.metrics)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        app.openapi_schema = openapi.complete(FastAPI.openapi(app))
    return app.openapi_schema


operations = APIRouter(tags=["operations"])


@operations.get("/ready", summary="Readiness, with the pool's state")
async def ready(service: ServiceDep) -> JSONResponse:
    """200 when the service can run code now, else 503; the body says why."""
    state = service.readiness()
    return JSONResponse(state, status_code=200 if state["ready"] else 503)


@operations.get("/metrics", summary="Prometheus metrics")
async def metrics(service: ServiceDep) -> Response:
    """The service's Prometheus metrics in the text format."""
    return Response(service.metrics.render(), media_type=service.metrics.content_type)
