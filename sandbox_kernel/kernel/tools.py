"""The tool bridge, kernel side: the caller's tools as `sandbox_tools`, each call sent as data.

A caller that serves tools (client/tools.py) lists them in its execute_request's metadata,
`{"sandbox": {"tools": {"protocol": 1, "specs": [...], "timeout": s, "max_calls": n,
"max_args": bytes}}}`: each spec a name, a docstring and a signature rendered as data. For that
run the kernel puts a module named `sandbox_tools` in sys.modules whose functions have those
names, signatures (`__signature__`) and docstrings, so `help()` and `inspect.signature` show a
model what it may call. A call binds its arguments to the signature, checks they are JSON, and
sends one `sandbox_tool_request` message; the caller runs the tool in its own process and
answers with one `sandbox_tool_reply` (docs/tools.md). Nothing but that JSON crosses: no host
object, callable or pickle can reach the kernel, and the caller parses nothing else.

The messages travel on channels the kernel already has: a ZMQ kernel's stdin channel (the one
`input()` waits on: a synchronous cell holds the shell channel), with the request's parent the
execute_request, as ipykernel's `_input_request` sends (kernel/tools_zmq.py: the one part that
imports ZMQ); a one-shot kernel's connection, as a message record out and a `TOOL_REPLY` record
back (kernel/oneshot_wire.py). No socket is made
and the filter is unchanged.

Calls may come from several threads (and from asyncio, through `tool.acall`, which waits in a
thread): a socket is used by one thread at a time, the *reader*, which sends what every caller
queued and hands each reply to the call it answers (matched by message id), in any order. A
call ends with its reply, its timeout, the run's interruption or deadline (raised in the
waiting thread), or the run's end; a reply that comes later is dropped. A stub kept past its
run (a variable, a thread) refuses to call: the run it was granted to has ended.

Everything the kernel checks here is a courtesy to honest code (clear errors, at once): the
caller enforces its own registry, caps, budget and timeout on whatever arrives.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
import json
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from .. import jsonwire
from ..fdwait import readable
from . import oneshot_wire as wire

PROTOCOL = 1
MODULE = "sandbox_tools"
REQUEST = "sandbox_tool_request"
REPLY = "sandbox_tool_reply"
POLL_SECONDS = 0.1  # the reader's longest wait in one go: other callers' sends wait this long
# Seconds a request waits for the client's stdin channel to connect (or, under a flood, for
# its queue to take one more message) before the call fails as ToolUnavailable.
CONNECT_WAIT = 2.0
REPLY_GRACE = 2.0  # past the call's own timeout, for the caller's timeout answer to arrive
MAX_REPLY = 64 * 2**20  # bytes of a reply record a one-shot kernel reads at most


class ToolError(Exception):
    """A tool call failed; for the tool's own error, `ename` and `evalue` are its type and
    message (the host's traceback never comes)."""

    def __init__(self, message: str, tool: str = "", ename: str = "", evalue: str = "") -> None:
        super().__init__(message)
        self.tool, self.ename, self.evalue = tool, ename, evalue


class ToolRefused(ToolError):
    """The caller (its registry, caps, budget or approval hook) refused the call."""


class ToolTimeout(ToolError, TimeoutError):
    """The tool did not answer within the call's timeout."""


class ToolUnavailable(ToolError):
    """No client serves tools to this run (a stock Jupyter client, or the caller is gone)."""


class ToolNotGranted(ToolError, ImportError):
    """A tool that was not granted to this run: the message names the ones that were."""


ERRORS: dict[str, type[ToolError]] = {
    "error": ToolError, "refused": ToolRefused, "timeout": ToolTimeout,
    "unavailable": ToolUnavailable}
_ERROR_CLASSES: tuple[type[ToolError], ...] = (
    ToolError, ToolRefused, ToolTimeout, ToolUnavailable, ToolNotGranted)
for _error in _ERROR_CLASSES:
    _error.__module__ = MODULE  # tracebacks read sandbox_tools.ToolError: the user's name
RESERVED = frozenset(cls.__name__ for cls in _ERROR_CLASSES)


class HostDefault:
    """A parameter's default that is not JSON: it stays on the host, which applies it."""

    def __repr__(self) -> str:
        return "<default on the host>"


HOST_DEFAULT = HostDefault()
_KINDS = {name: getattr(inspect.Parameter, name) for name in (
    "POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")}
# Names an annotation (sent as text) may use to read as a type again; anything else stays text.
_ANNOTATION_NAMES: dict[str, Any] = {
    name: getattr(builtins, name) for name in (
        "str", "int", "float", "bool", "list", "dict", "tuple", "set", "bytes", "object")
} | {"None": None, "Any": Any}


@dataclass(frozen=True)
class Grant:
    """The tools a request grants its run, and the run's limits (the caller's own figures)."""

    specs: tuple[dict[str, Any], ...]
    timeout: float
    max_calls: int
    max_args: int

    @classmethod
    def of(cls, parent: dict[str, Any]) -> Grant | None:
        """The grant in a request's metadata, or None (a client that serves no tools)."""
        sandbox = parent.get("metadata", {}).get("sandbox")
        tools = sandbox.get("tools") if isinstance(sandbox, dict) else None
        if not isinstance(tools, dict) or tools.get("protocol") != PROTOCOL:
            return None
        specs = tools.get("specs")
        specs = tuple(spec for spec in specs if _valid_spec(spec)) \
            if isinstance(specs, list) else ()
        return cls(specs, _number(tools.get("timeout"), 30.0),
                   int(_number(tools.get("max_calls"), 0)), int(_number(tools.get("max_args"), 0)))


def _number(value: Any, default: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else default


def _valid_spec(spec: Any) -> bool:
    return (isinstance(spec, dict) and isinstance(spec.get("name"), str)
            and spec["name"].isidentifier() and not spec["name"].startswith("_")
            and spec["name"] not in RESERVED and isinstance(spec.get("parameters", []), list))


class Transport(Protocol):
    """How a kernel's tool messages travel: its stdin channel, or a one-shot's connection."""

    def send(self, msg: dict[str, Any]) -> None:
        """Send one request (ToolUnavailable when nobody can receive it)."""

    def receive(self, timeout: float) -> list[dict[str, Any]]:
        """The replies that arrive within timeout seconds (none is fine)."""


class ToolSession:
    """One run's calls: what was granted, what is in flight, and the one reader at a time."""

    def __init__(self, grant: Grant, transport: Transport, session: Any,
                 parent: dict[str, Any]) -> None:
        self.grant, self.transport, self.session, self.parent = grant, transport, session, parent
        self.open = True
        self.calls = 0
        self.cond = threading.Condition()
        self.replies: dict[str, dict[str, Any] | None] = {}  # msg id -> reply (None: waiting)
        self.outbox: list[dict[str, Any]] = []
        self.reading = False

    def close(self) -> None:
        """The run ended: calls still waiting end with ToolRefused, later ones are refused."""
        with self.cond:
            self.open = False
            self.cond.notify_all()

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Send one call and wait for its answer; the answer's value, or its error raised."""
        __tracebackhide__ = True
        arguments = {"args": list(args), "kwargs": kwargs}
        problem = jsonwire.json_problem(arguments, "arguments")
        if problem:
            raise TypeError(f"{name}(): the arguments of a tool call must be JSON; {problem}")
        size = len(json.dumps(arguments, ensure_ascii=False, separators=(",", ":")).encode())
        if self.grant.max_args and size > self.grant.max_args:
            raise ToolRefused(f"{name}(): {size:,} bytes of arguments, more than the "
                              f"{self.grant.max_args:,} a call may send", name)
        with self.cond:
            self._check_open(name)
            self.calls += 1
            if self.grant.max_calls and self.calls > self.grant.max_calls:
                raise ToolRefused(f"{name}(): this run's budget of {self.grant.max_calls} tool "
                                  "calls is spent", name)
            msg = self.session.msg(REQUEST, {"tool": name, **arguments}, self.parent)
            msg_id = msg["header"]["msg_id"]
            self.replies[msg_id] = None
            self.outbox.append(msg)
        try:
            reply = self._wait(name, msg_id, time.monotonic() + self.grant.timeout + REPLY_GRACE)
        finally:
            with self.cond:
                self.replies.pop(msg_id, None)
        return _outcome(name, reply)

    def _check_open(self, name: str) -> None:
        if not self.open:
            raise ToolRefused(f"{name}(): the run this tool was granted to has ended (a tool "
                              "is called during its own run)", name)

    def _wait(self, name: str, msg_id: str, deadline: float) -> dict[str, Any]:
        __tracebackhide__ = True
        with self.cond:
            while (reply := self.replies.get(msg_id)) is None:
                self._check_open(name)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ToolTimeout(f"{name}(): no answer within {self.grant.timeout:g} s",
                                      name)
                if self.reading:
                    self.cond.wait(min(left, POLL_SECONDS))
                else:
                    self._read(min(left, POLL_SECONDS))
            return reply

    def _read(self, timeout: float) -> None:
        """As the reader (the condition held on entry and exit): send the queued requests,
        take the replies that come within timeout, hand each to its call."""
        self.reading = True
        outbox, self.outbox = self.outbox, []
        replies: list[dict[str, Any]] = []
        self.cond.release()
        try:
            while outbox:
                try:
                    self.transport.send(outbox[0])
                except ToolUnavailable as exc:  # every queued call gets the same answer
                    failed = {"status": "error", "kind": "unavailable", "evalue": str(exc)}
                    replies += [{"parent_header": msg["header"], "content": failed}
                                for msg in outbox]
                    outbox = []
                    break
                outbox.pop(0)
            if not replies:
                replies = self.transport.receive(timeout)
        finally:
            self.cond.acquire()
            self.reading = False
            self.outbox[:0] = outbox  # interrupted before sending them: the next reader does
            for reply in replies:
                msg_id = reply.get("parent_header", {}).get("msg_id")
                if msg_id in self.replies and isinstance(reply.get("content"), dict):
                    self.replies[msg_id] = reply  # other replies (late, forged) are dropped
            self.cond.notify_all()


def _outcome(name: str, reply: dict[str, Any]) -> Any:
    __tracebackhide__ = True
    content = reply["content"]
    if content.get("status") == "ok":
        return content.get("result")
    kind = content.get("kind")
    ename, evalue = str(content.get("ename", "")), str(content.get("evalue", ""))
    error = ERRORS.get(kind if isinstance(kind, str) else "", ToolError)
    message = f"{name}(): {ename}: {evalue}" if kind == "error" and ename else f"{name}(): {evalue}"
    raise error(message, name, ename, evalue)


# --- the module user code imports --------------------------------------------------------------


def _annotation(text: Any) -> Any:
    """An annotation sent as text: the type again when it names only plain types, else text."""
    if not isinstance(text, str):
        return inspect.Parameter.empty
    try:
        return eval(text, {"__builtins__": {}}, dict(_ANNOTATION_NAMES))  # noqa: S307
    except Exception:
        return text


def signature(spec: dict[str, Any]) -> inspect.Signature:
    """The tool's signature from its spec: names, kinds, JSON defaults, annotations as text."""
    parameters = []
    for param in spec.get("parameters", []):
        kind = _KINDS.get(param.get("kind", ""), inspect.Parameter.POSITIONAL_OR_KEYWORD)
        default = param["default"] if "default" in param else (
            HOST_DEFAULT if param.get("host_default") else inspect.Parameter.empty)
        parameters.append(inspect.Parameter(str(param.get("name")), kind, default=default,
                                            annotation=_annotation(param.get("annotation"))))
    try:
        return inspect.Signature(parameters, return_annotation=_annotation(spec.get("returns")))
    except (TypeError, ValueError):  # a spec no honest caller sends: any arguments
        return inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                                  inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def stub(session: ToolSession, spec: dict[str, Any]) -> Callable[..., Any]:
    """The function user code calls for one tool (and `acall`, its awaitable twin)."""
    name, sig = spec["name"], signature(spec)

    def tool(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{name}(): {exc}") from None
        return session.call(name, bound.args, bound.kwargs)

    async def acall(*args: Any, **kwargs: Any) -> Any:
        """Call the tool from asyncio code: the call waits in a thread, the loop goes on."""
        return await asyncio.to_thread(tool, *args, **kwargs)

    for function in (tool, acall):
        function.__module__ = MODULE
        setattr(function, "__signature__", sig)  # noqa: B010 (what inspect.signature reads)
    tool.__name__ = tool.__qualname__ = acall.__name__ = name
    acall.__qualname__ = f"{name}.acall"
    doc = spec.get("doc")
    tool.__doc__ = doc if isinstance(doc, str) else None
    tool.acall = acall  # type: ignore[attr-defined]
    return tool


def module(session: ToolSession | None) -> types.ModuleType:
    """A `sandbox_tools` module: the session's tools, the errors, and a clear refusal for any
    other name."""
    specs = session.grant.specs if session is not None else ()
    names = [spec["name"] for spec in specs]
    listing = "".join(f"\n  {spec['name']}{signature(spec)}" for spec in specs)
    mod = types.ModuleType(MODULE, "The tools the caller granted this run, called as data "
                           "across the sandbox's boundary (docs/tools.md)."
                           + (f"\n\nGranted:{listing}" if names else "\n\nNone was granted."))
    for error in _ERROR_CLASSES:
        setattr(mod, error.__name__, error)
    for spec in specs:
        setattr(mod, spec["name"], stub(session, spec))  # type: ignore[arg-type]
    mod.__all__ = names  # type: ignore[attr-defined]
    why = ("granted: " + ", ".join(names)) if names else (
        "none was granted to this run (its client serves no tools: see docs/tools.md)")

    def __getattr__(attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise ToolNotGranted(f"no tool named {attribute!r} was granted to this run; {why}",
                             attribute)

    setattr(mod, "__getattr__", __getattr__)  # noqa: B010 (PEP 562: the module's fallback)
    return mod


_NONE_GRANTED = module(None)
sys.modules[MODULE] = _NONE_GRANTED


@contextlib.contextmanager
def granted(parent: dict[str, Any], session: Any,
            transport: Callable[[], Transport]) -> Iterator[ToolSession | None]:
    """For one execution: `sandbox_tools` holds the tools its request granted (none, if its
    client serves none); afterwards every stub of the run refuses."""
    grant = Grant.of(parent)
    if grant is None:
        sys.modules[MODULE] = _NONE_GRANTED
        yield None
        return
    tool_session = ToolSession(grant, transport(), session, parent)
    sys.modules[MODULE] = module(tool_session)
    try:
        yield tool_session
    finally:
        tool_session.close()
        sys.modules[MODULE] = _NONE_GRANTED


class RecordTransport:
    """A one-shot kernel's connection: requests as message records (its Channel), replies as
    TOOL_REPLY records, read only here (nothing else reads the connection during a run)."""

    def __init__(self, session: Any, channel: Any) -> None:
        self.session, self.channel = session, channel
        self.records = wire.Records(MAX_REPLY)

    def send(self, msg: dict[str, Any]) -> None:
        """One message record (the channel writes a record at a time, whichever thread)."""
        try:
            self.session.send(self.channel, msg)
        except OSError as exc:
            raise ToolUnavailable(f"the caller's connection is gone ({exc})") from None

    def receive(self, timeout: float) -> list[dict[str, Any]]:
        """The replies among the records that arrive within timeout seconds."""
        conn = self.channel.conn
        if conn is None or not readable(conn, timeout):
            return []
        try:
            data = conn.recv(1 << 16)
        except OSError as exc:
            raise ToolUnavailable(f"the caller's connection is gone ({exc})") from None
        if not data:
            raise ToolUnavailable("the caller hung up")
        replies = []
        for kind, payload in self.records.feed(data):
            if kind != wire.TOOL_REPLY:
                continue
            try:
                frames = [bytes(frame) for frame in wire.unpack_frames(payload)]
                _, parts = self.session.feed_identities(frames)
                msg = self.session.deserialize(parts)
            except (ValueError, TypeError, KeyError):
                continue
            if msg.get("header", {}).get("msg_type") == REPLY:
                replies.append(msg)
        return replies
