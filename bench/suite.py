"""The measurements, in the order the table lists them, with plain and sandbox interleaved."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from bench import calls, fresh, mcp, payload, runtime_import
from bench.kernels import FORK, KINDS, SANDBOX, START_KINDS, Kernel
from bench.stats import Sample
from sandbox_kernel.client import Sandbox

MB = 1_000_000
CONCURRENCY_LEVELS = (1, 2, 4)  # the table has a row for each, measured or not
CALL_BLOCK = 10  # warm calls and process-per-request calls alternate in blocks of this size
SANDBOX_CALL_ROWS = ("main.small", "process.small", "main.1mb", "main.10mb",
                     *(f"concurrency.{level}" for level in CONCURRENCY_LEVELS),
                     *(row for row, _ in payload.ROWS))
SKIPPED_BY_QUICK = "skipped by --quick (too slow for a smoke run)"


@dataclass(frozen=True)
class Plan:
    """How many repetitions each measurement gets."""

    starts: int  # kernel starts of each kind (each also gives one peak-RSS reading)
    executes: int  # warm execute round trips of each kind
    calls: int  # small main() calls, and as many process-per-request calls
    mb_calls: int  # 1 MB main() calls
    ten_mb_calls: int  # 10 MB main() calls; 0 skips them
    concurrency: tuple[int, ...]  # numbers of sandboxes driven at once
    rounds: int  # repetitions of each concurrency level
    calls_each: int  # calls per sandbox in one concurrency round
    warmups: int = 1  # discarded repetitions before each measurement
    cpu_calls: int = 200  # warm calls per kernel-CPU reading (the clock ticks every 10 ms)
    cpu_rounds: int = 5
    fresh: int = 1  # fresh-kernel requests timed one at a time, per kind; pool hand-outs
    fresh_rounds: int = 0  # rounds of the requests-per-second rows; 0 skips them
    fresh_each: int = 2  # requests in one such round
    pandas: int = 0  # pandas code-node requests per kind (and rounds of its rates); 0 skips
    pss_kernels: int = 2  # kernels alive at once when PSS is read (shared pages are split)
    mcp: int = 5  # run_python round trips through the MCP server, fresh and in a session
    runtime: int = 0  # first imports of a runtime's preloaded package per kind; 0 skips


FULL = Plan(starts=30, executes=1000, calls=100, mb_calls=20, ten_mb_calls=6,
            concurrency=(1, 2, 4), rounds=7, calls_each=50, warmups=2,
            fresh=15, fresh_rounds=3, fresh_each=12, pandas=6, pss_kernels=4, mcp=40,
            runtime=5)
QUICK = Plan(starts=1, executes=20, calls=5, mb_calls=2, ten_mb_calls=0,
             concurrency=(1, 2), rounds=2, calls_each=5, cpu_calls=50, cpu_rounds=1,
             pss_kernels=1)
RATE_ROWS = ("fresh.pool", "rate.cold", "rate.fork", "rate.pool", "rate.process")
FRESH_ROWS = ("fresh.cold", "fresh.fork", "pool.first", *RATE_ROWS)
MCP_ROWS = ("mcp.fresh", "mcp.session")
PANDAS_ROWS = ("pandas.fork", "pandas.process", "pandas.rate.fork", "pandas.rate.process")


@dataclass
class Results:
    """Every sample of one run, plus what was skipped or failed and why."""

    plan: Plan
    samples: dict[str, Sample] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # row id -> why
    failed: dict[str, str] = field(default_factory=dict)  # row id -> error
    returns_results: bool | None = None  # does the kernel implement the main() convention?
    findings: dict[str, list[str]] = field(default_factory=dict)  # target -> evidence lines

    def sample(self, row: str, unit: str, higher_is_better: bool = False) -> Sample:
        """The sample for a row, created on first use."""
        if row not in self.samples:
            self.samples[row] = Sample(unit, higher_is_better=higher_is_better)
        return self.samples[row]


@contextmanager
def recording_failure(results: Results, *rows: str) -> Iterator[None]:
    """Record an error against those rows still unmeasured, and carry on with the others."""
    try:
        yield
    except Exception as exc:  # a benchmark that stops at the first error reports nothing
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        for row in rows:
            if row not in results.samples and row not in results.skipped:
                results.failed.setdefault(row, message)
        traceback.print_exc()


def _alternating(count: int) -> Iterator[tuple[int, str]]:
    """(repetition, kind) pairs in ABAB order, so drift hits both kinds alike."""
    for repetition in range(count):
        for kind in KINDS:
            yield repetition, kind


def measure_starts(results: Results) -> None:
    """1 and 6: start-to-ready of fresh kernels (cold and fork-served), CPU, RSS and PSS."""
    plan = results.plan
    for repetition in range(plan.warmups + plan.starts):
        for kind in START_KINDS:
            kernel = Kernel(kind)
            try:
                seconds = kernel.start()
                cpu = kernel.cpu_seconds()
                kernel.warm_up()  # the one trivial execute
                rss = kernel.peak_rss()
            finally:
                kernel.close()
            if repetition >= plan.warmups:  # the first starts also fill the page cache
                results.sample(f"start.{kind}", "s").add(seconds)
                results.sample(f"rss.{kind}", "bytes").add(rss)
                results.sample(f"cpu.{kind}", "s").add(cpu)


def measure_pss(results: Results) -> None:
    """6: PSS per kernel with several alive at once, cold against fork-served.

    PSS splits each shared page among the processes mapping it: cold kernels share the
    libraries' file pages, fork-served ones also the server's whole heap of imported modules.
    """
    for kind in (SANDBOX, FORK):
        kernels = [Kernel(kind) for _ in range(results.plan.pss_kernels)]
        try:
            for kernel in kernels:
                kernel.start()
                kernel.warm_up()
            for kernel in kernels:
                results.sample(f"pss.{kind}", "bytes").add(kernel.pss())
        finally:
            for kernel in kernels:
                kernel.close()


def measure_executes(results: Results) -> dict[str, Kernel]:
    """2: warm round trips of `pass`, alternating between a plain and a sandbox kernel."""
    kernels = {kind: Kernel(kind) for kind in KINDS}
    try:
        for kernel in kernels.values():
            kernel.start()
            kernel.warm_up()
    except BaseException:
        for kernel in kernels.values():
            kernel.close()
        raise
    plan = results.plan
    for repetition, kind in _alternating(plan.warmups * 10 + plan.executes):
        seconds = kernels[kind].execute("pass")
        if repetition >= plan.warmups * 10:
            results.sample(f"execute.{kind}", "s").add(seconds)
    return kernels


def measure_calls(results: Results, sandbox: Sandbox) -> None:
    """3 and 5: small main() calls, warm in the sandbox and one fresh process each.

    The two alternate in blocks, not call by call: drift still hits both, but a warm call does
    not run while the previous child process is still being torn down.
    """
    plan = results.plan
    results.returns_results = calls.kernel_returns_results(sandbox)
    verify = results.returns_results
    for _ in range(plan.warmups):
        calls.call_in_sandbox(sandbox, calls.SMALL_CALL, verify)
        calls.call_in_fresh_process(calls.SMALL_CALL)
    for block in _blocks(plan.calls, CALL_BLOCK):
        for _ in range(block):
            results.sample("main.small", "s").add(
                calls.call_in_sandbox(sandbox, calls.SMALL_CALL, verify))
        for _ in range(block):
            results.sample("process.small", "s").add(calls.call_in_fresh_process(calls.SMALL_CALL))


def _blocks(total: int, size: int) -> list[int]:
    """Block sizes that add up to total."""
    return [min(size, total - start) for start in range(0, total, size)]


def time_main_call(results: Results, sandbox: Sandbox, row: str, call: calls.Call,
                   keep: bool = True) -> None:
    """4: one main() call moving the call's JSON; its MB/s (inputs in plus result out)."""
    returned = bool(results.returns_results)
    seconds = calls.call_in_sandbox(sandbox, call, returned)
    if keep:
        results.sample(row, "MB/s", higher_is_better=True).add(
            call.json_bytes(returned=returned) / MB / seconds)
        results.sample(f"{row}.latency", "s").add(seconds)


