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
import codecs
import ctypes
import io
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NoReturn

import zmq
from ipykernel.kernelapp import IPKernelApp
from IPython.paths import get_ipython_dir
from traitlets import Any as AnyTrait
from traitlets import Dict, Type

from ..confine import denials, paths, privileges
from ..confine.errors import ConfinementError
from . import file_ops, messages, peeking, tools  # file_ops: imported in the zygote
from . import oneshot_wire as wire
from .app import SandboxKernelApp, _kept_without_collection
from .budget import BUDGET
from .kernel import SandboxKernel

KEEP_INPUTS = ("path", "limit", "since", "embed", "budget")  # of a keep_files request
REQUEST_TIMEOUT = 10.0  # seconds a caller has to send its request once connected
FLUSH_AFTER = 0.05  # seconds between a stream's messages while output keeps coming
FLUSH_SIZE = 64 * 1024  # characters a stream keeps before sending them
_PR_SET_PDEATHSIG = 1


def _overflow_uid() -> int:
    """The uid a user namespace shows for a uid it does not map (read before confinement)."""
    try:
        with open("/proc/sys/kernel/overflowuid") as file:
            return int(file.read())
    except (OSError, ValueError):
        return 65534


OVERFLOW_UID = _overflow_uid()


def _uid_mapped(uid: int) -> bool:
    """Whether this process's user namespace maps the (outer) uid."""
    try:
        with open("/proc/self/uid_map") as file:
            ranges = [tuple(map(int, line.split())) for line in file if line.strip()]
    except (OSError, ValueError):
        return True  # cannot tell: only the exact uids are taken
    return any(outside <= uid < outside + count for _, outside, count in ranges)


def caller_allowed(peer_uid: int, server_uid: int) -> bool:
    """Whether a connection from peer_uid may bring this process its request: the server's
    user (or root). A kernel that made its network namespace inside a user namespace of its
    own (a container without CAP_SYS_ADMIN: confine/sequence.py enter_namespace) maps only its
    own uid, so SO_PEERCRED shows the server's uid as the overflow uid; that one is taken
    then, as only the server's user can reach the pool's socket (its owner-only runtime dir).
    """
    if peer_uid in (server_uid, 0):
        return True
    return peer_uid == OVERFLOW_UID and not _uid_mapped(server_uid)


class Channel:
    """The shell and IOPub sockets of a one-shot kernel: messages become records on one socket.

    ipykernel hands this object to Session.send as a socket; before a message that is not a
    stream's, the streams send what they hold, so output and displays keep their order.
    """

    def __init__(self) -> None:
        self.conn: socket.socket | None = None  # the caller's connection, once it came
        self.lock = threading.Lock()  # a record at a time: tool calls come from any thread
        self.streams: list[CapturedStream] = []
        self.sending_output = False  # a stream's own message is being sent

    def send_multipart(self, frames: list[Any], copy: bool = True, **_: Any) -> None:
        """Session.send's call: write the message's frames as one record."""
        if not self.sending_output:
            for stream in self.streams:
                stream.flush()
        self.write(wire.MESSAGE, wire.pack_frames([_as_bytes(frame) for frame in frames]))

    def write(self, kind: int, payload: bytes) -> None:
        """One record to the caller; nothing before it connected (no caller, no message)."""
        if self.conn is not None:
            with self.lock:
                self.conn.sendall(wire.record(kind, payload))

    def flush(self, *_: Any) -> None:
        """ZMQStream's flush: every record is written when it is sent."""


def _as_bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    return bytes(getattr(frame, "bytes", frame))  # a zmq.Frame's bytes, or a buffer's


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


