"""The one-shot kernel: SandboxKernel with its channels replaced by one socket, for one run.

A stateless run needs one execution and none of a Jupyter kernel's transport: no five ZMQ
sockets, no IOPub, control, heartbeat or shell-channel thread, no connection file. Everything
else is the sandbox kernel's, unchanged: the confinement (confine/sequence.py: every layer,
by the same procedure as a ZMQ kernel's, in the same order: scratch, audit file, identity,
rlimits, network namespace with the egress listener handed out, promises, Landlock, uid
switch, seccomp with its listener handed out), the prebuilt IPython shell, and
`SandboxKernel`'s execution path (main(), caps, explained refusals, the deadline, usage).
This module holds every difference:

- the channels: `Channel` stands for the shell and IOPub sockets; each message ipykernel sends
  is written, as the frames Session.serialize made, in one record on the connection
  (kernel/oneshot_wire.py). So the caller gets the same Jupyter messages, in order.
- the output streams: `CapturedStream` replaces ipykernel's OutStream and its thread; fds 1
  and 2 are memfds, drained into the stream messages at each write and before any other
  message, so `os.write(1, ...)` and C libraries' output count as a ZMQ kernel's captured fds
  do. The output cap (kernel/output.py's budget) is spent on both.
- the companion: the descriptors a kernel hands its reaper (uid lock, seccomp listener, audit
  file, egress listener) go to the fork server's companion (confine/companion.py) instead.
- Landlock binds no port at all: there are no listeners to bind.
- the start: the application, kernel and shell are built and warmed once per pool, in the
  pool's zygote (launch/forkserver/zygote.py), before any request exists and unconfined, as
  every kernel's start-up is until init_confinement. Each pooled process is a fork of it that
  makes its per-process parts (scratch, profile dir, ids, namespace, history, memfds) and
  applies every layer itself (`confine`: the same functions in the same order), then waits.
- the tool bridge (kernel/tools.py): a tool call goes out as a message record, its answer
  comes back as a TOOL_REPLY record on the same connection (there is no stdin channel).
- the request: the process is confined *before* a request exists (a pool keeps it waiting,
  launch/forkserver/pools.py); it accepts exactly one connection, closes the listener, reads
  the request itself, runs it, and exits.

A one-shot kernel has no stdin (input() raises), no comms (widgets), no control channel (its
caller interrupts it with SIGINT, as a kernelspec's interrupt_mode "signal" does) and no second
execution: callers that need those start a ZMQ kernel.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import uuid
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NoReturn

import zmq
from ipykernel.kernelapp import IPKernelApp
from IPython.paths import get_ipython_dir
from traitlets import Any as AnyTrait
from traitlets import Dict, Type

from ..confine.errors import ConfinementError
from . import messages, oneshot_io, peeking, tools
from .app import SandboxKernelApp, _kept_without_collection
from .kernel import SandboxKernel
from .oneshot_io import CapturedStream, Channel, Discarded, caller_allowed  # noqa: F401


class ChannelSession(peeking.PeekingSession):
    """The one-shot kernel's Session: its messages built by kernel/messages.py, unsigned.

    ipykernel, IPython's display hooks and the streams send through Session.send, which builds
    with `msg` and frames with `serialize`: here both are the message builder's, the same
    shapes and bytes without jupyter_client (as the lean one-shot process builds them)."""

    def msg(self, msg_type: str, content: dict[str, Any] | None = None,
            parent: dict[str, Any] | None = None, header: dict[str, Any] | None = None,
            metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """Session.msg, by the builder; ids from this session's count, as before."""
        head = messages.header(self.msg_id, msg_type, self.username, self.session) \
            if header is None else header
        return messages.message(head, content, parent, {**self.metadata, **(metadata or {})})

    def serialize(self, msg: dict[str, Any], ident: Any = None) -> list[bytes]:
        """Session.serialize with key b"", by the builder: a one-shot signs nothing."""
        if self.auth is not None:
            raise ValueError("a one-shot kernel's messages are unsigned (its key is b\"\")")
        return messages.serialize(msg, ident)


