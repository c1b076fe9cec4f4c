"""Pools of one-shot kernels: a fork server keeps processes of one policy pre-confined.

`OneShotPool(policy, size)` asks the fork server of (python, preload), starting it if needed,
for the pool of that policy; the answer is the pool's socket path. Each connection to it is
accepted by exactly one waiting process, which then reads the request itself
(kernel/oneshot.py); the server forks its successor while it runs. A pool lives as long as
its server: a retired server's pool socket is gone, and the next ask reaches the successor.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..policy import SandboxPolicy
from .forkserver.client import ForkServerClient, _tail, request_env
from .forkserver.pools import PROCESSES
from .forkserver.protocol import ForkServerError, frame, pools_path, receive, runtime_dir

DEFAULT_ONE_SHOT_POOL = 2  # pre-confined processes per policy
# Which one-shot process a pool runs (launch/forkserver/pools.py PROCESSES): "shell", the lean
# one on IPython's shell (kernel/lean.py); "kernel", the ipykernel one (kernel/oneshot.py).
DEFAULT_ONE_SHOT_PROCESS = "shell"
PROCESS_VAR = "SANDBOX_ONE_SHOT_PROCESS"  # the operator's choice, for every face at once


def default_process() -> str:
    """The one-shot process a pool runs unless its caller says: SANDBOX_ONE_SHOT_PROCESS, else
    DEFAULT_ONE_SHOT_PROCESS."""
    chosen = os.environ.get(PROCESS_VAR) or DEFAULT_ONE_SHOT_PROCESS
    if chosen not in PROCESSES:
        raise ValueError(f"{PROCESS_VAR}={chosen!r}: one of {', '.join(PROCESSES)}")
    return chosen


class OneShotUnavailable(RuntimeError):
    """No pool of one-shot kernels could be had (the server refused, or the pool is broken)."""


@dataclass
class OneShotPool:
    """The fork server's pool of one-shot kernels for one policy."""

    policy: SandboxPolicy
    size: int = DEFAULT_ONE_SHOT_POOL
    python: str = sys.executable
    preload: Sequence[str] = ()
    process: str = field(default_factory=default_process)
    server: ForkServerClient = field(init=False)
    path: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.process not in PROCESSES:
            raise ValueError(f"a one-shot process is one of {', '.join(PROCESSES)}, "
                             f"not {self.process!r}")
        self.server = ForkServerClient(python=self.python, preload=self.preload)
        self.argv = self.policy.to_argv()
        self.cwd = launch_folder()

    @property
    def pools_path(self) -> str:
        """Where the server takes requests for pools (beside its own socket)."""
        return pools_path(self.server.socket_path)

    def connect(self) -> socket.socket:
        """A connection that one waiting process of the pool will accept (blocking)."""
        for attempt in range(2):
            if not self.path:
                self.path = self.ask()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.path)
                return conn
            except OSError as exc:
                conn.close()
                self.path = ""  # the server retired: its successor has a pool of its own
                if attempt:
                    raise OneShotUnavailable(f"cannot reach the one-shot pool: {exc}") from exc
        raise AssertionError("unreachable")

    def ask(self) -> str:
        """The pool's socket path, from the server (started first if there is none)."""
        conn = self._connect_pools()
        with conn:
            request = {"argv": self.argv, "env": request_env(self.argv, os.environ),
                       "cwd": self.cwd, "size": self.size, "process": self.process}
            try:
                conn.sendall(frame({"pool": request}))
                conn.settimeout(self.server.start_timeout)
                answer, _ = receive(conn)
            except (OSError, ValueError) as exc:
                raise OneShotUnavailable(f"the fork server did not answer: {exc}") from exc
        if "socket" not in answer:
            raise OneShotUnavailable(f"no one-shot kernels: {answer.get('error', answer)}; "
                                     f"{self.server_log()}")  # its last line: the refusal
        return str(answer["socket"])

    def server_log(self) -> str:
        """Where the server's log is, and its last line (a kernel's refusal to start)."""
        log = self.server.directory / f"{self.server.key}.log"
        return f"see {log}: {_tail(log)}"

    def exit_code(self, pid: int) -> int | None:
        """How one of the pool's processes ended, from its server (None if unknown)."""
        try:
            conn = _connect(self.pools_path)
        except OSError:
            return None
        with conn:
            try:
                conn.sendall(frame({"exit": pid}))
                conn.settimeout(5.0)
                answer, _ = receive(conn)
            except (OSError, ValueError):
                return None
        code = answer.get("exit")
        return code if isinstance(code, int) else None

    def _connect_pools(self) -> socket.socket:
        try:  # as ForkServerClient.connect: owner-only (made now if need be) before any
            runtime_dir()  # socket in it is trusted
        except ForkServerError as exc:
            raise OneShotUnavailable(str(exc)) from exc
        try:
            return _connect(self.pools_path)
        except OSError:
            pass
        try:
            return self._start_under_lock()
        except OSError as exc:  # e.g. a full disk: what the host refuses, said
            raise OneShotUnavailable(f"cannot start the fork server in "
                                     f"{self.server.directory}: {exc}") from exc

    def _start_under_lock(self) -> socket.socket:
        with open(self.server.directory / f"{self.server.key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return _connect(self.pools_path)  # another launcher started it meanwhile
            except OSError:
                try:
                    self.server.start_server()
                except ForkServerError as exc:
                    raise OneShotUnavailable(str(exc)) from exc
            try:
                return _connect(self.pools_path)
            except OSError as exc:
                raise OneShotUnavailable(f"cannot reach the fork server: {exc}") from exc


def launch_folder() -> str:
    """The folder a pool's kernels start in: the caller's, as a ZMQ kernel's is (kernel/app.py
    grants it with --grant-cwd, or names it when a relative open fails); a pool is keyed by it.
    """
    try:
        return os.getcwd()
    except OSError:  # the caller's folder is gone: as a kernel started there, none to grant
        return "/"


def _connect(path: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        raise
    return conn
