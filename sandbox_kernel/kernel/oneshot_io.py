"""What both one-shot processes share: the channel, the captured streams and the one request.

A one-shot process (the ipykernel one, kernel/oneshot.py, and the lean one on IPython's shell,
kernel/lean.py) writes every Jupyter message as a record on its caller's connection
(kernel/oneshot_wire.py), captures fds 1 and 2 in memfds drained into stream messages, takes
exactly one connection from the server's user, reads the request itself, answers and exits.
All of that is here, once, with no ipykernel, jupyter_client or ZMQ import: the lean process's
zygote must not load them (tests/test_layering.py). Request frames are bytes; a caller that
needs zmq.Frame objects (ipykernel's dispatch_shell) wraps them itself.
"""

from __future__ import annotations

import codecs
import ctypes
import io
import json
import os
import signal
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

from ..confine import denials, paths, privileges, scratch
from . import file_ops
from . import oneshot_wire as wire
from .budget import BUDGET

if TYPE_CHECKING:
    from ..policy import SandboxPolicy

KEEP_INPUTS = ("path", "limit", "since", "embed", "budget")  # of a keep_files request
REQUEST_TIMEOUT = 10.0  # seconds a caller has to send its request once connected
FLUSH_AFTER = 0.05  # seconds between a stream's messages while output keeps coming
FLUSH_SIZE = 64 * 1024  # characters a stream keeps before sending them
_PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # made once, in the zygote: not per process


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
        self.held: list[bytes] | None = None  # records kept for one write (hold, release)

    def send_multipart(self, frames: list[Any], copy: bool = True, **_: Any) -> None:
        """Session.send's call: write the message's frames as one record."""
        if not self.sending_output:
            for stream in self.streams:
                stream.flush()
        self.write(wire.MESSAGE, wire.pack_frames([_as_bytes(frame) for frame in frames]))

    def write(self, kind: int, payload: bytes) -> None:
        """One record to the caller; nothing before it connected (no caller, no message)."""
        if self.conn is not None:
            record = wire.record(kind, payload)
            with self.lock:
                if self.held is not None:
                    self.held.append(record)
                else:
                    self.conn.sendall(record)

    def hold(self) -> None:
        """Keep the records written from now on for one write (`release`): the run's last
        ones, which no user code runs between (its result, the reply, idle, done), reach the
        caller together, in order, as written, with one call and one wake-up of the caller.
        Only while this is the one thread: a thread the run left behind could be waiting for
        an answer to what it writes (a tool call), which a held record would never get."""
        if self.conn is not None and threading.active_count() == 1:
            with self.lock:
                if self.held is None:
                    self.held = []

    def release(self) -> None:
        """Write what `hold` kept, in one call."""
        with self.lock:
            held, self.held = self.held, None
            if held and self.conn is not None:
                self.conn.sendall(b"".join(held))

    def flush(self, *_: Any) -> None:
        """ZMQStream's flush: every record is written when it is sent."""


def _as_bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    return bytes(getattr(frame, "bytes", frame))  # a zmq.Frame's bytes, or a buffer's


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


class Discarded(io.TextIOBase):
    """Where the application's log goes once fd 2 is the user's: nowhere, through no fd (a
    pooled process closes every descriptor it did not make or keep itself)."""

    def writable(self) -> bool:
        """Always: everything written is dropped."""
        return True

    def write(self, text: str) -> int:  # type: ignore[override]
        """Drop the text."""
        return len(text)




def kernel_id() -> str:
    """The id a one-shot process's audit record names: its pid (there is no connection file)."""
    return f"one-shot-{os.getpid()}"


def cwd_refusal(layers: dict[str, Any]) -> str:
    """A one-shot's caller sees no banner: a refused --grant-cwd refuses its request ("" if
    the folder was granted or not asked for)."""
    cwd = layers["cwd"]
    return paths.cwd_not_granted(cwd["mode"], cwd["refused"]) if cwd["refused"] else ""


def warm_grants(policy: SandboxPolicy) -> None:
    """Work out in the zygote, once, what every pooled process's confinement works out alike
    from the host's paths (cached for the processes it forks, as a fork server caches them
    for its kernels): the interpreter's paths its uid must reach, the system's read-only
    grants, their real paths, whether the directories above them are open to the uids of
    --uid-range (the scratch's: scratch.root, fixed per zygote). The grants are still checked,
    and each layer applied, in each process."""
    privileges.remember_reachable([os.path.join(scratch.root(), "kernel"),
                                   *policy.read_paths, *policy.write_paths])
    try:
        read_only = paths.read_only(paths.check_grants(policy.read_paths))
    except (OSError, ValueError):
        return  # a grant that is missing refuses each process's start, as without this
    denials.FileAccess.granted(read_only, paths.read_write((), ""), "", "")


