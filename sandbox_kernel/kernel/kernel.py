"""The sandboxed IPython kernel: ipykernel's kernel plus what the sandbox reports and refuses."""

from __future__ import annotations

import asyncio
import linecache
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from types import FrameType
from typing import Any

from ipykernel.compiler import get_tmp_directory
from ipykernel.ipkernel import IPythonKernel
from IPython.core.inputtransformer2 import TransformerManager
from traitlets import Dict, Type

from .. import __version__, jsonwire
from ..confine import denials
from ..policy import SandboxPolicy
from . import cell_warnings, figures, main_call, pip, tools
from .deadline import Deadline, ExecutionTimeout
from .output import BUDGET
from .prebuilt import ZMQInteractiveShell
from .usage import SelfUsage

DEBUGGER_REFUSED = denials.DEBUGGER.why


def _compile_cell_patterns() -> None:
    """Compile the regular expressions IPython's cell transformer needs, once per process.

    The first cell a kernel runs compiled them (tokenize's token pattern above all): most of a
    fresh kernel's first execution. Done on import instead, a fork server compiles them once and
    every kernel it forks starts with them in the re and tokenize caches, so a kernel's first
    request costs what any later one does (and needs no warm-up execution to pay for it).
    """
    TransformerManager().transform_cell("pass\n")


_compile_cell_patterns()


def _timeout_source(label: Any) -> str:
    """Who set a request's timeout: the client's short label (e.g. `Sandbox.run(timeout=)`)."""
    if isinstance(label, str) and 0 < len(label) <= 80 and label.isprintable():
        return label
    return "metadata.sandbox.timeout"


def _is_warm_up(parent: dict[str, Any]) -> bool:
    """Whether a request is a client's warm-up (Sandbox.warm_up), which must leave no trace."""
    sandbox = parent.get("metadata", {}).get("sandbox")
    return isinstance(sandbox, dict) and sandbox.get("warm_up") is True


