"""A fresh kernel per request: cold, fork-served and from a warm pool, against a process each.

A request here is what a workflow platform's stateless code node costs: get a kernel of its own,
make one `main()` call, shut the kernel down (one-shot: killed once the result is in, its reaper
removing the scratch, as `sandbox-kernel run` does). Latency rows time one request at a time;
rate rows run a fixed number of requests from two threads at once (the machine's two cores) and
count requests per second, the process-per-request runner driven the same way.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from bench import calls
from sandbox_kernel.client import AsyncSandbox, Sandbox
from sandbox_kernel.hosting.pool import KernelPool

WORKERS = 2
PANDAS_CODE = ("import pandas\n"
               "def main(x):\n"
               "    return {'y': int(pandas.Series(range(x)).sum())}\n")
PANDAS_CALL = calls.Call(PANDAS_CODE, {"x": 10}, {"y": 45})
PRELOAD = ("numpy", "pandas")


def request_in_fresh_kernel(call: calls.Call, cold: bool, preload: tuple[str, ...] = ()) -> float:
    """Start a kernel, make one call, shut it down; return the seconds it all took."""
    started = time.perf_counter()
    sandbox = Sandbox(None, cold_start=cold, preload=preload)
    try:
        sandbox.start()
        calls.call_in_sandbox(sandbox, call)
    finally:
        sandbox.close(now=True)  # one-shot: the result is in, nothing to wait for
    return time.perf_counter() - started


def requests_per_second(request: Callable[[], float], count: int) -> float:
    """Requests per second with WORKERS threads sharing `count` requests."""
    left = list(range(count))
    lock = threading.Lock()
    failures: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                if not left:
                    return
                left.pop()
            try:
                request()
            except BaseException as exc:  # re-raised below
                failures.append(exc)
                return

    threads = [threading.Thread(target=work, daemon=True) for _ in range(WORKERS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise failures[0]
    return count / elapsed


async def _pool_requests(count: int, latencies: list[float]) -> float:
    """Requests served from a warm pool of WORKERS kernels; requests per second."""
    async with KernelPool(size=WORKERS, kernel_name=None) as pool:
        while pool.ready < WORKERS:
            await asyncio.sleep(0.05)

        async def one() -> None:
            started = time.perf_counter()
            sandbox = await pool.get()
            try:
                execution = await sandbox.run(calls.SMALL_CODE, inputs=calls.SMALL_INPUTS)
                if execution.result != calls.SMALL_RESULT:
                    raise RuntimeError(f"pool kernel returned {execution.result}")
                latencies.append(time.perf_counter() - started)
            finally:
                await sandbox.close()

        started = time.perf_counter()
        for _ in range(count // WORKERS):
            await asyncio.gather(*(one() for _ in range(WORKERS)))
        return (count // WORKERS) * WORKERS / (time.perf_counter() - started)


async def _handout_and_first_call(count: int) -> list[float]:
    """Seconds from `await pool.get()` to the first call's result, the pool full each time."""
    seconds = []
    async with KernelPool(size=1, kernel_name=None) as pool:
        for _ in range(count):
            while pool.ready < 1:
                await asyncio.sleep(0.05)
            started = time.perf_counter()
            sandbox: AsyncSandbox = await pool.get()
            execution = await sandbox.run(calls.SMALL_CODE, inputs=calls.SMALL_INPUTS)
            seconds.append(time.perf_counter() - started)
            if execution.result != calls.SMALL_RESULT:
                raise RuntimeError(f"pool kernel returned {execution.result}")
            await sandbox.close()
    return seconds


def pool_rate(count: int) -> tuple[float, list[float]]:
    """Pool requests per second and each request's latency."""
    latencies: list[float] = []
    rate = asyncio.run(_pool_requests(count, latencies))
    return rate, latencies


def pool_first_calls(count: int) -> list[float]:
    """Hand-out plus first call, `count` times."""
    return asyncio.run(_handout_and_first_call(count))
