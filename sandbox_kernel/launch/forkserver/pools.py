"""The fork server's pools of one-shot kernels: their listeners, zygotes, processes and exits.

A launcher asks the server (at `protocol.pools_path`, beside the server's socket) for the pool
of a policy (launch/oneshot.py); the server makes it, or finds it, and answers with the pool's
socket path. Each pool has a zygote (zygote.py) that builds the one-shot kernel once
(kernel/oneshot.py) and forks, on the server's word, the pool's processes: each confines itself
and waits on the pool's socket for one request. The server watches them (refilled as they are
taken, the pool broken after POOL_FAILURES in a row end untaken), reaps the ones that took a
request and keeps their exit codes for their callers (who cannot wait for a process that is not
their child).

This module is that half of the server; server.py holds the other (the ZMQ kernels it forks per
request, and the socket loop both halves are served by). A retiring server unlinks its pools'
sockets once, while they are still its own (listeners.py): a successor has the same paths.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import selectors
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import lean_zygote
from .listeners import listen, unlink_own
from .protocol import REQUEST_TIMEOUT, ForkServerError, frame, peer_pid_uid, pools_path, receive
from .zygote import FORK

# The one-shot processes a pool's zygote can build: "shell", the lean one on IPython's shell
# (kernel/lean.py, in a zygote started fresh: lean_zygote.py); "kernel", the ipykernel one
# (kernel/oneshot.py, in a zygote forked from the server).
PROCESSES = ("shell", "kernel")
RETIRE_GRACE = 2.0  # seconds a retiring server's pools still take connections made before
POOL_FAILURES = 3  # pooled processes in a row that end before taking a request: pool broken
DEFAULT_MAX_ONE_SHOTS = 5000  # one-shot processes a server forks before it retires


class Owner(Protocol):
    """What the pools need of their server (server.py's Server)."""

    path: str  # its socket: the pools' paths are beside it, named after its key
    preload: Sequence[str]  # what it imported for its kernels: a lean zygote imports it too
    last_active: float  # set when a launcher asks or a run ends: the server is not idle

    @property
    def retiring(self) -> bool:
        """Whether the server takes no new requests: no more processes are forked then."""

    def close_in_child(self) -> None:
        """Close, in a forked child (a zygote, the companion), every descriptor of the server."""


@dataclass
class _Pool:
    """Pre-confined one-shot processes of one policy, each waiting to take one request.

    Its argv and environment are the operator's (the same for every process of the pool), not
    a run's: a request's code and inputs are read by the process that runs them, never here.
    """

    path: str
    listener: socket.socket
    inode: int  # of the socket it bound at path (0 once unlinked: a successor's may be there)
    argv: list[str]
    env: dict[str, str]
    cwd: str
    size: int
    process: str = "kernel"  # which one-shot process its zygote builds (PROCESSES)
    waiting: dict[int, tuple[int, int]] = field(default_factory=dict)  # pid -> (pidfd, taken)
    failures: int = 0
    broken: str = ""
    control: socket.socket | None = None  # to the pool's zygote (zygote.py), once forked
    asked: list[int] = field(default_factory=list)  # taken pipes of forks asked, unanswered
    zygote: int = 0  # its pid
    zygote_pidfd: int = -1


def pool_path(directory: str, key: str, argv: list[str], env: dict[str, str], cwd: str,
              process: str = "kernel") -> str:
    """Where the pool of this policy (and one-shot process) listens: the same, the same pool."""
    keyed: list[Any] = [argv, env, cwd] if process == "kernel" else [argv, env, cwd, process]
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()
    # Short: a unix socket's path has at most 107 bytes, and the directory comes first.
    return os.path.join(directory, f"{key}.{digest[:8]}.sock")


class OneShotPools:
    """A server's pools of one-shot kernels (kernel/oneshot.py), served by its selector."""

    def __init__(self, owner: Owner, selector: selectors.BaseSelector) -> None:
        """Listen for pool requests beside the owner's socket, on the owner's selector."""
        self.owner, self.selector = owner, selector
        self.one_shots = 0  # forked for pools (a server retires after its max_one_shots)
        self.pools: dict[str, _Pool] = {}
        self.busy: dict[int, int] = {}  # one-shot pid -> pidfd, after taking
        self.companion: int | None = None  # the registry of the one-shots' companion, once started
        self.exits: dict[int, int] = {}  # recent one-shots' exit codes
        self.path = pools_path(owner.path)
        self.listener, self.inode = listen(self.path)
        self.selector.register(self.listener, selectors.EVENT_READ, self.accept_pool)

    def unlink_pools(self) -> None:
        """No new connections to any pool (nor pools); the waiting processes still take the
        connections made before, for RETIRE_GRACE seconds (close_pools then ends them)."""
        if self.listener.fileno() >= 0:
            self.selector.unregister(self.listener)
            self.listener.close()
            unlink_own(self.path, self.inode)
            self.inode = 0
        for pool in self.pools.values():
            # Once: by the second call (close_pools, RETIRE_GRACE later) a successor, of the
            # same key and so of the same paths, may have bound this pool's path anew.
            unlink_own(pool.path, pool.inode)
            pool.inode = 0

    def close_pools(self) -> None:
        """Retire every pool: its socket unlinked, its waiting processes killed (they ran
        nothing); processes that took a request finish it."""
        self.unlink_pools()
        for pool in self.pools.values():
            for pid in list(pool.waiting):
                self.end_waiting(pool, pid)
            self.end_zygote(pool)
            if pool.broken:
                self.selector.unregister(pool.listener)
            pool.listener.close()
        self.pools = {}

    def accept_pool(self, listener: Any) -> None:
        """A launcher asks for a pool: make it (or find it) and answer with its socket path."""
        conn, _ = self.listener.accept()
        self.owner.last_active = time.monotonic()
        with conn:
            try:
                pid, uid = peer_pid_uid(conn)
                if uid != os.getuid():
                    raise ForkServerError(f"peer pid {pid} runs as uid {uid}, not {os.getuid()}")
                conn.settimeout(REQUEST_TIMEOUT)
                request, fds = receive(conn)
                for fd in fds:
                    os.close(fd)
                if "exit" in request:
                    answer = self.exit_of(request["exit"])
                else:
                    pool = self.pool_for(request.get("pool"))
                    answer = {"error": pool.broken} if pool.broken else {"socket": pool.path}
            except (OSError, ValueError, ForkServerError) as exc:
                answer = {"error": str(exc)}
            with contextlib.suppress(OSError):
                conn.sendall(frame(answer))

    def pool_for(self, spec: Any) -> _Pool:
        """The pool of this policy, started (and filling) if it is new."""
        if not isinstance(spec, dict):
            raise ValueError("a pool request is {pool: {argv, env, cwd, size}}")
        argv, env, cwd, size = (spec.get("argv"), spec.get("env"), spec.get("cwd") or "/",
                                spec.get("size", 1))
        process = spec.get("process", "kernel")
        if process not in PROCESSES:
            raise ValueError(f"a pool's process is one of {', '.join(PROCESSES)}, not {process!r}")
        if (not isinstance(argv, list) or not all(isinstance(arg, str) for arg in argv)
                or not isinstance(env, dict)
                or not all(isinstance(v, str) for v in env.values())
                or not isinstance(cwd, str) or not isinstance(size, int) or not 1 <= size <= 64):
            raise ValueError("a pool is {argv: [str], env: {str: str}, cwd: str, size: 1-64}")
        path = pool_path(os.path.dirname(self.owner.path), os.path.basename(self.owner.path)
                         .removesuffix(".sock"), argv, env, cwd, process)
        pool = self.pools.get(path)
        if pool is None:
            if self.companion is None:
                from sandbox_kernel.confine import companion

                _, self.companion = companion.start(self.owner.close_in_child)
            pool = self.pools[path] = _Pool(path, *listen(path), argv, env, cwd, size, process)
            self.start_zygote(pool)
        pool.size = max(pool.size, size)
        self.refill(pool)
        return pool

    def refill(self, pool: _Pool) -> None:
        """Fork waiting processes until the pool has its size (off any request's path)."""
        while (not pool.broken and len(pool.waiting) + len(pool.asked) < pool.size
               and not self.owner.retiring):
            self.fork_one_shot(pool)

    def start_zygote(self, pool: _Pool) -> None:
        """Fork the pool's zygote: it builds the kernel once, then forks the pool's processes."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            self.become_zygote(pool, ours, theirs)
        theirs.close()
        if pool.process == "shell":  # the lean zygote's first message: what it builds
            lean_zygote.send_spec(ours, pool.argv, pool.env, list(self.owner.preload))
        pool.control, pool.zygote, pool.zygote_pidfd = ours, pid, os.pidfd_open(pid)
        self.selector.register(pool.zygote_pidfd, selectors.EVENT_READ,
                               lambda _: self.zygote_ended(pool))
        # Its answers are read as they come: the server never waits for the zygote's build.
        self.selector.register(ours, selectors.EVENT_READ, lambda _: self.zygote_answered(pool))

    def become_zygote(self, pool: _Pool, ours: socket.socket, theirs: socket.socket) -> None:
        """In the child: the pool's zygote, with the pool's listener and the companion's
        registry for the processes it forks, and none of the server's other descriptors."""
        try:
            ours.close()
            os.setsid()
            os.chdir(pool.cwd)
            listener = pool.listener.dup()
            assert self.companion is not None
            registry = os.dup(self.companion)
            self.owner.close_in_child()
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)  # fd 2 stays the server's log: a refusal to start is told there
            os.close(null)
            if pool.process == "shell":
                lean_zygote.exec_in_child(theirs, listener, registry)
            from . import zygote

            zygote.serve(theirs, listener, registry, pool.argv, pool.env, os.getuid())
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(1)

    def zygote_ended(self, pool: _Pool) -> None:
        """The pool's zygote is gone (it could not build the kernel): the pool is broken."""
        code = self.reap_zygote(pool)
        self.break_pool(pool, f"the one-shot kernels' zygote ended (exit code {code}) before "
                              "the pool was retired; the fork server's log says why")

    def reap_zygote(self, pool: _Pool) -> int | None:
        """Forget the zygote's pidfd and reap it (once); its exit code."""
        if pool.zygote_pidfd < 0:
            return None
        self.selector.unregister(pool.zygote_pidfd)
        _, status = os.waitpid(pool.zygote, 0)
        os.close(pool.zygote_pidfd)
        pool.zygote_pidfd = -1
        return os.waitstatus_to_exitcode(status)

    def end_zygote(self, pool: _Pool) -> None:
        """Retire the pool's zygote: its control socket closed, killed (it holds no request)."""
        self.forget_asked(pool)
        if pool.control is not None:
            self.selector.unregister(pool.control)
            pool.control.close()
            pool.control = None
        if pool.zygote_pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pool.zygote_pidfd, signal.SIGKILL)
            self.reap_zygote(pool)

    def fork_one_shot(self, pool: _Pool) -> None:
        """Ask the zygote to fork one process for the pool (answered in zygote_answered); the
        process tells `taken` once it has its request."""
        taken_read, taken_write = os.pipe()
        os.set_blocking(taken_read, False)  # read when the pidfd speaks too (one_shot_taken)
        try:
            if pool.control is None:
                raise OSError("the pool has no zygote")
            socket.send_fds(pool.control, [FORK], [taken_write])
        except OSError as exc:
            os.close(taken_read)
            self.break_pool(pool, f"the one-shot kernels' zygote cannot be asked for a "
                                  f"process ({exc}); the fork server's log says why")
            return
        finally:
            os.close(taken_write)
        pool.asked.append(taken_read)
        self.one_shots += 1

    def zygote_answered(self, pool: _Pool) -> None:
        """The zygote forked the process asked first (its pid), or could not (why)."""
        assert pool.control is not None
        try:
            answer = pool.control.recv(256)
        except OSError as exc:
            answer = f"error: {exc}".encode()
        if not answer.isdigit() or not pool.asked:
            self.forget_asked(pool)
            self.selector.unregister(pool.control)  # nothing more will come that is of use
            pool.control.close()
            pool.control = None
            self.break_pool(pool, "the one-shot kernels' zygote forked no process ("
                            f"{answer.decode(errors='replace') or 'it ended'}); the fork "
                            "server's log says why")
            return
        self.waiting_for_request(pool, int(answer), pool.asked.pop(0))

    def forget_asked(self, pool: _Pool) -> None:
        """Close the taken pipes of forks the zygote never answered."""
        for taken in pool.asked:
            os.close(taken)
        pool.asked = []

    def waiting_for_request(self, pool: _Pool, pid: int, taken_read: int) -> None:
        """A process of the pool exists (the server's child: zygote.py forks it with
        CLONE_PARENT): watch it and its taken pipe, whichever speaks first."""
        pidfd = os.pidfd_open(pid)
        pool.waiting[pid] = (pidfd, taken_read)
        for fd in (pidfd, taken_read):
            self.selector.register(fd, selectors.EVENT_READ,
                                   lambda _: self.one_shot_taken(pool, pid))

    def one_shot_taken(self, pool: _Pool, pid: int) -> None:
        """A pooled process took its request: it is the caller's now; a successor starts.

        Or it ended without one (it could not confine itself): its pipe closed unwritten. Its
        pidfd can speak first, in the same round, for a process that took its request and
        ended at once; the pipe tells, so such a run never counts as a failure (three in a
        row break the pool). Called once: the other fd's event is stale then (rounds.py)."""
        pidfd, taken = pool.waiting.pop(pid)
        self.selector.unregister(taken)
        try:
            took = os.read(taken, 1) == b"+"
        except BlockingIOError:  # ended, and a copy of the pipe outlives it: nothing taken
            took = False
        os.close(taken)
        self.owner.last_active = time.monotonic()
        self.busy[pid] = pidfd  # reaped, its exit code kept, once its pidfd says it ended
        self.selector.modify(pidfd, selectors.EVENT_READ, lambda _: self.reap_busy(pid))
        if took:
            pool.failures = 0
        else:
            self.pool_failed(pool, pid)
        self.refill(pool)

    def pool_failed(self, pool: _Pool, pid: int) -> None:
        """Count a pooled process that never took a request; three in a row break the pool."""
        pool.failures += 1
        if pool.failures >= POOL_FAILURES:
            self.break_pool(pool, f"{POOL_FAILURES} one-shot kernels in a row ended before "
                                  f"taking a request (the last: pid {pid}); the fork server's "
                                  "log says why")

    def break_pool(self, pool: _Pool, reason: str) -> None:
        """No more processes for this pool; its callers are told why (once broken, it stays)."""
        if pool.broken:
            return
        pool.broken = reason
        # Callers waiting in the backlog learn why; the server reads nothing they sent.
        self.selector.register(pool.listener, selectors.EVENT_READ,
                               lambda _: self.refuse_broken(pool))

    def refuse_broken(self, pool: _Pool) -> None:
        """Tell a caller of a broken pool why no process takes its request, and hang up."""
        conn, _ = pool.listener.accept()
        with conn, contextlib.suppress(OSError):
            from sandbox_kernel.kernel import oneshot_wire

            conn.sendall(oneshot_wire.record(oneshot_wire.REFUSED, pool.broken.encode()))

    def end_waiting(self, pool: _Pool, pid: int) -> None:
        """Kill a waiting process (it ran nothing), forget and reap it."""
        pidfd, taken = pool.waiting.pop(pid)
        self.selector.unregister(pidfd)
        self.selector.unregister(taken)
        os.close(taken)
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(pidfd)

    def reap_busy(self, pid: int) -> None:
        """A one-shot process that took its request ended: keep its exit code a while."""
        pidfd = self.busy.pop(pid)
        self.selector.unregister(pidfd)
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
        self.exits[pid] = os.waitstatus_to_exitcode(status)
        while len(self.exits) > 1024:
            del self.exits[next(iter(self.exits))]
        self.owner.last_active = time.monotonic()

    def exit_of(self, pid: Any) -> dict[str, Any]:
        """How a one-shot process that died under its caller ended (the caller cannot wait
        for a process that is not its child)."""
        if pid in self.busy:
            with selectors.DefaultSelector() as waiter:
                waiter.register(self.busy[pid], selectors.EVENT_READ)
                if waiter.select(2.0):
                    self.reap_busy(pid)
        if pid not in self.exits:
            return {"error": f"no exit code known for process {pid!r}"}
        return {"exit": self.exits[pid]}

    def close_in_child(self) -> None:
        """In a forked child: close every pool's descriptors and the pools' listener."""
        for pool in self.pools.values():
            pool.listener.close()
            if pool.control is not None:
                pool.control.close()
            if pool.zygote_pidfd >= 0:
                os.close(pool.zygote_pidfd)
            for taken in pool.asked:
                os.close(taken)
            for pidfd, taken in pool.waiting.values():
                os.close(pidfd)
                os.close(taken)
        for pidfd in self.busy.values():
            os.close(pidfd)
        self.pools, self.busy = {}, {}
        if self.companion is not None:
            os.close(self.companion)
            self.companion = None
        if self.listener.fileno() >= 0:
            self.listener.close()
