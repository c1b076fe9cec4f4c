"""Tool calls (the tool bridge, docs/tools.md): a call's round trip on each transport and face.

    python -m bench.tools [--calls 100]

For each transport (ZMQ kernel, one-shot kernel) and face (Sandbox, AsyncSandbox), one run
makes N calls of a tool that returns its argument; the kernel times each call
(`time.perf_counter` around it), and the same loop over a plain in-process function gives the
floor. Also the run's wall time with N calls against the same run with none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from sandbox_kernel.client import AsyncSandbox, Sandbox
from sandbox_kernel.policy import SandboxPolicy

CODE = """
import json, time
from sandbox_tools import echo
def plain(value):
    return value
def timed(call, n):
    spent = []
    for i in range({calls}):
        started = time.perf_counter()
        call(i) if n else None
        spent.append(time.perf_counter() - started)
    return spent
print(json.dumps({{"tool": timed(echo, {calls}), "plain": timed(plain, {calls})}}))
"""
EMPTY = "from sandbox_tools import echo\nx = 1\n"


def echo(value: Any) -> Any:
    """Return the value."""
    return value


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return statistics.median(ordered) * 1e6, ordered[int(len(ordered) * 0.99) - 1] * 1e6


def _figures(stdout: str, wall: float, empty_wall: float) -> dict[str, float]:
    spent = json.loads(stdout.strip().splitlines()[-1])
    p50, p99 = _percentiles(spent["tool"])
    plain50, _ = _percentiles(spent["plain"])
    return {"p50_us": p50, "p99_us": p99, "plain_p50_us": plain50,
            "run_s": wall, "empty_run_s": empty_wall}


def blocking(one_shot: bool, calls: int) -> dict[str, float]:
    """The figures through a blocking Sandbox."""
    with Sandbox(None, policy=SandboxPolicy(), one_shot=one_shot, tools={"echo": echo},
                 ) as sb:
        sb.run(EMPTY)  # warm: the first run's costs are not the bridge's
        started = time.perf_counter()
        empty = sb.run(EMPTY)
        empty_wall = time.perf_counter() - started
        started = time.perf_counter()
        ex = sb.run(CODE.format(calls=calls))
        wall = time.perf_counter() - started
    assert ex.error is None and empty.error is None, (ex.error, empty.error)
    return _figures(ex.stdout, wall, empty_wall)


async def awaited(one_shot: bool, calls: int) -> dict[str, float]:
    """The figures through an AsyncSandbox."""
    async with AsyncSandbox(None, policy=SandboxPolicy(), one_shot=one_shot,
                            tools={"echo": echo}) as sb:
        await sb.run(EMPTY)
        started = time.perf_counter()
        empty = await sb.run(EMPTY)
        empty_wall = time.perf_counter() - started
        started = time.perf_counter()
        ex = await sb.run(CODE.format(calls=calls))
        wall = time.perf_counter() - started
    assert ex.error is None and empty.error is None, (ex.error, empty.error)
    return _figures(ex.stdout, wall, empty_wall)


def main() -> None:
    """Print one line per transport and face."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    calls = parser.parse_args().calls
    print(f"{'transport':10} {'face':13} {'p50 us':>8} {'p99 us':>8} {'plain us':>9} "
          f"{'x plain':>8} {f'run+{calls} s':>10} {'run s':>7}")
    for transport, one_shot in (("zmq", False), ("one-shot", True)):
        for face, figures in (("Sandbox", blocking(one_shot, calls)),
                              ("AsyncSandbox", asyncio.run(awaited(one_shot, calls)))):
            ratio = figures["p50_us"] / max(figures["plain_p50_us"], 1e-3)
            print(f"{transport:10} {face:13} {figures['p50_us']:8.0f} {figures['p99_us']:8.0f} "
                  f"{figures['plain_p50_us']:9.2f} {ratio:8.0f} {figures['run_s']:10.3f} "
                  f"{figures['empty_run_s']:7.3f}")


if __name__ == "__main__":
    main()
