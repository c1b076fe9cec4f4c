"""What the kernel's companion does for it, counted where the kernel reads it: the reaper adds.

The reaper (or the one-shots' companion) answers every refused call (audit.py) and serves the
egress proxy, outside the kernel; the kernel reports each execution's cost in its execute_reply.
One shared page carries the counts between them: the calls refused, the CPU the companion
spent answering and recording them (audit.py), the CPU the egress proxy spent on the kernel's
connections (egress/cputime.py), and how many requests each of the
kernel's secrets was added to (egress/secret.py; the companion names the slots, since only it
knows every secret's name, e.g. those of a --secrets-file). It is a memfd the kernel creates before
its filter is loaded, maps read-only and hands to the reaper, which maps it writable; a refused
call is counted before it is answered, so it has been counted by the time it returns in the
kernel, and the proxy adds its CPU after each step of a connection's work. User code could only
falsify its own report, which it can do anyway: a figure the kernel reports is labelled as the
kernel's. It cannot shrink the memfd (its own descriptor is mmap's, which keeps one): the memfd
is sealed against resizing, since a page cut from under the reaper's mapping would kill the
reaper (SIGBUS).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct

_COUNT = struct.Struct("=Q")
_REFUSALS, _CPU_NS, _ANSWERS_NS = 0, _COUNT.size, 2 * _COUNT.size  # the counts' offsets
_NAME = 56  # bytes of a secret's name in its slot (names are environment variable names)
_SLOT = struct.Struct(f"={_NAME}sQ")  # a secret's name, then its uses
_SECRETS, SECRET_SLOTS = 3 * _COUNT.size, 32  # where the slots start; how many secrets count
_SIZE = _SECRETS + SECRET_SLOTS * _SLOT.size
_MAX = 2**64 - 1
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Tally:
    """The shared counts: refused calls, the CPU answering them and the egress proxy's CPU in
    nanoseconds (each an unsigned 64-bit integer, each with one writer: the auditor's thread,
    the proxy's)."""

    def __init__(self, fd: int, writable: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.map = mmap.mmap(fd, _SIZE, flags=mmap.MAP_SHARED, prot=prot)
        # The writers keep their own counts and never read the page: whatever user code writes
        # there (it can make its read-only view writable) reaches only the kernel's report.
        self.count = 0
        self.cpu_ns = 0
        self.answers_ns = 0
        self.slots: dict[str, int] = {}  # a secret's slot (the companion's side)
        self.uses: list[int] = []

    @staticmethod
    def create() -> int:
        """A new zeroed count's descriptor (close-on-exec, its size sealed), for Tally and the
        reaper."""
        fd = os.memfd_create("sandbox-kernel-tally", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, _SIZE)
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
        return seals & _SEALS == _SEALS and os.fstat(fd).st_size >= _SIZE

    def add(self) -> None:
        """Count one refused call (the reaper's side)."""
        self.count += 1
        _COUNT.pack_into(self.map, _REFUSALS, self.count & _MAX)

    def charge(self, seconds: float) -> None:
        """Add CPU the egress proxy spent for the kernel (the proxy's thread)."""
        if self.map.closed:  # the kernel is gone and its tally unmapped: nothing to report to
            return
        self.cpu_ns += max(0, round(seconds * 1e9))
        _COUNT.pack_into(self.map, _CPU_NS, self.cpu_ns & _MAX)

    def charge_answers(self, seconds: float) -> None:
        """Add CPU the companion spent answering and recording refused calls (its auditor)."""
        if self.map.closed:
            return
        self.answers_ns += max(0, round(seconds * 1e9))
        _COUNT.pack_into(self.map, _ANSWERS_NS, self.answers_ns & _MAX)

    def name_secrets(self, names: list[str]) -> None:
        """Give the kernel's secrets their slots, once, before any is used (the companion).

        Past SECRET_SLOTS secrets (or a name longer than a slot holds) the rest are not counted
        per secret; their uses are still in the audit record, one line each."""
        fitting = [name for name in sorted(set(names)) if len(name.encode()) <= _NAME]
        self.slots = {name: slot for slot, name in enumerate(fitting[:SECRET_SLOTS])}
        self.uses = [0] * len(self.slots)
        for name, slot in self.slots.items():
            _SLOT.pack_into(self.map, _SECRETS + slot * _SLOT.size, name.encode(), 0)

    def use(self, name: str) -> None:
        """Count one request the secret `name` was added to (the proxy's thread)."""
        slot = self.slots.get(name)
        if slot is None or self.map.closed:
            return
        self.uses[slot] += 1
        _COUNT.pack_into(self.map, _SECRETS + slot * _SLOT.size + _NAME, self.uses[slot] & _MAX)

    def secret_uses(self) -> dict[str, int]:
        """Each named secret's uses so far (the kernel's side)."""
        found = {}
        for slot in range(SECRET_SLOTS):
            raw, uses = _SLOT.unpack_from(self.map, _SECRETS + slot * _SLOT.size)
            name = raw.rstrip(b"\0").decode("ascii", "replace")
            if not name:
                break
            found[name] = int(uses)
        return found

    def value(self) -> int:
        """How many calls were refused so far."""
        return int(_COUNT.unpack_from(self.map, _REFUSALS)[0])

    def egress_seconds(self) -> float:
        """The CPU the egress proxy has spent for the kernel so far."""
        return int(_COUNT.unpack_from(self.map, _CPU_NS)[0]) / 1e9

    def answers_seconds(self) -> float:
        """The CPU the companion has spent answering the kernel's refused calls so far."""
        return int(_COUNT.unpack_from(self.map, _ANSWERS_NS)[0]) / 1e9
