"""The lean one-shot process: one request run on IPython's shell, with no ipykernel kernel.

A stateless run (the dify route, a native one-shot execute, MCP's fresh run_python, `sandbox-kernel
run`, `Sandbox.run`) needs one execution and its answer. The kernel-based one-shot process
(oneshot.py) gets there through a whole ipykernel application and kernel, in a zygote forked
from the fork server, whose image holds ipykernel, ZMQ, jupyter_client and the egress proxy's
libraries: every pooled process pays for that image in copy-on-write faults and its exit. This
one is built in a zygote started fresh (launch/forkserver/lean_zygote.py) whose image holds
CPython, IPython's shell (lean_shell.py), the runner (runner.py: every execution semantic), the
message builder (messages.py) and the confinement's precomputed inputs, nothing else.

Per pooled process, the same steps as oneshot.py's, through the same functions (oneshot_io.py;
confine/sequence.py's Confinement, in kernel/app.py's order): `before_threads`, its per-process
parts (captured fds, the shell renewed with its profile dir in the scratch), the uid switch, the
check that the server is its parent, `finish` (seccomp), `hand_to_user_code`; then one request: read
(oneshot_wire records), run through `Runner.execute` on the shell's `run_cell` (its async
variant for top-level await), and answered with the messages a kernel sends: status busy, the
run's output, execute_reply (with `metadata.sandbox.usage`), status idle; then the written
files, DONE, exit.

The policy comes from the pool's argv (policy.from_kernel_argv, as the launchers read it), the
same argv giving the same policy as the kernel application's (tests/test_policy_parity.py).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import gc
import getpass
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from functools import partial
from types import FrameType
from typing import Any, NoReturn

from IPython.core.error import StdinNotImplementedError
from IPython.core.profiledir import ProfileDir
from traitlets.config import Config

from ..confine.errors import ConfinementError
from ..confine.sequence import Channels, Confinement
from ..policy import SandboxPolicy, from_kernel_argv
from . import cell_warnings, figures, main_call, messages, oneshot_io, tools
from .lean_shell import Outbox, ZMQInteractiveShell, cell_compiler
from .runner import Runner

INLINE_BACKEND = "module://matplotlib_inline.backend_inline"  # as ipykernel's start-up sets it
# What a run's first time costs, paid in the zygote: compile, a cell with a value, a display,
# a main() call, an error (each silent: no caller exists yet).
WARM_UP: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("x = 1\nx + 1", None),
    ("from IPython.display import display\ndisplay({'text/plain': 'w'}, raw=True)", None),
    ("def main(a=1):\n    return {'a': a}", {}),
    ("raise ValueError('warm')", None),
)
REFUSED_PIP = ("%pip cannot run in a one-shot run: its process ends with the run, so nothing "
               "it installed would be kept; install into the runtime, or use a session")


def run_on_a_loop(coroutine: Any, close: bool = True) -> Any:
    """Run coroutine on an event loop of its own, leaving SIGINT to the code it runs: an
    interrupt is a KeyboardInterrupt in the cell (an awaiting cell's is a cancellation:
    `cancel_on_sigint`), as in a kernel; asyncio.run would cancel the whole request instead.
    close=False: the process ends after this run (`os._exit`, which runs no finalizer): the
    loop is left as it is, as closing it would leave it for nobody (its tasks are dropped
    either way; its executor's threads end with the process)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coroutine)
    finally:
        if close:
            asyncio.set_event_loop(None)
            loop.close()


def new_uuid4() -> str:
    """str(uuid.uuid4()), without running uuid.UUID's constructor in each pooled process."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _no_stdin(*_: Any, **__: Any) -> str:
    """input() in a one-shot run: there is no stdin channel (as a kernel without one says)."""
    raise StdinNotImplementedError(
        "raw_input was called, but this frontend does not support input requests.")


def _no_getpass(*_: Any, **__: Any) -> str:
    raise StdinNotImplementedError(
        "getpass was called, but this frontend does not support input requests.")


class LeanOneShot:
    """One pool's lean one-shot process: built in its zygote, then one request per fork."""

    def __init__(self, policy: SandboxPolicy) -> None:
        self.policy = policy
        self.launcher_stderr = os.dup(2)  # the server's log, for refuse_to_start
        self.server_pid = os.getppid()
        self.built_by = os.getpid()  # the pool's zygote
        self.ident = str(uuid.uuid4())
        self.messages = messages.Messages()
        self.channel = oneshot_io.Channel()
        self.outbox = Outbox(self.messages, self.channel, self.ident)
        self.streams = [oneshot_io.CapturedStream(self.channel, self.messages, name, fd)
                        for name, fd in (("stdout", 1), ("stderr", 2))]
        sys.stdout, sys.stderr = self.streams  # as a kernel's: output becomes messages
        self.shell = self._build_shell()
        self.compiler = cell_compiler()
        self.runner = Runner(self.shell, policy, is_user_frame=self.is_cell_frame,
                             publish_result=self.publish_result,
                             cancel_on_sigint=self.cancel_on_sigint, session=self.messages,
                             tool_transport=self.tool_transport)
        self.confinement: Confinement | None = None
        self.not_granted = ""
        self._sandbox_info: dict[str, Any] | None = {}  # None once confined: made when read
        # get_ipython().kernel: this process, as a kernel's shell names its kernel (its
        # session, parent request, tool transport and sandbox_info, as a kernel's are named)
        self.shell.kernel = self

    def _build_shell(self) -> ZMQInteractiveShell:
        """The shell, as a kernel builds it (history in memory, ipykernel's compiler), in a
        temporary IPython dir each pooled process replaces with its scratch's (renew)."""
        home = tempfile.mkdtemp(prefix="sandbox-kernel-lean-")
        try:
            shell = ZMQInteractiveShell.instance(
                config=Config({"HistoryManager": {"hist_file": ":memory:"}}),
                ipython_dir=home, profile_dir=ProfileDir(location=os.path.join(home, "profile")),
                compiler_class=cell_compiler().XCachingCompiler)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        shell.attach(self.outbox)
        assert shell.extension_manager is not None and shell.payload_manager is not None
        shell.extension_manager.load_extension("storemagic")  # IPython's, as a kernel loads it
        main_call.load_ipython_extension(shell)  # the %main magic
        cell_warnings.load_ipython_extension(shell)  # "Cell In[N], line L: UserWarning"
        figures.load_ipython_extension(shell)  # Agg's figures shown, not lost
        shell.register_magic_function(self.refuse_pip, "line", "pip")  # type: ignore[arg-type]
        return shell

    @staticmethod
    def refuse_pip(line: str) -> None:
        """%pip: refused with the reason (an install would end with the process)."""
        from IPython.core.error import UsageError

        raise UsageError(REFUSED_PIP)

    # --- what the runner needs of the transport ----------------------------------------------

    def is_cell_frame(self, frame: FrameType) -> bool:
        """Whether frame runs code the user sent (a cell's file, as ipykernel names it)."""
        return frame.f_code.co_filename.startswith(self.compiler.get_tmp_directory())

    def publish_result(self, content: bytes) -> None:
        """A main() result's execute_result (its content packed already: main_call.py): the
        run's user code is over, its last records go out together (Channel.hold)."""
        self.channel.hold()
        self.messages.send(self.channel, "execute_result", content,  # type: ignore[arg-type]
                           parent=self.outbox.parent, ident=self.outbox.topic("execute_result"))

    @contextlib.contextmanager
    def cancel_on_sigint(self, future: asyncio.Future[Any]) -> Iterator[None]:
        """An interrupt cancels the awaited coroutine instead of stopping the loop."""
        loop = asyncio.get_running_loop()

        def cancel(*_: Any) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.cancel())

        saved = signal.signal(signal.SIGINT, cancel)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, saved)

    def tool_transport(self) -> tools.Transport:
        """Tool calls travel on the run's one connection (there is no stdin channel)."""
        return tools.RecordTransport(self.messages, self.channel)

    @property
    def session(self) -> messages.Messages:
        """The message builder (a kernel's Session, by name)."""
        return self.messages

    @property
    def iopub_socket(self) -> oneshot_io.Channel:
        """Where IOPub messages go (a kernel's IOPub socket, by name): the one connection.
        What is sent here passes no cap of the kernel's; the caller caps it (its output cap)."""
        return self.channel

    @property
    def sandbox_info(self) -> dict[str, Any]:
        """The policy and layers, once confined (a kernel's kernel_info `sandbox`): made when
        first read, from what they are then (nothing changes them once user code runs); {}
        before."""
        if self._sandbox_info is None:
            assert self.confinement is not None
            self._sandbox_info = self.confinement.info()
        return self._sandbox_info

    @sandbox_info.setter
    def sandbox_info(self, info: dict[str, Any]) -> None:
        self._sandbox_info = info

    def get_parent(self) -> dict[str, Any]:
        """The request being answered (a kernel's get_parent)."""
        return self.outbox.parent

    # --- in the zygote ------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Run WARM_UP silently: compiler, shell, display, main() and error paths warmed once
        per pool; nothing is sent (no caller), and no trace is left (runner's warm-up)."""
        namespace = dict(self.shell.user_ns)  # put back after: the warm-up's names go
        for code, inputs in WARM_UP:
            metadata: dict[str, Any] = {"sandbox": {"warm_up": True}}
            if inputs is not None:
                metadata["sandbox"]["inputs"] = inputs
            request = self.messages.msg("execute_request", {"code": code, "silent": True},
                                        metadata=metadata)
            run_on_a_loop(self.execute(request))
        self.shell.user_ns.clear()
        self.shell.user_ns.update(namespace)
        self.shell.execution_count = 1

    # --- in each pooled process ---------------------------------------------------------------

    def confine(self) -> None:
        """Every layer, per process, in oneshot.py's order (kernel/app.py's)."""
        os.environ.setdefault("MPLBACKEND", INLINE_BACKEND)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the caller's interrupt
        try:
            self.confinement = Confinement(self.policy, Channels(), oneshot_io.kernel_id())
            self.confinement.before_threads()
            self.not_granted = oneshot_io.cwd_refusal(self.confinement.layers)
            oneshot_io.capture_fds(self.channel)
            self.renew()
            self.confinement.switch_user()
            if not oneshot_io.die_with_server(self.server_pid):
                self.refuse_to_start("the fork server that started this one-shot process "
                                     "is gone")
            self.confinement.finish()
        except ConfinementError as exc:  # every layer's failure: the error names the fix
            self.refuse_to_start(exc.refusal())
        self.hand_to_user_code()

    def renew(self) -> None:
        """What the zygote built that is per process: ids, usage, the shell's directories
        (lean_shell's `relocate`: its IPython and profile dirs made in the scratch; its
        namespaces are the zygote's clean ones, forked)."""
        self.ident = self.outbox.ident = new_uuid4()
        self.messages.renew()
        self.runner.renew()
        self.shell.relocate()
        session_name = os.environ.get("JPY_SESSION_NAME")
        if session_name:
            self.shell.user_ns["__session__"] = session_name

    def hand_to_user_code(self) -> None:
        """Confined: the log dup closed, the refusals explained and counted; user code next."""
        confinement = self.confinement
        assert confinement is not None
        os.close(self.launcher_stderr)
        self.launcher_stderr = 2
        confinement.hand_to_user_code()
        self.runner.file_access = confinement.file_access
        self.runner.usage.refusals = confinement.refusals
        self._sandbox_info = None  # sandbox_info: made when first read
        # tempfile's folder, as its first use would find it: TMPDIR, the scratch (unless the
        # policy's environment named another), which user code's uid may write. Its check, a
        # file written and removed there, was every run's (the cell compiler names cells in it).
        scratch_dir = confinement.layers["scratch"]["path"]
        if os.environ.get("TMPDIR") == scratch_dir:
            tempfile.tempdir = os.path.abspath(scratch_dir)

    def serve_one(self, listener: socket.socket, taken: int, server_uid: int) -> NoReturn:
        """Take exactly one connection, run its request, answer and exit."""
        conn = oneshot_io.take_connection(listener, taken, server_uid)
        self.channel.conn = conn
        frames = oneshot_io.receive_request(conn, self.not_granted)
        for stream in self.streams:  # what the start wrote to the fds is not output
            stream.read_to = os.fstat(stream.fd).st_size
        try:
            idents, parts = messages.split_identities(frames)
            request = messages.deserialize(parts)
        except (ValueError, TypeError, KeyError) as exc:
            oneshot_io.refuse_request(conn, f"the request could not be read: {exc}")
        try:
            run_on_a_loop(self.execute(request, idents), close=False)  # the process ends next
        except OSError:
            os._exit(0)  # the caller left: nobody to answer
        oneshot_io.finish_run(self.channel, conn, request)

    def refuse_to_start(self, reason: str) -> NoReturn:
        """Before any request: one line in the server's log, and exit."""
        os.write(self.launcher_stderr, f"sandbox-kernel: refusing to start: "
                                       f"{reason}\n".encode())
        os._exit(3)

    # --- the request --------------------------------------------------------------------------

    async def execute(self, request: dict[str, Any], idents: list[bytes] | None = None) -> None:
        """An execute_request, answered as a kernel answers it: status busy, the run's
        messages, execute_reply (usage in its metadata), status idle."""
        self.outbox.parent = request
        for stream in self.streams:
            stream.set_parent(request)
        content = request["content"]
        code, silent = content["code"], bool(content.get("silent", False))
        store_history = content.get("store_history", not silent)
        self.outbox.send("status", {"execution_state": "busy"}, "status")
        metadata = {"started": datetime.now(timezone.utc), "dependencies_met": True,
                    "engine": self.ident}
        self.runner.usage.start()
        run_cell = partial(self.run_cell, code, silent, content.get("user_expressions") or {})
        reply = await self.runner.execute(run_cell, code, request, silent=silent,
                                          store_history=store_history)
        self.channel.hold()  # user code is over: the rest goes out with DONE (finish_run)
        for stream in self.streams:
            stream.flush()
        metadata["status"] = reply["status"]
        if reply["status"] == "error" and reply.get("ename") == "UnmetDependency":
            metadata["dependencies_met"] = False
        metadata["sandbox"] = {"usage": self.runner.usage.report()}
        self.messages.send(self.channel, "execute_reply", reply, parent=request,
                           ident=idents or [], metadata=metadata)
        self.outbox.send("status", {"execution_state": "idle"}, "status")

    async def run_cell(self, code: str, silent: bool, user_expressions: dict[str, Any],
                       store_history: bool) -> dict[str, Any]:
        """Run the cell on the shell (as a coroutine when it awaits at top level); the
        execute_reply's content, as ipykernel's do_execute makes it."""
        shell = self.shell
        saved_input, saved_getpass = builtins.input, getpass.getpass
        builtins.input, getpass.getpass = _no_stdin, _no_getpass
        try:
            try:
                transformed, failed = shell.transform_cell(code), None
            except Exception:
                transformed, failed = code, sys.exc_info()
            if shell.should_run_async(code, transformed_cell=transformed,
                                      preprocessing_exc_tuple=failed):
                result = await self._run_async(code, silent, store_history, transformed, failed)
            else:
                result = shell.run_cell(code, store_history=store_history, silent=silent)
        finally:
            builtins.input, getpass.getpass = saved_input, saved_getpass
        return self.reply_content(result, user_expressions)

    async def _run_async(self, code: str, silent: bool, store_history: bool,
                         transformed: str, failed: Any) -> Any:
        shell = self.shell
        future = asyncio.ensure_future(shell.run_cell_async(
            code, store_history=store_history, silent=silent, transformed_cell=transformed,
            preprocessing_exc_tuple=failed))
        result = None
        with self.cancel_on_sigint(future):
            try:
                result = await future
            finally:
                shell.events.trigger("post_execute")
                if not silent:
                    shell.events.trigger("post_run_cell", result)
        return result

    def reply_content(self, result: Any, user_expressions: dict[str, Any]) -> dict[str, Any]:
        """The execute_reply's content for a run's ExecutionResult."""
        shell = self.shell
        error = result.error_before_exec if result.error_before_exec is not None \
            else result.error_in_exec
        reply: dict[str, Any] = {}
        if result.success and not getattr(shell, "_last_traceback_during_displayhook", False):
            reply["status"] = "ok"
        else:
            reply.update(status="error", traceback=shell._last_traceback or [],
                         ename=str(type(error).__name__), evalue=str(error),
                         engine_info={"engine_uuid": self.ident, "engine_id": -1,
                                      "method": "execute"})
        reply["execution_count"] = shell.execution_count - 1
        reply["user_expressions"] = shell.user_expressions(user_expressions) \
            if reply["status"] == "ok" else {}
        payloads = shell.payload_manager
        assert payloads is not None, "built with the shell"
        reply["payload"] = payloads.read_payload()
        payloads.clear_payload()
        return reply


PROCESS: LeanOneShot | None = None  # this process's, once built (as get_ipython().kernel is)


def build(argv: list[str]) -> LeanOneShot:
    """In a pool's lean zygote: the process, built and warmed, its objects frozen (never
    walked by a pooled process's collections, so never copied for it)."""
    global PROCESS
    gc.disable()
    try:
        PROCESS = LeanOneShot(from_kernel_argv(argv))
        PROCESS.warm_up()
        oneshot_io.warm_grants(PROCESS.policy)
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()
    return PROCESS
