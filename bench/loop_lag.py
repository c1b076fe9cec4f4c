"""How long one stateless run keeps its caller's event loop from turning.

The longest gap (and the 99th percentile) of a 2 ms ticker beside one one-shot run, for the
two answers of the pressure scenario (bench/load/pressure.py) that are heaviest on the caller:
a 13 MB main() result and 40,000 one-byte prints. Each is measured with the caller's two
protections, then without them, as the caller was before them: the result checked in place
(resultcheck.py checks one over 1 MiB in a child process) and 1 MiB taken per read
(client/oneshot.py READ_STEP is 64 KiB).

`python -m bench.loop_lag [--runs 3]`: one line per case, the gaps in ms of each run.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from sandbox_kernel.client import oneshot
from sandbox_kernel.launch.oneshot import OneShotPool
from sandbox_kernel.policy import SandboxPolicy

CASES = {
    "13 MB result": "def main():\n    return {'x': [[] for _ in range(4_300_000)]}\n",
    "40,000 1-byte prints": ("import sys\ndef main():\n    for _ in range(40_000):\n"
                             "        sys.stdout.write('x'); sys.stdout.flush()\n"
                             "    return {}\n"),
}
TICK = 0.002  # seconds the ticker sleeps between turns


async def gaps_beside(pool: OneShotPool, code: str) -> tuple[float, float]:
    """(max, p99) gap in ms between the ticker's turns while the run goes on."""
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.ensure_future(tick())
    try:
        execution = await oneshot.run(pool, code, {}, 60, raw_result=True)
    finally:
        ticker.cancel()
    if execution.error is not None:
        raise RuntimeError(f"the run failed: {execution.error}")
    gaps.sort()
    return round(gaps[-1] * 1000, 1), round(gaps[int(len(gaps) * 0.99)] * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loop_lag", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    pool = OneShotPool(SandboxPolicy(max_output_bytes=10**8), size=2)
    protected = (oneshot.checked_elsewhere, oneshot.READ_STEP)
    for protections in ("on", "off"):
        if protections == "off":  # as the caller was before: checked in place, 1 MiB reads
            oneshot.checked_elsewhere = _in_place  # type: ignore[assignment]
            oneshot.READ_STEP = 1 << 20
        for name, code in CASES.items():
            runs = [asyncio.run(gaps_beside(pool, code)) for _ in range(args.runs)]
            print(f"protections {protections}, {name}: (max ms, p99 ms) per run {runs}")
    oneshot.checked_elsewhere, oneshot.READ_STEP = protected


async def _in_place(content: bytes | memoryview) -> None:
    return None  # no outcome handed in: the collector checks the result itself


if __name__ == "__main__":
    main()