class OneShotKernel(SandboxKernel):
    """SandboxKernel whose shell stream is the one-shot channel (not a ZMQStream)."""

    session_class = ChannelSession

    request = Dict(help="The one request, as ipykernel parsed it (kept by set_parent).")
    shell_stream = AnyTrait(allow_none=True)  # type: ignore[assignment]
    control_stream = AnyTrait(allow_none=True)  # type: ignore[assignment]
    debugpy_stream = AnyTrait(allow_none=True)  # type: ignore[assignment]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # ipykernel pauses before each reply so that output on IOPub, which races the reply on
        # the shell channel, arrives first; here every message goes out in order on one
        # connection, and the pause (about 1 ms slept) was only latency.
        self._cell_pause = 0.0

    def _publish_execute_input(self, code: str, parent: dict[str, Any],
                               execution_count: int) -> None:
        # IOPub echoes the code to every client of a kernel; this one's only caller sent it.
        return

    def tool_transport(self) -> tools.Transport:
        """Tool calls travel on the run's one connection (no stdin channel here)."""
        return tools.RecordTransport(self.session, self.shell_stream)

    def renew(self) -> None:
        """In a pooled process: make again what the zygote built that is per process.

        Its ids (kernel, session; the message count), usage figures (rusage restarts at the
        fork), and the shell's per-process parts (prebuilt.py's `renew`: IPython and profile
        dirs, working and home dirs, namespaces, history, display hook, rebound here as
        IPythonKernel binds it). What the shell's classes, magics and hooks are stays built.
        """
        self.ident = str(uuid.uuid4())
        session = self.session
        assert session is not None, "the application gives the kernel its session"
        session.session = messages.new_id()
        session.pid = os.getpid()  # Session.send refuses to send from "a fork" otherwise
        session.message_count = 0
        self.runner.renew()
        shell = self.shell
        # The zygote's history in memory holds nothing (its warm-up stores none): a new session
        # on it, not a new database (3 ms). One in a file is never shared with a fork.
        in_memory = shell.history_manager.hist_file == ":memory:"  # type: ignore[union-attr]
        shell.renew(self.profile_dir, self.user_module, self.user_ns,  # type: ignore[union-attr]
                    history="reset" if in_memory else "new")
        hook = shell.displayhook  # type: ignore[union-attr]
        hook.session, hook.pub_socket = self.session, self.iopub_socket
        hook.topic = self._topic("execute_result")
        session_name = os.environ.get("JPY_SESSION_NAME")
        if session_name:
            shell.user_ns["__session__"] = session_name  # type: ignore[union-attr]

    def set_parent(self, ident: Any, parent: Any, channel: str = "shell") -> None:
        """ipykernel's, keeping the request too: read after the run, outside the context
        ipykernel keeps it in (OneShotKernelApp.send_written_files)."""
        super().set_parent(ident, parent, channel)
        if channel == "shell":
            self.request = parent

    def _abort_queues(self, subshell_id: str | None = None) -> None:
        # After an error ipykernel aborts the requests queued behind it: a one-shot has none.
        return


