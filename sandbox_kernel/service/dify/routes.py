"""The dify-sandbox routes: `/health` and `/v1/sandbox/*` (run, dependencies), X-Api-Key."""

from __future__ import annotations

import asyncio
import functools
import logging
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from ... import runtimes
from ...errors import KernelUnavailable
from ...hosting.admission import Busy
from ...hosting.fresh import RunRecord
from .. import deps
from ..access import json_line
from ..core import Service
from ..deps import ServiceDep
from ..direct import DirectRoute, serve_directly
from ..disconnects import unless_disconnected
from ..openapi import DEPENDENCIES_DOC, RUN_DOC
from . import dependencies, framing
from .answers import run_data
from .gin import GoJSON, bind, error_answer, success
from .nodejs import run_nodejs

log = logging.getLogger("sandbox_kernel.service")
router = APIRouter(tags=["dify-sandbox"], route_class=DirectRoute)

NETWORK_DISABLED = "network is disabled, please enable it in the configuration"


@router.get("/health", summary="Liveness: \"ok\"")
async def health() -> GoJSON:
    """Liveness, as dify-sandbox answers it."""
    return GoJSON("ok")


def _refused(request: Request, service: Service) -> Response | None:
    """dify-sandbox's answer to a missing or wrong X-Api-Key (401, empty body), else None."""
    if service.dify_key_ok(request.headers.get("x-api-key")):
        return None
    service.metrics.denials.labels(reason="bad_key").inc()
    return Response(status_code=401)


@router.post("/v1/sandbox/run", summary="Run code on a fresh kernel (dify-sandbox's API)",
             **RUN_DOC)
async def run(request: Request, service: ServiceDep) -> Response:
    """dify-sandbox's /v1/sandbox/run: the code on a fresh kernel, its stdout and error."""
    if (refusal := _refused(request, service)) is not None:
        return refusal
    try:
        with service.admission.slot(service.dify_tenant):
            return await _run_admitted(request, service)
    except Busy:
        service.metrics.denials.labels(reason="too_many_requests").inc()
        return error_answer(503, -503, "Too many requests")


async def _run_directly(request: Request) -> Response:
    """run() with the values FastAPI would pass (it takes no body: nothing to give back)."""
    return await run(request, await deps.service(request))


serve_directly(run, _run_directly)


async def _run_admitted(request: Request, service: Service) -> Response:
    values, refusal = await bind(request, ("language", "code", "preload", "enable_network"),
                                 ("language", "code"))
    if refusal is not None:
        service.metrics.denials.labels(reason="bad_input").inc()
        return refusal
    assert values is not None
    language = values["language"]
    if language == "nodejs":
        return await run_nodejs(request, service)
    if language != "python3":  # neither this service nor dify-sandbox knows it
        service.metrics.denials.labels(reason="bad_input").inc()
        return error_answer(400, -400, "unsupported language")
    network = bool(values.get("enable_network"))
    if network and not service.config.enable_network:
        service.metrics.denials.labels(reason="network_disabled").inc()
        return error_answer(200, -400, NETWORK_DISABLED)
    # `preload` is accepted and ignored: our preloading happens before confinement, server-side.
    record = RunRecord()
    request.state.record = record
    timeout = service.config.worker_timeout
    runner = framing.split(values["code"])  # Dify's runner: its result survives any logs
    try:
        outcome = await unless_disconnected(request, service.runner.run(
            runner or values["code"], network=network, timeout=timeout,
            tenant=service.dify_tenant, record=record, inputs={} if runner else None,
            entrypoint=framing.ENTRYPOINT))
    except KernelUnavailable as exc:  # dify-sandbox answers a runner failure so, too
        log.error(json_line(event="kernel_unavailable", error=str(exc)))
        return error_answer(200, -500, str(exc))
    if outcome is None:  # the client left; its kernel is already being shut down
        service.metrics.runs.labels(api="dify", outcome="abandoned").inc()
        return Response(status_code=499)
    execution, _ = outcome
    service.count_run("dify", execution)
    if runner:
        framing.explained(execution)
    data = run_data(execution, values["code"])
    if runner:
        data["stdout"] = framing.framed_stdout(execution, data["stdout"], data["stderr"])
    return success(data)


@functools.lru_cache(maxsize=1)
def _installed() -> list[dict[str, str]]:
    """Every distribution the kernel's interpreter (this one: kernels run sys.executable) has."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name not in found:
            found[name] = dist.version
    return [{"name": name, "version": found[name]} for name in sorted(found, key=str.lower)]


def _dependencies(service: Service) -> list[dict[str, str]]:
    """What dify-sandbox lists: its requirements file's lines, here the runtime's."""
    if not service.config.runtime:
        return _installed()
    runtime = runtimes.find(service.config.runtime)
    return dependencies.listed(runtime.requirements.read_text())


async def _dependency_route(request: Request, service: Service, data: Any) -> Response:
    if (denied := _refused(request, service)) is not None:
        return denied
    values, refusal = await bind(request, ("language",), ("language",))
    if refusal is not None:
        return refusal
    assert values is not None
    if values["language"] != "python3":
        return error_answer(400, -400, "unsupported language")
    try:
        return success(await data())
    except runtimes.RuntimesError as exc:  # dify-sandbox answers a failed install so, too
        log.error(json_line(event="runtime_failed", error=str(exc)))
        return error_answer(200, -500, str(exc))


@router.get("/v1/sandbox/dependencies", summary="The packages kernels have", **DEPENDENCIES_DOC)
async def list_dependencies(request: Request, service: ServiceDep) -> Response:
    """dify-sandbox's dependency list: the packages kernels can import."""
    async def listed() -> dict[str, Any]:
        return {"dependencies": _dependencies(service)}
    return await _dependency_route(request, service, listed)


@router.post("/v1/sandbox/dependencies/update", summary="New kernels take the runtime's build",
             **DEPENDENCIES_DOC)
async def update_dependencies(request: Request, service: ServiceDep) -> Response:
    """dify-sandbox prepares its environment again; here new kernels take the runtime's
    current build (one `sandbox-kernel runtime update` made since the service started)."""
    async def switched() -> dict[str, Any]:
        if service.config.runtime:
            await service.use_current_runtime()
        return {}
    return await _dependency_route(request, service, switched)


@router.get("/v1/sandbox/dependencies/refresh", summary="Rebuild the runtime; list its packages",
            **DEPENDENCIES_DOC)
async def refresh_dependencies(request: Request, service: ServiceDep) -> Response:
    """dify-sandbox installs its requirements file again; here the runtime is rebuilt from the
    operator's file (running kernels keep theirs) and new kernels take the new build."""
    async def rebuilt() -> dict[str, Any]:
        if service.config.runtime:
            await asyncio.to_thread(_rebuild, service.config.runtime)
            await service.use_current_runtime()
        else:
            _installed.cache_clear()
        return {"dependencies": _dependencies(service)}
    return await _dependency_route(request, service, rebuilt)


def _rebuild(name: str) -> None:
    """Rebuild the runtime from the operator's file; a directory it cannot write is said so."""
    try:
        runtimes.update(name, force=True)
    except OSError as exc:  # the shipped compose files' read-only root holds /opt/runtimes
        raise runtimes.RuntimesError(
            f"the runtime {name} cannot be rebuilt here: {exc.strerror} ({exc.filename}). With "
            "a read-only root, add the packages to python-requirements.txt and rebuild the "
            "image, or give the container a writable volume at the runtimes directory "
            "(docs/deploy.md)") from exc
