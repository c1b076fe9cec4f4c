"""The fork server: kernels forked from a process that has already imported everything.

A cold kernel spends most of its start-up importing IPython, ipykernel, zmq and their friends. The
fork server is a long-lived, single-threaded process (one per interpreter and preload set) that
has done those imports once, in a clean environment, and holds no thread, ZMQ context, event loop,
IPython shell or traitlets singleton. Per request it forks a child that does exactly what a cold
kernel does after its re-exec (`environment.prepare`, then `app.main`): its own scratch and
reaper, rlimits, identity, Landlock, sockets, seccomp, serve.

Protocol, on a Unix socket in an owner-only runtime directory, peers checked with SO_PEERCRED: the
client sends one length-prefixed JSON request `{"argv": [...], "env": {...}, "cwd": ...}` with its
stdin, stdout and stderr attached (SCM_RIGHTS); the server answers `{"pid": N}` with a pidfd of the
child attached, and, when the child has ended, `{"exit": returncode}`. If the client hangs up
first, its launcher is gone and the kernel is killed (what ipykernel's parent poller does for a
cold kernel). Everything user code can observe is per kernel: `random` (and numpy's) reseeded,
`tempfile.tempdir` reset, the server's descriptors closed, the environment, stdio and working
directory the launcher's. The hash seed and address-space layout are shared by one server's
children, so a server retires after `max_forks` forks or `max_age` seconds (docs/SECURITY.md).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import gc
import hashlib
import importlib
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# Imported by a kernel only once it runs (ipykernel's lazy imports, recorded from a started
# kernel's sys.modules); importing them in the server makes them free in every child.
KERNEL_IMPORTS = (
    "sandbox_kernel.kernel.app", "ipykernel.ipkernel", "ipykernel.zmqshell", "ipykernel.comm",
    "ipykernel.comm.manager", "ipykernel.heartbeat", "ipykernel.iostream",
    "ipykernel.control", "ipykernel.shellchannel", "ipykernel.subshell_manager",
    "ipykernel.eventloops", "ipykernel.displayhook", "ipykernel.jsonutil",
    "ipykernel.compiler", "ipykernel.kernelspec", "IPython.core.interactiveshell",
    "IPython.core.completer", "IPython.core.history", "IPython.core.magics",
    "IPython.core.profiledir", "IPython.core.application", "IPython.core.shellapp",
    "IPython.core.display", "IPython.display", "IPython.core.formatters",
    "IPython.core.payloadpage", "IPython.core.usage", "IPython.core.ultratb",
    "IPython.core.debugger", "IPython.utils.tokenutil", "IPython.extensions.storemagic",
    "jupyter_client.session", "jupyter_client.connect", "zmq.eventloop.zmqstream",
    "tornado.ioloop", "asyncio", "sqlite3", "comm", "sandbox_kernel.confine.seccomp",
    "sandbox_kernel.confine.landlock", "sandbox_kernel.confine.denials", "json", "ctypes",
    "uuid", "hmac", "pickle", "psutil", "faulthandler", "unicodedata", "ipykernel.debugger",
    "IPython.core.completerlib", "IPython.core.oinspect", "IPython.utils.wildcard",
    "tornado.gen", "tornado.locks", "tornado.queues", "tornado.platform.asyncio",
    "IPython.core.logger", "runpy",
)
DEFAULT_MAX_FORKS = 200
DEFAULT_MAX_AGE = 600.0
DEFAULT_IDLE = 300.0
_HEADER = struct.Struct("!I")
_MAX_REQUEST = 8 * 2**20


class ForkServerError(RuntimeError):
    """The fork server cannot give a kernel; the caller starts one cold instead."""


def runtime_dir() -> Path:
    """The owner-only directory holding the servers' sockets, locks and logs."""
    from jupyter_core.paths import jupyter_runtime_dir

    path = Path(jupyter_runtime_dir()) / "sandbox-kernel"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not path.is_dir() or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise ForkServerError(f"{path} must be a directory owned by uid {os.geteuid()} with "
                              "mode 0700; remove it to let the fork server recreate it")
    return path