class OneShotKernelApp(SandboxKernelApp):
    """SandboxKernelApp without ZMQ: confined the same way, serving one request on one socket."""

    kernel_class = Type(OneShotKernel, klass="ipykernel.kernelbase.Kernel",  # type: ignore
                        help="The kernel class to run.").tag(config=True)
    channel: Channel
    server_pid = 0  # the fork server: this process dies with it while it waits
    pooled = False  # a pooled process (confine ran), not the zygote
    built_by = 0  # the pid of the process that built this application: the pool's zygote
    start_up_env: Mapping[str, str] = MappingProxyType({})  # what ipykernel's start-up set
    not_granted = ""  # why the folder --grant-cwd asks for was refused (each request is)

    def initialize(self, argv: Any = None) -> None:
        """In the pool's zygote: the application, the kernel and its shell, built and warmed.

        ipykernel's start-up without SandboxKernelApp's confinement: that is every pooled
        process's own (`confine`), as the scratch, uid, namespace and filters are. Nothing of
        any request exists yet; no code but the sandbox's runs here: IPython extensions and
        the operator's startup code wait for `confine`.
        """
        self.launcher_stderr = os.dup(2)  # the server's log, for refuse_to_start
        self.server_pid, self.built_by = os.getppid(), os.getpid()
        before = dict(os.environ)
        with _kept_without_collection():  # frozen: no pooled process's collection walks it
            IPKernelApp.initialize(self, argv)
            self.start_up_env = {name: value for name, value in os.environ.items()
                                 if before.get(name) != value}
            self.warm_up()
            self.warm_grants()

    def confine(self) -> None:
        """In a pooled process forked from the zygote: every layer, per process.

        kernel/app.py's order (confine/sequence.py's Confinement): init_confinement (scratch,
        audit, identity, rlimits, network namespace and egress listener, promises, Landlock)
        while single-threaded, the parts of the kernel that are per process (a profile dir in
        the scratch, the captured fds, the kernel's renew, IPython extensions and the
        operator's startup code, all as a kernel makes them after init_confinement), then the
        uid switch and seccomp, then user code's environment.
        """
        self.pooled = True
        for name, value in self.start_up_env.items():  # e.g. ipykernel's MPLBACKEND: the
            os.environ.setdefault(name, value)  # pooled process's environment is made anew
        try:
            with _kept_without_collection():
                self.ipython_dir = get_ipython_dir()  # the scratch's (IPYTHONDIR)
                self.profile_dir = None  # the zygote's (in a directory removed since)
                self.init_profile_dir()
                self.init_confinement()
                self.note_cwd_refusal()
                self.capture_fds()
                self.kernel.profile_dir = self.profile_dir
                self.kernel.renew()
                self.init_extensions()
                self.init_code()
                self.finish_confinement()
        except ConfinementError as exc:  # every layer's failure: the error names the fix
            self.refuse_to_start(exc.refusal())
        self.hand_to_user_code()

    def note_cwd_refusal(self) -> None:
        """A one-shot's caller sees no banner: a refused --grant-cwd refuses its request."""
        self.not_granted = oneshot_io.cwd_refusal(self.layers)

    # --- the transport: no connection file, sockets, heartbeat or poller --------------------------

    def init_connection_file(self) -> None:
        """No connection file: the caller connects to the pool's socket."""

    def channel_files(self) -> list[str]:
        """No connection file to read."""
        return []

    def channel_ports(self) -> dict[str, int]:
        """No channel binds a port: Landlock then lets no TCP port be bound at all."""
        return {}

    def init_poller(self) -> None:
        """No parent to poll: the fork server and the caller's pidfd watch this process."""

    def init_sockets(self) -> None:
        """The channel; there are no sockets to bind (each pooled process confines itself)."""
        self.session.key = b""  # one private connection: nothing to sign against
        self.channel = Channel()
        self.iopub_socket = self.channel
        self.iopub_thread = None
        self.stdin_socket = None

    def init_heartbeat(self) -> None:
        """No heartbeat: the caller watches the process through its pidfd."""

    def write_connection_file(self, **kwargs: Any) -> None:
        """No connection file."""

    def log_connection_info(self) -> None:
        """No ports to tell."""

    def init_io(self) -> None:
        """sys.stdout and sys.stderr: the streams that drain fds 1 and 2 (capture_fds).

        The application's log stops here: fd 2 becomes the user's stderr, and the server's
        log (kept for a refusal to start) is closed before user code runs.
        """
        for handler in self.log.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(Discarded())
        sys.stdout = CapturedStream(self.channel, self.session, "stdout", 1)
        sys.stderr = CapturedStream(self.channel, self.session, "stderr", 2)
        from ipykernel.displayhook import ZMQDisplayHook

        self.displayhook = ZMQDisplayHook(self.session, self.iopub_socket)
        sys.displayhook = self.displayhook
        self.patch_io()

    def init_kernel(self) -> None:
        """The kernel, on the channel: no control or shell-channel threads to start."""
        if "hist_file" not in self.config.HistoryManager:
            self.config.HistoryManager.hist_file = ":memory:"
        self.kernel = self.kernel_class.instance(  # type: ignore[attr-defined]
            parent=self, session=self.session, shell_stream=self.channel,
            control_stream=None, debugpy_stream=None, iopub_socket=self.channel,
            iopub_thread=None, stdin_socket=None, log=self.log, profile_dir=self.profile_dir,
            user_ns=self.user_ns)
        self.displayhook.get_execution_count = lambda: self.kernel.execution_count

    def init_extensions(self) -> None:
        """The operator's IPython extensions load in a pooled process only: their code runs
        where a kernel's does, after init_confinement, never in the zygote. IPython's own
        (storemagic) loads in the zygote, once; a pooled process finds it loaded."""
        if self.pooled:
            super().init_extensions()
            return
        for name in self.default_extensions:
            self.shell.extension_manager.load_extension(name)  # type: ignore[union-attr]

    def init_code(self) -> None:
        """The operator's startup code, in a pooled process only (never in the zygote)."""
        if self.pooled:
            super().init_code()

    def capture_fds(self) -> None:
        """fds 1 and 2 become memfds of this process, for its streams to drain."""
        oneshot_io.capture_fds(self.channel)

    def finish_confinement(self) -> None:
        """The uid switch; then die with the fork server while waiting (set after the switch,
        which clears it); then filter.

        A pooled process waits for a request its server answers for; with the server gone
        (retired, stopped, killed) nobody will hand it one. A process that took its request no
        longer needs the server (take_connection).
        """
        assert self.confinement is not None
        self.confinement.switch_user()
        if not oneshot_io.die_with_server(self.server_pid):
            self.refuse_to_start("the fork server that started this one-shot kernel is gone")
        self.confinement.finish()  # nothing binds later: no wait before the filter

    @property
    def kernel_id(self) -> str:
        """The id the audit record names: the process's pid (there is no connection file)."""
        return oneshot_io.kernel_id()

    # --- the one request ----------------------------------------------------------------------

    def warm_up(self) -> None:
        """Take the execute path once, silently, in the zygote: the run's first-time costs
        are paid once per pool, and every pooled process is forked warm.

        The warm-up is a client's (`Sandbox.warm_up`): a silent `pass` that leaves no history,
        execution count or last result (kernel.py); nothing is sent, there is no caller yet.
        """
        msg = self.session.msg("execute_request", {
            "code": "pass", "silent": True, "store_history": False, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": False})
        msg["metadata"]["sandbox"] = {"warm_up": True}
        asyncio.run(self.kernel.dispatch_shell(
            [zmq.Frame(frame) for frame in self.session.serialize(msg)]))

    def warm_grants(self) -> None:
        """The grants' work every pooled process repeats alike, once (oneshot_io.warm_grants)."""
        oneshot_io.warm_grants(self.policy)

    def serve_one(self, listener: socket.socket, taken: int, server_uid: int) -> NoReturn:
        """Take exactly one connection, run its request, answer and exit."""
        conn = oneshot_io.take_connection(listener, taken, server_uid)
        self.channel.conn = conn
        frames = oneshot_io.receive_request(conn, self.not_granted)
        for stream in self.channel.streams:  # what the start wrote to the fds is not output
            stream.read_to = os.fstat(stream.fd).st_size
        try:
            asyncio.run(self.kernel.dispatch_shell([zmq.Frame(frame) for frame in frames]))
        except OSError:
            os._exit(0)  # the caller left: nobody to answer
        oneshot_io.finish_run(self.channel, conn, self.kernel.request)

    def refuse_to_start(self, reason: str) -> NoReturn:
        """Before any request: one line in the server's log, and exit."""
        os.write(self.launcher_stderr, f"sandbox-kernel: refusing to start: "
                                       f"{reason}\n".encode())
        os._exit(3)


def build(argv: list[str]) -> OneShotKernelApp:
    """In a pool's zygote (launch/forkserver/zygote.py): the application, built and warmed."""
    app = OneShotKernelApp.instance()
    app.initialize(argv)
    return app