class CapturedStream(io.TextIOBase):
    """sys.stdout or sys.stderr: text in stream messages, with what reached its fd.

    The fd (1 or 2) is a memfd; whatever was written to it (os.write, C code, a subprocess
    that cannot exist here) since the last look is taken in order before each Python write.
    Both go through the per-execution output budget, as CappedOutStream's writes do.
    """

    def __init__(self, channel: Channel, session: Any, name: str, fd: int) -> None:
        super().__init__()
        self.channel, self.session, self.name, self.fd = channel, session, name, fd
        self.parent: dict[str, Any] | None = None  # the request this output answers
        self.topic = f"stream.{name}".encode()
        self.pending: list[str] = []
        self.pending_size = 0
        self.sent_at = 0.0  # when this stream last sent a message
        self.read_to = 0  # bytes of the memfd already taken
        self.captured = False  # the fd is this process's memfd (not in the zygote: restart)
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        channel.streams.append(self)

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """Text goes out as UTF-8, as ipykernel's streams send it."""
        return "utf-8"

    def writable(self) -> bool:
        """Always: it is an output stream."""
        return True

    def isatty(self) -> bool:
        """Never a terminal (as in a notebook)."""
        return False

    def fileno(self) -> int:
        """The captured fd (1 or 2): what is written there is this stream's output too."""
        return self.fd

    def set_parent(self, parent: dict[str, Any]) -> None:
        """ipykernel's hook: the request this output answers."""
        self.parent = parent

    def restart(self) -> None:
        """In a pooled process: nothing kept or read yet of its own fd (a new memfd)."""
        self.pending, self.pending_size, self.sent_at, self.read_to = [], 0, 0.0, 0
        self.decoder.reset()
        self.captured = True

    def write(self, string: str) -> int:  # type: ignore[override]
        """Keep what the output budget allows, after what reached the fd meanwhile."""
        if not isinstance(string, str):
            raise TypeError(f"write() argument must be str, not {type(string).__name__}")
        self.take_fd_output()
        self._keep(BUDGET.take(string))
        return len(string)

    def write_uncapped(self, string: str) -> None:
        """Write past the cap (for the sandbox's own marker)."""
        self.take_fd_output()
        self._keep(string)

    def _keep(self, text: str) -> None:
        if not text:
            return
        for other in self.channel.streams:  # the other stream's text first: write order
            if other is not self and other.pending:
                other.flush()
        self.pending.append(text)
        self.pending_size += len(text)
        # A line goes out at once unless a message went out just now (a flood is batched);
        # what is kept goes out with the next write, message or the reply.
        if self.pending_size >= FLUSH_SIZE or (
                "\n" in text and time.monotonic() - self.sent_at >= FLUSH_AFTER):
            self.flush()

    def take_fd_output(self) -> None:
        """Add what was written to the fd since the last look (spending the budget)."""
        if not self.captured:
            return
        try:
            size = os.fstat(self.fd).st_size
        except OSError:
            return
        while self.read_to < size:
            data = os.pread(self.fd, min(size - self.read_to, 1 << 20), self.read_to)
            if not data:
                break
            self.read_to += len(data)
            self._keep(BUDGET.take(self.decoder.decode(data)))

    def flush(self) -> None:
        """Send what is kept (and what reached the fd) as one stream message."""
        self.take_fd_output()
        if not self.pending:
            return
        text, self.pending, self.pending_size = "".join(self.pending), [], 0
        self.sent_at = time.monotonic()
        self.channel.sending_output = True  # this message needs no streams flushed first
        try:
            self.session.send(self.channel, "stream", {"name": self.name, "text": text},
                              parent=self.parent, ident=self.topic)
        finally:
            self.channel.sending_output = False


