"""What an execution cost, as the kernel itself sees it, for its execute_reply's metadata.

A caller next to the kernel reads these figures from /proc, where user code cannot alter them
(client/meter.py); a caller of a remote kernel has only this report. getrusage has no per-call
peak: ru_maxrss is the process's high-water mark so far, an upper bound for the execution.
CPU and refusals count from the end of the previous execution (see client/meter.py): what a
thread left running spent between executions is in the next one's figures. The egress proxy's
CPU for this kernel's connections (spent in its companion, outside the kernel) comes from the
companion's tally, counted the same way: a step still running when the execution ends is in
the next execution's figure. So do the requests each secret was added to (`secret_uses`), and
the companion's CPU answering and recording the kernel's refused calls (`companion_cpu_seconds`,
confine/audit.py): a flood of refusals is billed to the execution that made it.
"""

from __future__ import annotations

import resource
from typing import Any, NamedTuple

from ..confine.tally import Tally


class _Figures(NamedTuple):
    rusage: Any
    refused: int
    egress: float
    answers: float
    uses: dict[str, int]


class SelfUsage:
    """The kernel's own CPU, peak memory and refused calls around each execution, and its
    companion's CPU for it (answering refused calls, the egress proxy)."""

    def __init__(self) -> None:
        self.refusals: Tally | None = None  # set by the application when the reaper counts
        self.before: _Figures | None = None
        self.reported: _Figures | None = None  # the figures the last report ended at

    def start(self) -> None:
        """Take the figures an execution starts from: where the last one's report ended."""
        self.before = self.reported or self._now()

    def report(self) -> dict[str, Any]:
        """The execution's figures since start(), JSON-able."""
        if self.before is None:
            return {}
        was, now = self.before, self._now()
        self.reported = now
        counted = self.refusals is not None
        return {
            "cpu_user_seconds": round(now.rusage.ru_utime - was.rusage.ru_utime, 6),
            "cpu_system_seconds": round(now.rusage.ru_stime - was.rusage.ru_stime, 6),
            "peak_memory_bytes": now.rusage.ru_maxrss * 1024,
            "refused_syscalls": now.refused - was.refused if counted else None,
            "egress_cpu_seconds": round(now.egress - was.egress, 6) if counted else None,
            "companion_cpu_seconds": round(now.answers - was.answers, 6) if counted else None,
            "secret_uses": {name: uses - was.uses.get(name, 0)
                            for name, uses in now.uses.items()} if now.uses else None,
        }

    def _now(self) -> _Figures:
        tally = self.refusals
        return _Figures(resource.getrusage(resource.RUSAGE_SELF),
                        0 if tally is None else tally.value(),
                        0.0 if tally is None else tally.egress_seconds(),
                        0.0 if tally is None else tally.answers_seconds(),
                        {} if tally is None else tally.secret_uses())
