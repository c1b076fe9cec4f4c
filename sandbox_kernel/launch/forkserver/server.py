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

The server also keeps pools of one-shot kernels (pools.py: their listeners, zygotes, processes
and exit codes); both are served by the one socket loop here (`serve`), and retire together.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
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
from .listeners import listen, unlink_own
from .pools import DEFAULT_MAX_ONE_SHOTS, RETIRE_GRACE, OneShotPools
from .protocol import (
    DEFAULT_IDLE,
    DEFAULT_MAX_AGE,
    DEFAULT_MAX_FORKS,
    REQUEST_TIMEOUT,
    ForkServerError,
    frame,
    main_module,
    peer_pid_uid,
    receive,
    split_names,
    thread_count,
)

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
        self.listener, self.bound_inode = listen(self.path)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, self.accept)
        # Its pools of one-shot kernels (pools.py): their requests' socket is beside this one.
        self.one_shot_pools = OneShotPools(self, self.selector)

    @property
    def retiring(self) -> bool:
        """Past its fork budget or age: take no new requests (the shared seed/layout ages)."""
        return (self.forks >= self.max_forks
                or self.one_shot_pools.one_shots >= self.max_one_shots
                or time.monotonic() - self.started >= self.max_age)

    def serve(self) -> None:
        """Run until retired (and every child reported) or idle."""
        listening, retired_at = True, 0.0
        while True:
            if listening and self.retiring:
                self.stop_listening()
                listening, retired_at = False, time.monotonic()
            pools = self.one_shot_pools
            if not listening and pools.pools and time.monotonic() - retired_at > RETIRE_GRACE:
                pools.close_pools()  # every connection made before the unlink was taken by now
            if not listening and not self.children and not pools.busy and not pools.pools:
                return
            if not self.children and not pools.busy \
                    and time.monotonic() - self.last_active > self.idle:
                pools.close_pools()
                return
            run_round(self.selector, 1.0)

    def stop_listening(self) -> None:
        """Unlink the socket so that the next client starts a fresh server."""
        unlink_own(self.path, self.bound_inode)
        self.bound_inode = 0
        self.selector.unregister(self.listener)
        self.listener.close()
        self.one_shot_pools.unlink_pools()

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
        self.one_shot_pools.close_in_child()
        self.selector.close()
        if self.listener.fileno() >= 0:
            self.listener.close()


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
