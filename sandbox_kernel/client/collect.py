"""One run's messages made into an Execution, and the watchdog that decides when to step in."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Generator
from typing import Any

from .. import jsonwire
from ..errors import ExecutionTimeout, KernelDied, MessageTooLarge, ResultTooLarge, SandboxError
from ..resultcheck import CHECK_ELSEWHERE, raw_result
from .execution import ErrorInfo, Execution, error_from
from .receive import Budget, CallerLimits, unpack_frames

POLL = 0.2  # seconds between looks at the kernel while no message comes
_DEATH_WAIT = 1.0  # a dropped connection: how long to watch for the kernel's exit

Callback = Callable[[Any], None] | None
# What a step asks its shell to do: a callable and its arguments; the answer is sent back in.
Call = tuple[Any, ...]


def info_of(error: SandboxError) -> ErrorInfo:
    """The ErrorInfo an Execution carries for one of the sandbox's own errors (errors.py)."""
    return ErrorInfo(error.code, str(error), error.traceback())


class Collector:
    """Turns the IOPub messages of one request into an Execution, within the caller's limits."""

    def __init__(self, msg_id: str, on_stdout: Callback, on_stderr: Callback,
                 on_display: Callback, limits: CallerLimits | None = None,
                 session: Any = None, raw_result: bool = False) -> None:
        self.msg_id = msg_id
        self.execution = Execution()
        self.callbacks = {"stdout": on_stdout, "stderr": on_stderr, "display": on_display}
        self.idle = False
        self.budget = Budget(limits or CallerLimits())
        self.session = session
        self.result_bytes = 0
        self.raw_result = raw_result  # keep a main() result as its JSON bytes (receive.raw_result)

    def feed_frames(self, frames: list[Any]) -> None:
        """Take one message as it came off the socket (content parsed only if it is ours)."""
        msg = self.unpack(frames)
        if msg is not None:
            self.feed(msg)

    def unpack(self, frames: list[Any]) -> dict[str, Any] | None:
        """The message in frames if it is ours (checked, content still packed), else None."""
        return unpack_frames(self.session, frames, self.msg_id)

    def feed(self, msg: dict[str, Any]) -> None:
        """Take one message; its content may still be packed (bytes), as unpack_frames leaves it."""
        if msg.get("parent_header", {}).get("msg_id") != self.msg_id:
            return
        kind, content = msg["header"]["msg_type"], msg["content"]
        size = msg.get("content_size", 0)
        if kind == "execute_result":
            self._result(content, size, msg.get("checked"))
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
            ex.error = error_from(content)
        elif kind == "status" and content["execution_state"] == "idle":
            self.idle = True
            self._add_markers()

    def checks_elsewhere(self, msg: dict[str, Any]) -> bool:
        """Whether feed(msg) would check a result kept as JSON bytes (raw_result) over
        CHECK_ELSEWHERE bytes: an async caller checks it beforehand in a child process
        (resultcheck.checked_elsewhere) and hands the outcome in the message as "checked"."""
        size = msg.get("content_size", 0)
        return (self.raw_result and msg["header"]["msg_type"] == "execute_result"
                and isinstance(msg["content"], (bytes, memoryview))
                and msg.get("parent_header", {}).get("msg_id") == self.msg_id
                and CHECK_ELSEWHERE < size and self.budget.near_limit(size))

    def _result(self, content: Any, size: int, checked: Any = None) -> None:
        if self.raw_result and isinstance(content, (bytes, memoryview)):
            self._raw_result(content, size, checked)
            return
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
            ex.error = info_of(ResultTooLarge(problem))
            return
        ex.text = data.get("text/plain")
        ex.result = json_data if isinstance(json_data, dict) else None
        self.result_bytes = _result_bytes(ex.result, ex.text)

    def _raw_result(self, content: bytes | memoryview, size: int, checked: Any) -> None:
        """checked: raw_result's outcome, found elsewhere (a tuple or its ValueError)."""
        ex = self.execution
        problem = None if self.budget.near_limit(size) else self.budget.result_problem(size)
        if problem is None:
            try:
                if isinstance(checked, ValueError):
                    raise checked
                raw, text = checked if checked is not None else raw_result(content)
            except ValueError as exc:
                ex.error = ErrorInfo("InvalidResult", str(exc), [f"InvalidResult: {exc}"])
                return
            problem = None if raw is None else self.budget.json_problem(len(raw))
        if problem is not None:
            ex.error = info_of(ResultTooLarge(problem))
            return
        ex.result_json, ex.text = raw, text if isinstance(text, str) else None
        self.result_bytes = len(raw) if raw is not None else _result_bytes(None, ex.text)

    def _add_markers(self) -> None:
        for marker in (self.budget.output_marker(), self.budget.display_marker()):
            if marker:
                self.execution.logs.append({"name": "stderr", "text": marker})
                self._call("stderr", marker)

    def _call(self, name: str, payload: Any) -> None:
        callback = self.callbacks.get(name)
        if callback:
            callback(payload)


