"""The tool bridge, caller side: the caller's functions, called by code in the sandbox as data.

    def search(query: str, limit: int = 5) -> list[str]:
        "Search the catalogue."
        ...

    with Sandbox(tools={"search": search}) as sb:
        sb.run("from sandbox_tools import search\nprint(search('chairs'))")

A run's execute_request lists the tools as data (name, signature rendered by
`inspect.signature` with JSON defaults only, docstring) with the run's limits; the kernel
makes them a module of stubs (kernel/tools.py). A stub's call arrives as a
`sandbox_tool_request` message whose parent is the run's request; `ToolRun.serve` decides it
and runs the tool here, in the caller's process, and its answer is one `sandbox_tool_reply`
(docs/tools.md). The caller's safety depends on nothing the kernel checks: every request is
held to the caller's registry (a name it was not given is never run), its size cap (refused
before its content is parsed), JSON only (nothing else is ever deserialized), the run's call
budget, the approval hook, a per-call timeout, and a cap on the result; every call is audited
(`Execution.tool_calls`: tool, bytes each way, duration, outcome; payloads only when asked)
and counted in `Execution.usage` (`tool_calls`, `tool_seconds`).

Where tools run: an async tool on the event loop that serves the run (AsyncSandbox's, or for a
blocking Sandbox a loop of its own in a thread, `ToolLoop`); a sync tool in a thread of its
own (never on an event loop; a tool that hangs past its timeout is abandoned there, its late
result dropped). A tool may not call back into the sandbox that is running it: that would wait
on the run that waits for it, so the sandbox refuses at once (`refuse_reentry`).

The two transports deliver the same messages: `StdinDesk` reads a ZMQ kernel's stdin channel
for the run's Inbox (client/inbox.py); a one-shot run's reader (client/oneshot.py) takes the
requests among its message records and writes each answer as a TOOL_REPLY record.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import json
import keyword
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq

from .. import jsonwire
from ..kernel.tools import MODULE, PROTOCOL, REPLY, REQUEST, RESERVED
from .receive import Refusals, unpack_frames, watch_connection

MAX_MESSAGE_TEXT = 4096  # characters of a tool's error message sent to the kernel
MAX_DOC = 8192  # characters of a docstring sent with a tool's spec
ENVELOPE = 4096  # bytes of a request's content beyond its arguments' JSON
# Records kept per run: a flood of forged requests is answered, but its records stop here.
MAX_RECORDS_BEYOND_BUDGET = 64

Approve = Callable[[str, dict[str, Any]], Any]  # -> bool | str, or an awaitable of one


@dataclass(frozen=True)
class ToolLimits:
    """What a run's tool calls may take, enforced by the caller (0: no limit)."""

    max_calls: int = 100  # calls per run; later ones are refused
    timeout: float = 30.0  # seconds per call; then ToolTimeout in the kernel
    max_args: int = 1 << 20  # bytes of one call's arguments (JSON)
    max_result: int = 1 << 20  # bytes of one call's result (JSON)
    concurrency: int = 8  # tools running at once; more wait their turn (within their timeout)


@dataclass
class ToolCall:
    """One tool call of a run, as the caller recorded it (payloads only with audit_payloads).

    outcome: "ok", "error" (the tool raised, or returned what cannot be sent), "refused" (by
    the registry, a cap, the budget or the approval hook: the tool did not run), "timeout",
    or "abandoned" (the run ended first)."""

    tool: str
    call_id: str
    outcome: str = "abandoned"
    args_bytes: int = 0
    result_bytes: int = 0
    seconds: float = 0.0
    message: str = ""
    arguments: Any = field(default=None, repr=False)
    result: Any = field(default=None, repr=False)


_SERVING: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "sandbox_kernel_serving_tools", default=frozenset())


def refuse_reentry(sandbox: object) -> None:
    """Raise if the caller is a tool that this sandbox's current run called."""
    if id(sandbox) in _SERVING.get():
        raise RuntimeError("a tool may not call back into the sandbox that is running it "
                           "(that run waits for the tool): use another Sandbox")


