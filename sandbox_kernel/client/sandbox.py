"""Python client: start a sandboxed kernel and run code (or a `main()` call) in it.

    with Sandbox() as sb:
        ex = sb.run("def main(x):\n    print('hi')\n    return {'y': x * 2}", inputs={"x": 21})
        ex.result  # {'y': 42}; ex.stdout == 'hi\\n'
"""

from __future__ import annotations

import asyncio
import base64
import json
import queue
import re
import shlex
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel

from .. import jsonwire
from ..install import DEFAULT_NAME, kernel_json
from ..policy import SandboxPolicy
from .managers import AsyncSandboxKernelManager, SandboxKernelManager
from .receive import (
    Budget,
    CallerLimits,
    Refusals,
    bounded_context,
    oversize_error,
    unpack_frames,
    watch_connection,
)

_ANSI = re.compile(r"\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])")
GRACE_SECONDS = 5.0  # default time a kernel gets past its deadline, and after an interrupt
_POLL = 0.2
_DEATH_WAIT = 1.0  # a dropped connection: how long to watch for the kernel's exit
# After the kernel_info_reply, how long to wait for an IOPub message (which proves the
# subscription) before asking again: a fork-served kernel answers before IOPub has joined.
_IOPUB_JOIN = 0.05
_RECONNECT_MS = 10
_REPLY_WAIT = 2.0  # the reply is sent before the kernel goes idle; this only bounds a lost one
# warm_up()'s request: silent and without history, it leaves no execution count, no history
# entry and no variable behind (and the kernel keeps its last-result state as it was); it only
# makes the first run pay nothing for first-time work.
_WARM_UP = {"code": "pass", "silent": True, "store_history": False, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": False}


@dataclass
class ExecutionError:
    """An error raised by the code, by `main`, or by the sandbox around them."""

    name: str
    value: str
    traceback: list[str] = field(default_factory=list)


def _error(content: dict[str, Any]) -> ExecutionError:
    """The error of an `error` message or an error execute_reply, without ANSI colours."""
    return ExecutionError(str(content.get("ename", "Error")), str(content.get("evalue", "")),
                          [_ANSI.sub("", str(line)) for line in content.get("traceback", [])])


def _reply_error(execution: Execution, reply: dict[str, Any] | None) -> None:
    """Take the error from the execute_reply when no `error` message came (e.g. a kernel at its
    thread limit cannot format and publish one): a failed run never reads as a success."""
    content = (reply or {}).get("content", {})
    if execution.error is None and content.get("status") == "error":
        execution.error = _error(content)


@dataclass
class Execution:
    """Everything one `run` produced, each kind of output kept apart."""

    result: dict | None = None
    text: str | None = None
    logs: list[dict[str, str]] = field(default_factory=list)
    displays: list[dict[str, Any]] = field(default_factory=list)
    error: ExecutionError | None = None
    duration: float = 0.0
    state_lost: bool = False

    @property
    def stdout(self) -> str:
        """Everything the code printed to stdout."""
        return "".join(chunk["text"] for chunk in self.logs if chunk["name"] == "stdout")

    @property
    def stderr(self) -> str:
        """Everything the code printed to stderr."""
        return "".join(chunk["text"] for chunk in self.logs if chunk["name"] == "stderr")

    def to_dict(self) -> dict[str, Any]:
        """The whole execution as JSON-able values."""
        return {**asdict(self), "stdout": self.stdout, "stderr": self.stderr}

    def save_displays(self, directory: str | Path) -> list[str]:
        """Write each display to directory as display-N.EXT in its richest format; the paths."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        paths = []
        for number, bundle in enumerate(self.displays, start=1):
            kind = next((k for k in _DISPLAY_FILES if k[0] in bundle), None)
            if kind is None:
                continue
            mime, extension, encoding = kind
            path = Path(directory, f"display-{number}.{extension}")
            path.write_bytes(_display_bytes(bundle[mime], encoding))
            paths.append(str(path))
        return paths


# Richest first: (mime type, file extension, how the message carries it).
_DISPLAY_FILES = (
    ("image/png", "png", "base64"), ("image/jpeg", "jpg", "base64"),
    ("image/gif", "gif", "base64"), ("image/svg+xml", "svg", "text"),
    ("text/html", "html", "text"), ("text/markdown", "md", "text"),
    ("text/latex", "tex", "text"), ("application/json", "json", "json"),
    ("text/plain", "txt", "text"),
)


def _display_bytes(value: Any, encoding: str) -> bytes:
    if encoding == "base64":
        return base64.b64decode(value)
    if encoding == "json":
        return json.dumps(value, indent=2, ensure_ascii=False).encode()
    return ("".join(value) if isinstance(value, list) else str(value)).encode()


Callback = Callable[[Any], None] | None


class _Collector:
    """Turns the IOPub messages of one request into an Execution, within the caller's limits."""

    def __init__(self, msg_id: str, on_stdout: Callback, on_stderr: Callback,
                 on_display: Callback, limits: CallerLimits | None = None,
                 session: Any = None) -> None:
        self.msg_id = msg_id
        self.execution = Execution()
        self.callbacks = {"stdout": on_stdout, "stderr": on_stderr, "display": on_display}
        self.idle = False
        self.budget = Budget(limits or CallerLimits())
        self.session = session

    def feed_frames(self, frames: list[Any]) -> None:
        """Take one message as it came off the socket (content parsed only if it is ours)."""
        msg = unpack_frames(self.session, frames, self.msg_id)
        if msg is not None:
            self.feed(msg)

    def feed(self, msg: dict[str, Any]) -> None:
        """Take one message; its content may still be packed (bytes), as unpack_frames leaves it."""
        if msg.get("parent_header", {}).get("msg_id") != self.msg_id:
            return
        kind, content = msg["header"]["msg_type"], msg["content"]
        size = msg.get("content_size", 0)
        if kind == "execute_result":
            self._result(content, size)
            return
        if kind in ("display_data", "update_display_data") and not self.budget.take_display(size):
            return
        if isinstance(content, (bytes, memoryview)):
            content = jsonwire.loads(content)
        ex = self.execution
        if kind == "stream":
            text = self.budget.take_output(content["text"])
            if text:
                ex.logs.append({"name": content["name"], "text": text})
                self._call(content["name"], text)
        elif kind in ("display_data", "update_display_data"):
            ex.displays.append(content["data"])
            self._call("display", content["data"])
        elif kind == "error":
            ex.error = _error(content)
        elif kind == "status" and content["execution_state"] == "idle":
            self.idle = True
            self._add_markers()

    def _result(self, content: Any, size: int) -> None:
        ex = self.execution
        problem = None if self.budget.near_limit(size) else self.budget.result_problem(size)
        if problem is None:
            if isinstance(content, (bytes, memoryview)):
                content = jsonwire.loads(content, keep=True)  # handed to the caller: thawed
            data = content["data"]
            json_data = data.get("application/json")
            problem = self.budget.result_problem(size, json_data)
        if problem is not None:
            ex.result = ex.text = None
            ex.error = ExecutionError("ResultTooLarge", problem, [f"ResultTooLarge: {problem}"])
            return
        ex.text = data.get("text/plain")
        ex.result = json_data if isinstance(json_data, dict) else None

    def _add_markers(self) -> None:
        for marker in (self.budget.output_marker(), self.budget.display_marker()):
            if marker:
                self.execution.logs.append({"name": "stderr", "text": marker})
                self._call("stderr", marker)

    def _call(self, name: str, payload: Any) -> None:
        callback = self.callbacks.get(name)
        if callback:
            callback(payload)


def _sandbox_metadata(inputs: dict | None, timeout: float | None, entrypoint: str,
                      timeout_source: str = "Sandbox.run(timeout=)") -> dict:
    meta: dict[str, Any] = {}
    if inputs is not None:
        meta["entrypoint"] = entrypoint
        meta["inputs"] = inputs
    if timeout is not None:
        # The label only names the limit in the kernel's ExecutionTimeout message.
        meta.update(timeout=timeout, timeout_source=timeout_source)
    return {"sandbox": meta} if meta else {}


def _execute_request(client: Any, code: str, inputs: dict | None, timeout: float | None,
                     entrypoint: str, timeout_source: str) -> dict[str, Any]:
    msg = client.session.msg("execute_request", {
        # A main() call is not a notebook cell: no history to write (it costs the kernel a thread
        # wake-up and a database row per call).
        "code": code, "silent": False, "store_history": inputs is None,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
    msg["metadata"].update(_sandbox_metadata(inputs, timeout, entrypoint, timeout_source))
    return msg


def _warm_up_request(client: Any) -> dict[str, Any]:
    """The silent `pass` of warm_up(), marked so the kernel also keeps its last-result state."""
    msg = client.session.msg("execute_request", dict(_WARM_UP))
    msg["metadata"]["sandbox"] = {"warm_up": True}
    return msg  # type: ignore[no-any-return]


def _fast_reconnecting(client: Any) -> Any:
    """The sockets of a client (or manager) retry a refused connection after 10 ms, not 100.

    The first kernel_info request goes out before the kernel has bound its sockets; a
    fork-served kernel binds them within tens of milliseconds, and would otherwise wait out
    the rest of the 100 ms. The same holds for the manager's control socket, connected as the
    kernel starts: a shutdown soon after the start waited for its reconnection, 100 ms of
    every fresh kernel's graceful close. The context is the client's (or manager's) own.
    """
    client.context.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
    return client


def _start_channels(client: Any) -> None:
    """Connect the shell and IOPub channels, the only ones a sandbox reads.

    Liveness is the kernel process's (the manager's is_alive), not a client heartbeat thread;
    requests never allow stdin; the manager has a control socket of its own. The others are
    still created, and connected, the first time client.control_channel (etc.) is used.
    """
    client.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)


def _never_waiting(context: Any) -> Any:
    """No send on the context's sockets may wait: it raises zmq.Again instead.

    jupyter_client's Session.send sends synchronously, even on an asyncio socket; a DEALER whose
    peer failed the handshake (a port taken by another process's socket of the wrong type) has
    no pipe left, and such a send would hold the event loop forever (it froze the service).
    """
    context.setsockopt(zmq.SNDTIMEO, 0)
    return context


_STARTING = ("Kernel died before replying to kernel_info",  # as jupyter_client's wait_for_ready
             "Kernel didn't respond in {timeout:g} seconds")
_WARMING_UP = ("the kernel died while warming up (before any code of the caller ran)",
               "the kernel did not answer a silent `pass` within {timeout:g} s")


def _check_start(alive: bool, deadline: float, timeout: float,
                 errors: tuple[str, str] = _STARTING) -> None:
    """Raise if the kernel died or took too long (errors: what to say for each)."""
    if not alive:
        raise RuntimeError(errors[0])
    if time.monotonic() > deadline:
        raise RuntimeError(errors[1].format(timeout=timeout))


def _exit_status(manager: Any) -> str:
    """How the kernel process ended, e.g. "exit status 1" or "killed by signal SIGSEGV"."""
    code = getattr(getattr(manager.provisioner, "process", None), "returncode", None)
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class _Watchdog:
    """Decides, between messages, whether to interrupt or give up on the kernel."""

    def __init__(self, timeout: float | None, grace: float, one_shot: bool = False) -> None:
        self.started = time.monotonic()
        self.timeout, self.grace, self.one_shot = timeout, grace, one_shot
        # The kernel enforces `timeout` itself; the client steps in only if that did not work.
        self.deadline = None if timeout is None else self.started + timeout + grace
        self.interrupted_at: float | None = None
        self.oversize = ("MessageTooLarge", "")
        self.checked_at = self.started

    def due(self) -> bool:
        """Whether to look at the kernel now: when no message came, or every _POLL seconds
        while messages keep coming (a stream of them must not hold the deadline off)."""
        now = time.monotonic()
        if now - self.checked_at < _POLL:
            return False
        self.checked_at = now
        return True

    def check(self, alive: bool) -> str | None:
        """None (keep waiting), "interrupt", or why the kernel is lost ("died", "hung")."""
        now = time.monotonic()
        if not alive:
            return "died"
        if self.interrupted_at is not None:
            return "hung" if now > self.interrupted_at + self.grace else None
        if self.deadline is not None and now > self.deadline:
            self.interrupted_at = now
            return "interrupt"
        return None

    def finish(self, execution: Execution, lost: str | None, manager: Any) -> Execution:
        """Fill in the duration, and the error when the client had to step in."""
        execution.duration = time.monotonic() - self.started
        restarted = "the kernel was restarted and its state (variables, imports) was lost"
        if lost == "died":
            execution.error = ExecutionError(
                "KernelDied", f"the kernel process died ({_exit_status(manager)}); {restarted}")
        elif lost == "hung":
            execution.error = ExecutionError(
                "ExecutionTimeout", f"the execution ran past its {self.timeout:g} s limit and "
                f"did not stop when interrupted; {restarted}")
        elif lost == "oversize":
            execution.result = execution.text = None
            execution.error = ExecutionError(*self.oversize, [])
            execution.error.value += f"; {restarted}"
            execution.error.traceback.append(f"{execution.error.name}: {execution.error.value}")
        elif self.interrupted_at is not None and execution.error is not None \
                and execution.error.name == "KeyboardInterrupt":
            error = execution.error
            error.name = "ExecutionTimeout"
            error.value = f"the execution ran past its {self.timeout:g} s limit and was " \
                "interrupted" + ("" if self.one_shot else
                                 "; the kernel and its variables are still there")
            error.traceback.append(f"{error.name}: {error.value}")  # ends as the others do
        execution.state_lost = lost is not None
        return execution


def _ready_frames(socket: Any) -> list[Any] | None:
    """The frames of a message already queued on this socket, else None (without waiting).

    A run's messages arrive in bursts (busy, streams, result, idle): taking what is queued
    before polling saves a poll per message.
    """
    try:
        return socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)  # type: ignore[no-any-return]
    except zmq.Again:
        return None


async def _ready_frames_async(socket: Any) -> list[Any] | None:
    """_ready_frames for an asyncio socket: a non-blocking read's future is already done, so
    awaiting it costs no turn of the event loop."""
    try:
        return await socket.recv_multipart(  # type: ignore[no-any-return]
            flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None


def _queued_reply(client: Any, frames: list[Any] | None) -> dict[str, Any] | None:
    """The shell reply in these frames, parsed as the client's get_shell_msg would."""
    if frames is None:
        return None
    _idents, parts = client.session.feed_identities(frames, copy=False)
    return client.session.deserialize(parts, copy=False)  # type: ignore[no-any-return]


class _Inbox:
    """A client's IOPub socket read frame by frame, and whether libzmq refused a frame."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.socket = client.iopub_channel.socket
        self.monitor = watch_connection(self.socket)
        self.refusals = Refusals()
        self.poller = self._poller()

    def _poller(self) -> Any:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        return poller

    def receive(self, timeout: float) -> list[Any] | None:
        """The next message's frames, or None after `timeout` seconds without one."""
        frames = _ready_frames(self.socket)
        if frames is not None:
            return frames
        events = dict(self.poller.poll(timeout * 1000))
        if self.monitor in events:
            self.refusals.note(self.monitor.recv_multipart())
        if self.socket in events:
            return self.socket.recv_multipart(copy=False)  # type: ignore[no-any-return]
        return None

    @property
    def refused(self) -> bool:
        """Whether libzmq refused a frame past the caller's size limit (see Refusals)."""
        return self.refusals.refused

    def watch(self, timeout: float) -> None:
        """Take the connection's events for up to `timeout` seconds (messages stay queued)."""
        if self.monitor.poll(timeout * 1000):
            self.refusals.note(self.monitor.recv_multipart())

    def close(self) -> None:
        """Stop watching the socket."""
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is already closed
        self.monitor.close(linger=0)


class _AsyncInbox(_Inbox):
    """The asyncio twin of _Inbox."""

    async def watch(self, timeout: float) -> None:  # type: ignore[override]
        """Take the connection's events for up to `timeout` seconds (messages stay queued)."""
        if await self.monitor.poll(timeout * 1000):
            self.refusals.note(await self.monitor.recv_multipart())

    def _poller(self) -> Any:
        poller = zmq.asyncio.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        return poller

    async def receive(self, timeout: float) -> list[Any] | None:  # type: ignore[override]
        """The next message's frames, or None after `timeout` seconds without one."""
        frames = await _ready_frames_async(self.socket)
        if frames is not None:
            return frames
        events = dict(await self.poller.poll(timeout * 1000))
        if self.monitor in events:
            self.refusals.note(await self.monitor.recv_multipart())
        if self.socket in events:
            return await self.socket.recv_multipart(copy=False)  # type: ignore[no-any-return]
        return None


class _PackageSpecs(KernelSpecManager):
    """Serves a kernelspec built from this package, for sandboxes started without installing."""

    def __init__(self, policy: SandboxPolicy, cold_start: bool = False,
                 preload: Sequence[str] = (), python: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = KernelSpec(**kernel_json(policy, "sandbox (package)", cold_start, preload,
                                             python))

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return self.spec


def _manager_kwargs(kernel_name: str | None, policy: SandboxPolicy | None, cold_start: bool,
                    preload: Sequence[str], python: str | None = None) -> dict[str, Any]:
    if kernel_name is None:
        specs = _PackageSpecs(policy or SandboxPolicy(), cold_start, preload, python)
        return {"kernel_name": "sandbox-package", "kernel_spec_manager": specs}
    if policy is not None or cold_start or preload:
        raise ValueError("give either kernel_name (an installed kernelspec, which sets policy, "
                         "cold start and preload) or those options, not both")
    return {"kernel_name": kernel_name}


def _installed_policy(kernel_name: str) -> dict[str, Any]:
    """The policy an installed kernelspec records (caller-side, so user code cannot alter it)."""
    try:
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel:
        return {}  # start_kernel will say so
    policy = spec.metadata.get("sandbox_kernel", {}).get("policy", {})
    return policy if isinstance(policy, dict) else {}


def install_code(packages: Sequence[str], upgrade: bool = False) -> str:
    """The cell that installs packages (wheels) into a kernel's session: `%pip install ...`."""
    if not packages:
        raise ValueError("name at least one package to install")
    for package in packages:
        if not package or package.startswith("-") or any(c.isspace() for c in package):
            raise ValueError(f"not a requirement: {package!r} (give names such as 'x==1.0'; "
                             "options are not available)")
    return "%pip install " + ("-U " if upgrade else "") + shlex.join(packages)


class _SandboxSettings:
    """What Sandbox and AsyncSandbox are made of: a kernel manager and their limits."""

    manager_class: type = SandboxKernelManager
    lock_class: type = threading.Lock
    # What a timeout message says set the limit, and whether state outlives one run (the CLI
    # changes both: its limit is `--timeout`, and its kernel ends after the one run).
    timeout_source = "Sandbox.run(timeout=)"
    one_shot = False
    context_class: type = zmq.Context
    inbox_class: type = _Inbox

    def __init__(self, kernel_name: str | None = DEFAULT_NAME, *,
                 policy: SandboxPolicy | None = None, startup_timeout: float = 60.0,
                 grace: float = GRACE_SECONDS, max_output: int | None = None,
                 max_result: int | None = None, cold_start: bool = False,
                 preload: Sequence[str] = (), python: str | None = None) -> None:
        # python: the interpreter of a runtime to run on (runtimes/), with kernel_name None.
        self.manager = self.manager_class(
            **_manager_kwargs(kernel_name, policy, cold_start, preload, python))
        jsonwire.use_exact_json(self.manager.session)  # results exact with or without orjson
        recorded = policy.as_dict() if policy is not None else (
            _installed_policy(kernel_name) if kernel_name else SandboxPolicy().as_dict())
        # Enforced here on what arrives, whatever the kernel does (see receive.py).
        self.limits = CallerLimits.from_policy(recorded, max_output, max_result)
        self.context = bounded_context(self.limits, self.context_class)
        self.startup_timeout = startup_timeout
        self.grace = grace
        self.client: Any = None
        self._inbox: Any = None
        self._lock = self.lock_class()

    def _send(self, msg: dict[str, Any], on_stdout: Callback = None, on_stderr: Callback = None,
              on_display: Callback = None) -> tuple[_Collector, Any]:
        """Send an execute request; return what collects its output and the inbox to read."""
        collector = _Collector(msg["header"]["msg_id"], on_stdout, on_stderr, on_display,
                               self.limits, self.client.session)
        inbox = self._current_inbox()  # before the send: nothing of the reply may be missed
        self.client.shell_channel.send(msg)
        return collector, inbox

    def _finish(self, watchdog: _Watchdog, collector: _Collector, lost: str | None) -> Execution:
        watchdog.oversize = oversize_error(self.limits)
        return watchdog.finish(collector.execution, lost, self.manager)

    def _live_context(self) -> Any:
        """The bounded ZMQ context for the client's sockets (a new one after close())."""
        if self.context.closed:
            self.context = bounded_context(self.limits, self.context_class)
        return self.context

    def _current_inbox(self) -> Any:
        """The inbox of the current client (a restart replaces the client and its sockets)."""
        if self._inbox is None or self._inbox.client is not self.client:
            self._close_inbox()
            self._inbox = self.inbox_class(self.client)
        return self._inbox

    def _close_inbox(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None


class Sandbox(_SandboxSettings):
    """A sandboxed kernel whose state persists across `run` calls; use it as a context manager."""

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the kernel and wait until it answers."""
        _fast_reconnecting(self.manager).start_kernel()
        self._connect()

    def _connect(self) -> None:
        self.client = _fast_reconnecting(self.manager.client(context=self._live_context()))
        _start_channels(self.client)
        try:
            self._wait_for_ready()
        except RuntimeError:
            self.close()
            raise

    def _wait_for_ready(self) -> None:
        """Ready once kernel_info is answered and IOPub delivers (not after 0.2 s of silence)."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            msg_id = self.client.kernel_info()
            try:
                while self.client.get_shell_msg(timeout=1.0)["parent_header"].get(
                        "msg_id") != msg_id:
                    pass
                self.client.get_iopub_msg(timeout=_IOPUB_JOIN)  # the subscription is live
                return
            except queue.Empty:
                pass
            _check_start(self.manager.is_alive(), deadline, self.startup_timeout)

    def close(self, now: bool = False) -> None:
        """Shut the kernel down: graceful, or with now=True killed at once.

        now=True is the one-shot close of a kernel whose results have all arrived: no shutdown
        handshake, the kernel is gone when this returns and its reaper still removes the
        scratch directory.
        """
        if self.client is not None:
            self.client.stop_channels()
        if self.manager.has_kernel:
            # Graceful by default; either way the scratch reaper removes the scratch directory.
            self.manager.shutdown_kernel(now=now)
        self._close_inbox()
        self.context.destroy(linger=0)

    def restart(self) -> None:
        """Replace the kernel with a fresh one; all state is lost."""
        self.client.stop_channels()
        self.manager.restart_kernel(now=True)
        self._connect()

    def interrupt(self) -> None:
        """Interrupt the code that is running."""
        self.manager.interrupt_kernel()

    def kernel_info(self) -> dict[str, Any]:
        """The kernel_info_reply content, including the sandbox's policy and layers."""
        with self._lock:
            return self.client.kernel_info(reply=True, timeout=self.startup_timeout)["content"]

    def warm_up(self) -> None:
        """Send one silent `pass` through run()'s path, so the next run() pays no first time.

        It sets up the run's IOPub reader, drains what the start left on IOPub and takes the
        kernel through its execute path once, leaving no history, execution count or variable:
        the kernel stays as fresh as it started. Pools call it before handing a kernel out.
        """
        with self._lock:
            msg = _warm_up_request(self.client)
            collector, inbox = self._send(msg)
            deadline = time.monotonic() + self.startup_timeout
            while not collector.idle:
                frames = inbox.receive(_POLL)
                if frames is None:
                    _check_start(self.manager.is_alive(), deadline, self.startup_timeout,
                                 _WARMING_UP)
                else:
                    collector.feed_frames(frames)
            self._take_reply(msg["header"]["msg_id"])

    def install(self, *packages: str, upgrade: bool = False,
                timeout: float | None = None) -> Execution:
        """Install wheels into this kernel's session (`%pip install`), for the next run to
        import; the error says why when the policy or the package does not allow it."""
        return self.run(install_code(packages, upgrade), timeout=timeout)

    def run(self, code: str, inputs: dict | None = None, timeout: float | None = None,
            on_stdout: Callback = None, on_stderr: Callback = None, on_display: Callback = None,
            entrypoint: str = "main") -> Execution:
        """Run code; with inputs, then call `entrypoint(**inputs)` and return its dict."""
        with self._lock:
            watchdog = _Watchdog(timeout, self.grace, self.one_shot)
            msg = _execute_request(self.client, code, inputs, timeout, entrypoint,
                                   self.timeout_source)
            collector, inbox = self._send(msg, on_stdout, on_stderr, on_display)
            lost = None
            while not collector.idle and not lost:
                frames = inbox.receive(_POLL)
                if frames is not None:
                    collector.feed_frames(frames)
                    if not watchdog.due():
                        continue
                lost = self._verdict(watchdog, inbox)
            execution = self._finish(watchdog, collector, lost)
            jsonwire.thaw()
            if lost:
                self.restart()
            else:
                _reply_error(execution, self._take_reply(msg["header"]["msg_id"]))
            return execution

    def _verdict(self, watchdog: _Watchdog, inbox: _Inbox) -> str | None:
        """Interrupt the kernel, or say why it is lost ("died", "hung", "oversize"), or None."""
        alive = self.manager.is_alive()
        if alive and inbox.refused:
            # A dying kernel drops the connection too, a moment before it is seen to exit.
            give_up = time.monotonic() + _DEATH_WAIT
            while (alive := self.manager.is_alive()) and inbox.refused \
                    and time.monotonic() < give_up:
                inbox.watch(_POLL / 4)
            if alive and inbox.refused:
                return "oversize"
        verdict = watchdog.check(alive)
        if verdict == "interrupt":
            self.interrupt()
            return None
        return verdict

    def _take_reply(self, msg_id: str) -> dict[str, Any] | None:
        """Read the execute_reply (and any stale one before it) so replies do not pile up."""
        give_up = time.monotonic() + _REPLY_WAIT  # absolute: a stream of stale ones ends too
        while (left := give_up - time.monotonic()) > 0:
            # The kernel sends the reply before it goes idle: it is usually queued already.
            reply = _queued_reply(self.client, _ready_frames(self.client.shell_channel.socket))
            if reply is None:
                try:
                    reply = self.client.get_shell_msg(timeout=left)
                except queue.Empty:
                    return None
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply
        return None


class AsyncSandbox(_SandboxSettings):
    """The asyncio twin of Sandbox."""

    manager_class = AsyncSandboxKernelManager
    lock_class = asyncio.Lock
    context_class = zmq.asyncio.Context
    inbox_class = _AsyncInbox

    async def __aenter__(self) -> AsyncSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _live_context(self) -> Any:
        return _never_waiting(super()._live_context())

    async def start(self) -> None:
        """Start the kernel and wait until it answers."""
        _never_waiting(self.manager.context)  # its control socket (shutdown requests)
        await _fast_reconnecting(self.manager).start_kernel()
        await self._connect()

    async def _connect(self) -> None:
        self.client = _fast_reconnecting(self.manager.client(context=self._live_context()))
        _start_channels(self.client)
        try:
            await self._wait_for_ready()
        except RuntimeError:
            await self.close()
            raise

    async def _wait_for_ready(self) -> None:
        """Ready once kernel_info is answered and IOPub delivers (not after 0.2 s of silence)."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                msg_id = self.client.kernel_info()
            except zmq.Again:  # nothing takes it (see _never_waiting): as if no reply came
                await asyncio.sleep(1.0)
                _check_start(await self.manager.is_alive(), deadline, self.startup_timeout)
                continue
            try:
                while (await self.client.get_shell_msg(timeout=1.0))["parent_header"].get(
                        "msg_id") != msg_id:
                    pass
                await self.client.get_iopub_msg(timeout=_IOPUB_JOIN)
                return
            except queue.Empty:
                pass
            _check_start(await self.manager.is_alive(), deadline, self.startup_timeout)

    async def close(self, now: bool = False) -> None:
        """Shut the kernel down: graceful, or with now=True killed at once (see Sandbox.close)."""
        if self.client is not None:
            self.client.stop_channels()
        if self.manager.has_kernel:
            try:
                await self.manager.shutdown_kernel(now=now)
            except zmq.Again:  # its control port takes nothing: no polite request, then
                await self.manager.shutdown_kernel(now=True)
        self._close_inbox()
        self.context.destroy(linger=0)

    async def restart(self) -> None:
        """Replace the kernel with a fresh one; all state is lost."""
        self.client.stop_channels()
        await self.manager.restart_kernel(now=True)
        await self._connect()

    async def interrupt(self) -> None:
        """Interrupt the code that is running."""
        await self.manager.interrupt_kernel()

    async def warm_up(self) -> None:
        """Send one silent `pass` through run()'s path, so the next run() pays no first time
        (see Sandbox.warm_up)."""
        async with self._lock:
            msg = _warm_up_request(self.client)
            collector, inbox = self._send(msg)
            deadline = time.monotonic() + self.startup_timeout
            while not collector.idle:
                frames = await inbox.receive(_POLL)
                if frames is None:
                    _check_start(await self.manager.is_alive(), deadline,
                                 self.startup_timeout, _WARMING_UP)
                else:
                    collector.feed_frames(frames)
            await self._take_reply(msg["header"]["msg_id"])

    async def install(self, *packages: str, upgrade: bool = False,
                      timeout: float | None = None) -> Execution:
        """Install wheels into this kernel's session (`%pip install`); see Sandbox.install."""
        return await self.run(install_code(packages, upgrade), timeout=timeout)

    async def run(self, code: str, inputs: dict | None = None, timeout: float | None = None,
                  on_stdout: Callback = None, on_stderr: Callback = None,
                  on_display: Callback = None, entrypoint: str = "main") -> Execution:
        """Run code; with inputs, then call `entrypoint(**inputs)` and return its dict."""
        async with self._lock:
            watchdog = _Watchdog(timeout, self.grace, self.one_shot)
            msg = _execute_request(self.client, code, inputs, timeout, entrypoint,
                                   self.timeout_source)
            collector, inbox = self._send(msg, on_stdout, on_stderr, on_display)
            lost = None
            while not collector.idle and not lost:
                frames = await inbox.receive(_POLL)
                if frames is not None:
                    collector.feed_frames(frames)
                    if not watchdog.due():
                        continue
                lost = await self._verdict(watchdog, inbox)
            execution = self._finish(watchdog, collector, lost)
            jsonwire.thaw()
            if lost:
                await self.restart()
            else:
                _reply_error(execution, await self._take_reply(msg["header"]["msg_id"]))
            return execution

    async def _verdict(self, watchdog: _Watchdog, inbox: _AsyncInbox) -> str | None:
        """Interrupt the kernel, or say why it is lost ("died", "hung", "oversize"), or None."""
        alive = await self.manager.is_alive()
        if alive and inbox.refused:
            # A dying kernel drops the connection too, a moment before it is seen to exit.
            give_up = time.monotonic() + _DEATH_WAIT
            while (alive := await self.manager.is_alive()) and inbox.refused \
                    and time.monotonic() < give_up:
                await inbox.watch(_POLL / 4)
            if alive and inbox.refused:
                return "oversize"
        verdict = watchdog.check(alive)
        if verdict == "interrupt":
            await self.interrupt()
            return None
        return verdict

    async def _take_reply(self, msg_id: str) -> dict[str, Any] | None:
        """Read the execute_reply (and any stale one before it) so replies do not pile up."""
        give_up = time.monotonic() + _REPLY_WAIT  # absolute: a stream of stale ones ends too
        while (left := give_up - time.monotonic()) > 0:
            reply = _queued_reply(self.client, await _ready_frames_async(
                self.client.shell_channel.socket))  # usually queued already, as above
            if reply is None:
                try:
                    reply = await self.client.get_shell_msg(timeout=left)
                except queue.Empty:
                    return None
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply
        return None
