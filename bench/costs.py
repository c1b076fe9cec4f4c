"""Where a fresh fork-served kernel's CPU and memory go: evidence for the fork-server targets.

A rate is bounded by the CPU one request costs the whole machine (2 cores), so the rate rows
are explained by that cost, measured the same way for a fork-served kernel and for a process
per request: every CPU's busy time from /proc/stat across a block of requests run one after
the other (idle machine assumed; anything else running is counted too), split into user and
system time, and the client's own share from getrusage. A fork-served kernel's memory is
explained by what it has written of the pages it shares with its server: its private dirty
pages per kind of mapping, and the page faults (copy-on-write copies, mostly) it took.
"""

from __future__ import annotations

import os
import resource
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from bench.kernels import FORK, Kernel

TICK = os.sysconf("SC_CLK_TCK")
REQUESTS = 30


def _machine_busy() -> tuple[int, int]:
    """(user, system) clock ticks of every CPU so far: the first line of /proc/stat."""
    user, nice, system = (int(field) for field in Path("/proc/stat").read_text().split()[1:4])
    return user + nice, system


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def request_cost(request: Callable[[], object], count: int = REQUESTS) -> dict[str, float]:
    """Milliseconds per request: wall, machine CPU (user, system) and this client's CPU."""
    request()  # the first one may start a server or fill a cache
    before, own, started = _machine_busy(), _own_cpu(), time.perf_counter()
    for _ in range(count):
        request()
    wall, after = time.perf_counter() - started, _machine_busy()
    user, system = ((b - a) * 1000 / TICK / count for a, b in zip(before, after, strict=True))
    return {"wall": wall * 1000 / count, "user": user, "system": system,
            "client": (_own_cpu() - own) * 1000 / count}


def cost_lines(costs: dict[str, dict[str, float]]) -> list[str]:
    """One line per kind of request, and what a 2-core machine can serve at that cost."""
    lines = []
    for kind, cost in costs.items():
        machine = cost["user"] + cost["system"]
        lines.append(
            f"- {kind}: {cost['wall']:.1f} ms per request one at a time; machine CPU "
            f"{machine:.1f} ms per request (user {cost['user']:.1f}, system "
            f"{cost['system']:.1f}; the client's own {cost['client']:.1f}): at most "
            f"{2000 / machine:.1f} requests/s on 2 cores.")
    return lines


def _private_dirty_by_kind(pid: int) -> Counter[str]:
    """KiB of private dirty pages per kind of mapping: heap, anonymous, stacks, libraries."""
    kinds: Counter[str] = Counter()
    kind = "anonymous"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            name = fields[5] if len(fields) > 5 else ""
            kind = ("heap" if name == "[heap]" else "stack" if name.startswith("[stack")
                    else "libraries" if name.startswith("/") else "anonymous")
        elif fields[0] == "Private_Dirty:":
            kinds[kind] += int(fields[1])
    return kinds


def _minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def fork_memory_lines() -> list[str]:
    """What one fork-served kernel has written of its server's pages after start + one pass."""
    kernel = Kernel(FORK)
    try:
        kernel.start()
        kernel.warm_up()
        dirty, faults = _private_dirty_by_kind(kernel.pid), _minor_faults(kernel.pid)
    finally:
        kernel.close()
    total = sum(dirty.values())
    return [
        f"- One fork-served kernel after its start and one `pass`: {total / 1024:.1f} MiB private "
        "dirty (" + ", ".join(f"{kind} {kib / 1024:.1f}" for kind, kib in dirty.most_common())
        + f" MiB) after {faults} minor page faults. Pages it shares with the server become "
        "private when written: CPython writes an object's reference count whenever code uses "
        "it, so every page holding an object the kernel's start-up touches is copied (and each "
        "copy is a fault: system time).",
    ]