def capture_fds(channel: Channel) -> None:
    """fds 1 and 2 become memfds of this process, for its streams to drain."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        memfd = os.memfd_create(f"one-shot {name}")
        os.dup2(memfd, fd)
        os.close(memfd)
    for stream in channel.streams:
        stream.restart()


def die_with_server(server_pid: int) -> bool:
    """Die with the fork server while waiting (set after the uid switch, which clears it);
    whether the server is still this process's parent.

    A pooled process waits for a request its server answers for; with the server gone
    (retired, stopped, killed) nobody will hand it one. A process that took its request no
    longer needs the server (take_connection)."""
    return _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 \
        and os.getppid() == server_pid


def take_connection(listener: socket.socket, taken: int, server_uid: int) -> socket.socket:
    """The first connection from the server's user; the listener closed after it."""
    while True:
        conn, _ = listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if caller_allowed(uid, server_uid):
            break
        conn.close()  # another user's connection: never this process's request
    # The run is the caller's now and outlives the server (its companion serves it on):
    # one killed mid-run takes with it only the processes still waiting. Killed before
    # this line, the process hangs up before its pid record, and the caller asks again.
    _PRCTL(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
    listener.close()
    try:
        os.write(taken, b"+")  # the server starts this one's successor now
    finally:
        os.close(taken)
    return conn


def send_pid(conn: socket.socket) -> None:
    """The first record: this process's pid, with a pidfd the caller can kill it by."""
    pidfd = os.pidfd_open(os.getpid())
    try:
        socket.send_fds(conn, [wire.record(wire.PID, str(os.getpid()).encode())], [pidfd])
    finally:
        os.close(pidfd)


def read_request(conn: socket.socket) -> list[bytes]:
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
            return [bytes(frame) for frame in wire.unpack_frames(payload)]


def receive_request(conn: socket.socket, not_granted: str) -> list[bytes]:
    """Send the pid record, read the request (refused with the reason if it cannot be read,
    or if the cwd grant was refused: read first, so a caller still sending sees the answer)."""
    try:
        send_pid(conn)
        frames = read_request(conn)
    except (OSError, wire.WireError) as exc:
        refuse_request(conn, f"the request could not be read: {exc}")
    except MemoryError:
        refuse_request(conn, "the kernel's memory limit leaves no room to read the "
                       "request: raise --memory-limit")
    if not_granted:
        refuse_request(conn, not_granted)
    return frames


def refuse_request(conn: socket.socket, reason: str) -> NoReturn:
    """Tell the caller why nothing ran, and exit."""
    try:
        conn.sendall(wire.record(wire.REFUSED, reason.encode()))
    except OSError:
        pass
    os._exit(4)


def keep_files_asked(request: dict[str, Any]) -> dict[str, Any] | None:
    """The request's keep_files (what the caller asked to keep of the written files), if any."""
    sandbox = request.get("metadata", {}).get("sandbox")
    asked = sandbox.get("keep_files") if isinstance(sandbox, dict) else None
    return asked if isinstance(asked, dict) else None


def written_files(request: dict[str, Any]) -> bytes | None:
    """The files the run wrote, if the request asked to keep them (JSON), else None: this
    scratch ends with the process, where a ZMQ kernel's caller asks for them in further runs.
    Listed and read by the code those runs send (kernel/file_ops.py), in this process, after
    the run: what user code could reach, and no more trusted than its output."""
    asked = keep_files_asked(request)
    if asked is None:
        return None
    inputs = {key: asked[key] for key in KEEP_INPUTS if key in asked}
    try:
        kept = json.dumps(_file_op()("keep", **inputs))
    except Exception as exc:  # the caller is told; the run stands
        kept = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    return kept.encode()


def finish_run(channel: Channel, conn: socket.socket, request: dict[str, Any]) -> NoReturn:
    """After the reply: the streams' rest, the written files if asked, DONE (in one write with
    the records the run held: Channel.hold); then wait until the caller hangs up (it kills
    this process then: it reads the host's figures of the run from /proc meanwhile, as it
    does for a ZMQ kernel), and exit."""
    try:
        for stream in channel.streams:
            stream.flush()
        if keep_files_asked(request) is not None:
            channel.release()  # the reply first: listing and reading the files takes a while
        kept = written_files(request)
        if kept is not None:
            channel.write(wire.FILES, kept)
        channel.write(wire.DONE, b"")
        channel.release()
        conn.settimeout(REQUEST_TIMEOUT)
        conn.recv(1)
    except OSError:
        pass  # the caller left: nobody to answer
    os._exit(0)


def _file_op() -> Any:
    """The file operations' function: the kernel's own module, which a ZMQ kernel is sent as
    text by its client (a module attribute, so a test can stand in for it)."""
    return file_ops.__sandbox_files__