def skip_unshown_records(log: Any) -> None:
    """Let a logger drop what none of its handlers shows before building a record for it.

    traitlets sets its application's logger to DEBUG and filters in the handlers, so the
    debug lines of every start (config files looked for, ports bound) and of every message
    were built, formatted and thrown away.
    """
    handlers = log.handlers if isinstance(log, logging.Logger) else []
    shown = min((handler.level for handler in handlers), default=logging.NOTSET)
    if shown > log.level:
        log.setLevel(shown)


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
    """Transform the cell's code once for its execution, where IPython would do it twice.

    ipykernel transforms the cell to decide whether it must run as a coroutine, then IPython's
    run_cell transforms the same text again: a pure-Python tokenizer pass over the whole cell
    (about 0.5 ms for ten lines). The second call for this code takes the first one's result,
    once; every other call (and a transform that raised) computes as before. Main thread
    only: cells of subshells run in threads of their own, beside it, on the same shell.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    own = shell.__dict__.get("transform_cell")  # an instance override, restored after
    transform = shell.transform_cell
    calls = 0  # of this code: the first one's result serves the second, once
    first: str | None = None

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

    shell.transform_cell = transform_cell
    try:
        yield
    finally:
        if own is None:
            del shell.transform_cell
        else:
            shell.transform_cell = own


class SandboxKernel(IPythonKernel):
    """An IPython kernel that runs inside the sandbox its application set up."""

    implementation = "sandbox_kernel"
    implementation_version = __version__

    sandbox_info = Dict(help="Effective policy and active layers, set by the application.")
    shell_class = Type(ZMQInteractiveShell,  # type: ignore[assignment]
                       klass="ipykernel.zmqshell.ZMQInteractiveShell",
                       help="ipykernel's shell, adopted from a fork server (prebuilt.py).")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        main_call.load_ipython_extension(self.shell)  # the %main magic
        pip.load_ipython_extension(self.shell)  # %pip, in-process, into the session
        cell_warnings.load_ipython_extension(self.shell)  # "Cell In[N], line L: UserWarning"
        figures.load_ipython_extension(self.shell)  # Agg's figures shown, not lost
        jsonwire.use_in_kernel(self.session)  # exact inputs, parsed once, whatever is installed
        self._skip_unshown_log_records()
        self.deadline: Deadline | None = None
        self._cell_pause = self._execute_sleep  # as configured, for notebook cells
        self.file_access: denials.FileAccess | None = None  # set by the application
        self.usage = SelfUsage()  # reported in each execute_reply's metadata
        # IPython's hook for errors it shows: the ones the sandbox has something to say about.
        self.shell.set_custom_exc(  # type: ignore[union-attr]
            (asyncio.CancelledError, ExecutionTimeout, OSError), self.show_error)

    def _skip_unshown_log_records(self) -> None:
        skip_unshown_records(self.log)  # the application did so too, unless there is none

    @property
    def banner(self) -> str:  # type: ignore[override]
        """IPython's banner plus what the sandbox lets code reach (network, files)."""
        network = "on" if self.policy.allow_network else "off"
        files = self.sandbox_info.get("layers", {}).get("files", [])
        return (super().banner + f"\nsandbox-kernel: no processes; network {network}; files "
                "user code may reach besides the system and the interpreter:\n"
                + "".join(f"  {line}\n" for line in files))

    @property
    def policy(self) -> SandboxPolicy:
        """The policy of the application that started this kernel."""
        assert self.parent is not None, "the kernel is started by SandboxKernelApp"
        return self.parent.policy  # type: ignore[no-any-return]

    @property
    def kernel_info(self) -> dict[str, Any]:
        """ipykernel's kernel_info without the debugger, plus the sandbox's layers."""
        info = super().kernel_info
        info["supported_features"] = [f for f in info["supported_features"] if f != "debugger"]
        info["sandbox"] = self.sandbox_info
        return info

    @property
    def result_limit(self) -> int:
        """Largest main() result in bytes of JSON (0: none); the caller enforces it too."""
        return self.policy.max_result_bytes

    def _publish_execute_input(self, code: str, parent: dict[str, Any],
                               execution_count: int) -> None:
        # A main() call's caller sent the code itself: echoing it back carries nothing and
        # costs every warm call an IOPub message. Notebook cells are echoed as usual.
        if main_call.request_from(parent.get("metadata")) is None:
            super()._publish_execute_input(code, parent, execution_count)

    def init_metadata(self, parent: dict[str, Any]) -> dict[str, Any]:
        """ipykernel's reply metadata; the execution's usage starts being counted here."""
        self.usage.start()
        return super().init_metadata(parent)  # type: ignore[no-any-return]

    def finish_metadata(self, parent: dict[str, Any], metadata: dict[str, Any],
                        reply_content: dict[str, Any]) -> dict[str, Any]:
        """ipykernel's reply metadata, plus {"sandbox": {"usage": ...}}: what it cost."""
        metadata = super().finish_metadata(parent, metadata, reply_content)
        metadata["sandbox"] = {"usage": self.usage.report()}
        return metadata

    def time_limit(self) -> tuple[float, str]:
        """Seconds the current execution may run (0: no limit) and where that number came from."""
        sandbox = self.get_parent().get("metadata", {}).get("sandbox")
        if not isinstance(sandbox, dict):
            sandbox = {}
        requested = sandbox.get("timeout")
        if isinstance(requested, (int, float)) and not isinstance(requested, bool) \
                and requested > 0:
            return float(requested), _timeout_source(sandbox.get("timeout_source"))
        return self.policy.timeout, "the kernel's --timeout policy default"

    @staticmethod
    def is_cell_frame(frame: FrameType) -> bool:
        """Whether frame runs code the user sent (ipykernel names cells by a per-kernel dir)."""
        return frame.f_code.co_filename.startswith(get_tmp_directory())

    async def do_execute(self, code: str, silent: bool, store_history: bool = True,
                         user_expressions: dict | None = None, allow_stdin: bool = False,
                         **kwargs: Any) -> dict[str, Any]:
        """Run a cell within the execution's time limit and output cap."""
        # ipykernel pauses before every reply so that frontends which stop reading output at
        # the reply still get all of it; a main() caller reads IOPub until the kernel is idle,
        # so for it the pause (0.5 ms asked, about 1 ms slept) is only latency.
        is_main_call = main_call.request_from(self.get_parent().get("metadata")) is not None
        self._execute_sleep = 0.0 if is_main_call else self._cell_pause
        if _is_warm_up(self.get_parent()) and silent:
            with _no_trace(self.shell):
                return await self._do_execute(code, silent, False, user_expressions,
                                              allow_stdin, **kwargs)
        return await self._do_execute(code, silent, store_history, user_expressions,
                                      allow_stdin, **kwargs)

    async def _do_execute(self, code: str, silent: bool, store_history: bool,
                          user_expressions: dict | None, allow_stdin: bool,
                          **kwargs: Any) -> dict[str, Any]:
        self.deadline = deadline = Deadline(*self.time_limit(), is_user_frame=self.is_cell_frame)
        BUDGET.reset(self.policy.max_output_bytes)
        try:
            request = main_call.request_from(self.get_parent().get("metadata"))
            run_code = partial(super().do_execute, code, silent, store_history,
                               user_expressions, allow_stdin, **kwargs)
            with deadline.armed(), _transformed_once(self.shell, code), \
                    tools.granted(self.get_parent(), self.session, self.tool_transport):
                reply = await (run_code() if request is None  # main(): see main_call.py
                               else main_call.execute(self, request, run_code,
                                                       self.translate_error))
            if deadline.expired and reply.get("ename") == "CancelledError":
                reply.update(ename="ExecutionTimeout", evalue=str(deadline.error()))
            return reply
        finally:
            self.report_dropped_output()
            jsonwire.thaw()  # a large request's parsed inputs rejoin the collector

    def tool_transport(self) -> tools.Transport:
        """Where this execution's tool calls travel: the stdin channel, to the client that
        sent the request (ipykernel's `_input_request` routes its input_request the same way)."""
        return tools.StdinTransport(self.session, self.stdin_socket, self._parent_ident["shell"])

    def translate_error(self, error: BaseException) -> BaseException:
        """The error to show: an async cell cancelled by the time limit shows the limit."""
        expired = self.deadline is not None and self.deadline.expired
        if expired and isinstance(error, asyncio.CancelledError):
            return self.deadline.error()  # type: ignore[union-attr]
        return error

    def show_error(self, shell: Any, etype: type, value: BaseException, tb: Any,
                   tb_offset: int | None = None) -> None:
        """IPython's handler for the errors above: a refusal says why, and its traceback ends
        at the user's call (no sandbox or library frames after it)."""
        shown = self.translate_error(value)
        shown = denials.explain_file_error(shown, self.file_access) or shown
        if isinstance(shown, ExecutionTimeout) or denials.is_refusal(shown):
            tb = denials.user_part(tb, self.is_cell_frame)
        shell.showtraceback((type(shown), shown, tb), tb_offset=tb_offset)

    def report_dropped_output(self) -> None:
        """After an execution, say how much output the cap dropped (one marker, on stderr)."""
        # The budget is spent at write() time, so it is exact without a flush here (a flush waits
        # for the IOPub thread; ipykernel flushes once the reply is ready anyway).
        marker = BUDGET.marker()
        if marker and hasattr(sys.stderr, "write_uncapped"):
            sys.stderr.write_uncapped(marker)

    def _send_interrupt_children(self) -> None:
        # An interrupt_request makes ipykernel signal its process group, which the filter
        # refuses (a group is more than this process); there are no children: signal only self.
        os.kill(os.getpid(), signal.SIGINT)

    def _process_children(self) -> list[Any]:
        # ipykernel ends its children at shutdown by scanning /proc, which Landlock closes.
        # The only child is the scratch reaper, which must outlive the kernel: report none.
        return []

    async def do_debug_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Refuse every debug request with a reason, instead of starting debugpy."""
        return {
            "type": "response",
            "request_seq": msg.get("seq", 0),
            "success": False,
            "command": msg.get("command", ""),
            "message": DEBUGGER_REFUSED,
        }