def server_key(python: str, preload: Sequence[str]) -> str:
    """One server per interpreter, preload set and version of this package's code.

    The path as given, not resolved: every virtualenv's python links to the same binary, yet
    each has its own site-packages. A server imported the kernel's code when it started: after
    an upgrade (or an edit of an editable install) it would go on forking kernels that run the
    old confinement code, so the code's fingerprint is part of the key too.
    """
    text = json.dumps([os.path.abspath(python), sorted(set(preload)), _code_fingerprint()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def _code_fingerprint() -> list[tuple[str, int, int]]:
    """Path, size and mtime of each module of this package, as this process imported it."""
    package = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted(package.rglob("*.py")):
        info = path.stat()
        found.append((str(path.relative_to(package)), info.st_size, info.st_mtime_ns))
    return found


def server_env(current: Mapping[str, str], home: Path) -> dict[str, str]:
    """The server's own environment: the kernels' allowlist, with home for their scratch.

    BLAS libraries start a thread pool when they are imported unless told to use one thread;
    a server with threads cannot fork safely, so one thread each unless the launcher chose.
    """
    from sandbox_kernel.confine.environment import PASSED_THROUGH, SAFE_PATH

    home.mkdir(mode=0o700, exist_ok=True)
    env = {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "HOME": str(home),
           "MPLCONFIGDIR": str(home / "matplotlib"), "XDG_CACHE_HOME": str(home / "cache"),
           "XDG_CONFIG_HOME": str(home / "config")}
    env.update({name: current[name] for name in PASSED_THROUGH
                if name in current and not name.startswith("JPY_")})
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, "1")
    return env


def thread_count() -> int:
    """Threads of this process, from the kernel's point of view (Python's may not know)."""
    return len(os.listdir("/proc/self/task"))


# --- the server -------------------------------------------------------------------------------


@dataclass
class _Child:
    conn: socket.socket
    pidfd: int
    hung_up: bool = False


@dataclass
class Server:
    """The single-threaded loop: accept requests, fork kernels, report their exits."""

    path: str
    preload: Sequence[str] = ()
    max_forks: int = DEFAULT_MAX_FORKS
    max_age: float = DEFAULT_MAX_AGE
    idle: float = DEFAULT_IDLE
    forks: int = 0
    children: dict[int, _Child] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)

    def prepare(self) -> None:
        """Import what kernels need, then make sure that left exactly one thread."""
        sys.modules["debugpy"] = None  # type: ignore[assignment]  # as in __main__: refused
        for name in (*KERNEL_IMPORTS, *self.preload):
            try:
                importlib.import_module(name)
            except ImportError as exc:
                if name in self.preload:
                    raise ForkServerError(f"cannot preload {name}: {exc}") from exc
        # Policy-independent work every kernel would repeat: done once here, after the imports
        # (a preloaded module may extend sys.path).
        from sandbox_kernel.confine import paths, privileges, seccomp
        from sandbox_kernel.kernel.app import SandboxKernelApp
        from sandbox_kernel.launch import fontcache

        paths.interpreter_paths()
        fontcache.build(os.environ.get("MPLCONFIGDIR", ""))  # for every kernel to copy
        privileges.prepare()
        seccomp.precompile()
        SandboxKernelApp.prebuild_parser()
        # A collection in a child walks every object and writes to it: each page the server
        # shares with its kernels would be copied. Frozen objects are never collected.
        gc.collect()
        gc.freeze()
        if thread_count() != 1:
            raise ForkServerError(f"the server has {thread_count()} threads after importing "
                                  f"{', '.join(self.preload) or 'the kernel'}; a multi-threaded "
                                  "process cannot fork safely: do not preload that module")

    def bind(self) -> None:
        """Listen on the socket path (replacing a dead server's socket)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self.listener.bind(self.path)
        finally:
            os.umask(old_umask)
        self.bound_inode = os.stat(self.path).st_ino
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, self.accept)

    @property
    def retiring(self) -> bool:
        """Past its fork budget or age: take no new requests (the shared seed/layout ages)."""
        return (self.forks >= self.max_forks
                or time.monotonic() - self.started >= self.max_age)

    def serve(self) -> None:
        """Run until retired (and every child reported) or idle."""
        listening = True
        while True:
            if listening and self.retiring:
                self.stop_listening()
                listening = False
            if not listening and not self.children:
                return
            if not self.children and time.monotonic() - self.last_active > self.idle:
                return
            for key, _ in self.selector.select(timeout=1.0):
                key.data(key.fileobj)

    def stop_listening(self) -> None:
        """Unlink the socket so that the next client starts a fresh server."""
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self.bound_inode:  # not a successor's socket
                os.unlink(self.path)
        self.selector.unregister(self.listener)
        self.listener.close()

    def accept(self, listener: Any) -> None:
        conn, _ = self.listener.accept()
        self.last_active = time.monotonic()
        try:
            conn.settimeout(5.0)
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if uid != os.getuid():
                raise ForkServerError(f"peer pid {pid} runs as uid {uid}, not {os.getuid()}")
            request, fds = _receive(conn)
        except (OSError, ValueError, ForkServerError) as exc:
            self.refuse(conn, exc)
            return
        try:
            self.fork(conn, request, fds)
        except (OSError, ValueError, KeyError, ForkServerError) as exc:
            self.refuse(conn, exc)
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    def refuse(conn: socket.socket, exc: Exception) -> None:
        """Say why there is no kernel, and hang up."""
        with contextlib.suppress(OSError):
            conn.sendall(_frame({"error": str(exc)}))
        conn.close()

    def fork(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        argv, env = list(request["argv"]), dict(request["env"])
        cwd = str(request.get("cwd") or "/")
        if len(fds) != 3:
            raise ForkServerError("a request carries exactly three descriptors (stdio)")
        if thread_count() != 1:
            raise ForkServerError("the server is multi-threaded and cannot fork safely")
        pid = os.fork()
        if pid == 0:
            conn.close()  # the child's launcher talks to the server, not to the kernel
            self.become_kernel(argv, env, fds, cwd)
        self.forks += 1
        pidfd = os.pidfd_open(pid)
        self.children[pid] = _Child(conn, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, lambda _: self.reap(pid))
        self.selector.register(conn, selectors.EVENT_READ, lambda _: self.hang_up(pid))
        try:
            socket.send_fds(conn, [_frame({"pid": pid})], [pidfd])
        except OSError:
            self.hang_up(pid)  # the launcher left before it learned of its kernel

    def reap(self, pid: int) -> None:
        """The child ended: tell its client how."""
        _, status = os.waitpid(pid, 0)
        child = self.children.pop(pid)
        self.selector.unregister(child.pidfd)
        if not child.hung_up:
            self.selector.unregister(child.conn)
        os.close(child.pidfd)
        with contextlib.suppress(OSError):
            child.conn.sendall(_frame({"exit": os.waitstatus_to_exitcode(status)}))
        child.conn.close()
        self.last_active = time.monotonic()

    def hang_up(self, pid: int) -> None:
        """The client wrote or hung up: its launcher is gone, and so must the kernel be."""
        child = self.children[pid]
        with contextlib.suppress(OSError):
            if child.conn.recv(1, socket.MSG_PEEK):
                child.conn.recv(4096)  # a protocol breach; nothing more is expected
                return
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
        self.selector.unregister(child.conn)
        child.hung_up = True

    def become_kernel(self, argv: list[str], env: dict[str, str], stdio: list[int],
                      cwd: str = "/") -> None:
        """In the child: exactly what a cold kernel does after its re-exec, then exit."""
        code = 1
        try:
            os.setsid()  # its own process group, as jupyter_client gives a cold kernel
            # Where the launcher would have started it (under Jupyter, the notebook's folder):
            # the kernel remembers it to explain a refused relative name (confine/denials.py).
            os.chdir(cwd)
            self.close_in_child()
            for target, fd in enumerate(stdio):
                os.dup2(fd, target)
            from sandbox_kernel.confine.environment import prepare
            from sandbox_kernel.kernel.app import main

            kernel_env = prepare(argv, env)  # closes the remaining server descriptors
            from sandbox_kernel.launch import fontcache

            fontcache.copy_into(os.environ.get("MPLCONFIGDIR", ""),
                                kernel_env.get("MPLCONFIGDIR", ""))
            os.environ.clear()
            os.environ.update(kernel_env)
            _forget_environment()
            _reseed()  # after prepare: making the scratch fixed tempfile's default dir
            sys.argv = [str(Path(__file__).parent.parent / "__main__.py"), *argv]
            code = 0
            # Its parent is this server, not the launcher; the server watches the launcher
            # (see hang_up). 1 tells ipykernel there is no parent to poll.
            main([*argv, "--IPKernelApp.parent_handle=1"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:
            # jupyter_client interrupts a kernel before shutting it down: one still starting
            # (a pool's, when its owner stops) ends here, which is no error worth a traceback.
            code = 128 + signal.SIGINT
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            _exit_like_python(code)

    def close_in_child(self) -> None:
        """Close the server's listening socket and every other kernel's descriptors."""
        for child in self.children.values():
            child.conn.close()
            os.close(child.pidfd)
        self.selector.close()
        if self.listener.fileno() >= 0:
            self.listener.close()


def _reseed() -> None:
    """What user code can observe of the server's random state: made per kernel."""
    import random
    import tempfile

    random.seed()
    tempfile.tempdir = None
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _forget_environment() -> None:
    """Drop what preloaded modules derived from the server's environment at import time."""
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is not None:  # its config and cache dirs: the kernel's scratch, not the server's
        for name, fmt in (("get_configdir", "CONFIGDIR=%s"), ("get_cachedir", "CACHEDIR=%s")):
            uncached = getattr(matplotlib, name).__wrapped__
            setattr(matplotlib, name, matplotlib._logged_cached(fmt)(uncached))


