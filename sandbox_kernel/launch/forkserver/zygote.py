"""A pool's zygote: the one-shot kernel built and warmed once, forked for each pooled process.

The fork server forks one zygote per pool (pools.py). It does what a pooled process used to do
before its confinement, once: the pool's environment, the application with its configuration,
the kernel and its shell, a warm-up execution (kernel/oneshot.py `build`). It then forks, on the
server's word, one process per pool member; each makes its per-process parts and confines itself
(`OneShotKernelApp.confine`: every layer, in kernel/app.py's order), then waits for its one
request. The zygote never confines itself, never accepts a connection and never holds a request's
bytes: no request exists in any process it forked from, and it forks nothing after one.

Its children are forked with CLONE_PARENT: they are the server's children, as a pooled process
always was, so the server reaps them, learns their exit codes and is what they die with (the
kernel checks its parent is the server before its seccomp filter). The zygote dies with the
server, and ends when the server closes its end of the control socket (the pool retired).

The control socket (SOCK_SEQPACKET): the server sends "fork" with the write end of the new
process's `taken` pipe; the zygote answers with the child's pid, or "error: why".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any, NoReturn

from .. import fontcache
from . import sharing
from .protocol import main_module, thread_count

_CLONE_PARENT = 0x00008000
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
FORK = b"fork"
NAME = b"sk-zygote"  # its /proc/<pid>/comm: `ps` and bench/service.py tell it from the others


def fork_sibling() -> int:
    """fork(), but the child's parent is this process's parent (clone with CLONE_PARENT).

    os.fork cannot ask for it; this is os.fork's sequence around the raw clone: Python's
    before-fork hooks and locks, then its after-fork work in the child and the parent. Called
    only while single-threaded (as os.fork should be).
    """
    syscall, arguments = _clone_call()
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = syscall(*arguments)
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        return 0
    error = ctypes.get_errno()
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(error, f"clone(CLONE_PARENT): {os.strerror(error)}")
    return int(pid)


@functools.cache
def _clone_call() -> tuple[Any, tuple[Any, ...]]:
    """libc's syscall() and clone's arguments, made once: objects the zygote makes anew for
    each fork are pages it writes while its newest child still shares them, each one copied."""
    number = _SYS_CLONE.get(os.uname().machine)
    if number is None:
        raise OSError(f"no clone syscall number known for {os.uname().machine}")
    syscall = ctypes.PyDLL(None, use_errno=True).syscall  # PyDLL: the GIL stays held
    syscall.restype = ctypes.c_long
    return syscall, (ctypes.c_long(number), ctypes.c_ulong(_CLONE_PARENT | signal.SIGCHLD),
                     *(ctypes.c_long(0) for _ in range(4)))


def serve(control: socket.socket, listener: socket.socket, registry: int, argv: list[str],
          env: dict[str, str], server_uid: int,
          build: Callable[[list[str]], Any] | None = None) -> NoReturn:
    """In the zygote (forked from the server, its descriptors closed; or started fresh for the
    lean process, lean_zygote.py): build, then fork. build: what builds the pooled processes'
    object from the pool's argv (kernel/oneshot.py's `build`, unless given)."""
    libc = ctypes.CDLL(None, use_errno=True)
    server = os.getppid()
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != server:
        os._exit(1)
    with open("/proc/self/comm", "rb") as comm:
        name = comm.read().strip()  # the server's, given back to each process forked
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(NAME), 0, 0, 0)
    font_cache = os.environ.get("MPLCONFIGDIR", "")  # the server's, built for every kernel
    fonts = fontcache.font_lists(font_cache) if font_cache else []
    app = _build(argv, env, build)
    sharing.compact_modules()  # again: the build imported more (see the server's)
    if thread_count() != 1:
        _say(f"the zygote has {thread_count()} threads after building the kernel; a "
             "multi-threaded process cannot fork safely")
        os._exit(1)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 64, 1)
        except OSError:
            os._exit(0)
        if message != FORK or len(fds) != 1:  # the server retired the pool (or broke protocol)
            for fd in fds:
                os.close(fd)
            os._exit(0)
        taken = fds[0]
        try:
            pid = fork_sibling()
        except OSError as exc:
            os.close(taken)
            control.send(f"error: {exc}".encode())
            continue
        if pid == 0:
            control.close()
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
            _become_pooled(app, listener, registry, taken, argv, env, server_uid, fonts)
        os.close(taken)
        control.send(str(pid).encode())


def _build(argv: list[str], env: dict[str, str],
           build: Callable[[list[str]], Any] | None) -> Any:
    """The application, as a pooled process's start would build it, in a temporary home.

    The environment is the one a pooled process gets (environment.allowed) with a temporary
    directory standing in for the scratch: configuration is read from the same places, and
    the IPython dir it makes there is removed; each pooled process makes its own (confine).
    """
    from sandbox_kernel.confine.environment import allowed

    if build is None:
        from sandbox_kernel.kernel import oneshot

        build = oneshot.build
    home = tempfile.mkdtemp(prefix="sandbox-kernel-zygote-")
    try:
        os.environ.clear()
        os.environ.update(allowed(home, argv, env))
        sys.argv = [main_module(), *argv]
        try:
            return build(list(argv))
        except SystemExit as exc:
            os._exit(exc.code if isinstance(exc.code, int) else 1)
        except BaseException:
            import traceback

            traceback.print_exc(file=sys.__stderr__)
            os._exit(1)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _become_pooled(app: Any, listener: socket.socket, registry: int, taken: int,
                   argv: list[str], env: dict[str, str], server_uid: int,
                   fonts: list[str]) -> NoReturn:
    """In a pooled process: its scratch and companion channel, every layer, one request."""
    from sandbox_kernel.confine import companion
    from sandbox_kernel.confine.environment import prepare

    from .child import forget_environment, reseed

    code = 1
    try:
        os.setsid()
        def register(scratch: str) -> int:
            return companion.register(registry, scratch)

        kernel_env = prepare(argv, dict(env), companion=register,
                             kept=(listener.fileno(), taken, app.launcher_stderr))
        fontcache.copy_lists(fonts, kernel_env.get("MPLCONFIGDIR", ""))
        replace_environment(kernel_env)
        forget_environment()
        reseed()
        app.confine()
        app.serve_one(listener, taken, server_uid)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        with contextlib.suppress(OSError, ValueError):
            os.write(app.launcher_stderr, traceback.format_exc().encode())
    os._exit(code)


def replace_environment(env: dict[str, str]) -> None:
    """os.environ becomes exactly env, keys in env's order, as clear() then update(env) make
    it: only the variables that differ from the zygote's are unset or set (each one a call
    into libc's environment, on pages the zygote's process holds)."""
    for name in [name for name in os.environ if name not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    if list(os.environ) != list(env):  # the zygote's order differed: env's, as update makes
        os.environ.clear()
        os.environ.update(env)


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"sandbox-kernel zygote: {line}\n".encode())
