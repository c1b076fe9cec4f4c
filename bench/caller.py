"""`python -I -m bench.caller [KERNELS]`: the caller's CPU per fresh fork-served kernel, by phase.

What a service pays for each one-shot request besides the kernel's own work: an AsyncSandbox is
started, warmed up (Sandbox.warm_up; the service's pool no longer does it, the column says what
it would cost), runs the Dify-wrapped `main()` once and is closed at once (`close(now=True)`,
the service's way). Each phase's CPU is
this process's (every thread: the event loop's and libzmq's I/O threads), from
time.process_time; the kernel's CPU is not counted. The first kernels are left out (server start,
first-time imports). Medians; load from elsewhere on the machine inflates them a little.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import time

from bench.service import USER_CODE, dify_wrapped
from sandbox_kernel.client import AsyncSandbox
from sandbox_kernel.policy import SandboxPolicy

PHASES = ("made", "start", "warm_up", "run", "close")
SKIPPED = 3  # first kernels, not counted


def _ms() -> float:
    return time.process_time() * 1000


async def _one_kernel(policy: SandboxPolicy, code: str) -> list[float]:
    """CPU ms of each phase for one fresh kernel."""
    marks = [_ms()]
    sandbox = AsyncSandbox(None, policy=policy)
    marks.append(_ms())
    await sandbox.start()
    marks.append(_ms())
    await sandbox.warm_up()
    marks.append(_ms())
    execution = await sandbox.run(code, timeout=5)
    marks.append(_ms())
    await sandbox.close(now=True)
    marks.append(_ms())
    if execution.error is not None:
        raise RuntimeError(f"the run failed: {execution.error}")
    return [after - before for before, after in itertools.pairwise(marks)]


async def _measure(kernels: int) -> list[list[float]]:
    policy, code = SandboxPolicy(network="on"), dify_wrapped(USER_CODE, {})
    rows = [await _one_kernel(policy, code) for _ in range(kernels + SKIPPED)]
    return rows[SKIPPED:]


def main(argv: list[str]) -> None:
    """Print the median CPU per phase and in all, in milliseconds."""
    kernels = int(argv[0]) if argv else 40
    rows = asyncio.run(_measure(kernels))
    print(f"Caller CPU per fresh fork-served kernel (AsyncSandbox, network on, {kernels} kernels,"
          " median ms)")
    print("| " + " | ".join(PHASES) + " | total |")
    print("|" + "---|" * (len(PHASES) + 1))
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    total = statistics.median(sum(row) for row in rows)
    print("| " + " | ".join(f"{value:.2f}" for value in medians) + f" | {total:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
