"""The runner: every execution semantic of the sandbox, around "run this cell".

Below both transports (DESIGN.md §13). The ZMQ kernel (kernel.py) gives it ipykernel's own
`do_execute` as the way to run a cell, so ipykernel's shell class and hooks stay in charge of
the cell itself; a one-shot kernel (oneshot.py) is that kernel on another channel; a shell's
`run_cell` serves as well. What the runner adds to each execution:

- the time limit (deadline.py), armed around the cell and main(); a cancellation it caused is
  reported as the limit;
- the output cap (budget.py), reset for each execution, its marker written after it;
- the main() convention (main_call.py): the code, then `main(**inputs)`, its result published
  through the transport, its errors named;
- the tool bridge (tools.py): the tools the request grants, as `sandbox_tools`, for the run;
- explained refusals: the shell's handler for the errors the sandbox has something to say
  about (a refused call names the policy, its traceback ends at the user's frame);
- usage (usage.py): what an execution cost, reported by the transport's reply;
- the warm-up: a silent execution that leaves no trace for user code to read;
- the cell's code transformed and judged (coroutine or not) once where IPython would do each
  twice.

It imports no ipykernel: the transport hands it the shell, how to tell the user's frames, how
to publish a result's content, how to cancel a coroutine on SIGINT, and its session and the
channel its tool calls travel on.
"""

from __future__ import annotations

import asyncio
import linecache
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any

from IPython.core.interactiveshell import InteractiveShell

from .. import jsonwire
from ..confine import denials
from . import main_call, tools
from .budget import BUDGET
from .deadline import Deadline, ExecutionTimeout
from .usage import SelfUsage

if TYPE_CHECKING:
    from ..policy import SandboxPolicy

# Run the cell, storing its input in the history or not; the execute_reply's content.
RunCell = Callable[[bool], Awaitable[dict[str, Any]]]


def timeout_source(label: Any) -> str:
    """Who set a request's timeout: the client's short label (e.g. `Sandbox.run(timeout=)`)."""
    if isinstance(label, str) and 0 < len(label) <= 80 and label.isprintable():
        return label
    return "metadata.sandbox.timeout"


def is_warm_up(metadata: dict[str, Any] | None) -> bool:
    """Whether a request is a client's warm-up (Sandbox.warm_up), which must leave no trace."""
    sandbox = (metadata or {}).get("sandbox")
    return isinstance(sandbox, dict) and sandbox.get("warm_up") is True


@contextmanager
def _no_trace(shell: Any) -> Iterator[None]:
    """Undo what a silent execution still leaves where user code can read it: the shell's last
    execution result and success, and the cell's source in linecache and the compiler's map
    of cell names. A warmed-up kernel then reads as one that never ran anything."""
    saved = shell.last_execution_result, shell.last_execution_succeeded
    cells, names = set(linecache.cache), set(shell.compile._filename_map)
    try:
        yield
    finally:
        shell.last_execution_result, shell.last_execution_succeeded = saved
        for name in set(linecache.cache) - cells:
            linecache.cache.pop(name, None)
        for name in set(shell.compile._filename_map) - names:
            shell.compile._filename_map.pop(name, None)


