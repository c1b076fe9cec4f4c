"""The dify-sandbox compatible routes: `/health` and `/v1/sandbox/*`, matched at the HTTP level.

dify-sandbox is a gin server; its answers are reproduced here as bytes: Go's JSON encoding
(compact, HTML characters escaped, `application/json; charset=utf-8`), gin's binding rules (an
exact `Content-Type: application/json` makes a bad body a 400, any other type a 200 with the same
-400 envelope), its validation messages, and its runner's error text ("process exited with code
255" and the traceback; "error: timeout" and exit code -1).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from importlib import metadata
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..client import Execution
from .access import json_line
from .kernels import KernelUnavailable
from .runs import SERVICE_STOPPING, SERVICE_TIMEOUT, Busy, RunRecord, unless_disconnected

log = logging.getLogger("sandbox_kernel.service")
router = APIRouter(tags=["dify-sandbox"])

NETWORK_DISABLED = "network is disabled, please enable it in the configuration"
TIMEOUT_NAMES = {SERVICE_TIMEOUT}  # the kernel's own limit and the client's use the same name
# Python's exit status for an uncaught exception under dify-sandbox's excepthook (sys.exit(-1)).
UNCAUGHT_EXIT = 255
_EXIT_HINT = "To exit: use 'exit', 'quit', or Ctrl-D."  # IPython's warning after SystemExit


class GoJSON(Response):
    """JSON as gin's c.JSON writes it."""

    media_type = "application/json; charset=utf-8"

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
        for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                             ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
            text = text.replace(char, escape)
        return text.encode("utf-8", "replace")


def envelope(code: int, message: str, data: Any = None) -> dict[str, Any]:
    return {"code": code, "message": message, "data": data}


def error_answer(status: int, code: int, message: str) -> GoJSON:
    return GoJSON(envelope(code, message), status_code=status)


def success(data: Any) -> GoJSON:
    return GoJSON(envelope(0, "success", data))


# --- gin's binding -------------------------------------------------------------------------

class BindError(Exception):
    """The request could not be bound; str() is gin's message."""


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads has joined every valid pair
_FIELD_TYPES = {"language": str, "code": str, "preload": str, "enable_network": bool}
_GO_TYPES = {str: "string", bool: "bool"}
_JSON_KINDS = {str: "string", bool: "bool", int: "number", float: "number", list: "array",
               dict: "object"}


def _go_syntax_error(exc: json.JSONDecodeError) -> str:
    if exc.pos >= len(exc.doc.rstrip()):
        return "unexpected EOF"
    char = exc.doc[exc.pos]
    context = {"Expecting ':' delimiter": "after object key",
               "Expecting ',' delimiter": "after object key:value pair",
               "Expecting property name enclosed in double quotes": "looking for beginning of "
               "object key string"}.get(exc.msg, "looking for beginning of value")
    if exc.msg == "Extra data":
        context = "after top-level value"
    return f"invalid character {char!r} {context}"


def _from_json(body: bytes, fields: tuple[str, ...]) -> dict[str, Any]:
    text = body.decode("utf-8", "replace")  # Go puts U+FFFD for invalid UTF-8, too
    if not text.strip():
        raise BindError("EOF")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BindError(_go_syntax_error(exc)) from None
    except RecursionError:  # Go's decoder stops at 10000 levels; Python's stack sooner
        raise BindError("exceeded max depth") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise BindError(f"invalid JSON: {exc}") from None
    if not isinstance(document, dict):
        kind = "null" if document is None else _JSON_KINDS.get(type(document), "value")
        if document is None:
            return {}
        raise BindError(f"json: cannot unmarshal {kind} into Go value of type struct")
    values: dict[str, Any] = {}
    for name in fields:
        # encoding/json matches keys case-insensitively, preferring an exact match.
        keys = [key for key in document if key.lower() == name]
        if not keys:
            continue
        value = document[name] if name in document else document[keys[-1]]
        if value is None:
            continue
        expected = _FIELD_TYPES[name]
        if type(value) is not expected:
            kind = _JSON_KINDS.get(type(value), "value")
            raise BindError(f"json: cannot unmarshal {kind} into Go struct field .{name} of "
                            f"type {_GO_TYPES[expected]}")
        if isinstance(value, str):  # Go decodes a lone "\ud800" escape as U+FFFD
            value = _LONE_SURROGATE.sub("\ufffd", value)
        values[name] = value
    return values