def measure_concurrency(results: Results, sandboxes: list[Sandbox]) -> None:
    """7: calls per second with 1, 2, 4 sandboxes driven at once from their own threads."""
    plan = results.plan
    verify = bool(results.returns_results)
    for level in set(CONCURRENCY_LEVELS) - set(plan.concurrency):
        results.skipped[f"concurrency.{level}"] = SKIPPED_BY_QUICK
    for level in plan.concurrency:
        with recording_failure(results, f"concurrency.{level}"):
            calls.calls_per_second(sandboxes[:level], plan.calls_each, verify)  # warm-up
            for _ in range(plan.rounds):
                rate = calls.calls_per_second(sandboxes[:level], plan.calls_each, verify)
                results.sample(f"concurrency.{level}", "calls/s", higher_is_better=True).add(rate)


def _started_sandboxes(count: int) -> list[Sandbox]:
    sandboxes = []
    try:
        for _ in range(count):
            sandbox = Sandbox(None)  # this package's kernelspec, default policy
            sandbox.start()
            sandboxes.append(sandbox)
    except BaseException:
        _close_all(sandboxes)
        raise
    return sandboxes


def _close_all(sandboxes: list[Sandbox]) -> None:
    for sandbox in sandboxes:
        sandbox.close()


def measure_sandbox_calls(results: Results) -> None:
    """3, 4, 5 and 7 on one pool of warm sandboxes."""
    plan = results.plan
    sandboxes = _started_sandboxes(max(plan.concurrency))
    try:
        with recording_failure(results, "main.small", "process.small"):
            measure_calls(results, sandboxes[0])
        measure_payloads(results, sandboxes)
        measure_concurrency(results, [_alive(sandboxes, i) for i in range(len(sandboxes))])
    finally:
        _close_all(sandboxes)


