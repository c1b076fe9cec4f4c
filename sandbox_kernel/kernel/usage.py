"""What an execution cost, as the kernel itself sees it, for its execute_reply's metadata.

A caller next to the kernel reads these figures from /proc, where user code cannot alter them
(client/meter.py); a caller of a remote kernel has only this report. getrusage has no per-call
peak: ru_maxrss is the process's high-water mark so far, an upper bound for the execution.
CPU and refusals count from the end of the previous execution (see client/meter.py): what a
thread left running spent between executions is in the next one's figures.
"""

from __future__ import annotations

import resource
from typing import Any

from ..confine.tally import Tally


class SelfUsage:
    """The kernel's own CPU, peak memory and refused calls around each execution."""

    def __init__(self) -> None:
        self.refusals: Tally | None = None  # set by the application when the reaper counts
        self.before: tuple[Any, int] | None = None
        self.reported: tuple[Any, int] | None = None  # the figures the last report ended at

    def start(self) -> None:
        """Take the figures an execution starts from: where the last one's report ended."""
        self.before = self.reported or (resource.getrusage(resource.RUSAGE_SELF),
                                        self._refused())

    def report(self) -> dict[str, Any]:
        """The execution's figures since start(), JSON-able."""
        if self.before is None:
            return {}
        (was, refused_before), now = self.before, resource.getrusage(resource.RUSAGE_SELF)
        refused = self._refused()
        self.reported = (now, refused)
        return {
            "cpu_user_seconds": round(now.ru_utime - was.ru_utime, 6),
            "cpu_system_seconds": round(now.ru_stime - was.ru_stime, 6),
            "peak_memory_bytes": now.ru_maxrss * 1024,
            "refused_syscalls": None if self.refusals is None else refused - refused_before,
        }

    def _refused(self) -> int:
        return 0 if self.refusals is None else self.refusals.value()
