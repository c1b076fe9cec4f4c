"""The one-shots' companion's CPU beside a run's, for runs that flood it with refused calls.

Every call the sandbox refuses waits until the companion answers it (confine/audit.py), outside
the run and its limits; its answers are paid from a share of the run's own CPU
(confine/share.py). A one-shot run calls refused system calls (acct, syslog) in a loop from 1,
2 or 8 threads for `--seconds`, either back to back or with some work of its own between calls;
the figures, summed over `--runs` runs of each case (CPU times come in 10 ms ticks), are the
run's CPU (its usage: the host's /proc figures), the companion's (/proc/<companion>/stat before
and after, utime + stime), their ratio (the target: at most 0.5), what the run's usage was
charged (`companion_cpu_seconds`) and the calls answered.

    python -m bench.companion [--seconds S] [--runs N]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import time
from pathlib import Path

from bench.service import _children, _is_companion, _stat_times
from sandbox_kernel.client import oneshot
from sandbox_kernel.launch.oneshot import OneShotPool
from sandbox_kernel.policy import SandboxPolicy

FLOOD = """
import ctypes, threading, time
libc = ctypes.CDLL(None, use_errno=True)
def flood(stop, counts):
    n = 0
    while time.monotonic() < stop:
        libc.syscall(163, 0)
        libc.syscall(103, 10, 0, 0)
        n += 2
        {work}
    counts.append(n)
counts = []
stop = time.monotonic() + {seconds}
threads = [threading.Thread(target=flood, args=(stop, counts)) for _ in range({threads})]
for t in threads: t.start()
for t in threads: t.join()
sum(counts)
"""
WORK = "sum(range(5_000))"  # ~0.1 ms of the run's own CPU between two pairs of calls
CASES = [(1, ""), (2, ""), (8, ""), (1, WORK), (8, WORK)]


def companion_of(pool: OneShotPool) -> int:
    """The pid of the pool's fork server's companion (run one request first: it starts it):
    of the server's children with its uid, the first started (a pooled process forked a moment
    ago may not have taken its own uid yet)."""
    server = pool.server.server_pid()
    found = [pid for pid in _children(server or 0) if _is_companion(pid)]
    if not found:
        raise RuntimeError("no companion under the fork server")
    return min(found, key=_started)


def _started(pid: int) -> int:
    """When a process started, in clock ticks since boot (its stat file's 22nd field)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def measure(pool: OneShotPool, companion: int, code: str) -> tuple[float, float, float, int]:
    """One run: its CPU, the companion's meanwhile, the run's charge and the calls made."""
    before = _stat_times(companion)
    execution = asyncio.run(oneshot.run(pool, code, None, 120.0))
    time.sleep(0.2)  # the companion's last answers and the ward's end
    spent = _stat_times(companion) - before
    if execution.error is not None:
        raise RuntimeError(f"the flood failed: {execution.error}")
    usage = execution.usage
    own = (usage.cpu_user_seconds or 0.0) + (usage.cpu_system_seconds or 0.0)
    calls = ast.literal_eval(execution.text or "0")
    return own, spent, usage.companion_cpu_seconds or 0.0, calls


def main() -> None:
    """Print, per case, the run's CPU, the companion's, their ratio and what was charged."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="each run's flood")
    parser.add_argument("--runs", type=int, default=3, help="runs of each case, summed")
    args = parser.parse_args()
    pool = OneShotPool(SandboxPolicy(), size=1)
    asyncio.run(oneshot.run(pool, "pass", None, 60.0))  # the server and its companion
    companion = companion_of(pool)
    print(f"{args.runs} runs of {args.seconds:g} s each; CPU seconds, summed over the runs")
    print(f"{'case':28} {'run':>7} {'companion':>10} {'ratio':>6} {'charged':>8} {'calls':>8}")
    for threads, work in CASES:
        code = FLOOD.format(seconds=args.seconds, threads=threads, work=work)
        own = spent = charged = 0.0
        calls = 0
        for _ in range(args.runs):
            figures = measure(pool, companion, code)
            own, spent, charged = own + figures[0], spent + figures[1], charged + figures[2]
            calls += figures[3]
        name = f"{threads} thread{'s' if threads > 1 else ''}" \
            + (", work between calls" if work else ", back to back")
        print(f"{name:28} {own:7.3f} {spent:10.3f} {spent / max(own, 0.01):6.2f} "
              f"{charged:8.4f} {calls:8d}")


if __name__ == "__main__":
    main()