class _Discarded(io.TextIOBase):
    """Where the application's log goes once fd 2 is the user's: nowhere, through no fd (a
    pooled process closes every descriptor it did not make or keep itself)."""

    def writable(self) -> bool:
        """Always: everything written is dropped."""
        return True

    def write(self, text: str) -> int:  # type: ignore[override]
        """Drop the text."""
        return len(text)


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
        cwd = self.layers["cwd"]
        if cwd["refused"]:
            self.not_granted = paths.cwd_not_granted(cwd["mode"], cwd["refused"])

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
                handler.setStream(_Discarded())
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
        for fd, name in ((1, "stdout"), (2, "stderr")):
            memfd = os.memfd_create(f"one-shot {name}")
            os.dup2(memfd, fd)
            os.close(memfd)
        for stream in self.channel.streams:
            stream.restart()

    def finish_confinement(self) -> None:
        """The uid switch; then die with the fork server while waiting (set after the switch,
        which clears it); then filter.

        A pooled process waits for a request its server answers for; with the server gone
        (retired, stopped, killed) nobody will hand it one. A process that took its request no
        longer needs the server (take_connection).
        """
        assert self.confinement is not None
        self.confinement.switch_user()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 \
                or os.getppid() != self.server_pid:
            self.refuse_to_start("the fork server that started this one-shot kernel is gone")
        self.confinement.finish()  # nothing binds later: no wait before the filter

    @property
    def kernel_id(self) -> str:
        """The id the audit record names: the process's pid (there is no connection file)."""
        return f"one-shot-{os.getpid()}"

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
        """Work out in the zygote, once, what every pooled process's confinement works out
        alike from the host's paths (cached for the processes it forks, as a fork server
        caches them for its kernels): the interpreter's paths its uid must reach, the
        system's read-only grants, their real paths. The grants are still checked, and each
        layer applied, in each process."""
        privileges.interpreter_needs()
        try:
            read_only = paths.read_only(paths.check_grants(self.policy.read_paths))
        except (OSError, ValueError):
            return  # a grant that is missing refuses each process's start, as without this
        denials.FileAccess.granted(read_only, paths.read_write((), ""), "", "")

    def serve_one(self, listener: socket.socket, taken: int, server_uid: int) -> NoReturn:
        """Take exactly one connection, run its request, answer and exit."""
        conn = self.take_connection(listener, taken, server_uid)
        self.channel.conn = conn
        try:
            pidfd = os.pidfd_open(os.getpid())
            try:
                socket.send_fds(conn, [wire.record(wire.PID, str(os.getpid()).encode())],
                                [pidfd])
            finally:
                os.close(pidfd)
            frames = self.read_request(conn)
        except (OSError, wire.WireError) as exc:
            self.refuse_request(conn, f"the request could not be read: {exc}")
        except MemoryError:
            self.refuse_request(conn, "the kernel's memory limit leaves no room to read the "
                                "request: raise --memory-limit")
        if self.not_granted:  # read first: a caller still sending would miss the answer
            self.refuse_request(conn, self.not_granted)
        for stream in self.channel.streams:  # what the start wrote to the fds is not output
            stream.read_to = os.fstat(stream.fd).st_size
        try:
            asyncio.run(self.kernel.dispatch_shell(frames))
            for stream in self.channel.streams:
                stream.flush()
            self.send_written_files()
            self.channel.write(wire.DONE, b"")
            # Until the caller hangs up (it kills this process then): it reads the host's
            # figures of the run from /proc meanwhile, as it does for a ZMQ kernel.
            conn.settimeout(REQUEST_TIMEOUT)
            conn.recv(1)
        except OSError:
            pass  # the caller left: nobody to answer
        os._exit(0)

    def send_written_files(self) -> None:
        """The files the run wrote, if the request asked to keep them: this scratch ends with
        the process, where a ZMQ kernel's caller asks for them in further runs. Listed and
        read by the code those runs send (kernel/file_ops.py), in this process, after
        the run: what user code could reach, and no more trusted than its output."""
        sandbox = self.kernel.request.get("metadata", {}).get("sandbox")
        asked = sandbox.get("keep_files") if isinstance(sandbox, dict) else None
        if not isinstance(asked, dict):
            return
        inputs = {key: asked[key] for key in KEEP_INPUTS if key in asked}
        try:
            kept = json.dumps(_file_op()("keep", **inputs))
        except Exception as exc:  # the caller is told; the run stands
            kept = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        self.channel.write(wire.FILES, kept.encode())

    def take_connection(self, listener: socket.socket, taken: int,
                        server_uid: int) -> socket.socket:
        """The first connection from the server's user; the listener closed after it."""
        while True:
            conn, _ = listener.accept()
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if caller_allowed(uid, server_uid):
                break
            conn.close()  # another user's connection: never this process's request
        # The run is the caller's now and outlives the server (its companion serves it on):
        # one killed mid-run takes with it only the processes still waiting. Killed before
        # this line, the process hangs up before its pid record, and the caller asks again.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
        listener.close()
        try:
            os.write(taken, b"+")  # the server starts this one's successor now
        finally:
            os.close(taken)
        return conn

    @staticmethod
    def read_request(conn: socket.socket) -> list[zmq.Frame]:
        """The execute_request's frames, read by this process itself (never by the server)."""
        conn.settimeout(REQUEST_TIMEOUT)
        records = wire.Records(wire.MAX_REQUEST)
        while True:
            data = conn.recv(1 << 16)
            if not data:
                raise wire.WireError("the caller hung up before its request was complete")
            for kind, payload in records.feed(data):
                if kind != wire.REQUEST:
                    raise wire.WireError(f"expected a request record, got kind {kind}")
                conn.settimeout(None)
                return [zmq.Frame(bytes(frame)) for frame in wire.unpack_frames(payload)]

    def refuse_request(self, conn: socket.socket, reason: str) -> NoReturn:
        """Tell the caller why nothing ran, and exit."""
        try:
            conn.sendall(wire.record(wire.REFUSED, reason.encode()))
        except OSError:
            pass
        os._exit(4)

    def refuse_to_start(self, reason: str) -> NoReturn:
        """Before any request: one line in the server's log, and exit."""
        os.write(self.launcher_stderr, f"sandbox-kernel: refusing to start: "
                                       f"{reason}\n".encode())
        os._exit(3)


def _file_op() -> Any:
    """The file operations' function: the kernel's own module, which a ZMQ kernel is sent as
    text by its client (a module attribute, so a test can stand in for it)."""
    return file_ops.__sandbox_files__


def build(argv: list[str]) -> OneShotKernelApp:
    """In a pool's zygote (launch/forkserver/zygote.py): the application, built and warmed."""
    app = OneShotKernelApp.instance()
    app.initialize(argv)
    return app
