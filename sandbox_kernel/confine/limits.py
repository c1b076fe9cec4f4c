"""Resource limits (rlimits) for the kernel process, applied before user code exists.

The memory limit is the kernel's whole memory: its scratch tmpfs (RAM, which no rlimit counts)
takes its size out of it, and RLIMIT_DATA gets the rest (heap_limit).

Memory uses RLIMIT_DATA, not RLIMIT_AS: address-space limits break thread creation (every thread
reserves a large stack and glibc arenas reserve 64 MiB each), while RLIMIT_DATA counts what is
actually private and writable. It misses shared mappings, so the seccomp filter refuses shared
anonymous mmap, MAP_GROWSDOWN and memfd_create, and SysV/POSIX shared memory is refused or out of
reach.

Threads use RLIMIT_NPROC, which the kernel checks at every clone() against the number of tasks
the caller's real uid has host-wide. A kernel with a uid of its own therefore gets exactly its
bound. One that shares its uid gets the bound on top of the tasks the uid had at start-up: the
uid as a whole cannot pass that sum through this kernel, however many of its tasks come and go.
uid 0 is exempt from RLIMIT_NPROC, so it bounds nothing there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import signal
from typing import Any

from .libc import libc as _libc

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
DEFAULT_MEMORY_LIMIT = 4 * 2**30  # the kernel's whole memory: heap and scratch tmpfs together


def parse_size(text: str) -> int:
    """Bytes from '512M', '2G', '1048576' (binary units; 0 means no limit)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (use a number of bytes or e.g. 512M, 2G)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def _lower(limit: int, soft: int, hard: int | None = None) -> dict[str, int]:
    """Set a limit no higher than what is already in force; return what was set."""
    current_soft, current_hard = resource.getrlimit(limit)
    hard = soft if hard is None else hard

    def cap(value: int, ceiling: int) -> int:
        return value if ceiling == resource.RLIM_INFINITY else min(value, ceiling)

    new_hard = cap(hard, current_hard)
    new_soft = min(cap(soft, current_soft), new_hard)
    resource.setrlimit(limit, (new_soft, new_hard))
    return {"soft": new_soft, "hard": new_hard}


def lower_priority(increment: int) -> dict[str, int]:
    """Raise the nice value by increment, with no way back for user code.

    Called while the process has one thread: the threads made later inherit it. RLIMIT_NICE 0
    lets no nice value be lowered (setpriority, nice, sched_setattr's sched_nice), RLIMIT_RTPRIO
    0 lets no real-time policy be taken (sched_setattr carries its policy in memory, where
    seccomp cannot read it); a host may grant either to the launcher's user.
    """
    _lower(resource.RLIMIT_NICE, 0)
    _lower(resource.RLIMIT_RTPRIO, 0)
    value = os.nice(increment) if increment else os.getpriority(os.PRIO_PROCESS, 0)
    return {"nice": value, "increment": increment}


def has_tasks(uid: int) -> bool:
    """Whether any task (thread) of this PID namespace has uid as its real uid.

    One system call, where scanning /proc costs a stat per process: getpriority(PRIO_USER)
    walks the tasks in the kernel and fails with ESRCH when none has that real uid (the uid
    RLIMIT_NPROC counts; /proc shows a directory's owner as the effective one).
    """
    try:
        os.getpriority(os.PRIO_USER, uid)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return False
        raise
    return True


def tasks_of(uid: int) -> int:
    """Tasks (threads) the real uid has now, as far as /proc shows them."""
    if not has_tasks(uid):  # a fresh uid of a kernel's own: no /proc scan needed
        return 0
    count = 0
    for entry in os.scandir("/proc"):
        try:
            # The directory's owner (the effective uid) rules most processes out with one
            # stat; the status file then gives the real uid, which RLIMIT_NPROC counts.
            if not entry.name.isdigit() or entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:  # gone meanwhile, or hidden from us
            continue
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields["Threads"])
    return count


def thread_bound(max_threads: int, uid: int) -> int:
    """RLIMIT_NPROC that lets this (single-threaded) process run max_threads threads as uid."""
    others = tasks_of(uid) - (1 if uid == os.getuid() else 0)
    return max(others, 0) + max_threads


def _one_malloc_arena() -> None:
    """Every thread allocates from glibc's main heap, which gives freed memory back for real.

    A thread's own arena gives it back with MADV_DONTNEED, leaving the pages mapped and counted
    in RLIMIT_DATA: user code that once filled memory from threads would keep that much less for
    good, down to threads that cannot start (CPython then waits forever in Thread.start).
    """
    M_ARENA_MAX = -8  # malloc.h
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        _libc().mallopt(M_ARENA_MAX, 1)


def heap_limit(memory: int, scratch_quota: int | None) -> int:
    """RLIMIT_DATA for a memory limit that counts a scratch tmpfs of scratch_quota bytes too."""
    if not memory or not scratch_quota:
        return memory
    if scratch_quota >= memory:
        raise ValueError(f"--scratch-size {scratch_quota / 2**20:g}M leaves nothing of "
                         f"--memory-limit {memory / 2**20:g}M, which counts the scratch (RAM) "
                         "too: lower --scratch-size or raise --memory-limit")
    return memory - scratch_quota


def apply(memory: int, cpu_seconds: int, file_size: int, open_files: int,
          max_threads: int = 0, uid: int | None = None, nice: int = 0) -> dict[str, Any]:
    """Apply the policy's limits (0 means no limit) and report them.

    uid is whom user code will run as: RLIMIT_NPROC counts that uid's tasks. nice: how much
    lower than now the process's CPU priority becomes (lower_priority).
    """
    report: dict[str, Any] = {"core": _lower(resource.RLIMIT_CORE, 0)}
    report["priority"] = lower_priority(nice)
    if memory:
        report["data"] = _lower(resource.RLIMIT_DATA, memory)
        _one_malloc_arena()
    if cpu_seconds:
        # SIGXCPU at the soft limit, SIGKILL at the hard one a little later.
        report["cpu"] = _lower(resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 5)
    if file_size:
        # Without this, going past the limit kills the process instead of failing with EFBIG.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        report["fsize"] = _lower(resource.RLIMIT_FSIZE, file_size)
    report["nofile"] = _lower(resource.RLIMIT_NOFILE, open_files)
    if max_threads and uid:
        report["nproc"] = _lower(resource.RLIMIT_NPROC, thread_bound(max_threads, uid))
        report["nproc"]["threads"] = max_threads
    return report
