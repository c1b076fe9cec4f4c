"""Per-execution usage of a local kernel, read from outside it, in /proc/<pid>.

The caller knows its kernel's pid (the provisioner's: the process it started, or the one a fork
server forked for it). Before a request it resets the kernel's peak-memory mark (writing "5" to
/proc/<pid>/clear_refs resets VmHWM and nothing else; root may do it for a kernel of another
uid) and reads its CPU times (/proc/<pid>/stat: every thread, in clock ticks); once the kernel
is idle it reads both again. Where the reset is refused, VmRSS is sampled each time the run loop
looks at the kernel instead ("sampled"). A kernel with no local process (a remote provisioner)
gets the figures the kernel reports about itself ("kernel").

The files stay open for the kernel's life: pread re-reads a /proc file, a few microseconds a run.

An execution's CPU is counted from the end of the kernel's previous execution, not from its own
start: a thread a cell left running spends CPU between executions, and that CPU must be in some
figure a caller can bill, so it is in the next execution's (the first execution of a kernel
counts from its own start: starting the kernel is the operator's).

CPU spent after a sandbox's last execution (a thread still running) is in no execution's figures;
the sandbox's total (SessionTotal, `Sandbox.total_usage()`) counts every tick of its kernels from
their first execution on, whenever it is asked: what a session spends is in a figure to bill.
"""

from __future__ import annotations

import os
from typing import Any

from .execution import Usage

_TICK = os.sysconf("SC_CLK_TCK")
_KERNEL_FIGURES = ("cpu_user_seconds", "cpu_system_seconds", "peak_memory_bytes",
                   "refused_syscalls", "egress_cpu_seconds", "companion_cpu_seconds")


class KernelProcess:
    """The /proc files of one local kernel process, open for reading again and again."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.stat = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        self.status = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
        self.billed: tuple[int, int] | None = None  # CPU ticks when the last execution ended
        self.first: tuple[int, int] | None = None  # CPU ticks when the first execution started
        self.clear_refs: int | None = None
        try:
            self.clear_refs = os.open(f"/proc/{pid}/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:  # neither root nor the kernel's uid: peak memory is sampled
            self.clear_refs = None

    def cpu_ticks(self) -> tuple[int, int]:
        """User and system time of every thread, in clock ticks."""
        fields = os.pread(self.stat, 1024, 0).rsplit(b")", 1)[1].split()
        return int(fields[11]), int(fields[12])  # stat fields 14 and 15 (utime, stime)

    def memory(self, key: bytes) -> int:
        """A Vm* line of the status file (VmHWM, VmRSS) in bytes."""
        status = os.pread(self.status, 8192, 0)
        # At a line's start: the first line is the process's name, which user code chooses.
        start = status.index(b"\n" + key + b":") + len(key) + 2
        return int(status[start:status.index(b"kB", start)]) * 1024

    def reset_peak(self) -> bool:
        """Reset VmHWM to the current RSS; False where this caller may not."""
        if self.clear_refs is None:
            return False
        try:
            os.write(self.clear_refs, b"5")
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Close the files."""
        for fd in (self.stat, self.status, self.clear_refs):
            if fd is not None:
                os.close(fd)


