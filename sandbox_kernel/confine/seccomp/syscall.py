"""Plumbing: libseccomp, and the raw seccomp(2) calls that load a compiled program.

Raw calls rather than libseccomp's own load: a fork server's kernels load programs the server
compiled (program.py), which libseccomp can only load from the filter context that built them.
The flags are those libseccomp would choose (TSYNC, with TSYNC_ESRCH where Linux has it).

libseccomp (through pyseccomp) is imported on first use, by a process that compiles. A lean
zygote compiles nothing: its fork server hands it the programs and the two facts below that
libseccomp found out (`told`), so neither the binding nor the library is in its image.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path
from typing import Any

from ..errors import ConfinementError, waiver


class SeccompError(ConfinementError):
    """The filter could not be built, loaded or verified."""

    layer = "seccomp"
    fix = waiver("a system-call filter", "--no-seccomp")


# What a process that compiled the programs found out, told to one that loads them without
# libseccomp (program.adopt): "available" (why seccomp cannot be used, or None), "seccomp"
# (seccomp(2)'s number) and "tsync_flags". Empty in a process that asks libseccomp itself.
told: dict[str, Any] = {}


@functools.cache
def _binding() -> tuple[Any, str | None]:
    """pyseccomp, imported on first use; or why it cannot be."""
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as exc:  # RuntimeError: libseccomp not found
        return None, (f"libseccomp is not usable ({exc}); install the system package "
                      "libseccomp2 (Debian/Ubuntu: apt-get install libseccomp2)")
    return pyseccomp, None


def libseccomp() -> Any:
    """The pyseccomp module, to compile with (SeccompError when libseccomp is not usable)."""
    module, reason = _binding()
    if module is None:
        raise SeccompError(reason)
    return module


@functools.cache
def available() -> str | None:
    """None when seccomp can be used here; otherwise why not (a fact of the running Linux
    and libseccomp: found out once per process, by a fork server for all its kernels and
    for its lean zygotes, which are told it)."""
    if "available" in told:
        return told["available"]  # type: ignore[no-any-return]
    _, reason = _binding()
    if reason is not None:
        return reason
    status = Path("/proc/self/status").read_text()
    if "Seccomp:" not in status:
        return "this Linux kernel was built without seccomp support"
    return None


# struct sock_filter (linux/filter.h) is 8 bytes: code, jt, jf, k.
INSTRUCTION_SIZE = 8
# seccomp(2) and prctl(2) (linux/seccomp.h, linux/prctl.h).
_SECCOMP_SET_MODE_FILTER = 1
_FLAG_TSYNC = 1
_FLAG_NEW_LISTENER = 1 << 3
_FLAG_TSYNC_ESRCH = 1 << 4
_PR_SET_NO_NEW_PRIVS = 38


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


@functools.cache
def seccomp_number() -> int:
    """seccomp(2)'s number here, looked up once (a fork server's kernels inherit it, a lean
    zygote is told it)."""
    if "seccomp" in told:
        return int(told["seccomp"])
    sc = libseccomp()
    return int(sc.resolve_syscall(sc.Arch.NATIVE, "seccomp"))


def _seccomp(flags: int, program: Any) -> int:
    """seccomp(SECCOMP_SET_MODE_FILTER, flags, program); OSError when it fails."""
    number = seccomp_number()
    result = _libc().syscall(ctypes.c_long(number), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                             ctypes.c_long(flags), program)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(result)


@functools.cache
def tsync_flags() -> int:
    """TSYNC, with TSYNC_ESRCH where this Linux has it, as libseccomp chooses them.

    TSYNC_ESRCH makes a failed synchronisation an ESRCH error instead of a thread id, which is
    what lets TSYNC and the notification listener (whose fd is the result) go together.
    """
    if "tsync_flags" in told:
        return int(told["tsync_flags"])
    try:  # a NULL program: EFAULT if the flags are understood, EINVAL if not
        _seccomp(_FLAG_TSYNC | _FLAG_TSYNC_ESRCH, None)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            return _FLAG_TSYNC | _FLAG_TSYNC_ESRCH
    return _FLAG_TSYNC


def load(program: bytes, listener: bool) -> int | None:
    """Load a BPF program into every thread as libseccomp's load would; the listener's fd if
    asked for one."""
    # Without CAP_SYS_ADMIN, seccomp() requires no_new_privs; libseccomp sets it before each load.
    no_new_privs = (ctypes.c_ulong(value) for value in (1, 0, 0, 0))
    if _libc().prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), *no_new_privs) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")
    flags = tsync_flags()
    if listener:
        if not flags & _FLAG_TSYNC_ESRCH:  # the kernel refuses TSYNC with a listener without it
            raise SeccompError("recording denials with every thread filtered needs Linux 5.7")
        flags |= _FLAG_NEW_LISTENER
    instructions = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // INSTRUCTION_SIZE, ctypes.addressof(instructions))
    result = _seccomp(flags, ctypes.byref(fprog))
    if listener:
        return result
    if result:  # without TSYNC_ESRCH, a thread that could not be synchronised is named
        raise OSError(errno.ESRCH, f"thread {result} could not receive the filter")
    return None


_SECCOMP_FIELD = b"\nSeccomp:"


def thread_modes() -> dict[int, int]:
    """Seccomp mode of every thread of this process (2 means a filter is active).

    Raw reads of each /proc/self/task/TID/status: in a freshly forked kernel, pathlib's
    objects cost three times the reads themselves (~0.75 ms of every start).
    """
    modes = {}
    for name in os.listdir("/proc/self/task"):
        try:
            fd = os.open(f"/proc/self/task/{name}/status", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # the thread ended meanwhile: it runs nothing unfiltered
            continue
        try:
            status = os.read(fd, 65536)  # the whole file (about 1.5 KiB) in one read
        finally:
            os.close(fd)
        start = status.find(_SECCOMP_FIELD)
        if start >= 0:  # a Linux without seccomp has no such line
            value = status[start + len(_SECCOMP_FIELD):].split(b"\n", 1)[0]
            modes[int(name)] = int(value)
    return modes