@contextmanager
def _transformed_once(shell: Any, code: str) -> Iterator[None]:
    """Transform the cell's code once for its execution, and decide once whether it runs as a
    coroutine, where IPython would do each twice.

    ipykernel (and the lean process) transform the cell to decide whether it must run as a
    coroutine, then IPython's run_cell transforms the same text again and decides again: a
    pure-Python tokenizer pass over the whole cell (about 0.5 ms for ten lines) and a compile
    of it. The second call of each for this code takes the first one's result, once; a cell
    whose text says neither await nor async is not compiled to be judged at all (IPython's
    compile could find no top-level await in it: `_may_await`); every other call (and a
    transform that raised) computes as before. Main thread only: cells of subshells run in
    threads of their own, beside it, on the same shell.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = [name for name in ("transform_cell", "should_run_async") if hasattr(shell, name)]
    own = {name: shell.__dict__.get(name) for name in names}  # instance overrides, put back
    transform, decide = shell.transform_cell, getattr(shell, "should_run_async", None)
    ipythons = getattr(type(shell), "should_run_async", None) is InteractiveShell.should_run_async
    calls = decisions = 0  # of this code: the first one's result serves the second, once
    first: str | None = None
    decided: tuple[str, bool] | None = None  # the transformed cell judged first, and how

    def transform_cell(raw_cell: str) -> str:
        nonlocal calls, first
        if raw_cell != code:
            return transform(raw_cell)  # type: ignore[no-any-return]
        calls += 1
        if calls == 2 and first is not None:
            return first
        result: str = transform(raw_cell)
        first = result if calls == 1 else None
        return result

    def should_run_async(raw_cell: str, *, transformed_cell: Any = None,
                         preprocessing_exc_tuple: Any = None) -> bool:
        nonlocal decisions, decided
        assert decide is not None
        if raw_cell != code or preprocessing_exc_tuple is not None:
            decision: bool = decide(raw_cell, transformed_cell=transformed_cell,
                                    preprocessing_exc_tuple=preprocessing_exc_tuple)
            return decision
        if ipythons and isinstance(transformed_cell, str) and not _may_await(transformed_cell):
            return False  # what IPython's compile would find, without compiling the cell
        decisions += 1
        if decisions == 2 and decided is not None and decided[0] == transformed_cell:
            return decided[1]
        result: bool = decide(raw_cell, transformed_cell=transformed_cell)
        decided = (transformed_cell, result) if decisions == 1 else None
        return result

    shell.transform_cell = transform_cell
    if decide is not None:
        shell.should_run_async = should_run_async
    try:
        yield
    finally:
        for name, override in own.items():
            if override is None:
                delattr(shell, name)
            else:
                setattr(shell, name, override)


def _may_await(cell: str) -> bool:
    """Whether a cell's text could make it a coroutine: IPython's should_run_async compiles the
    cell and looks for CO_COROUTINE, which only a top-level await, async for, async with or
    async comprehension sets, each spelled with "await" or "async"."""
    return "await" in cell or "async" in cell


class Runner:
    """Runs one process's executions on its shell, under the sandbox's semantics."""

    def __init__(self, shell: Any, policy: SandboxPolicy, *,
                 is_user_frame: Callable[[FrameType], bool],
                 publish_result: Callable[[bytes], None],
                 cancel_on_sigint: Callable[[asyncio.Future[Any]],
                                            AbstractContextManager[Any]],
                 session: Any, tool_transport: Callable[[], tools.Transport]) -> None:
        """is_user_frame: whether a frame runs code the user sent; publish_result: send an
        execute_result's content (JSON bytes) to the caller; cancel_on_sigint: a context in
        which an interrupt cancels the future (an async main()) instead of the loop; session
        and tool_transport: what makes a run's tool calls' messages and where they travel."""
        self.shell, self.policy, self.is_user_frame = shell, policy, is_user_frame
        self.publish_result, self.cancel_on_sigint = publish_result, cancel_on_sigint
        self.session, self.tool_transport = session, tool_transport
        self.deadline: Deadline | None = None
        self.file_access: denials.FileAccess | None = None  # set once the process is confined
        self.usage = SelfUsage()  # reported in each execute_reply's metadata
        # IPython's hook for errors it shows: the ones the sandbox has something to say about
        # (a tool call's error is the tool's, raised deep in kernel/tools.py: see show_error).
        shell.set_custom_exc((asyncio.CancelledError, ExecutionTimeout, OSError,
                              tools.ToolError), self.show_error)

    def renew(self) -> None:
        """In a forked process, before it is confined: usage figures of its own (rusage
        restarts at the fork)."""
        self.usage = SelfUsage()

    @property
    def result_limit(self) -> int:
        """Largest main() result in bytes of JSON (0: none); the caller enforces it too."""
        return self.policy.max_result_bytes

    def time_limit(self, metadata: dict[str, Any] | None) -> tuple[float, str]:
        """Seconds an execution may run (0: no limit) and where that number came from."""
        sandbox = (metadata or {}).get("sandbox")
        if not isinstance(sandbox, dict):
            sandbox = {}
        requested = sandbox.get("timeout")
        if isinstance(requested, (int, float)) and not isinstance(requested, bool) \
                and requested > 0:
            return float(requested), timeout_source(sandbox.get("timeout_source"))
        return self.policy.timeout, "the kernel's --timeout policy default"

    async def execute(self, run_cell: RunCell, code: str, parent: dict[str, Any], *,
                      silent: bool, store_history: bool) -> dict[str, Any]:
        """Run a cell (and main(), if the request's metadata asks) within the execution's time
        limit and output cap; parent: the execute_request; the execute_reply's content."""
        if is_warm_up(parent.get("metadata")) and silent:
            with _no_trace(self.shell):
                return await self._execute(run_cell, code, parent, False)
        return await self._execute(run_cell, code, parent, store_history)

    async def _execute(self, run_cell: RunCell, code: str, parent: dict[str, Any],
                       store_history: bool) -> dict[str, Any]:
        metadata = parent.get("metadata")
        self.deadline = deadline = Deadline(*self.time_limit(metadata),
                                            is_user_frame=self.is_user_frame)
        BUDGET.reset(self.policy.max_output_bytes)
        try:
            request = main_call.request_from(metadata)
            run_code = partial(run_cell, store_history)
            with deadline.armed(), _transformed_once(self.shell, code), \
                    tools.granted(parent, self.session, self.tool_transport):
                reply = await (run_code() if request is None  # main(): see main_call.py
                               else main_call.execute(self, request, run_code,
                                                      self.translate_error))
            if deadline.expired and reply.get("ename") == "CancelledError":
                reply.update(ename="ExecutionTimeout", evalue=str(deadline.error()))
            return reply
        finally:
            self.report_dropped_output()
            jsonwire.thaw()  # a large request's parsed inputs rejoin the collector

    def translate_error(self, error: BaseException) -> BaseException:
        """The error to show: an async cell cancelled by the time limit shows the limit."""
        expired = self.deadline is not None and self.deadline.expired
        if expired and isinstance(error, asyncio.CancelledError):
            return self.deadline.error()  # type: ignore[union-attr]
        return error

    def show_error(self, shell: Any, etype: type, value: BaseException, tb: Any,
                   tb_offset: int | None = None) -> None:
        """IPython's handler for the errors above: a refusal says why, and its traceback ends
        at the user's call (no sandbox or library frames after it); so does a tool call's
        error, whose message is the tool's (the bridge's own frames would say nothing)."""
        shown = self.translate_error(value)
        shown = denials.explain_file_error(shown, self.file_access) or shown
        if isinstance(shown, (ExecutionTimeout, tools.ToolError)) or denials.is_refusal(shown):
            tb = denials.user_part(tb, self.is_user_frame)
        shell.showtraceback((type(shown), shown, tb), tb_offset=tb_offset)

    @staticmethod
    def report_dropped_output() -> None:
        """After an execution, say how much output the cap dropped (one marker, on stderr)."""
        # The budget is spent at write() time, so it is exact without a flush here (a flush waits
        # for the IOPub thread; ipykernel flushes once the reply is ready anyway).
        marker = BUDGET.marker()
        if marker and hasattr(sys.stderr, "write_uncapped"):
            sys.stderr.write_uncapped(marker)
