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
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import zmq
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager, KernelManager

from .install import DEFAULT_NAME, kernel_json
from .policy import SandboxPolicy

_ANSI = re.compile(r"\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])")
GRACE_SECONDS = 5.0  # default time a kernel gets past its deadline, and after an interrupt
_POLL = 0.2
# After the kernel_info_reply, how long to wait for an IOPub message (which proves the
# subscription) before asking again: a fork-served kernel answers before IOPub has joined.
_IOPUB_JOIN = 0.05
_RECONNECT_MS = 10
_REPLY_WAIT = 2.0  # the reply is sent before the kernel goes idle; this only bounds a lost one


@dataclass
class ExecutionError:
    """An error raised by the code, by `main`, or by the sandbox around them."""

    name: str
    value: str
    traceback: list[str] = field(default_factory=list)


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
    """Turns the IOPub messages of one request into an Execution."""

    def __init__(self, msg_id: str, on_stdout: Callback, on_stderr: Callback,
                 on_display: Callback) -> None:
        self.msg_id = msg_id
        self.execution = Execution()
        self.callbacks = {"stdout": on_stdout, "stderr": on_stderr, "display": on_display}
        self.idle = False

    def feed(self, msg: dict[str, Any]) -> None:
        if msg.get("parent_header", {}).get("msg_id") != self.msg_id:
            return
        kind, content = msg["header"]["msg_type"], msg["content"]
        ex = self.execution
        if kind == "stream":
            ex.logs.append({"name": content["name"], "text": content["text"]})
            self._call(content["name"], content["text"])
        elif kind in ("display_data", "update_display_data"):
            ex.displays.append(content["data"])
            self._call("display", content["data"])
        elif kind == "execute_result":
            data = content["data"]
            ex.text = data.get("text/plain")
            json_data = data.get("application/json")
            ex.result = json_data if isinstance(json_data, dict) else None
        elif kind == "error":
            ex.error = ExecutionError(content["ename"], content["evalue"],
                                      [_ANSI.sub("", line) for line in content["traceback"]])
        elif kind == "status" and content["execution_state"] == "idle":
            self.idle = True

    def _call(self, name: str, payload: Any) -> None:
        callback = self.callbacks.get(name)
        if callback:
            callback(payload)


def _sandbox_metadata(inputs: dict | None, timeout: float | None, entrypoint: str) -> dict:
    meta: dict[str, Any] = {}
    if inputs is not None:
        meta["entrypoint"] = entrypoint
        meta["inputs"] = inputs
    if timeout is not None:
        meta["timeout"] = timeout
    return {"sandbox": meta} if meta else {}