def measure_payloads(results: Results, sandboxes: list[Sandbox]) -> None:
    """4 and 8: main() throughput and its floor, alternating call by call; 9: CPU per call."""
    plan = results.plan
    echo = payload.Echo()
    try:
        for size, count in ((MB, plan.mb_calls), (10 * MB, plan.ten_mb_calls)):
            name = f"{size // MB}mb"
            if not count:
                results.skipped[f"main.{name}"] = results.skipped[f"floor.{name}"] = \
                    SKIPPED_BY_QUICK
                continue
            with recording_failure(results, f"main.{name}", f"floor.{name}"):
                call = calls.echo_call(size)
                for repetition in range(count + 1):  # the first of each is a warm-up
                    floor = echo.round_trip(call)
                    with payload.kernel_cpu(results, _alive(sandboxes, 0), f"main.{name}",
                                            keep=repetition > 0):
                        time_main_call(results, _alive(sandboxes, 0), f"main.{name}", call,
                                       keep=repetition > 0)
                    if repetition:
                        payload.record(results, f"floor.{name}", call, floor)
    finally:
        echo.close()
    with recording_failure(results, "cpu.small", "capacity.small"):
        payload.measure_cpu(results, _alive(sandboxes, 0), plan.cpu_calls, plan.cpu_rounds)


def _alive(sandboxes: list[Sandbox], index: int) -> Sandbox:
    """The sandbox at index, replaced by a fresh one if an earlier failure killed its kernel."""
    if not sandboxes[index].manager.is_alive():
        sandboxes[index].close()
        sandboxes[index] = _started_sandboxes(1)[0]
    return sandboxes[index]


def measure_fresh(results: Results) -> None:
    """8: a fresh kernel per request (cold, fork-served, pooled) against a process per request.

    Each row is measured on its own: a failure (say, a cold kernel losing jupyter_client's
    port race) costs that row only.
    """
    plan = results.plan
    small = calls.SMALL_CALL
    requests = {"cold": lambda: fresh.request_in_fresh_kernel(small, cold=True),
                "fork": lambda: fresh.request_in_fresh_kernel(small, cold=False),
                "process": lambda: calls.call_in_fresh_process(small)}
    for kind in ("cold", "fork"):
        with recording_failure(results, f"fresh.{kind}"):
            for _ in range(plan.fresh):  # the starts above warmed the page cache and server
                results.sample(f"fresh.{kind}", "s").add(requests[kind]())
    if not plan.fresh_rounds:
        for row in RATE_ROWS:
            results.skipped[row] = SKIPPED_BY_QUICK
    for kind, request in requests.items():
        with recording_failure(results, f"rate.{kind}"):
            for _ in range(plan.fresh_rounds):
                results.sample(f"rate.{kind}", "req/s", higher_is_better=True).add(
                    fresh.requests_per_second(request, plan.fresh_each))
    with recording_failure(results, "rate.pool", "fresh.pool"):
        for _ in range(plan.fresh_rounds):
            rate, latencies = fresh.pool_rate(plan.fresh_each)
            results.sample("rate.pool", "req/s", higher_is_better=True).add(rate)
            for seconds in latencies:
                results.sample("fresh.pool", "s").add(seconds)
    with recording_failure(results, "pool.first"):
        for seconds in fresh.pool_first_calls(plan.fresh):
            results.sample("pool.first", "s").add(seconds)


