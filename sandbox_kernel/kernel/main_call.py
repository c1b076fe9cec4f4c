"""The main() convention: run the code, call `main(**inputs)`, return its dict as the result.

Request: an ``execute_request`` whose metadata holds ``{"sandbox": {"entrypoint": "main",
"inputs": {...}}}`` (either key is enough; ``entrypoint`` defaults to ``"main"`` and ``inputs``
to ``{}``). The code runs first, as an ordinary cell whose last expression is not displayed; if it
succeeded, the kernel calls ``main(**inputs)`` (awaiting it if it is ``async def``).

Result: ONE ``execute_result`` with ``application/json`` = the returned dict and ``text/plain`` =
its JSON text (``indent=2``), metadata ``{"sandbox": {"entrypoint": "main"}}``. Whatever the code
or ``main`` prints goes out as stream messages only.

In a notebook, ``%main {"x": 1}`` (``%main`` alone: no inputs) calls the ``main`` defined in an
earlier cell and displays the same result; ``r = %main`` binds the dict.

Errors arrive as an ``error`` message and an ``execute_reply`` with status ``error``:

===================  ==========================================================================
ename                evalue (examples)
===================  ==========================================================================
EntrypointNotFound   ``no function named 'main' is defined: the code must define
                     def main(**inputs) -> dict`` / ``'main' is not a function (it is int)``
InvalidInputs        ``inputs must be a JSON object of argument names to values, got array`` /
                     ``%main takes a JSON object of inputs: Expecting value: line 1 column 1
                     (char 0)``
SignatureMismatch    ``main() is missing the required input 'numbers' (it takes: numbers,
                     label)`` / ``main() got the unexpected input 'colour' (it takes: ...)``
(main's own)         whatever ``main`` raised, e.g. ``ValueError``, with main's traceback only
InvalidResult        ``main() must return a dict, got list`` / ``main() returned a value that is
                     not JSON: result["when"]: datetime`` / ``...: result["score"]: float nan
                     (NaN and Infinity are not JSON)``
EntrypointError      ``%main cannot await an async main(); ...`` (the magic only)
===================  ==========================================================================

Tuples are accepted as JSON arrays; dict keys must be strings.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import types
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from IPython.core.magic import no_var_expand

from .. import jsonwire

DEFAULT_ENTRYPOINT = "main"
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__) + os.sep


class EntrypointError(Exception):
    """A main() request that cannot be carried out; shown as one line, without a traceback."""

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of formatting frames: the frames are ours, not the user's.
        return [f"{type(self).__name__}: {self}"]


class EntrypointNotFound(EntrypointError):
    """The entrypoint is not defined, or is not callable."""


class InvalidInputs(EntrypointError):
    """The inputs are not a JSON object."""


class SignatureMismatch(EntrypointError):
    """The inputs do not fit the entrypoint's parameters."""


class InvalidResult(EntrypointError):
    """The entrypoint returned something that is not a JSON object."""


@dataclass(frozen=True)
class Request:
    """Which function to call after the code ran, and with what."""

    entrypoint: Any = DEFAULT_ENTRYPOINT
    inputs: Any = None


def request_from(metadata: dict[str, Any] | None) -> Request | None:
    """The main() request in an execute_request's metadata, or None for ordinary code."""
    sandbox = (metadata or {}).get("sandbox")
    if not isinstance(sandbox, dict) or not ({"entrypoint", "inputs"} & sandbox.keys()):
        return None
    name = sandbox.get("entrypoint")
    return Request(DEFAULT_ENTRYPOINT if name is None else name, sandbox.get("inputs", {}))


# --- checks shared by the request and the magic -------------------------------------------------

_JSON_TYPES = ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in _JSON_TYPES if isinstance(value, kind)),
                type(value).__name__)


