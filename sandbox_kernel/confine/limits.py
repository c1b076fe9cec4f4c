"""Resource limits (rlimits) for the kernel process, applied before user code exists.

Memory uses RLIMIT_DATA, not RLIMIT_AS: address-space limits break thread creation (every thread
reserves a large stack and glibc arenas reserve 64 MiB each), while RLIMIT_DATA counts what is
actually private and writable. It misses shared mappings, so the seccomp filter refuses shared
anonymous mmap and memfd_create, and SysV/POSIX shared memory is refused or out of reach.
"""

from __future__ import annotations

import re
import resource
import signal
from typing import Any

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


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


def apply(memory: int, cpu_seconds: int, file_size: int, open_files: int) -> dict[str, Any]:
    """Apply the policy's limits (0 means no limit) and report them."""
    report: dict[str, Any] = {"core": _lower(resource.RLIMIT_CORE, 0)}
    if memory:
        report["data"] = _lower(resource.RLIMIT_DATA, memory)
    if cpu_seconds:
        # SIGXCPU at the soft limit, SIGKILL at the hard one a little later.
        report["cpu"] = _lower(resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 5)
    if file_size:
        # Without this, going past the limit kills the process instead of failing with EFBIG.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        report["fsize"] = _lower(resource.RLIMIT_FSIZE, file_size)
    report["nofile"] = _lower(resource.RLIMIT_NOFILE, open_files)
    return report
