"""The four targets, whether a run met them, and the profiling that explains a miss."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import calls, costs, fresh, payload
from bench.kernels import PLAIN, SANDBOX, Kernel
from bench.suite import Results


@dataclass(frozen=True)
class Target:
    """A ratio of two rows' medians and the bound it must keep."""

    key: str
    numerator: str  # row ids
    denominator: str
    limit: float
    at_least: bool = False  # the ratio must be >= limit (a speed-up), not <= (an overhead)
    row: str = ""  # the table row that shows it, when not the numerator (a .latency sample)

    @property
    def text(self) -> str:
        """The bound as the table shows it."""
        if not self.denominator:  # an absolute bound on a time
            return f"{'≥' if self.at_least else '≤'} {self.limit * 1000:g} ms"
        return f"{'≥' if self.at_least else '≤'} {self.limit:g}x"

    @property
    def shown_on(self) -> str:
        """The row id whose line carries this target."""
        return self.row or self.numerator


TARGETS = (
    Target("start", "start.sandbox", "start.plain", 1.00),
    Target("fork", "start.fork", "start.plain", 0.15),
    Target("pss", "pss.fork", "pss.sandbox", 0.6),
    Target("fresh", "rate.fork", "rate.process", 1.5, at_least=True),
    Target("pandas", "pandas.rate.fork", "pandas.rate.process", 5.0, at_least=True),
    Target("pool", "pool.first", "main.small", 2.5),
    Target("execute", "execute.sandbox", "execute.plain", 1.05),
    Target("speedup", "process.small", "main.small", 10.0, at_least=True),
    Target("rss", "rss.sandbox", "rss.plain", 1.10),
    # Payloads (bench/payload.py): main() against its floor, and kernel CPU per warm call.
    Target("payload.1mb", "main.1mb.latency", "floor.1mb.latency", 2.0, row="main.1mb"),
    Target("payload.10mb", "main.10mb.latency", "floor.10mb.latency", 2.0, row="main.10mb"),
    Target("cpu", "cpu.small", "", 0.003),
)
TARGET_BY_ROW = {target.shown_on: target for target in TARGETS}


@dataclass(frozen=True)
class Verdict:
    """A target's ratio in one run (None when a row is missing) and whether it was met."""

    target: Target
    ratio: float | None

    @property
    def met(self) -> bool | None:
        """True, False, or None when it could not be measured."""
        if self.ratio is None:
            return None
        if self.target.at_least:
            return self.ratio >= self.target.limit
        return self.ratio <= self.target.limit


def verdict(results: Results, target: Target) -> Verdict:
    """The target's ratio of medians in these results."""
    top = results.samples.get(target.numerator)
    if top and not target.denominator:
        return Verdict(target, top.median)
    bottom = results.samples.get(target.denominator)
    if not top or not bottom:
        return Verdict(target, None)
    return Verdict(target, top.median / bottom.median)


def _gap(results: Results, measurement: str) -> float:
    """Sandbox median minus plain median of a measurement taken of both."""
    samples = results.samples
    return samples[f"{measurement}.{SANDBOX}"].median - samples[f"{measurement}.{PLAIN}"].median


def _profiling() -> Any:
    """bench/profiling.py, imported only when a run asks for profiles (--profile)."""
    from bench import profiling

    return profiling


def _explain_execute(results: Results, kernels: dict[str, Kernel]) -> list[str]:
    return _profiling().explain_execute(kernels[PLAIN], kernels[SANDBOX],
                                        _gap(results, "execute"))


EXPLAINERS: dict[str, Callable[[Results, dict[str, Kernel]], list[str]]] = {
    "start": lambda results, kernels: _profiling().explain_start(_gap(results, "start")),
    "execute": _explain_execute,
    "speedup": lambda results, kernels: _profiling().explain_speedup(),
    "rss": lambda results, kernels: _profiling().explain_rss(),
    "payload.1mb": lambda results, kernels: payload.explain(results, "1mb"),
    "payload.10mb": lambda results, kernels: payload.explain(results, "10mb"),
    "cpu": lambda results, kernels: payload.explain_cpu(results),
    "fork": lambda results, kernels: _profiling().explain_fork(
        results.samples["cpu.fork"].median),
    "pss": lambda results, kernels: [*_related(results, "pss.fork", "pss.sandbox", "rss.fork"),
                                     *costs.fork_memory_lines()],
    "fresh": lambda results, kernels: [*_related(results, "fresh.fork", "fresh.pool",
                                                 "rate.pool", "cpu.fork"),
                                       *_request_costs(calls.SMALL_CALL)],
    "pandas": lambda results, kernels: [*_related(results, "pandas.fork", "pandas.process"),
                                        *_request_costs(fresh.PANDAS_CALL, fresh.PRELOAD)],
    "pool": lambda results, kernels: _related(results, "pool.first", "fresh.pool"),
}


def _request_costs(call: calls.Call, preload: tuple[str, ...] = ()) -> list[str]:
    """Machine CPU of a fresh fork-served request and of a process per request, side by side."""
    return costs.cost_lines({
        "fresh fork-served kernel": costs.request_cost(
            lambda: fresh.request_in_fresh_kernel(call, cold=False, preload=preload)),
        "process per request": costs.request_cost(lambda: calls.call_in_fresh_process(call)),
    })


def _related(results: Results, *rows: str) -> list[str]:
    """The rows that account for a fork-server target: where its time or memory goes."""
    lines = []
    for row in rows:
        sample = results.samples.get(row)
        if sample:
            lines.append(f"`{row}`: median {sample.median:.4g} {sample.unit}, "
                         f"p90 {sample.p90:.4g} (n={len(sample)})")
    return lines or ["No related rows were measured."]


def explainer(mode: str) -> Callable[[Results, dict[str, Kernel]], None]:
    """What to profile: "missed" targets, "all" of them, or "none"."""

    def explain(results: Results, kernels: dict[str, Kernel]) -> None:
        if mode == "none":
            return
        for target in TARGETS:
            met = verdict(results, target).met
            if met is None or (met and mode == "missed"):
                continue
            if target.key == "execute" and len(kernels) < 2:
                continue  # the warm kernels it needs did not start
            print(f"profiling: {target.key}", file=sys.stderr)
            try:
                results.findings[target.key] = EXPLAINERS[target.key](results, kernels)
            except Exception as exc:  # evidence is a bonus; never lose the figures over it
                results.findings[target.key] = [f"Profiling failed: {type(exc).__name__}: {exc}"]

    return explain
