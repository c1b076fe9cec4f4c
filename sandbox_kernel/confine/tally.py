"""A count of the calls the seccomp filter refused: the reaper adds, the kernel reads.

The reaper answers every refused call (audit.py) but lives outside the kernel; the kernel reports
each execution's cost in its execute_reply. One shared page carries the count between them: a
memfd the kernel creates before its filter is loaded, maps read-only and hands to the reaper,
which maps it writable and adds one before it answers each refused call, so a refused call has
been counted by the time it returns in the kernel. User code could only falsify its own report,
which it can do anyway: a figure the kernel reports is labelled as the kernel's. It cannot
shrink the memfd (its own descriptor is mmap's, which keeps one): the memfd is sealed against
resizing, since a page cut from under the reaper's mapping would kill the reaper (SIGBUS).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct

_COUNT = struct.Struct("=Q")
_MAX = 2**64 - 1
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Tally:
    """The shared count of refused calls (one unsigned 64-bit integer)."""

    def __init__(self, fd: int, writable: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.map = mmap.mmap(fd, _COUNT.size, flags=mmap.MAP_SHARED, prot=prot)
        # The writer keeps its own count and never reads the page: whatever user code writes
        # there (it can make its read-only view writable) reaches only the kernel's report.
        self.count = 0

    @staticmethod
    def create() -> int:
        """A new zeroed count's descriptor (close-on-exec, its size sealed), for Tally and the
        reaper."""
        fd = os.memfd_create("sandbox-kernel-refusals", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, _COUNT.size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except OSError:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def sealed(fd: int) -> bool:
        """Whether fd is a count no one can resize: the only kind the reaper may map."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # not a memfd
            return False
        return seals & _SEALS == _SEALS and os.fstat(fd).st_size >= _COUNT.size

    def add(self) -> None:
        """Count one refused call (the reaper's side)."""
        self.count += 1
        _COUNT.pack_into(self.map, 0, self.count & _MAX)

    def value(self) -> int:
        """How many calls were refused so far."""
        return int(_COUNT.unpack_from(self.map)[0])
