"""Tools declared as data, for the faces: a name, a description and a JSON schema of parameters,
served by someone other than a Python caller's function.

The tool bridge (client/tools.py) grants a run Python callables; a face's tools are declared
instead (by another MCP server's listing, for `mcp --tools-from`; by the HTTP caller, in the
native API's `tools` field) and answered elsewhere. This module is what both faces share:

- `Declared`: one declared tool, its Python stub derived from its schema (`stub_signature`:
  typed parameters where the schema says, required before optional; `stub_text`: the
  `def name(...) -> ...: \"\"\"...\"\"\"` a model reads), and `callable_for`: an async callable
  with that signature and docstring that sends the arguments given, as one JSON object, to a
  function of the face's. The bridge makes its stubs from that signature like any other tool,
  and enforces its rules on it (registry, sizes both ways, per-call timeout, budget, audit).
- `Desk`: calls waiting for an answer that comes by another request (the service's
  `POST /api/v1/runs/{run}/tool_calls/{call}`): each run's calls by id, owned by the API key
  that started the run, answered once, within the call's deadline, within the size cap; every
  refusal a `ToolAnswerError` with its HTTP status and reason.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import keyword
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .. import jsonwire
from ..client.tools import Toolbox, ToolLimits
from ..kernel.tools import RESERVED

MAX_DESCRIPTION = 8192  # characters of a declared tool's description kept
MAX_TOOLS = 128  # tools one run may be granted by declaration
_SCALARS = {"string": "str", "integer": "int", "number": "float", "boolean": "bool",
            "array": "list", "object": "dict", "null": "None"}


class ToolFailed(Exception):
    """A declared tool's own failure (the other server's error, the caller's `error` answer):
    the kernel gets it as `ToolError` with ename `ToolFailed` and this message."""


class ToolUnavailable(Exception):
    """No one can serve the tool on this run (the caller did not take the event stream): the
    kernel gets it as `ToolUnavailable`, at once, with this message."""

    tool_kind = "unavailable"  # what client/tools.py answers the kernel with


def unserved(why: str) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    """The function of a declared tool nobody serves: each call fails at once, saying why."""
    async def send(arguments: dict[str, Any]) -> Any:
        raise ToolUnavailable(why)
    return send


def is_tool_name(name: object) -> bool:
    """Whether a name may be a tool's in `sandbox_tools` (the bridge's rule)."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) \
        and not name.startswith("_") and name not in RESERVED


def module_safe(text: str) -> str:
    """text as a tool name: each run of characters that cannot be in an identifier becomes
    `_`, leading underscores dropped, and `t_` put before a leading digit or keyword."""
    name = re.sub(r"\W+", "_", text, flags=re.ASCII).lstrip("_") or "tool"
    if name[0].isdigit() or keyword.iskeyword(name) or name in RESERVED:
        name = f"t_{name}"
    return name


def annotation_of(schema: Any) -> str | None:
    """A JSON schema's Python annotation, as text: str, int, float, bool, list[...], dict,
    unions of those (`X | None` for a nullable one); None when it says no type we can name."""
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        names = [annotation_of({**schema, "type": one}) for one in kind]
        return " | ".join(dict.fromkeys(names)) if all(names) else None  # type: ignore[arg-type]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            names = [annotation_of(option) for option in options]
            return " | ".join(dict.fromkeys(names)) if all(names) else None  # type: ignore[arg-type]
    if "enum" in schema and isinstance(schema["enum"], list) and kind is None:
        types = {type(v).__name__ for v in schema["enum"]}
        return types.pop() if len(types) == 1 and types <= {"str", "int", "float", "bool"} \
            else None
    if kind == "array":
        inner = annotation_of(schema.get("items"))
        return f"list[{inner}]" if inner and "|" not in inner else "list"
    return _SCALARS.get(kind) if isinstance(kind, str) else None


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def stub_signature(schema: Any, returns: str | None = None) -> inspect.Signature:
    """The Python signature of a tool whose arguments are the JSON object `schema` describes:
    its properties that are identifiers, required ones first (in the schema's order), optional
    ones with the schema's default, else None; `**kwargs` too when a property's name is not an
    identifier or the schema allows more (`additionalProperties`)."""
    schema = schema if isinstance(schema, Mapping) else {}
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = schema.get("required")
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) \
        else set()
    plain = [(n, s) for n, s in properties.items()
             if isinstance(n, str) and n.isidentifier() and not keyword.iskeyword(n)]
    odd = len(plain) < len(properties)
    parameters = []
    for wanted in (True, False):
        for name, prop in plain:
            if (name in required) != wanted:
                continue
            text = annotation_of(prop)
            if wanted:
                default: Any = inspect.Parameter.empty
            else:
                given = prop.get("default") if isinstance(prop, Mapping) else None
                default = given if _json_value(given) else None
                if default is None and text and "None" not in text.split(" | "):
                    text = f"{text} | None"
            parameters.append(inspect.Parameter(
                name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                annotation=text if text else inspect.Parameter.empty))
    if odd or schema.get("additionalProperties") not in (None, False):
        parameters.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(parameters, return_annotation=returns or inspect.Signature.empty)


