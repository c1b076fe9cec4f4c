"""The launcher's side of the fork server: ask for a kernel, stand in for its Popen object.

What a launcher sends is filtered here, before it leaves: only the variables a kernel may take
from its launcher (confine/environment.py) go into a request, and the server a launcher starts
gets the same allowlist. Nothing else of the launcher's environment (API keys, tokens) reaches
the server's memory or, through a fork, any kernel's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ...confine import environment
from ...fdwait import readable
from .protocol import (
    DEFAULT_IDLE,
    DEFAULT_MAX_AGE,
    DEFAULT_MAX_FORKS,
    ForkServerError,
    frame,
    peer_pid_uid,
    receive,
    runtime_dir,
    runtime_path,
    server_key,
    split_names,
)


def server_env(current: Mapping[str, str], home: Path) -> dict[str, str]:
    """The server's own environment: the kernels' allowlist, with home for their scratch.

    BLAS libraries start a thread pool when they are imported unless told to use one thread;
    a server with threads cannot fork safely, so one thread each unless the launcher chose.
    """
    home.mkdir(mode=0o700, exist_ok=True)
    env = {"PATH": environment.SAFE_PATH, "LANG": "C.UTF-8", "HOME": str(home),
           "MPLCONFIGDIR": str(home / "matplotlib"), "XDG_CACHE_HOME": str(home / "cache"),
           "XDG_CONFIG_HOME": str(home / "config")}
    env.update({name: current[name] for name in environment.PASSED_THROUGH
                if name in current and not name.startswith("JPY_")})
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, "1")
    return env


def request_env(argv: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The part of a launcher's environment a request carries: what the kernel may inherit."""
    return environment.inherited(argv, env)


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
            if not readable(self.conn, timeout):
                return
            try:
                message, _ = receive(self.conn)
                self.returncode = int(message["exit"])
                self._release()
                return
            except (OSError, ValueError, KeyError):
                self.conn.close()  # the server died; the kernel lives on
                timeout = 0.0
        if readable(self.pidfd, timeout):  # ended, but only its (gone) parent could learn how
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
        """Ask the kernel to end (SIGTERM), as Popen.terminate does."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """End the kernel now (SIGKILL), as Popen.kill does."""
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
        self.preload = split_names(self.preload)
        self.directory = runtime_path()  # made (and checked) by the first connect()
        self.key = server_key(self.python, self.preload)
        self.socket_path = str(self.directory / f"{self.key}.sock")

    def spawn(self, argv: Sequence[str], env: Mapping[str, str],
              stdio: Sequence[int], cwd: str | os.PathLike[str] | None = None,
              ready: int | None = None, sealed: int | None = None) -> ForkedKernel:
        """A new kernel running `python -m sandbox_kernel argv`, with stdio as its fds, started
        in cwd (this process's working directory by default). Of env, only what a kernel may
        inherit is sent (request_env). ready: the write end of a pipe the kernel writes a line
        to, and closes, once its sockets listen. sealed: the kernel's vault (confine/vault.py),
        a descriptor the server's child hands on to the kernel's reaper unread."""
        request: dict[str, Any] = {"argv": list(argv), "env": request_env(argv, env),
                                   "cwd": os.path.abspath(cwd or "."),
                                   "ready": ready is not None, "vault": sealed is not None}
        fds = [*stdio, *([] if ready is None else [ready]), *([] if sealed is None else [sealed])]
        conn = self.connect()
        try:
            socket.send_fds(conn, [frame(request)], fds)
            conn.settimeout(self.start_timeout)
            reply, fds = receive(conn)
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
        """A connection to a running server; start one (once, under a lock) if there is none.

        Whatever the host refuses on the way (a read-only runtime directory, a full disk) is a
        ForkServerError, the launcher's cue to start the kernel cold.
        """
        runtime_dir()  # owner-only (made now if need be): no one else could plant a socket
        try:
            return self._connect()
        except OSError:
            pass
        try:
            return self._start_and_connect()
        except OSError as exc:
            raise ForkServerError(f"cannot start the fork server in {self.directory}: "
                                  f"{exc}") from exc

    def _start_and_connect(self) -> socket.socket:
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
        command = [self.python, "-I", "-m", "sandbox_kernel.launch.forkserver.server",
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
            answer = ready.readline() if readable(ready, self.start_timeout) else b""
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
            return peer_pid_uid(conn)[0]

    def stop_server(self, timeout: float = 10.0) -> int | None:
        """End this interpreter's and preload set's server (its kernels live on); its pid.

        Returns once the server is gone (at most timeout seconds): a launcher that stops it and
        asks for a kernel at once must reach a new server, not the old one on its way out (which
        resets the connection, and the kernel starts cold).
        """
        pid = self.server_pid()
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        return pid


def _running(pid: int) -> bool:
    """Whether pid is a live process (a zombie is not: it is gone but for its exit status)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_servers() -> list[int]:
    """End every fork server of this runtime dir (its kernels live on); their pids."""
    stopped = []
    for path in runtime_path().glob("*.sock"):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(path))
            pid = peer_pid_uid(conn)[0]
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
