"""The sandboxed IPython kernel: ipykernel's kernel plus what the sandbox reports and refuses.

Its executions go through the runner (runner.py), with ipykernel's own do_execute as the way
to run a cell; what stays here is ipykernel's: its hooks, kernel_info, interrupts, debugging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from functools import partial
from types import FrameType
from typing import Any

from ipykernel.compiler import get_tmp_directory
from ipykernel.ipkernel import IPythonKernel
from IPython.core.inputtransformer2 import TransformerManager
from traitlets import Dict, Type

from .. import __version__
from ..confine import denials
from ..policy import SandboxPolicy
from . import cell_warnings, figures, main_call, peeking, pip, tools, tools_zmq
from .prebuilt import ZMQInteractiveShell
from .runner import Runner
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


START_WAIT = 10.0  # seconds a shutdown request waits for start() to return


class SandboxKernel(IPythonKernel):
    """An IPython kernel that runs inside the sandbox its application set up."""

    implementation = "sandbox_kernel"
    implementation_version = __version__

    sandbox_info = Dict(help="Effective policy and active layers, set by the application.")
    shell_class = Type(ZMQInteractiveShell,  # type: ignore[assignment]
                       klass="ipykernel.zmqshell.ZMQInteractiveShell",
                       help="ipykernel's shell, adopted from a fork server (prebuilt.py).")

    session_class: type[peeking.PeekingSession] = peeking.PeekingSession  # what the app's
    # Session becomes in the kernel (a one-shot's builds its messages without jupyter_client)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._started = threading.Event()  # start() has returned (shutdown_request)
        main_call.load_ipython_extension(self.shell)  # the %main magic
        pip.load_ipython_extension(self.shell)  # %pip, in-process, into the session
        cell_warnings.load_ipython_extension(self.shell)  # "Cell In[N], line L: UserWarning"
        figures.load_ipython_extension(self.shell)  # Agg's figures shown, not lost
        # exact inputs, parsed once, whatever is installed
        peeking.use_in_kernel(self.session, self.session_class)
        self._skip_unshown_log_records()
        self._cell_pause = self._execute_sleep  # as configured, for notebook cells
        self.runner = Runner(self.shell, self.policy, is_user_frame=self.is_cell_frame,
                             publish_result=self.publish_result,
                             cancel_on_sigint=self._cancel_on_sigint,
                             session=self.session, tool_transport=self.tool_transport)

    def start(self) -> None:
        """ipykernel's start; once it has returned, a shutdown request may stop the loops."""
        try:
            super().start()
        finally:
            self._started.set()

    async def shutdown_request(self, stream: Any, ident: Any, parent: Any) -> None:
        """ipykernel's, after start() has returned. The control thread answers while the main
        thread is still in start(): a request then (a manager shutting down a kernel it has
        just launched, e.g. a server closing after cold starts) stopped and closed the control
        thread's loop under start(), which failed with "Event loop is closed" tracebacks in
        the launcher's log."""
        deadline = time.monotonic() + START_WAIT
        while not self._started.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await super().shutdown_request(stream, ident, parent)

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
    def usage(self) -> SelfUsage:
        """What this kernel's executions cost, as its replies report it (the runner's)."""
        return self.runner.usage

    @property
    def kernel_info(self) -> dict[str, Any]:
        """ipykernel's kernel_info without the debugger, plus the sandbox's layers."""
        info = super().kernel_info
        info["supported_features"] = [f for f in info["supported_features"] if f != "debugger"]
        info["sandbox"] = self.sandbox_info
        return info

    def _publish_execute_input(self, code: str, parent: dict[str, Any],
                               execution_count: int) -> None:
        # A main() call's caller sent the code itself: echoing it back carries nothing and
        # costs every warm call an IOPub message. Notebook cells are echoed as usual.
        if main_call.request_from(parent.get("metadata")) is None:
            super()._publish_execute_input(code, parent, execution_count)

    def init_metadata(self, parent: dict[str, Any]) -> dict[str, Any]:
        """ipykernel's reply metadata; the execution's usage starts being counted here."""
        self.runner.usage.start()
        return super().init_metadata(parent)  # type: ignore[no-any-return]

    def finish_metadata(self, parent: dict[str, Any], metadata: dict[str, Any],
                        reply_content: dict[str, Any]) -> dict[str, Any]:
        """ipykernel's reply metadata, plus {"sandbox": {"usage": ...}}: what it cost."""
        metadata = super().finish_metadata(parent, metadata, reply_content)
        metadata["sandbox"] = {"usage": self.runner.usage.report()}
        return metadata

    @staticmethod
    def is_cell_frame(frame: FrameType) -> bool:
        """Whether frame runs code the user sent (ipykernel names cells by a per-kernel dir)."""
        return frame.f_code.co_filename.startswith(get_tmp_directory())

    async def do_execute(self, code: str, silent: bool, store_history: bool = True,
                         user_expressions: dict | None = None, allow_stdin: bool = False,
                         **kwargs: Any) -> dict[str, Any]:
        """Run a cell through the runner (runner.py): ipykernel's do_execute runs the cell."""
        parent = self.get_parent()
        # ipykernel pauses before every reply so that frontends which stop reading output at
        # the reply still get all of it; a main() caller reads IOPub until the kernel is idle,
        # so for it the pause (0.5 ms asked, about 1 ms slept) is only latency.
        is_main_call = main_call.request_from(parent.get("metadata")) is not None
        self._execute_sleep = 0.0 if is_main_call else self._cell_pause
        run_cell = partial(super().do_execute, code, silent, user_expressions=user_expressions,
                           allow_stdin=allow_stdin, **kwargs)
        return await self.runner.execute(run_cell, code, parent, silent=silent,
                                         store_history=store_history)

    def publish_result(self, content: bytes) -> None:
        """A main() result's execute_result, on IOPub's own topic (runner.py)."""
        session = self.session
        assert session is not None, "the application gives the kernel its session"
        # Content packed as JSON around the result (main_call.result_content): Session.send
        # takes bytes as they are, and still signs them.
        session.send(self.iopub_socket, "execute_result", content,  # type: ignore[arg-type]
                     parent=self.get_parent(), ident=self._topic("execute_result"))

    def tool_transport(self) -> tools.Transport:
        """Where this execution's tool calls travel: the stdin channel, to the client that
        sent the request (ipykernel's `_input_request` routes its input_request the same way)."""
        return tools_zmq.StdinTransport(self.session, self.stdin_socket,
                                        self._parent_ident["shell"])

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