def _from_form(pairs: dict[str, list[str]], fields: tuple[str, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in fields:
        if name not in pairs:
            continue
        text = pairs[name][0]
        if _FIELD_TYPES[name] is bool:
            lowered = text.lower()
            if lowered in ("1", "t", "true"):
                values[name] = True
            elif lowered in ("0", "f", "false", ""):
                values[name] = False
            else:
                raise BindError(f'strconv.ParseBool: parsing "{text}": invalid syntax')
        else:
            values[name] = text
    return values


def _validate(values: dict[str, Any], required: tuple[str, ...]) -> None:
    problems = [f"Key: '{name.capitalize()}' Error:Field validation for '{name.capitalize()}' "
                "failed on the 'required' tag" for name in required if not values.get(name)]
    if problems:
        raise BindError("\n".join(problems))


async def bind(request: Request, fields: tuple[str, ...], required: tuple[str, ...]
               ) -> tuple[dict[str, Any] | None, GoJSON | None]:
    """The request's fields as gin binds them, or the answer gin gives when it cannot."""
    content_type = request.headers.get("content-type", "")
    mime = content_type.split(";")[0].strip().lower()
    status = 400 if content_type == "application/json" else 200  # BindJSON vs ShouldBind
    try:
        if request.method == "GET":
            values = _from_form(parse_qs(request.url.query, keep_blank_values=True), fields)
        elif mime == "application/json":
            values = _from_json(await request.body(), fields)
        elif mime == "application/x-www-form-urlencoded":
            query = parse_qs(request.url.query, keep_blank_values=True)
            body = parse_qs((await request.body()).decode("utf-8", "replace"),
                            keep_blank_values=True)
            values = _from_form({**query, **body}, fields)
        else:
            values = _from_form(parse_qs(request.url.query, keep_blank_values=True), fields)
        _validate(values, required)
    except BindError as exc:
        answer = error_answer(status, -400, str(exc))
        if status == 400:
            # gin's BindJSON writes the 400 status line before c.JSON sets its header, so Go's
            # net/http sniffs the body instead: the envelope goes out as text/plain.
            answer.headers["content-type"] = "text/plain; charset=utf-8"
        return None, answer
    return values, None


# --- the runner's answer -------------------------------------------------------------------

def _exit_status(value: str) -> tuple[int, str]:
    """Python's exit status for SystemExit(value), and what it prints on stderr."""
    if value in ("", "None"):
        return 0, ""
    try:
        return int(value) & 0xFF, ""
    except ValueError:
        return 1, value + "\n"


def _failure(exit_code: int, stderr: str, exec_error: str = "") -> str:
    """dify-sandbox's buildExecutionError."""
    text = f"process exited with code {exit_code}"
    for detail in (exec_error, stderr):
        if detail:
            if not text.endswith("\n"):
                text += "\n"
            text += detail
    return text


def run_data(execution: Execution) -> dict[str, Any]:
    """The `data` of a run's answer, as dify-sandbox reports the same outcome of a process."""
    stdout, stderr = execution.stdout, execution.stderr
    error = execution.error
    if error is None:
        return {"stdout": stdout, "stderr": stderr, "error": "", "exit_code": 0}
    if error.name in TIMEOUT_NAMES:
        return {"stdout": stdout, "stderr": stderr,
                "error": _failure(-1, stderr, "error: timeout\n"), "exit_code": -1}
    if error.name == "KernelDied":  # killed by a signal: Go reports exit code -1
        # Only how it died: the client's note about restarting means nothing to a one-off run.
        died = error.value.split(";")[0]
        return {"stdout": stdout, "stderr": stderr,
                "error": _failure(-1, stderr, f"error: {died}\n"), "exit_code": -1}
    if error.name == SERVICE_STOPPING:  # its kernel was shut down: a killed process, for Go
        return {"stdout": stdout, "stderr": stderr,
                "error": _failure(-1, stderr, f"error: {error.value}\n"), "exit_code": -1}
    if error.name == "SystemExit":
        code, printed = _exit_status(error.value)
        stderr = "".join(chunk["text"] for chunk in execution.logs
                         if chunk["name"] == "stderr" and _EXIT_HINT not in chunk["text"])
        stderr += printed
        return {"stdout": stdout, "stderr": stderr,
                "error": _failure(code, stderr) if code else "", "exit_code": code}
    lines = error.traceback or [f"{error.name}: {error.value}"]
    traceback = "\n".join(lines).rstrip("\n") + "\n"
    stderr += traceback
    return {"stdout": stdout, "stderr": stderr, "error": _failure(UNCAUGHT_EXIT, stderr),
            "exit_code": UNCAUGHT_EXIT}


# --- routes --------------------------------------------------------------------------------

@router.get("/health", summary="Liveness: \"ok\"")
async def health() -> GoJSON:
    return GoJSON("ok")


def _authorized(request: Request) -> bool:
    service = request.app.state.service
    return service.dify_key_ok(request.headers.get("x-api-key"))


def _unauthorized(request: Request) -> Response:
    request.app.state.service.metrics.denials.labels(reason="bad_key").inc()
    return Response(status_code=401)


@router.post("/v1/sandbox/run", summary="Run code on a fresh kernel: body {language, code, "
             "preload, enable_network}, header X-Api-Key")
async def run(request: Request) -> Response:
    if not _authorized(request):
        return _unauthorized(request)
    service = request.app.state.service
    try:
        with service.admission.slot():
            return await _run_admitted(request, service)
    except Busy:
        service.metrics.denials.labels(reason="too_many_requests").inc()
        return error_answer(503, -503, "Too many requests")


async def _run_admitted(request: Request, service: Any) -> Response:
    values, refusal = await bind(request, ("language", "code", "preload", "enable_network"),
                                 ("language", "code"))
    if refusal is not None:
        service.metrics.denials.labels(reason="bad_input").inc()
        return refusal
    assert values is not None
    language = values["language"]
    if language != "python3":
        service.metrics.denials.labels(reason="bad_input").inc()
        message = "unsupported language"
        if language == "nodejs":
            message += ": nodejs is not available in sandbox-kernel, which runs python3 only"
        return error_answer(400, -400, message)
    network = bool(values.get("enable_network"))
    if network and not service.config.enable_network:
        service.metrics.denials.labels(reason="network_disabled").inc()
        return error_answer(200, -400, NETWORK_DISABLED)
    # `preload` is accepted and ignored: our preloading happens before confinement, server-side.
    record = RunRecord()
    request.state.record = record
    timeout = service.config.worker_timeout
    try:
        outcome = await unless_disconnected(request, service.runner.run(
            values["code"], network=network, timeout=timeout, record=record))
    except KernelUnavailable as exc:  # dify-sandbox answers a runner failure so, too
        log.error(json_line(event="kernel_unavailable", error=str(exc)))
        return error_answer(200, -500, str(exc))
    if outcome is None:  # the client left; its kernel is already being shut down
        service.metrics.runs.labels(api="dify", outcome="abandoned").inc()
        return Response(status_code=499)
    execution, _ = outcome
    service.count_run("dify", execution)
    return success(run_data(execution))


@functools.lru_cache(maxsize=1)
def _dependencies() -> list[dict[str, str]]:
    """Every distribution the kernel's interpreter (this one: kernels run sys.executable) has."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name not in found:
            found[name] = dist.version
    return [{"name": name, "version": found[name]} for name in sorted(found, key=str.lower)]


async def _dependency_route(request: Request, data: Any) -> Response:
    if not _authorized(request):
        return _unauthorized(request)
    values, refusal = await bind(request, ("language",), ("language",))
    if refusal is not None:
        return refusal
    assert values is not None
    if values["language"] != "python3":
        return error_answer(400, -400, "unsupported language")
    return success(data() if callable(data) else data)


@router.get("/v1/sandbox/dependencies")
async def dependencies(request: Request) -> Response:
    return await _dependency_route(request, lambda: {"dependencies": _dependencies()})


@router.post("/v1/sandbox/dependencies/update")
async def update_dependencies(request: Request) -> Response:
    # Nothing to install: packages come with the service's image, not at run time.
    return await _dependency_route(request, {})


@router.get("/v1/sandbox/dependencies/refresh")
async def refresh_dependencies(request: Request) -> Response:
    def fresh() -> dict[str, Any]:
        _dependencies.cache_clear()
        return {"dependencies": _dependencies()}
    return await _dependency_route(request, fresh)
