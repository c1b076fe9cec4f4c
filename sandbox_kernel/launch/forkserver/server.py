"""The fork server: a single-threaded process that has imported the kernel, forking kernels.

It has done the imports a kernel needs once, in a clean environment, and holds no thread, ZMQ
context, event loop or traitlets singleton; its one IPython shell never ran code and is there for
its kernels to adopt (kernel/prebuilt.py). Per request it forks a child that does exactly what a
cold kernel does after its re-exec (`environment.prepare`, then `app.main`): its own scratch and
reaper, rlimits, identity, Landlock, sockets, seccomp, serve.

The server forks *before* it reads a request: the child reads its own request (argv, env, stdio)
and tells the server, through a pipe, whether it was well formed. So no request's bytes, and
nothing parsed from one, are ever in the server's heap, from which every later kernel is forked:
kernels of one server never see each other's arguments or environment, even in freed memory.
If a client hangs up after its kernel started, its launcher is gone and the kernel is killed (what
ipykernel's parent poller does for a cold kernel). Everything user code can observe is per kernel:
`random` (and numpy's) reseeded, `tempfile.tempdir` reset, the server's descriptors closed, the
environment, stdio and working directory the launcher's. The hash seed and address-space layout
are shared by one server's children, so a server retires after `max_forks` forks or `max_age`
seconds (docs/SECURITY.md).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...confine.rounds import run_round
from ...confine.vault import VAULT_VAR
from .child import forget_environment, reseed
from .protocol import (
    DEFAULT_IDLE,
    DEFAULT_MAX_AGE,
    DEFAULT_MAX_FORKS,
    REQUEST_TIMEOUT,
    ForkServerError,
    frame,
    main_module,
    peer_pid_uid,
    pools_path,
    receive,
    split_names,
    thread_count,
)
from .zygote import FORK

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
    # A network kernel's reaper serves its egress proxy (confine/reaper.py) and imported these
    # per kernel: ~10 ms of CPU in every network kernel's reaper, for modules that never change.
    "sandbox_kernel.confine.egress.proxy", "sandbox_kernel.confine.egress.rules",
)



@dataclass
class _Child:
    conn: socket.socket
    pidfd: int
    hung_up: bool = False


RETIRE_GRACE = 2.0  # seconds a retiring server's pools still take connections made before
POOL_FAILURES = 3  # pooled processes in a row that end before taking a request: pool broken
DEFAULT_MAX_ONE_SHOTS = 5000  # one-shot processes a server forks before it retires


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
    waiting: dict[int, tuple[int, int]] = field(default_factory=dict)  # pid -> (pidfd, taken)
    failures: int = 0
    broken: str = ""
    control: socket.socket | None = None  # to the pool's zygote (zygote.py), once forked
    asked: list[int] = field(default_factory=list)  # taken pipes of forks asked, unanswered
    zygote: int = 0  # its pid
    zygote_pidfd: int = -1


def pool_path(directory: str, key: str, argv: list[str], env: dict[str, str], cwd: str) -> str:
    """Where the pool of this policy listens (the same policy, the same pool)."""
    digest = hashlib.sha256(json.dumps([argv, env, cwd], sort_keys=True).encode()).hexdigest()
    # Short: a unix socket's path has at most 107 bytes, and the directory comes first.
    return os.path.join(directory, f"{key}.{digest[:8]}.sock")


@dataclass
class Server:
    """The single-threaded loop: accept requests, fork kernels, report their exits."""

    path: str
    preload: Sequence[str] = ()
    max_forks: int = DEFAULT_MAX_FORKS
    max_age: float = DEFAULT_MAX_AGE
    idle: float = DEFAULT_IDLE
    forks: int = 0
    max_one_shots: int = DEFAULT_MAX_ONE_SHOTS
    one_shots: int = 0  # forked for pools
    children: dict[int, _Child] = field(default_factory=dict)
    pools: dict[str, _Pool] = field(default_factory=dict)
    busy: dict[int, int] = field(default_factory=dict)  # one-shot pid -> pidfd, after taking
    companion: int | None = None  # the registry of the one-shots' companion, once started
    exits: dict[int, int] = field(default_factory=dict)  # recent one-shots' exit codes
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
        from sandbox_kernel.kernel import prebuilt
        from sandbox_kernel.kernel.app import SandboxKernelApp
        from sandbox_kernel.kernel.oneshot import OneShotKernelApp
        from sandbox_kernel.launch import fontcache

        from . import sharing

        paths.interpreter_paths()
        fontcache.build(os.environ.get("MPLCONFIGDIR", ""))  # for every kernel to copy
        privileges.prepare()
        seccomp.precompile()
        SandboxKernelApp.prebuild_parser()
        OneShotKernelApp.prebuild_parser()  # the pools' kernels (kernel/oneshot.py)
        prebuilt.prebuild_shell()  # the IPython shell each kernel adopts (kernel/prebuilt.py)
        # A collection in a child walks every object and writes to it: each page the server
        # shares with its kernels would be copied. Frozen objects are never collected.
        gc.collect()
        if prebuilt.left_behind():
            raise ForkServerError("the IPython shell built to warm its classes is still "
                                  "referenced after collection; a server holds no such shell")
        sharing.share_kernel_start()
        gc.freeze()
        if thread_count() != 1:
            raise ForkServerError(f"the server has {thread_count()} threads after importing "
                                  f"{', '.join(self.preload) or 'the kernel'}; a multi-threaded "
                                  "process cannot fork safely: do not preload that module")

    def bind(self) -> None:
        """Listen on the socket path (replacing a dead server's socket)."""
        self.listener, self.bound_inode = _listen(self.path)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, self.accept)
        self.pools_listener, self.pools_inode = _listen(self.pools_path)
        self.selector.register(self.pools_listener, selectors.EVENT_READ, self.accept_pool)

    @property
    def pools_path(self) -> str:
        """Where launchers ask for pools of one-shot kernels (beside the server's socket)."""
        return pools_path(self.path)

    @property
    def retiring(self) -> bool:
        """Past its fork budget or age: take no new requests (the shared seed/layout ages)."""
        return (self.forks >= self.max_forks or self.one_shots >= self.max_one_shots
                or time.monotonic() - self.started >= self.max_age)

    def serve(self) -> None:
        """Run until retired (and every child reported) or idle."""
        listening, retired_at = True, 0.0
        while True:
            if listening and self.retiring:
                self.stop_listening()
                listening, retired_at = False, time.monotonic()
            if not listening and self.pools and time.monotonic() - retired_at > RETIRE_GRACE:
                self.close_pools()  # every connection made before the unlink was taken by now
            if not listening and not self.children and not self.busy and not self.pools:
                return
            if not self.children and not self.busy \
                    and time.monotonic() - self.last_active > self.idle:
                self.close_pools()
                return
            run_round(self.selector, 1.0)

    def stop_listening(self) -> None:
        """Unlink the socket so that the next client starts a fresh server."""
        _unlink_own(self.path, self.bound_inode)
        self.bound_inode = 0
        self.selector.unregister(self.listener)
        self.listener.close()
        self.unlink_pools()

    def unlink_pools(self) -> None:
        """No new connections to any pool (nor pools); the waiting processes still take the
        connections made before, for RETIRE_GRACE seconds (close_pools then ends them)."""
        if self.pools_listener.fileno() >= 0:
            self.selector.unregister(self.pools_listener)
            self.pools_listener.close()
            _unlink_own(self.pools_path, self.pools_inode)
            self.pools_inode = 0
        for pool in self.pools.values():
            # Once: by the second call (close_pools, RETIRE_GRACE later) a successor, of the
            # same key and so of the same paths, may have bound this pool's path anew.
            _unlink_own(pool.path, pool.inode)
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

    # --- pools of one-shot kernels (kernel/oneshot.py) ------------------------------------------

    def accept_pool(self, listener: Any) -> None:
        """A launcher asks for a pool: make it (or find it) and answer with its socket path."""
        conn, _ = self.pools_listener.accept()
        self.last_active = time.monotonic()
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
        if (not isinstance(argv, list) or not all(isinstance(arg, str) for arg in argv)
                or not isinstance(env, dict)
                or not all(isinstance(v, str) for v in env.values())
                or not isinstance(cwd, str) or not isinstance(size, int) or not 1 <= size <= 64):
            raise ValueError("a pool is {argv: [str], env: {str: str}, cwd: str, size: 1-64}")
        path = pool_path(os.path.dirname(self.path), os.path.basename(self.path)
                         .removesuffix(".sock"), argv, env, cwd)
        pool = self.pools.get(path)
        if pool is None:
            if self.companion is None:
                from sandbox_kernel.confine import companion

                _, self.companion = companion.start(self.close_in_child)
            pool = self.pools[path] = _Pool(path, *_listen(path), argv, env, cwd, size)
            self.start_zygote(pool)
        pool.size = max(pool.size, size)
        self.refill(pool)
        return pool

    def refill(self, pool: _Pool) -> None:
        """Fork waiting processes until the pool has its size (off any request's path)."""
        while (not pool.broken and len(pool.waiting) + len(pool.asked) < pool.size
               and not self.retiring):
            self.fork_one_shot(pool)

    def start_zygote(self, pool: _Pool) -> None:
        """Fork the pool's zygote: it builds the kernel once, then forks the pool's processes."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            self.become_zygote(pool, ours, theirs)
        theirs.close()
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
            self.close_in_child()
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)  # fd 2 stays the server's log: a refusal to start is told there
            os.close(null)
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
        self.last_active = time.monotonic()
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
        self.last_active = time.monotonic()

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

    def accept(self, listener: Any) -> None:
        """A client: check who it is, and fork the child that reads its request."""
        conn, _ = self.listener.accept()
        self.last_active = time.monotonic()
        try:
            pid, uid = peer_pid_uid(conn)
            if uid != os.getuid():
                raise ForkServerError(f"peer pid {pid} runs as uid {uid}, not {os.getuid()}")
            if thread_count() != 1:
                raise ForkServerError("the server is multi-threaded and cannot fork safely")
            self.fork(conn)
        except (OSError, ForkServerError) as exc:
            self.refuse(conn, exc)

    @staticmethod
    def refuse(conn: socket.socket, exc: Exception | str) -> None:
        """Say why there is no kernel, and hang up."""
        with contextlib.suppress(OSError):
            conn.sendall(frame({"error": str(exc)}))
        conn.close()

    def fork(self, conn: socket.socket) -> None:
        """Fork a child that reads the request itself; report it once it took the request."""
        verdict_read, verdict_write = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(verdict_read)
            os.close(verdict_write)
            raise
        if pid == 0:
            os.close(verdict_read)
            self.serve_request(conn, verdict_write)
        os.close(verdict_write)
        pidfd = os.pidfd_open(pid)
        if not self.request_taken(verdict_read):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(pidfd)
            conn.close()  # the child told the client why, or the client sent nothing in time
            return
        self.forks += 1
        self.children[pid] = _Child(conn, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, lambda _: self.reap(pid))
        self.selector.register(conn, selectors.EVENT_READ, lambda _: self.hang_up(pid))
        try:
            socket.send_fds(conn, [frame({"pid": pid})], [pidfd])
        except OSError:
            self.hang_up(pid)  # the launcher left before it learned of its kernel

    @staticmethod
    def request_taken(verdict: int) -> bool:
        """Whether the child read a well-formed request (it says so on the verdict pipe)."""
        with os.fdopen(verdict, "rb", buffering=0) as pipe:
            with selectors.DefaultSelector() as waiter:
                waiter.register(pipe, selectors.EVENT_READ)
                if not waiter.select(REQUEST_TIMEOUT + 1.0):
                    return False
            return pipe.read(1) == b"+"

    def serve_request(self, conn: socket.socket, verdict: int) -> None:
        """In the child: read the request, say whether it is usable, become its kernel."""
        try:
            self.close_in_child()  # before reading: nothing of another kernel stays open
            try:
                argv, env, fds, cwd = self.read_request(conn)
            except (OSError, ValueError, ForkServerError) as exc:
                self.refuse(conn, exc)  # before the verdict: the server kills a refused child
                os.write(verdict, b"-")
                os._exit(0)
            os.write(verdict, b"+")
            os.close(verdict)
            conn.close()  # the child's launcher talks to the server, not to the kernel
        except BaseException:
            os._exit(1)
        self.become_kernel(argv, env, fds, cwd)

    @staticmethod
    def read_request(conn: socket.socket) -> tuple[list[str], dict[str, str], list[int], str]:
        """argv, env, descriptors and cwd of a request; ValueError when it is not well formed.

        The descriptors: stdio, then the ready pipe and the vault where the request says it
        brings them (a request from before the vault names no "ready": a fourth is the pipe).
        """
        conn.settimeout(REQUEST_TIMEOUT)
        request, fds = receive(conn)
        argv, env, cwd = request.get("argv"), request.get("env"), request.get("cwd") or "/"
        extra = (int(request.get("ready", len(fds) == 4) is True)
                 + int(request.get("vault") is True))
        if (len(fds) != 3 + extra or not isinstance(argv, list) or not isinstance(env, dict)
                or not isinstance(cwd, str)
                or not all(isinstance(arg, str) for arg in argv)
                or not all(isinstance(value, str) for value in env.values())):
            for fd in fds:
                os.close(fd)
            raise ValueError("a request is {argv: [str], env: {str: str}, cwd: str} with "
                             "three descriptors (stdio) and, optionally, a ready pipe and a "
                             "vault")
        env.pop(VAULT_VAR, None)  # only the descriptor this request brought is the vault
        if request.get("vault") is True:
            env[VAULT_VAR] = str(fds.pop())
        return argv, env, fds, cwd

    def reap(self, pid: int) -> None:
        """The child ended: tell its client how."""
        _, status = os.waitpid(pid, 0)
        child = self.children.pop(pid)
        self.selector.unregister(child.pidfd)
        if not child.hung_up:
            self.selector.unregister(child.conn)
        os.close(child.pidfd)
        with contextlib.suppress(OSError):
            child.conn.sendall(frame({"exit": os.waitstatus_to_exitcode(status)}))
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
        """In the child: exactly what a cold kernel does after its re-exec, then exit.

        stdio: the kernel's fds 0-2, then optionally the launcher's ready pipe.
        """
        code = 1
        try:
            os.setsid()  # its own process group, as jupyter_client gives a cold kernel
            # Where the launcher would have started it (under Jupyter, the notebook's folder):
            # the kernel remembers it to explain a refused relative name (confine/denials.py).
            os.chdir(cwd)
            self.close_in_child()
            for target, fd in enumerate(stdio[:3]):
                os.dup2(fd, target)
            from sandbox_kernel.confine.environment import READY_VAR, prepare
            from sandbox_kernel.kernel.app import main
            from sandbox_kernel.launch import fontcache

            # Only the pipe this request brought may be named the ready pipe, never another fd.
            env.pop(READY_VAR, None)
            if len(stdio) == 4:
                env[READY_VAR] = str(stdio[3])
            kernel_env = prepare(argv, env)  # closes the remaining server descriptors
            fontcache.copy_into(os.environ.get("MPLCONFIGDIR", ""),
                                kernel_env.get("MPLCONFIGDIR", ""))
            os.environ.clear()
            os.environ.update(kernel_env)
            forget_environment()
            reseed()  # after prepare: making the scratch fixed tempfile's default dir
            sys.argv = [main_module(), *argv]
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
            sys.stderr.flush()
            # Not through atexit: a kernel that failed half-way (e.g. a port another process
            # took) has sockets open, and ipykernel's atexit close() then waits for them in
            # context.term() for ever, while its launcher waits for it to answer or end.
            os._exit(1)
        finally:
            _exit_like_python(code)

    def close_in_child(self) -> None:
        """Close the server's listening sockets and every other kernel's descriptors."""
        for child in self.children.values():
            child.conn.close()
            os.close(child.pidfd)
        self.children = {}  # closed once: become_kernel calls this again
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
        self.selector.close()
        for listener in (self.listener, self.pools_listener):
            if listener.fileno() >= 0:
                listener.close()


def _listen(path: str) -> tuple[socket.socket, int]:
    """A unix listener at path that only this server's user may connect to, and the inode
    of its socket file (replacing a dead server's)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(path)
    except OSError as exc:  # "AF_UNIX path too long" has no errno: say what to change
        listener.close()
        raise OSError(f"cannot listen at {path}: {exc}; set JUPYTER_RUNTIME_DIR to a "
                      "directory with a shorter path") from exc
    finally:
        os.umask(old_umask)
    listener.listen(64)
    return listener, os.stat(path).st_ino


def _unlink_own(path: str, inode: int) -> None:
    """Unlink the socket file this server bound at path, if it still is that one (inode 0:
    unlinked already). A successor has the same key, so the same paths: its sockets stay."""
    with contextlib.suppress(FileNotFoundError):
        if inode and os.stat(path).st_ino == inode:
            os.unlink(path)


def _exit_like_python(code: int) -> None:
    """Run atexit handlers and flush, as an interpreter exit would, but never return."""
    import atexit

    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve_main(argv: Sequence[str] | None = None) -> None:
    """`python -I -m sandbox_kernel.launch.forkserver.server --socket PATH ...`: run a server."""
    parser = argparse.ArgumentParser(prog="sandbox-kernel-forkserver")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--preload", default="")
    parser.add_argument("--max-forks", type=int, default=DEFAULT_MAX_FORKS)
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE)
    parser.add_argument("--idle", type=float, default=DEFAULT_IDLE)
    parser.add_argument("--ready-fd", type=int)
    args = parser.parse_args(argv)
    server = Server(args.socket, split_names(args.preload), args.max_forks, args.max_age, args.idle)
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




if __name__ == "__main__":
    serve_main()