def find_entrypoint(namespace: dict[str, Any], name: Any) -> Callable[..., Any]:
    """The callable called `name` in the user's namespace."""
    if not isinstance(name, str) or not name.isidentifier():
        raise EntrypointNotFound(f"the entrypoint must be the name of a function, got {name!r}")
    if name not in namespace:
        raise EntrypointNotFound(f"no function named {name!r} is defined: the code must define "
                                 f"def {name}(**inputs) -> dict")
    func = namespace[name]
    if not callable(func):
        raise EntrypointNotFound(f"{name!r} is not a function (it is {type(func).__name__})")
    return func


def check_inputs(inputs: Any) -> dict[str, Any]:
    """The inputs, if they are a JSON object."""
    if not isinstance(inputs, dict):
        raise InvalidInputs("inputs must be a JSON object of argument names to values, "
                            f"got {_json_type(inputs)}")
    return inputs


def _inputs(names: list[str]) -> str:
    quoted = ", ".join(repr(name) for name in names)
    return f"input {quoted}" if len(names) == 1 else f"inputs {quoted}"


def check_signature(func: Callable[..., Any], name: str, inputs: dict[str, Any]) -> None:
    """Refuse inputs that `func(**inputs)` cannot take, naming each missing or unexpected one."""
    parameters = _parameters(func)
    if parameters is None:  # no signature (some builtins): the call itself will say
        return
    by_name, takes_any, unfillable = parameters
    missing = [p_name for p_name, has_default in by_name
               if not has_default and p_name not in inputs]
    unexpected = [] if takes_any else sorted(set(inputs) - {p_name for p_name, _ in by_name})
    problems = []
    if missing:
        problems.append(f"is missing the required {_inputs(missing)}")
    if unexpected:
        problems.append(f"got the unexpected {_inputs(unexpected)}")
    if unfillable:
        problems.append(f"has positional-only parameters that inputs cannot fill: "
                        f"{', '.join(unfillable)}")
    if problems:
        accepted = [p_name for p_name, _ in by_name] + (["**kwargs"] if takes_any else [])
        takes = f"it takes: {', '.join(accepted)}" if accepted else "it takes no inputs"
        raise SignatureMismatch(f"{name}() {'; '.join(problems)} ({takes})")


_NOT_PLAIN = ("__wrapped__", "__signature__", "__text_signature__", "_partialmethod")


def _parameters(func: Callable[..., Any]) -> tuple[list[tuple[str, bool]], bool,
                                                    list[str]] | None:
    """What inspect.signature(func) says that inputs can fill: the parameters taken by name
    (name, has a default), whether it takes **kwargs, its positional-only parameters with no
    default; None when it has no signature.

    A plain function's are read off its code object, as inspect.signature reads them (its
    pure-Python walk costs a pooled process ~0.5 ms, mostly pages first touched there);
    anything else (wrapped, a partial, a method, a class, a callable object) is inspect's."""
    if type(func) is types.FunctionType and not any(
            attribute in func.__dict__ for attribute in _NOT_PLAIN):
        code = func.__code__
        positional, only = code.co_argcount, code.co_posonlyargcount
        names = code.co_varnames[:positional + code.co_kwonlyargcount]
        first_default = positional - len(func.__defaults__ or ())
        keyword_defaults = func.__kwdefaults__ or {}
        by_name = [(p_name, index >= first_default if index < positional
                    else p_name in keyword_defaults)
                   for index, p_name in enumerate(names) if index >= only]
        unfillable = [names[index] for index in range(min(only, first_default))]
        return by_name, bool(code.co_flags & inspect.CO_VARKEYWORDS), unfillable
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    return ([(p.name, p.default is not p.empty) for p in params
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)],
            any(p.kind is p.VAR_KEYWORD for p in params),
            [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty])


def encode_result(value: Any, name: str, limit: int = 0) -> bytes:
    """The returned dict as compact UTF-8 JSON, validated in the same pass that encodes it.

    InvalidResult says what is wrong where, or that the JSON is larger than `limit` bytes (the
    policy's --max-result; 0: no limit). The caller enforces its own limit as well: this one
    is a courtesy that tells the user early and plainly.
    """
    if not isinstance(value, dict):
        got = f"None (did {name}() forget to return?)" if value is None else type(value).__name__
        raise InvalidResult(f"{name}() must return a dict, got {got}")
    try:
        encoded = jsonwire.encode_result(value)
    except jsonwire.NotJSON as exc:
        raise InvalidResult(f"{name}() returned a value that is not JSON: {exc}") from None
    if limit and len(encoded) > limit:
        raise InvalidResult(f"{name}() returned {len(encoded):,} bytes of JSON, more than the "
                            f"result limit of {limit:,} bytes (--max-result raises it)")
    return encoded