def open_process(pid: Any) -> KernelProcess | None:
    """The kernel's /proc files, or None where the kernel is not a local process we can read."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        return KernelProcess(pid)
    except OSError:
        return None


class SessionTotal:
    """What a sandbox's kernels spent in all: the host's CPU ticks of each kernel process from
    its first execution on, billed or not; the CPU of one-shot runs (each kernel ends with its
    run, so its execution's figures are all it spent); the companion's CPU its executions were
    charged (the egress proxy's, and answering refused calls). A kernel replaced (a restart,
    a lost kernel) adds what it spent up to its last reading."""

    def __init__(self) -> None:
        self.ended = (0.0, 0.0)  # CPU seconds of kernels no longer current, and one-shot runs
        self.local = False  # some kernel's CPU was read from the host
        self.egress: float | None = None
        self.companion: float | None = None

    def spent(self, process: KernelProcess | None) -> tuple[int, int]:
        """The current kernel's ticks since its first execution (its last ones, if it is gone)."""
        if process is None or process.first is None:
            return 0, 0
        try:
            now = process.cpu_ticks()
        except (OSError, ValueError):  # gone: what the host read last
            now = process.billed or process.first
        return now[0] - process.first[0], now[1] - process.first[1]

    def retire(self, process: KernelProcess | None) -> None:
        """The process is about to end or be replaced: keep what it spent (once)."""
        user, system = self.spent(process)
        self._add(user / _TICK, system / _TICK)
        if process is not None:
            process.first = None

    def add_run(self, usage: Usage, own_kernel: bool) -> None:
        """An execution's figures; own_kernel: it had a kernel of its own (a one-shot run)."""
        if usage.egress_cpu_seconds is not None:
            self.egress = (self.egress or 0.0) + usage.egress_cpu_seconds
        if usage.companion_cpu_seconds is not None:
            self.companion = (self.companion or 0.0) + usage.companion_cpu_seconds
        if own_kernel and usage.cpu_user_seconds is not None \
                and usage.cpu_system_seconds is not None:
            self._add(usage.cpu_user_seconds, usage.cpu_system_seconds)
            self.local = self.local or usage.source.get("cpu_user_seconds") == "host"

    def usage(self, process: KernelProcess | None) -> Usage:
        """The totals so far, the current kernel's ticks included; CPU None where no kernel of
        the sandbox was ever a local process (its executions' own figures are all there is)."""
        total = Usage(egress_cpu_seconds=self.egress, companion_cpu_seconds=self.companion)
        if self.egress is not None:
            total.source["egress_cpu_seconds"] = "kernel"
        if self.companion is not None:
            total.source["companion_cpu_seconds"] = "kernel"
        self.local = self.local or (process is not None and process.first is not None)
        if self.local:
            user, system = self.spent(process)
            total.cpu_user_seconds = round(self.ended[0] + user / _TICK, 6)
            total.cpu_system_seconds = round(self.ended[1] + system / _TICK, 6)
            total.source.update(cpu_user_seconds="host", cpu_system_seconds="host")
        return total

    def _add(self, user: float, system: float) -> None:
        self.ended = (self.ended[0] + user, self.ended[1] + system)


class Meter:
    """One execution's usage: started before the request goes out, stopped at idle."""

    def __init__(self, process: KernelProcess | None) -> None:
        self.process = process
        self.cpu: tuple[int, int] | None = None
        self.peak: int | None = None
        self.sampling = False
        self.host = Usage()
        if process is not None:
            try:
                self.sampling = not process.reset_peak()
                self.peak = process.memory(b"VmRSS") if self.sampling else None
                now = process.cpu_ticks()
                self.cpu = process.billed or now  # from where the last execution's ended
                process.first = process.first or now
            except (OSError, ValueError):  # the kernel is gone: its own report stands
                self.process = None

    def sample(self) -> None:
        """Where the peak cannot be reset, take the current RSS into the peak."""
        if self.sampling and self.process is not None:
            try:
                self.peak = max(self.peak or 0, self.process.memory(b"VmRSS"))
            except (OSError, ValueError):
                self.process = None

    def stop(self) -> None:
        """Take the host's figures: at idle, or before a lost kernel is replaced."""
        self.host = Usage()
        if self.process is None or self.cpu is None:
            return
        try:
            user, system = self.process.cpu_ticks()
            peak = self.process.memory(b"VmRSS" if self.sampling else b"VmHWM")
        except (OSError, ValueError):  # died meanwhile
            return
        self.process.billed = (user, system)
        self.host.cpu_user_seconds = (user - self.cpu[0]) / _TICK
        self.host.cpu_system_seconds = (system - self.cpu[1]) / _TICK
        self.host.peak_memory_bytes = max(peak, self.peak or 0)
        self.host.source.update(cpu_user_seconds="host", cpu_system_seconds="host",
                                peak_memory_bytes="sampled" if self.sampling else "host")

    def finish(self, wall: float, output: int, result: int,
               reply: dict[str, Any] | None) -> Usage:
        """The Usage: the host's figures, the kernel's own where the host has none."""
        usage = self.host
        usage.wall_seconds, usage.output_bytes, usage.result_bytes = wall, output, result
        usage.source.update(wall_seconds="caller", output_bytes="caller", result_bytes="caller")
        reported = ((reply or {}).get("metadata") or {}).get("sandbox") or {}
        _kernel_figures(usage, reported.get("usage") if isinstance(reported, dict) else None)
        return usage


def _kernel_figures(usage: Usage, reported: Any) -> None:
    """Fill the figures the host did not measure from the kernel's report (if well-formed)."""
    if not isinstance(reported, dict):
        return
    for name in _KERNEL_FIGURES:
        value = reported.get(name)
        if name in usage.source or isinstance(value, bool) \
                or not isinstance(value, (int, float)) or value < 0:
            continue
        setattr(usage, name, int(value) if name in ("peak_memory_bytes", "refused_syscalls")
                else float(value))
        usage.source[name] = "kernel"
    uses = reported.get("secret_uses")
    if isinstance(uses, dict) and all(isinstance(name, str) and type(count) is int
                                      and count >= 0 for name, count in uses.items()):
        usage.secret_uses = dict(uses)
        usage.source["secret_uses"] = "kernel"  # noqa: S105 (a figure's name, not a password)