def render(sig: inspect.Signature) -> str:
    """A signature as Python source: annotations given as text shown unquoted."""
    def text(annotation: Any) -> str:
        return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)

    parts = []
    for param in sig.parameters.values():
        part = f"**{param.name}" if param.kind is inspect.Parameter.VAR_KEYWORD else param.name
        if param.annotation is not inspect.Parameter.empty:
            part += f": {text(param.annotation)}"
        if param.default is not inspect.Parameter.empty:
            part += f" = {param.default!r}" if param.annotation is not inspect.Parameter.empty \
                else f"={param.default!r}"
        parts.append(part)
    returns = "" if sig.return_annotation is inspect.Signature.empty \
        else f" -> {text(sig.return_annotation)}"
    return f"({', '.join(parts)}){returns}"


@dataclass(frozen=True)
class Declared:
    """One tool declared as data: its name in `sandbox_tools`, the description a model reads,
    the JSON schema of its arguments (an object), and what it returns, as an annotation."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)
    returns: str | None = None

    def __post_init__(self) -> None:
        if not is_tool_name(self.name):
            raise ValueError(f"not a tool name: {self.name!r} (a Python identifier that does "
                             f"not start with _ and is none of {sorted(RESERVED)})")

    @property
    def signature(self) -> inspect.Signature:
        """The stub's signature, from the schema."""
        return stub_signature(self.parameters, self.returns)

    def stub_text(self) -> str:
        """The stub as a model reads it: `def name(a: str, b: int = 10) -> dict:` and the
        description as its docstring, indented."""
        doc = self.description.strip()[:MAX_DESCRIPTION].replace('"""', "'''")
        body = "\n".join(f"    {line}".rstrip() for line in doc.splitlines()) if doc \
            else "    ..."
        quoted = f'    """{body.strip()}"""' if "\n" not in doc else f'    """\n{body}\n    """'
        return f"def {self.name}{render(self.signature)}:\n{quoted}"

    def callable_for(self, send: Callable[[dict[str, Any]], Awaitable[Any]]) -> Callable[..., Any]:
        """An async callable with the stub's signature and docstring: a call's arguments (those
        given: an optional one left out, or given as None with no default of its own, is not
        sent) become one JSON object, handed to `send`, whose value is the tool's result."""
        sig = self.signature
        unset = {name for name, param in sig.parameters.items() if param.default is None}

        async def tool(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            arguments: dict[str, Any] = {}
            for name, value in bound.arguments.items():
                if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                    arguments.update(value)
                elif not (value is None and name in unset):
                    arguments[name] = value
            return await send(arguments)

        tool.__name__ = tool.__qualname__ = self.name
        tool.__doc__ = self.description[:MAX_DESCRIPTION] or None
        setattr(tool, "__signature__", sig)  # noqa: B010 (what inspect.signature reads)
        return tool


def granted(tools: list[tuple[Declared, Callable[[dict[str, Any]], Awaitable[Any]]]],
            ) -> dict[str, Callable[..., Any]]:
    """The bridge's `tools=` mapping for declared tools and the function serving each."""
    return {declared.name: declared.callable_for(send) for declared, send in tools}


# --- calls answered by another request ---------------------------------------------------------


AnswerReason = Literal["unknown_run", "other_instance", "unknown_call", "answered", "expired",
                       "run_ended", "too_large", "bad_answer"]


class ToolAnswerError(Exception):
    """An answer to a tool call that is refused: `status` is the HTTP status, `reason` the kind
    of refusal, `facts` what it names (the run, the call, the instance holding the run)."""

    def __init__(self, status: int, message: str, reason: AnswerReason, **facts: Any) -> None:
        super().__init__(message)
        self.status, self.reason, self.facts = status, reason, facts


@dataclass(eq=False)
class PendingCall:
    """One call waiting for its answer."""

    id: str
    tool: str
    arguments: dict[str, Any]
    deadline: float  # monotonic
    future: asyncio.Future[Any]


@dataclass(eq=False)
class DeskRun:
    """One run's calls: those waiting, and what became of the others (by id)."""

    id: str
    owner: str
    waiting: dict[str, PendingCall] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)  # call id -> "answered"/"expired"
    ended_at: float | None = None