def _execute_request(client: Any, code: str, inputs: dict | None, timeout: float | None,
                     entrypoint: str) -> dict[str, Any]:
    msg = client.session.msg("execute_request", {
        # A main() call is a function call, not a notebook cell: no history to write.
        "code": code, "silent": False, "store_history": inputs is None,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
    msg["metadata"].update(_sandbox_metadata(inputs, timeout, entrypoint))
    return msg


def _fast_reconnecting(client: Any) -> Any:
    """The client's sockets retry a refused connection after 10 ms, not ZMQ's 100 ms.

    The first kernel_info request goes out before the kernel has bound its sockets; a
    fork-served kernel binds them within tens of milliseconds, and would otherwise wait out
    the rest of the 100 ms. The context is the client's own (jupyter_client makes one each).
    """
    client.context.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
    return client


def _check_start(alive: bool, deadline: float, timeout: float) -> None:
    """Raise (as jupyter_client's wait_for_ready does) if the kernel died or took too long."""
    if not alive:
        raise RuntimeError("Kernel died before replying to kernel_info")
    if time.monotonic() > deadline:
        raise RuntimeError(f"Kernel didn't respond in {timeout:g} seconds")


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

    def __init__(self, timeout: float | None, grace: float) -> None:
        self.started = time.monotonic()
        self.timeout, self.grace = timeout, grace
        # The kernel enforces `timeout` itself; the client steps in only if that did not work.
        self.deadline = None if timeout is None else self.started + timeout + grace
        self.interrupted_at: float | None = None

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
        elif self.interrupted_at is not None and execution.error is not None \
                and execution.error.name == "KeyboardInterrupt":
            error = execution.error
            error.name = "ExecutionTimeout"
            error.value = (f"the execution ran past its {self.timeout:g} s limit and was "
                           "interrupted; the kernel and its variables are still there")
            error.traceback.append(f"{error.name}: {error.value}")  # ends as the others do
        execution.state_lost = lost is not None
        return execution


class _PackageSpecs(KernelSpecManager):
    """Serves a kernelspec built from this package, for sandboxes started without installing."""

    def __init__(self, policy: SandboxPolicy, cold_start: bool = False,
                 preload: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = KernelSpec(**kernel_json(policy, "sandbox (package)", cold_start, preload))

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return self.spec


def _manager_kwargs(kernel_name: str | None, policy: SandboxPolicy | None, cold_start: bool,
                    preload: Sequence[str]) -> dict[str, Any]:
    if kernel_name is None:
        specs = _PackageSpecs(policy or SandboxPolicy(), cold_start, preload)
        return {"kernel_name": "sandbox-package", "kernel_spec_manager": specs}
    if policy is not None or cold_start or preload:
        raise ValueError("give either kernel_name (an installed kernelspec, which sets policy, "
                         "cold start and preload) or those options, not both")
    return {"kernel_name": kernel_name}


class _SandboxSettings:
    """What Sandbox and AsyncSandbox are made of: a kernel manager and their limits."""

    manager_class: type = KernelManager
    lock_class: type = threading.Lock

    def __init__(self, kernel_name: str | None = DEFAULT_NAME, *,
                 policy: SandboxPolicy | None = None, startup_timeout: float = 60.0,
                 grace: float = GRACE_SECONDS, cold_start: bool = False,
                 preload: Sequence[str] = ()) -> None:
        self.manager = self.manager_class(
            **_manager_kwargs(kernel_name, policy, cold_start, preload))
        self.startup_timeout = startup_timeout
        self.grace = grace
        self.client: Any = None
        self._lock = self.lock_class()


class Sandbox(_SandboxSettings):
    """A sandboxed kernel whose state persists across `run` calls; use it as a context manager."""

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the kernel and wait until it answers."""
        self.manager.start_kernel()
        self._connect()

    def _connect(self) -> None:
        self.client = _fast_reconnecting(self.manager.client())
        self.client.start_channels()
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

    def close(self) -> None:
        """Shut the kernel down."""
        if self.client is not None:
            self.client.stop_channels()
        if self.manager.has_kernel:
            # Graceful, so the kernel removes its scratch directory on the way out.
            self.manager.shutdown_kernel()

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

    def run(self, code: str, inputs: dict | None = None, timeout: float | None = None,
            on_stdout: Callback = None, on_stderr: Callback = None, on_display: Callback = None,
            entrypoint: str = "main") -> Execution:
        """Run code; with inputs, then call `entrypoint(**inputs)` and return its dict."""
        with self._lock:
            watchdog = _Watchdog(timeout, self.grace)
            msg = _execute_request(self.client, code, inputs, timeout, entrypoint)
            collector = _Collector(msg["header"]["msg_id"], on_stdout, on_stderr, on_display)
            self.client.shell_channel.send(msg)
            lost = None
            while not collector.idle and not lost:
                try:
                    collector.feed(self.client.get_iopub_msg(timeout=_POLL))
                    continue
                except queue.Empty:
                    pass
                verdict = watchdog.check(self.manager.is_alive())
                if verdict == "interrupt":
                    self.interrupt()
                else:
                    lost = verdict
            execution = watchdog.finish(collector.execution, lost, self.manager)
            if lost:
                self.restart()
            else:
                self._take_reply(msg["header"]["msg_id"])
            return execution

    def _take_reply(self, msg_id: str) -> None:
        """Read the execute_reply (and any stale one before it) so replies do not pile up."""
        while True:
            try:
                reply = self.client.get_shell_msg(timeout=_REPLY_WAIT)
            except queue.Empty:
                return
            if reply["parent_header"].get("msg_id") == msg_id:
                return


class AsyncSandbox(_SandboxSettings):
    """The asyncio twin of Sandbox."""

    manager_class = AsyncKernelManager
    lock_class = asyncio.Lock

    async def __aenter__(self) -> AsyncSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the kernel and wait until it answers."""
        await self.manager.start_kernel()
        await self._connect()

    async def _connect(self) -> None:
        self.client = _fast_reconnecting(self.manager.client())
        self.client.start_channels()
        try:
            await self._wait_for_ready()
        except RuntimeError:
            await self.close()
            raise

    async def _wait_for_ready(self) -> None:
        """Ready once kernel_info is answered and IOPub delivers (not after 0.2 s of silence)."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            msg_id = self.client.kernel_info()
            try:
                while (await self.client.get_shell_msg(timeout=1.0))["parent_header"].get(
                        "msg_id") != msg_id:
                    pass
                await self.client.get_iopub_msg(timeout=_IOPUB_JOIN)
                return
            except queue.Empty:
                pass
            _check_start(await self.manager.is_alive(), deadline, self.startup_timeout)

    async def close(self) -> None:
        """Shut the kernel down."""
        if self.client is not None:
            self.client.stop_channels()
        if self.manager.has_kernel:
            await self.manager.shutdown_kernel()

    async def restart(self) -> None:
        """Replace the kernel with a fresh one; all state is lost."""
        self.client.stop_channels()
        await self.manager.restart_kernel(now=True)
        await self._connect()

    async def interrupt(self) -> None:
        """Interrupt the code that is running."""
        await self.manager.interrupt_kernel()

    async def run(self, code: str, inputs: dict | None = None, timeout: float | None = None,
                  on_stdout: Callback = None, on_stderr: Callback = None,
                  on_display: Callback = None, entrypoint: str = "main") -> Execution:
        """Run code; with inputs, then call `entrypoint(**inputs)` and return its dict."""
        async with self._lock:
            watchdog = _Watchdog(timeout, self.grace)
            msg = _execute_request(self.client, code, inputs, timeout, entrypoint)
            collector = _Collector(msg["header"]["msg_id"], on_stdout, on_stderr, on_display)
            self.client.shell_channel.send(msg)
            lost = None
            while not collector.idle and not lost:
                try:
                    collector.feed(await self.client.get_iopub_msg(timeout=_POLL))
                    continue
                except queue.Empty:
                    pass
                verdict = watchdog.check(await self.manager.is_alive())
                if verdict == "interrupt":
                    await self.interrupt()
                else:
                    lost = verdict
            execution = watchdog.finish(collector.execution, lost, self.manager)
            if lost:
                await self.restart()
            else:
                await self._take_reply(msg["header"]["msg_id"])
            return execution

    async def _take_reply(self, msg_id: str) -> None:
        """Read the execute_reply (and any stale one before it) so replies do not pile up."""
        while True:
            try:
                reply = await self.client.get_shell_msg(timeout=_REPLY_WAIT)
            except queue.Empty:
                return
            if reply["parent_header"].get("msg_id") == msg_id:
                return
