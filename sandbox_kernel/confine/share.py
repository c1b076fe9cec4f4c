"""How much of its unconfined companion's CPU one kernel's refused calls may take.

Each call the filter refuses waits until the kernel's companion (its reaper, or the one-shots'
companion) answers it (audit.py). An answer costs the companion more CPU than the call cost the
kernel: a wake-up, two ioctls and the Python around them, against one system call. Unpaced,
eight threads of user code refusing calls in a loop made the one-shots' companion spend 1.5-3.9
times the run's own CPU, billed to nobody and outside every limit, in the process that answers
every one-shot. So a kernel's answers are paid from a budget: FREE seconds of the companion's
CPU at first (tens of answers, each of the first hundred with its record: more than an ordinary
run's library probes ask for), refilled by SHARE of the CPU the kernel itself spends (read from
/proc/<pid>/stat, which user code cannot alter; in clock ticks, so up to SAVED is kept for
later), never by time alone. A kernel past its budget waits: its waiting calls (BATCH at most)
are answered in one turn after PAUSE seconds, then after twice as long, and so on up to
LONGEST_PAUSE, until its own CPU has paid for more. A flood crawls, nothing hangs, and what the
companion spends on a kernel stays within FREE + SHARE x its CPU + one turn per pause (a run
that waits out a 60 s deadline gets about seventeen).
"""

from __future__ import annotations

import os

from .logrelay import TokenBucket

FREE = 0.002  # the companion's CPU seconds a kernel's answers may take at first ...
SHARE = 0.25  # ... and per second of CPU the kernel spends after that ...
SAVED = 0.005  # ... of which at most this much is kept for later (more than a clock tick's)
PAUSE = 1.0  # past both, seconds before the next answer: a flood slows down, never stops;
LONGEST_PAUSE = 4.0  # the pause doubles while the kernel stays past its share, up to this
_TICK = os.sysconf("SC_CLK_TCK")


class ProcessCpu:
    """A process's CPU so far, every thread's user and system time, from its /proc stat file."""

    def __init__(self, pid: int | None) -> None:
        self.last = 0.0
        try:
            self.fd = -1 if pid is None else os.open(f"/proc/{pid}/stat",
                                                     os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # gone already, or not ours to read: it pays for nothing
            self.fd = -1

    def __call__(self) -> float:
        """The seconds so far (in clock ticks); what was read last once the process is gone."""
        if self.fd >= 0:
            try:  # after the name, which user code chooses and may end with ") "
                fields = os.pread(self.fd, 1024, 0).rsplit(b")", 1)[1].split()
                self.last = (int(fields[11]) + int(fields[12])) / _TICK
            except (OSError, ValueError, IndexError):
                pass
        return self.last

    def close(self) -> None:
        """Close the stat file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CpuShare:
    """The companion's CPU budget for one kernel: FREE at once, then SHARE of the kernel's CPU."""

    def __init__(self, pid: int | None) -> None:
        self.cpu = ProcessCpu(pid)
        self.bucket = TokenBucket(SAVED, SHARE, clock=self.cpu)
        self.bucket.tokens = FREE

    def allows(self) -> bool:
        """Whether the budget has CPU left (the kernel's CPU is read only once it seems not)."""
        return self.bucket.tokens > 0 or self.bucket.available() > 0

    def spend(self, seconds: float) -> None:
        """Charge CPU the companion spent for the kernel (after the fact: it may go in debt,
        by SAVED at most: a turn made slow by a cold cache must not stop the kernel for good)."""
        self.bucket.spend(seconds)
        self.bucket.tokens = max(self.bucket.tokens, -SAVED)

    def close(self) -> None:
        """Stop reading the kernel's CPU."""
        self.cpu.close()