def _json_default(value: Any) -> tuple[bool, Any]:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False, None
    return True, value


def _annotation_text(annotation: Any) -> str | None:
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        return annotation
    return annotation.__name__ if isinstance(annotation, type) else \
        str(annotation).replace("typing.", "")


def tool_spec(name: str, function: Callable[..., Any]) -> dict[str, Any]:
    """What the kernel learns of a tool: its name, docstring and signature, as JSON."""
    try:
        sig = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without one: any arguments
        sig = inspect.Signature([
            inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
            inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    parameters = []
    for param in sig.parameters.values():
        entry: dict[str, Any] = {"name": param.name, "kind": param.kind.name}
        if param.default is not inspect.Parameter.empty:
            ok, value = _json_default(param.default)
            entry.update({"default": value} if ok else {"host_default": True})
        if (text := _annotation_text(param.annotation)) is not None:
            entry["annotation"] = text
        parameters.append(entry)
    spec: dict[str, Any] = {"name": name, "parameters": parameters,
                            "doc": (inspect.getdoc(function) or "")[:MAX_DOC] or None}
    if (returns := _annotation_text(sig.return_annotation)) is not None:
        spec["returns"] = returns
    return spec


def _is_async(function: Callable[..., Any]) -> bool:
    # A callable object's async __call__ counts too (inspect does not look there).
    call = type(function).__call__ if not inspect.isroutine(function) else None
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


@dataclass(frozen=True)
class Tool:
    """One registered tool: the callable, and what the kernel is told of it."""

    name: str
    function: Callable[..., Any]
    spec: dict[str, Any]
    is_async: bool


class Toolbox:
    """A caller's registry of tools, with the limits, approval hook and audit settings."""

    def __init__(self, tools: Mapping[str, Callable[..., Any]], *,
                 limits: ToolLimits | None = None, approve: Approve | None = None,
                 audit_payloads: bool = False) -> None:
        self.tools: dict[str, Tool] = {}
        for name, function in tools.items():
            if not (isinstance(name, str) and name.isidentifier()) or keyword.iskeyword(name) \
                    or name.startswith("_") or name in RESERVED:
                raise ValueError(f"not a tool name: {name!r} (a Python identifier that does "
                                 f"not start with _ and is none of {sorted(RESERVED)})")
            if not callable(function):
                raise TypeError(f"tool {name!r} is not callable")
            self.tools[name] = Tool(name, function, tool_spec(name, function), _is_async(function))
        self.limits = limits or ToolLimits()
        self.approve = approve
        self.audit_payloads = audit_payloads

    def with_tools(self, tools: Mapping[str, Callable[..., Any]]) -> Toolbox:
        """These tools with this toolbox's limits, hook and audit settings (a run's own)."""
        return Toolbox(tools, limits=self.limits, approve=self.approve,
                       audit_payloads=self.audit_payloads)

    def metadata(self, max_message: int = -1) -> dict[str, Any]:
        """The request's `metadata.sandbox.tools`: the grant the kernel builds stubs from.
        max_message: the largest message the caller's connection takes (-1: any)."""
        return {"protocol": PROTOCOL, "specs": [tool.spec for tool in self.tools.values()],
                "timeout": self.limits.timeout, "max_calls": self.limits.max_calls,
                "max_args": self.max_args(max_message)}

    def max_args(self, max_message: int) -> int:
        """Bytes of arguments a call may send (0: any): the limit, and never more than one
        message the caller's connection takes can hold. A larger request would make the
        connection refuse it (a ZMQ client's stdin channel is then dropped for good, a
        one-shot's run lost), so the kernel refuses such a call itself, at once, naming the
        size: the caller's check on what arrives (_decide) stays as it was."""
        if max_message <= 0:
            return self.limits.max_args
        room = max(max_message - ENVELOPE, 1)
        return min(self.limits.max_args, room) if self.limits.max_args else room

    def start(self, msg_id: str, owner: object) -> ToolRun:
        """The serving state of one run (its execute_request's msg_id), for sandbox `owner`."""
        return ToolRun(self, msg_id, owner)


class ToolRun:
    """One run's tool calls: each request decided, its tool run, its answer, its record."""

    def __init__(self, toolbox: Toolbox, msg_id: str, owner: object) -> None:
        self.toolbox, self.msg_id, self.owner = toolbox, msg_id, id(owner)
        self.records: list[ToolCall] = []
        self.requests = 0  # every request taken, recorded or not
        self.calls = 0  # requests for a granted tool within the budget
        self.seen: set[str] = set()
        self.closed = False
        self.tasks: set[asyncio.Future[Any]] = set()
        self.semaphore: asyncio.Semaphore | None = None  # made on the loop that serves

    def account(self, execution: Any) -> None:
        """Put the run's calls in its Execution: the records, and the counts in its usage."""
        execution.tool_calls = list(self.records)
        execution.usage.tool_calls = self.requests
        execution.usage.tool_seconds = round(sum(record.seconds for record in self.records), 6)
        execution.usage.source.update(tool_calls="caller", tool_seconds="caller")

    def close(self) -> None:
        """The run ended: calls still running are abandoned (an async tool is cancelled; a
        thread cannot be, and its result is dropped), and no request is served any more."""
        self.closed = True
        for task in list(self.tasks):
            loop = task.get_loop()
            if loop.is_closed():
                continue
            if loop is _running_loop():
                task.cancel()
            else:
                loop.call_soon_threadsafe(task.cancel)

    async def serve(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The reply content for one request (content still packed, as unpack_frames leaves
        it), or None when nothing is to be sent (the run ended)."""
        if self.closed:
            return None
        self.requests += 1
        call_id = str(msg.get("header", {}).get("msg_id", ""))
        record = ToolCall("", call_id)
        if len(self.records) < self.toolbox.limits.max_calls + MAX_RECORDS_BEYOND_BUDGET:
            self.records.append(record)
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        started = time.monotonic()
        try:
            return await self._decide(msg, record)
        except asyncio.CancelledError:
            record.outcome, record.message = "abandoned", "the run ended before the tool did"
            raise
        finally:
            record.seconds = time.monotonic() - started
            if task is not None:
                self.tasks.discard(task)

    async def _decide(self, msg: dict[str, Any], record: ToolCall) -> dict[str, Any]:
        limits = self.toolbox.limits
        size = msg.get("content_size", 0)
        record.args_bytes = size
        if record.call_id in self.seen or not record.call_id:
            return _refuse(record, "a call id that was already used (a replayed request)")
        self.seen.add(record.call_id)
        if limits.max_args and size > limits.max_args + ENVELOPE:
            return _refuse(record, f"a call of {size:,} bytes, more than the {limits.max_args:,} "
                           "bytes of arguments a call may send")
        if msg.get("buffers"):
            return _refuse(record, "a tool call carries JSON only, no binary buffers")
        try:
            content = msg["content"]
            content = jsonwire.loads(content) if isinstance(content, (bytes, memoryview)) \
                else content
        except ValueError:
            return _refuse(record, "a call whose content is not JSON")
        name, args, kwargs = _parts(content)
        if name is None or args is None or kwargs is None:
            return _refuse(record, "a call that is not {\"tool\": name, \"args\": [...], "
                           "\"kwargs\": {...}}")
        record.tool = name
        if self.toolbox.audit_payloads:
            record.arguments = {"args": args, "kwargs": kwargs}
        tool = self.toolbox.tools.get(name)
        if tool is None:
            granted = ", ".join(self.toolbox.tools) or "none"
            return _refuse(record, f"no tool named {name!r} was granted to this run; "
                           f"granted: {granted}")
        self.calls += 1
        if limits.max_calls and self.calls > limits.max_calls:
            return _refuse(record, f"this run's budget of {limits.max_calls} tool calls is spent")
        try:
            inspect.signature(tool.function).bind(*args, **kwargs)
        except TypeError as exc:
            return _refuse(record, f"{name}(): {exc}")
        except ValueError:
            pass  # no signature to check against: the tool itself says
        if self.semaphore is None:
            self.semaphore = asyncio.Semaphore(limits.concurrency or 1 << 30)
        try:
            async with self.semaphore:
                return await asyncio.wait_for(self._run(tool, args, kwargs, record),
                                              limits.timeout or None)
        except asyncio.TimeoutError:
            record.outcome = "timeout"
            record.message = f"no answer within {limits.timeout:g} s"
            return {"status": "error", "kind": "timeout", "evalue": record.message}

    async def _run(self, tool: Tool, args: list[Any], kwargs: dict[str, Any],
                   record: ToolCall) -> dict[str, Any]:
        _SERVING.set(_SERVING.get() | {self.owner})  # this task's context, and its threads'
        verdict = await _invoke(self.toolbox.approve, tool.name, {"args": args, "kwargs": kwargs},
                                is_async=_is_async(self.toolbox.approve)) \
            if self.toolbox.approve is not None else True
        if verdict is not True:
            why = verdict if isinstance(verdict, str) and verdict else \
                "the caller's approval hook refused this call"
            return _refuse(record, why)
        try:
            result = await _invoke(tool.function, *args, is_async=tool.is_async, **kwargs)
        except Exception as exc:  # the tool's own error: its type and message, no traceback
            kind = getattr(exc, "tool_kind", "error")  # a host's tool that cannot be served
            if kind in ("refused", "unavailable"):
                record.outcome, record.message = "refused", str(exc)
                return {"status": "error", "kind": kind, "evalue": str(exc)[:MAX_MESSAGE_TEXT]}
            record.outcome, record.message = "error", f"{type(exc).__name__}: {exc}"
            return {"status": "error", "kind": "error", "ename": type(exc).__name__,
                    "evalue": str(exc)[:MAX_MESSAGE_TEXT]}
        problem = jsonwire.json_problem(result, "result")
        if problem:
            return _fail(record, f"the tool returned what is not JSON: {problem}")
        encoded = jsonwire.dumps(result)
        limit = self.toolbox.limits.max_result
        if limit and len(encoded) > limit:
            return _fail(record, f"the tool's result is {len(encoded):,} bytes of JSON, more "
                         f"than the {limit:,} a call may return")
        record.outcome, record.result_bytes = "ok", len(encoded)
        if self.toolbox.audit_payloads:
            record.result = result
        return {"status": "ok", "result": result}


def _parts(content: Any) -> tuple[str | None, list[Any] | None, dict[str, Any] | None]:
    if not isinstance(content, dict):
        return None, None, None
    name, args, kwargs = content.get("tool"), content.get("args"), content.get("kwargs")
    return (name if isinstance(name, str) else None, args if isinstance(args, list) else None,
            kwargs if isinstance(kwargs, dict) else None)


def _refuse(record: ToolCall, why: str) -> dict[str, Any]:
    record.outcome, record.message = "refused", why
    return {"status": "error", "kind": "refused", "evalue": why}


def _fail(record: ToolCall, why: str) -> dict[str, Any]:
    record.outcome, record.message = "error", why
    return {"status": "error", "kind": "error", "ename": "ToolResultError", "evalue": why}


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _invoke(function: Callable[..., Any], *args: Any, is_async: bool,
                  **kwargs: Any) -> Any:
    """Call a tool (or the approval hook): awaited on this loop if async, else in a thread
    of its own that carries this task's context."""
    if is_async:
        return await function(*args, **kwargs)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return  # abandoned: its timeout or the run's end came first
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, error = context.run(function, *args, **kwargs), None
        except BaseException as exc:  # handed to the waiting task (SystemExit included)
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is gone: nobody waits for this result any more

    threading.Thread(target=target, name=f"sandbox tool {getattr(function, '__name__', '')}",
                     daemon=True).start()
    result = await future
    return await result if inspect.isawaitable(result) else result


def reply_message(session_msg: Callable[..., dict[str, Any]], request: dict[str, Any],
                  content: dict[str, Any]) -> dict[str, Any]:
    """The reply to a request: its parent is the request's header."""
    return session_msg(REPLY, content, parent={"header": request["header"]})


class ToolLoop:
    """A blocking Sandbox's event loop for its tool calls, in a daemon thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="sandbox tools")
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run a coroutine there."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the loop (tools still running are abandoned)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            if not self.thread.is_alive():
                self.loop.close()


class StdinLink:
    """A ZMQ client's stdin channel, connected again when libzmq refused a frame on it.

    The caller's sockets refuse a frame larger than its limits allow (receive.py: libzmq drops
    the connection and never makes it again). The kernel keeps honest calls within that size
    (Toolbox.max_args), but its code can send any request it likes on its stdin channel: one
    forged oversize request would leave every later run of the sandbox without its tools
    (ToolUnavailable). So the connection's events are watched from the first run that grants
    tools, and before each such run a refused connection is made again."""

    def __init__(self, client: Any) -> None:
        self.client = client
        socket = client.stdin_channel.socket
        self.io: zmq.Socket[Any] = zmq.Socket.shadow(socket.underlying)
        self.endpoint = self.io.getsockopt_string(zmq.LAST_ENDPOINT)
        self.monitor = watch_connection(socket)  # an asyncio client's: read through a shadow
        self.events: zmq.Socket[Any] = zmq.Socket.shadow(self.monitor.underlying)
        self.refusals = Refusals()

    def mend(self) -> bool:
        """Connect the channel again if a frame was refused on it; whether it was."""
        while True:
            try:
                self.refusals.note(self.events.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
        if not self.refusals.refused:
            return False
        self.io.disconnect(self.endpoint)
        self.io.connect(self.endpoint)
        self.refusals = Refusals()
        return True

    def close(self) -> None:
        """Stop watching (before the channel's socket closes: see Sandbox._stop_client)."""
        try:
            self.io.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is already closed
        self.monitor.close(linger=0)


class StdinDesk:
    """A run's tool calls on a ZMQ kernel's stdin channel, for the run's Inbox: requests taken
    from the socket, decided off the socket's thread, their answers sent back on it (a zmq
    socket is used from one thread only: finished answers wait in a queue and an eventfd
    wakes the Inbox's poll)."""

    def __init__(self, run: ToolRun, client: Any,
                 submit: Callable[[Coroutine[Any, Any, Any]], Awaitable[Any] | Any]) -> None:
        self.run, self.client, self.submit = run, client, submit
        self.socket = client.stdin_channel.socket  # polled (an asyncio client's: awaited)
        # Read and written through a blocking view of it: never awaited, never waiting.
        self.io: zmq.Socket[Any] = zmq.Socket.shadow(self.socket.underlying)
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.answers: queue.SimpleQueue[tuple[dict[str, Any], dict[str, Any]]] = \
            queue.SimpleQueue()

    def take_ready(self) -> None:
        """Every message queued on the stdin socket, taken."""
        while True:
            try:
                frames = self.io.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.take(frames)

    def take(self, frames: list[Any]) -> None:
        """One message from the stdin socket: a request of this run is served; anything
        else (other runs', malformed, unsigned, other types) is dropped unparsed."""
        msg = unpack_frames(self.client.session, frames, self.run.msg_id)
        if msg is None or msg["header"].get("msg_type") != REQUEST:
            return
        future = self.submit(self.run.serve(msg))
        future.add_done_callback(lambda done: self._answered(msg, done))  # type: ignore[union-attr]

    def _answered(self, msg: dict[str, Any], done: Any) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        content = done.result()
        if content is not None and not self.run.closed:
            self.answers.put((msg, content))
            try:
                os.eventfd_write(self.wake_fd, 1)
            except OSError:
                pass  # closed: the run is over

    def send_answers(self) -> None:
        """Send every finished answer (called on the socket's thread)."""
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:
            pass
        while True:
            try:
                request, content = self.answers.get_nowait()
            except queue.Empty:
                return
            if not self.run.closed:
                self.client.session.send(self.io, reply_message(
                    self.client.session.msg, request, content))

    def close(self) -> None:
        """The run is over: stop serving, drop what was not sent."""
        self.run.close()
        os.close(self.wake_fd)


__all__ = ["MODULE", "ToolCall", "ToolLimits", "ToolRun", "Toolbox", "refuse_reentry"]