Announce = Callable[[dict[str, Any]], None]


class Desk:
    """Runs whose tool calls are answered by another request, by run id; a run's answers are
    taken from the API key that started it only, once per call, within its deadline and the
    size cap. Run ids start with this instance's id (`<instance>.<token>`), so an answer that
    reaches another instance is refused there naming the one that holds the run."""

    KEEP_ENDED = 300.0  # seconds an ended run's ids are remembered (a late answer is told so)
    MAX_FINISHED = 1024  # calls remembered per run

    def __init__(self, instance: str, max_answer: int) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", instance):
            raise ValueError(f"an instance id is 1-64 letters, digits, - or _: {instance!r}")
        self.instance = instance
        self.max_answer = max_answer  # bytes of one answer's result (JSON)
        self.runs: dict[str, DeskRun] = {}

    def open(self, owner: str) -> DeskRun:
        """A new run of owner's whose calls wait here."""
        self._sweep()
        run = DeskRun(f"{self.instance}.{secrets.token_urlsafe(12)}", owner)
        self.runs[run.id] = run
        return run

    def close(self, run: DeskRun) -> None:
        """The run ended: calls still waiting end (the bridge has already said so in the
        kernel) and later answers are told the run ended."""
        run.ended_at = time.monotonic()
        for call in list(run.waiting.values()):
            if not call.future.done():
                call.future.cancel()
        run.waiting.clear()

    def sender(self, run: DeskRun, declared: Declared, timeout: float,
               announce: Announce) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        """The function serving one declared tool for the run: each call is announced (its
        `tool_call` event: run, call, tool, arguments, seconds to answer) and waits for its
        answer; the bridge's per-call timeout (`timeout`, the same) ends the wait."""
        async def send(arguments: dict[str, Any]) -> Any:
            if run.ended_at is not None:
                raise ToolFailed("the run has ended")
            call = PendingCall(secrets.token_urlsafe(9), declared.name, arguments,
                               time.monotonic() + timeout,
                               asyncio.get_running_loop().create_future())
            run.waiting[call.id] = call
            try:
                announce({"run": run.id, "call": call.id, "tool": declared.name,
                          "arguments": arguments, "timeout": timeout})
                return await call.future
            finally:
                if run.waiting.pop(call.id, None) is not None:  # not answered: its deadline
                    self._finish(run, call.id, "expired")
        return send

    def grant(self, run: DeskRun, declared: list[Declared], timeout: float,
              announce: Announce, max_calls: int = ToolLimits.max_calls) -> Toolbox:
        """The run's toolbox: each declared tool served by announcing its calls and waiting
        for their answers here, `timeout` seconds each (the bridge's per-call timeout, so the
        kernel gets ToolTimeout when it passes), results capped at this desk's size."""
        limits = ToolLimits(max_calls=max_calls, timeout=timeout, max_result=self.max_answer)
        return Toolbox(granted([(one, self.sender(run, one, timeout, announce))
                                for one in declared]), limits=limits)

    @staticmethod
    def unserved(declared: list[Declared], why: str) -> Toolbox:
        """The toolbox of a run nobody answers for: each call fails at once (ToolUnavailable
        in the kernel), saying why."""
        return Toolbox(granted([(one, unserved(why)) for one in declared]))

    def answer(self, owner: str, run_id: str, call_id: str, answer: Mapping[str, Any]) -> None:
        """Settle a waiting call with `{"result": ...}` or `{"error": "message"}`; raises
        ToolAnswerError when it may not be (another instance's run, another key's, no such
        call, answered already, past its deadline, too large, neither or both fields)."""
        prefix = run_id.partition(".")[0]
        if prefix != self.instance and "." in run_id:
            raise ToolAnswerError(
                409, f"run {run_id} is held by instance {prefix!r}, not this one "
                f"({self.instance!r}): send the answer to that instance (route "
                "/api/v1/runs/ by the run id's prefix, or keep the caller on the instance "
                "that streams the run)", "other_instance", run=run_id, instance=prefix)
        run = self.runs.get(run_id)
        if run is None or run.owner != owner:  # another key's run is as unknown as none
            raise ToolAnswerError(404, f"no run {run_id!r} of this API key waits for tool "
                                  "answers", "unknown_run", run=run_id)
        call = run.waiting.get(call_id)
        if call is None:
            done = run.finished.get(call_id)
            if done == "answered":
                raise ToolAnswerError(409, f"call {call_id} was already answered",
                                      "answered", run=run_id, call=call_id)
            if done == "expired":
                raise ToolAnswerError(410, f"call {call_id} is no longer waiting: its deadline "
                                      "passed (the code got ToolTimeout)", "expired",
                                      run=run_id, call=call_id)
            if run.ended_at is not None:
                raise ToolAnswerError(410, f"run {run_id} has ended", "run_ended", run=run_id)
            raise ToolAnswerError(404, f"run {run_id} has no call {call_id!r}",
                                  "unknown_call", run=run_id, call=call_id)
        if time.monotonic() > call.deadline:
            raise ToolAnswerError(410, f"call {call_id} is no longer waiting: its deadline "
                                  "passed", "expired", run=run_id, call=call_id)
        has_result, has_error = "result" in answer, answer.get("error") is not None
        if has_result == has_error:
            raise ToolAnswerError(422, "an answer is {\"result\": value} or {\"error\": "
                                  "\"message\"}, one of the two", "bad_answer", run=run_id,
                                  call=call_id)
        if has_error:
            outcome: Any = ToolFailed(str(answer["error"])[:4096])
        else:
            result = answer["result"]
            problem = jsonwire.json_problem(result, "result")
            if problem:
                raise ToolAnswerError(422, f"the result is not JSON: {problem}", "bad_answer",
                                      run=run_id, call=call_id)
            size = len(jsonwire.dumps(result))
            if self.max_answer and size > self.max_answer:
                raise ToolAnswerError(
                    413, f"the result is {size:,} bytes of JSON, more than the "
                    f"{self.max_answer:,} a call may return; the call still waits: answer "
                    "it with less, or with an error", "too_large", run=run_id, call=call_id,
                    limit=self.max_answer)
            outcome = result
        del run.waiting[call_id]
        self._finish(run, call_id, "answered")
        if not call.future.done():
            if isinstance(outcome, ToolFailed):
                call.future.set_exception(outcome)
            else:
                call.future.set_result(outcome)

    def _finish(self, run: DeskRun, call_id: str, how: str) -> None:
        if len(run.finished) < self.MAX_FINISHED:
            run.finished[call_id] = how

    def _sweep(self) -> None:
        now = time.monotonic()
        for run_id in [r.id for r in self.runs.values()
                       if r.ended_at is not None and now - r.ended_at > self.KEEP_ENDED]:
            del self.runs[run_id]