def _exit_like_python(code: int) -> None:
    """Run atexit handlers and flush, as an interpreter exit would, but never return."""
    import atexit

    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    return _HEADER.pack(len(data)) + data


def _read_exactly(sock: socket.socket, size: int, start: bytes = b"") -> bytes:
    data = bytearray(start)
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer hung up mid-message")
        data += chunk
    return bytes(data)


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One framed message and the descriptors that came with its first bytes."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 4)
    if not data:
        raise ConnectionError("the peer hung up")
    data = _read_exactly(sock, _HEADER.size, data)
    (size,) = _HEADER.unpack_from(data)
    if size > _MAX_REQUEST:
        raise ValueError(f"a {size}-byte message is too large")
    body = _read_exactly(sock, _HEADER.size + size, data)[_HEADER.size:]
    return json.loads(body), fds


def serve_main(argv: Sequence[str] | None = None) -> None:
    """`python -I -m sandbox_kernel.launch.forkserver --socket PATH ...`: run a server."""
    parser = argparse.ArgumentParser(prog="sandbox-kernel-forkserver")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--preload", default="")
    parser.add_argument("--max-forks", type=int, default=DEFAULT_MAX_FORKS)
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE)
    parser.add_argument("--idle", type=float, default=DEFAULT_IDLE)
    parser.add_argument("--ready-fd", type=int)
    args = parser.parse_args(argv)
    server = Server(args.socket, _split(args.preload), args.max_forks, args.max_age, args.idle)
    try:
        server.prepare()
        server.bind()
    except (OSError, ForkServerError) as exc:
        print(f"sandbox-kernel fork server: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if args.ready_fd is not None:
        os.write(args.ready_fd, b"ready\n")
        os.close(args.ready_fd)
    server.serve()


def _split(names: str | Sequence[str]) -> tuple[str, ...]:
    items = names.split(",") if isinstance(names, str) else names
    return tuple(sorted({name.strip() for name in items if name.strip()}))


# --- the client -------------------------------------------------------------------------------


class ForkedKernel:
    """A fork-served kernel process, with the part of subprocess.Popen that jupyter_client uses."""

    stdin = stdout = stderr = None

    def __init__(self, conn: socket.socket, pid: int, pidfd: int) -> None:
        self.conn, self.pid, self.pidfd = conn, pid, pidfd
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the kernel has ended, else None."""
        if self.returncode is None:
            self._check(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end of the kernel; subprocess.TimeoutExpired after timeout seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout or 0)
            self._check(0.5 if left is None else min(left, 0.5))
        assert self.returncode is not None
        return self.returncode

    def _check(self, timeout: float) -> None:
        """Read the server's exit report; if the server is gone, watch the pidfd instead."""
        if self.conn.fileno() >= 0:
            ready, _, _ = select.select([self.conn], [], [], timeout)
            if not ready:
                return
            try:
                message, _ = _receive(self.conn)
                self.returncode = int(message["exit"])
                self._release()
                return
            except (OSError, ValueError, KeyError):
                self.conn.close()  # the server died; the kernel lives on
                timeout = 0.0
        ready, _, _ = select.select([self.pidfd], [], [], timeout)  # type: ignore[list-item]
        if ready:  # ended, but only its (gone) parent could learn how
            self.returncode = 255
            self._release()

    def exit_fd(self) -> int:
        """A descriptor that becomes readable when poll() may have news."""
        return self.conn.fileno() if self.conn.fileno() >= 0 else self.pidfd

    def send_signal(self, signum: int) -> None:
        """Signal the kernel itself (never a recycled pid: the pidfd names this process).

        As Popen's: nothing once the kernel has ended, even before its exit report arrived
        (jupyter_client interrupts a kernel before it shuts it down or kills it).
        """
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _release(self) -> None:
        self.conn.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._release()


@dataclass
class ForkServerClient:
    """Asks the fork server of (python, preload) for a kernel, starting the server if needed."""

    python: str = sys.executable
    preload: Sequence[str] = ()
    max_forks: int = DEFAULT_MAX_FORKS
    max_age: float = DEFAULT_MAX_AGE
    idle: float = DEFAULT_IDLE
    start_timeout: float = 60.0

    def __post_init__(self) -> None:
        self.preload = _split(self.preload)
        self.directory = runtime_dir()
        self.key = server_key(self.python, self.preload)
        self.socket_path = str(self.directory / f"{self.key}.sock")

    def spawn(self, argv: Sequence[str], env: Mapping[str, str],
              stdio: Sequence[int], cwd: str | os.PathLike[str] | None = None) -> ForkedKernel:
        """A new kernel running `python -m sandbox_kernel argv` in env, with stdio as its fds,
        started in cwd (this process's working directory by default)."""
        request = {"argv": list(argv), "env": dict(env), "cwd": os.path.abspath(cwd or ".")}
        conn = self.connect()
        try:
            socket.send_fds(conn, [_frame(request)], list(stdio))
            conn.settimeout(self.start_timeout)
            reply, fds = _receive(conn)
            conn.settimeout(None)
        except (OSError, ValueError) as exc:
            conn.close()
            raise ForkServerError(f"the fork server did not answer: {exc}") from exc
        if "error" in reply or len(fds) != 1:
            conn.close()
            for fd in fds:
                os.close(fd)
            raise ForkServerError(f"the fork server refused: {reply.get('error', reply)}")
        return ForkedKernel(conn, int(reply["pid"]), fds[0])

    def connect(self) -> socket.socket:
        """A connection to a running server; start one (once, under a lock) if there is none."""
        try:
            return self._connect()
        except OSError:
            pass
        with open(self.directory / f"{self.key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return self._connect()  # another launcher started it meanwhile
            except OSError:
                self.start_server()
            try:
                return self._connect()
            except OSError as exc:
                raise ForkServerError(f"cannot reach the fork server: {exc}") from exc

    def _connect(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket_path)
        except OSError:
            conn.close()
            raise
        return conn

    def start_server(self) -> None:
        """Start a detached server and wait until it listens (or say why it could not)."""
        read_end, write_end = os.pipe()
        log_path = self.directory / f"{self.key}.log"
        command = [self.python, "-I", "-m", "sandbox_kernel.launch.forkserver",
                   "--socket", self.socket_path, "--preload", ",".join(self.preload),
                   "--max-forks", str(self.max_forks), "--max-age", str(self.max_age),
                   "--idle", str(self.idle), "--ready-fd", str(write_end)]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env=server_env(os.environ, self.directory / f"{self.key}.home"),
                start_new_session=True, pass_fds=(write_end,), cwd="/")
        os.close(write_end)
        with os.fdopen(read_end, "rb") as ready:
            selected, _, _ = select.select([ready], [], [], self.start_timeout)
            answer = ready.readline() if selected else b""
        if answer != b"ready\n":
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()
            raise ForkServerError(f"the fork server did not start; see {log_path}: "
                                  f"{_tail(log_path)}")
        # Detached: the server outlives this launcher, and reaps itself via init.
        process.returncode = 0

    def server_pid(self) -> int | None:
        """The pid of the running server, or None."""
        try:
            conn = self._connect()
        except OSError:
            return None
        with conn:
            pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return int(pid)

    def stop_server(self) -> int | None:
        """End this interpreter's and preload set's server (its kernels live on); its pid."""
        pid = self.server_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return pid


def stop_servers() -> list[int]:
    """End every fork server of this runtime dir (its kernels live on); their pids."""
    stopped = []
    for path in runtime_dir().glob("*.sock"):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(path))
            pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
        except OSError:
            continue
        finally:
            conn.close()
    return stopped


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


def stdio_fds(stdout: IO[Any] | int | None, stderr: IO[Any] | int | None) -> list[int]:
    """The descriptors a kernel would inherit from Popen(stdin=DEVNULL, stdout, stderr)."""
    def fd_of(target: IO[Any] | int | None, default: int) -> int:
        if target is None:
            return default
        if isinstance(target, int):
            if target < 0:
                raise ForkServerError("pipes to the kernel's stdio need a cold start")
            return target
        return target.fileno()

    null = os.open(os.devnull, os.O_RDWR)
    return [null, fd_of(stdout, 1), fd_of(stderr, 2)]


if __name__ == "__main__":
    serve_main()