def _result_bytes(result: dict | None, text: str | None) -> int:
    """Bytes of the result: its JSON for a main() result, else the UTF-8 of its text."""
    if result is not None:
        return len(jsonwire.dumps(result))
    return len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0


def exit_status(manager: Any) -> str:
    """How the kernel process ended, e.g. "exit status 1" or "killed by signal SIGSEGV"."""
    return exit_description(getattr(getattr(manager.provisioner, "process", None),
                                    "returncode", None))


def exit_description(code: int | None) -> str:
    """An exit code (negative: the signal that ended it) as exit_status says it."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class Watchdog:
    """Decides, between messages, whether to interrupt or give up on the kernel."""

    def __init__(self, timeout: float | None, grace: float, one_shot: bool = False) -> None:
        self.started = time.monotonic()
        self.timeout, self.grace, self.one_shot = timeout, grace, one_shot
        # The kernel enforces `timeout` itself; the client steps in only if that did not work.
        self.deadline = None if timeout is None else self.started + timeout + grace
        self.interrupted_at: float | None = None
        self.oversize = (MessageTooLarge.code, "")
        self.checked_at = self.started

    def due(self) -> bool:
        """Whether to look at the kernel now: when no message came, or every POLL seconds
        while messages keep coming (a stream of them must not hold the deadline off)."""
        now = time.monotonic()
        if now - self.checked_at < POLL:
            return False
        self.checked_at = now
        return True

    def verdict(self, manager: Any, inbox: Any) -> Generator[Call, Any, str | None]:
        """Steps: interrupt the kernel, or say why it is lost ("died", "hung", "oversize")."""
        alive = yield (manager.is_alive,)
        if alive and inbox.refused:
            # A dying kernel drops the connection too, a moment before it is seen to exit.
            give_up = time.monotonic() + _DEATH_WAIT
            while (alive := (yield (manager.is_alive,))) and inbox.refused \
                    and time.monotonic() < give_up:
                yield (inbox.watch, POLL / 4)
            if alive and inbox.refused:
                return "oversize"
        verdict = self.check(alive)
        if verdict == "interrupt":
            yield (manager.interrupt_kernel,)
            return None
        return verdict

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
            execution.error = ErrorInfo(
                KernelDied.code, f"the kernel process died ({exit_status(manager)}); {restarted}")
        elif lost == "hung":
            execution.error = ErrorInfo(
                ExecutionTimeout.code, f"the execution ran past its {self.timeout:g} s limit and "
                f"did not stop when interrupted; {restarted}")
        elif lost == "oversize":
            execution.result = execution.text = None
            execution.error = ErrorInfo(*self.oversize, [])
            execution.error.value += f"; {restarted}"
            execution.error.traceback.append(f"{execution.error.name}: {execution.error.value}")
        elif self.interrupted_at is not None and execution.error is not None \
                and execution.error.name == "KeyboardInterrupt":
            error = execution.error
            error.name = ExecutionTimeout.code
            error.value = f"the execution ran past its {self.timeout:g} s limit and was " \
                "interrupted" + ("" if self.one_shot else
                                 "; the kernel and its variables are still there")
            error.traceback.append(f"{error.name}: {error.value}")  # ends as the others do
        execution.state_lost = lost is not None
        return execution