def check_result(value: Any, name: str) -> dict[str, Any]:
    """The returned dict as plain JSON values, or InvalidResult saying what is wrong where."""
    return jsonwire.loads(encode_result(value, name))  # type: ignore[no-any-return]


_INDENTED_UP_TO = 64 * 1024  # indenting runs in pure Python: larger results stay compact
TEXT_COPY_UP_TO = 256 * 1024  # past this, text/plain is a one-line summary, not a second copy


def result_text(result: dict[str, Any], encoded: bytes | None = None) -> str:
    """The text/plain form of a result: indented JSON, compact JSON, or a summary when large."""
    if encoded is None:
        encoded = jsonwire.dumps(result)
    if len(encoded) > TEXT_COPY_UP_TO:
        return (f"<main() result: {len(encoded):,} bytes of JSON, in this message's "
                "application/json>")
    if len(encoded) > _INDENTED_UP_TO:
        return encoded.decode("utf-8")
    return json.dumps(result, indent=2, ensure_ascii=False, default=jsonwire.natives)


def result_bundle(result: dict[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(data, metadata) of the execute_result that carries a result."""
    data = {"application/json": result, "text/plain": result_text(result)}
    return data, {"sandbox": {"entrypoint": name}}


def result_content(value: dict[str, Any], encoded: bytes, name: str, count: int) -> bytes:
    """The execute_result's content, packed around the result's JSON so it is encoded once.

    Session.send signs pre-packed content like any other: the result stays under the HMAC.
    """
    return b"".join((
        b'{"execution_count":', str(int(count)).encode(),
        b',"data":{"application/json":', encoded,
        b',"text/plain":', jsonwire.dumps(result_text(value, encoded)),
        b'},"metadata":{"sandbox":{"entrypoint":', jsonwire.dumps(name), b"}}}"))


def prepare_call(namespace: dict[str, Any], name: Any, inputs: Any) -> Callable[..., Any]:
    """The entrypoint, once it and the inputs are known to fit together."""
    func = find_entrypoint(namespace, name)
    check_signature(func, name, check_inputs(inputs))
    return func


# --- the kernel side: execute_request metadata ---------------------------------------------------

@contextmanager
def _last_value_hidden(shell: Any) -> Iterator[None]:
    """Run a cell without displaying its last expression: the result is main's dict, alone."""
    saved = shell.ast_node_interactivity
    shell.ast_node_interactivity = "none"
    try:
        yield
    finally:
        shell.ast_node_interactivity = saved


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the user's first frame on: drops this module's and asyncio's frames."""
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_code.co_filename.startswith(_ASYNCIO_DIR)):
        tb = tb.tb_next
    return tb


async def _call(runner: Any, request: Request) -> tuple[dict[str, Any], bytes]:
    """Call the entrypoint named in the request (awaiting a coroutine); its dict and JSON."""
    func = prepare_call(runner.shell.user_ns, request.entrypoint, request.inputs)
    value = func(**request.inputs)
    if inspect.isawaitable(value):
        future = asyncio.ensure_future(value)
        # As ipykernel does for async cells: an interrupt cancels the coroutine, not the loop.
        with runner.cancel_on_sigint(future):
            value = await future
    return value, encode_result(value, request.entrypoint, runner.result_limit)


def _publish_result(runner: Any, value: dict[str, Any], encoded: bytes, name: str,
                    count: int) -> None:
    content = result_content(value, encoded, name, count)
    # Streams first, so everything main printed arrives before its result.
    sys.stdout.flush()
    sys.stderr.flush()
    runner.publish_result(content)


def _show_error(shell: Any, exc: BaseException, reply: dict[str, Any]) -> dict[str, Any]:
    """Send the error as a normal frontend error and turn the reply into an error reply."""
    user_tb = _user_traceback(exc.__traceback__)
    if isinstance(exc, shell.custom_exceptions):  # the kernel explains sandbox refusals
        shell.CustomTB(type(exc), exc, user_tb, tb_offset=0)
    else:
        shell.showtraceback((type(exc), exc, user_tb), tb_offset=0)
    reply.update(status="error", ename=type(exc).__name__, evalue=str(exc),
                 traceback=shell._last_traceback or [], user_expressions={})
    return reply


async def execute(runner: Any, request: Request,
                  run_code: Callable[[], Awaitable[dict[str, Any]]],
                  translate: Callable[[BaseException], BaseException] = lambda exc: exc,
                  ) -> dict[str, Any]:
    """Run the code, then the entrypoint; publish its dict or show its error; return the reply.

    runner (kernel/runner.py) gives the shell, the result limit, how to publish the result and
    how an interrupt cancels an async main; translate picks the error to show for the one main
    raised (the runner shows a cancellation by its time limit as that limit).
    """
    shell = runner.shell
    with _last_value_hidden(shell):
        reply = await run_code()
    if reply["status"] != "ok":
        return reply
    try:
        value, encoded = await _call(runner, request)
    except BaseException as exc:  # main's own errors, KeyboardInterrupt and SystemExit included
        return _show_error(shell, translate(exc), reply)
    finally:
        # Shows the figures main drew (matplotlib-inline flushes them on post_execute).
        shell.events.trigger("post_execute")
    try:
        _publish_result(runner, value, encoded, request.entrypoint, reply["execution_count"])
    except Exception as exc:  # whatever passed the check but cannot be sent is still an error
        error = InvalidResult(f"{request.entrypoint}() returned a result that could not be "
                              f"sent: {type(exc).__name__}: {exc}")
        return _show_error(shell, error, reply)
    return reply


# --- the notebook side: %main ---------------------------------------------------------------------

class MainResult(dict):
    """The dict `%main` returns; it displays as the same JSON result as the request form."""

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
        return result_bundle(dict(self), DEFAULT_ENTRYPOINT)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Without this, IPython's dict printer would replace the JSON text with a Python repr.
        printer.text(result_text(self))


def _parse_line(line: str) -> Any:
    try:
        return json.loads(line) if line.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidInputs(f"%main takes a JSON object of inputs: {exc}") from None


@no_var_expand  # the line is JSON, whose braces IPython would otherwise try to expand
def main_magic(line: str) -> MainResult:
    """%main {"x": 1}: call the main() defined in an earlier cell with these JSON inputs."""
    __tracebackhide__ = True  # IPython leaves this frame out of main's traceback
    from IPython import get_ipython

    shell = get_ipython()
    inputs = _parse_line(line)
    func = prepare_call(shell.user_ns, DEFAULT_ENTRYPOINT, inputs)
    if inspect.iscoroutinefunction(func):
        raise EntrypointError("%main cannot await an async main(); in a cell write "
                              "`await main(**inputs)`, or send the code with the main() request")
    try:
        value = func(**inputs)
    except Exception as exc:
        _render_from_user_frames(shell, exc)
        raise
    return MainResult(check_result(value, DEFAULT_ENTRYPOINT))


def _render_from_user_frames(shell: Any, exc: Exception) -> None:
    """Make IPython show main's traceback from main's frame on, without the magic's callers."""
    user_tb = _user_traceback(exc.__traceback__)
    # showtraceback() prefers an exception's own _render_traceback_ to formatting its frames.
    exc._render_traceback_ = lambda: shell.InteractiveTB.structured_traceback(  # type: ignore
        type(exc), exc, user_tb, tb_offset=0)


def load_ipython_extension(shell: Any) -> None:
    """Register `%main` (the kernel does; elsewhere `%load_ext sandbox_kernel.kernel.main_call`)."""
    shell.register_magic_function(main_magic, "line", "main")