def measure_pandas(results: Results) -> None:
    """9: a code node that imports pandas, per request: fork server with pandas preloaded."""
    plan = results.plan
    if not plan.pandas:
        for row in PANDAS_ROWS:
            results.skipped[row] = SKIPPED_BY_QUICK
        return
    node = fresh.PANDAS_CALL
    requests = {"fork": lambda: fresh.request_in_fresh_kernel(node, False, fresh.PRELOAD),
                "process": lambda: calls.call_in_fresh_process(node)}
    for repetition in range(1 + plan.pandas):  # the first fills the server's preload
        for kind, request in requests.items():
            seconds = request()
            if repetition:
                results.sample(f"pandas.{kind}", "s").add(seconds)
    for _ in range(plan.fresh_rounds):
        for kind, request in requests.items():
            results.sample(f"pandas.rate.{kind}", "req/s", higher_is_better=True).add(
                fresh.requests_per_second(request, plan.pandas))


def measure_mcp(results: Results) -> None:
    """10: MCP run_python round trips (fresh kernel and session) beside Sandbox.run."""
    for row, timings in mcp.round_trips(results.plan.mcp).items():
        for seconds in timings:
            results.sample(row, "s").add(seconds)


def measure_runtime(results: Results) -> None:
    """11: the first import of a runtime's preloaded package, fork-served against cold."""
    rows = [row for row, _ in runtime_import.ROWS]
    if not results.plan.runtime:
        for row in rows:
            results.skipped[row] = SKIPPED_BY_QUICK
        return
    for row, values in runtime_import.measure(results.plan.runtime).items():
        for seconds in values:
            results.sample(row, "s").add(seconds)


def run(plan: Plan, explain: Callable[[Results, dict[str, Kernel]], None],
        progress: Callable[[str], None] = print) -> Results:
    """Every measurement, then `explain` for the targets that were missed."""
    results = Results(plan)
    started = time.monotonic()
    progress("1, 6: kernel start-to-ready and peak RSS (plain/sandbox alternating)")
    with recording_failure(results, "start.plain", "start.sandbox", "rss.plain", "rss.sandbox"):
        measure_starts(results)
    with recording_failure(results, "pss.sandbox", "pss.fork"):
        measure_pss(results)
    progress("2: warm execute round trips")
    kernels: dict[str, Kernel] = {}
    try:
        with recording_failure(results, "execute.plain", "execute.sandbox"):
            kernels = measure_executes(results)
        progress("3, 4, 5, 7: main() calls, throughput, process per request, concurrency")
        with recording_failure(results, *SANDBOX_CALL_ROWS):
            measure_sandbox_calls(results)
        progress("8, 9: a fresh kernel per request: cold, fork-served, pooled, pandas")
        with recording_failure(results, *FRESH_ROWS):
            measure_fresh(results)
        with recording_failure(results, *PANDAS_ROWS):
            measure_pandas(results)
        progress("10: MCP run_python round trips, fresh and in a session")
        with recording_failure(results, *MCP_ROWS):
            measure_mcp(results)
        progress("11: first import of a runtime's preloaded package (builds a runtime)")
        with recording_failure(results, *(row for row, _ in runtime_import.ROWS)):
            measure_runtime(results)
        progress("profiling (--profile)")
        explain(results, kernels)
    finally:
        for kernel in kernels.values():
            kernel.close()
    progress(f"done in {time.monotonic() - started:.0f} s")
    return results

