"""Scenario 2, soak: normal code nodes at half the saturation throughput for a fixed time; the
service's RSS and descriptors over time, and every answer checked."""

from __future__ import annotations

import collections
import json
import statistics
import time
from dataclasses import dataclass

from bench.load.report import DATA_DIR
from tests.load import check, driver, mixed, resources, workload
from tests.load.driver import Http
from tests.load.results import ScenarioResult, fmt_mib, fmt_ms
from tests.load.service import Service


@dataclass
class Plan:
    duration: float = 600.0
    warmup: float = 60.0  # excluded from the flatness check
    window: float = 60.0  # the first and last windows after warm-up whose medians are compared
    concurrency: int = 16
    worker_timeout: float = 5.0
    sample_every: float = 2.0
    rate: float | None = None  # requests/s; None: half the saturation measured by `mixed`


FULL = Plan()
QUICK = Plan(duration=40.0, warmup=10.0, window=10.0, sample_every=1.0)


def saturation_from_mixed() -> float | None:
    """The normal-only throughput at concurrency 16 that the last full mixed run measured."""
    path = DATA_DIR / "mixed.json"
    if not path.exists():
        return None
    return float(json.loads(path.read_text())["series"].get("saturation_rps") or 0) or None


async def measure_saturation(http: Http, service: Service, plan: Plan, count: int) -> float:
    """Normal runs at full concurrency: completed runs per second."""
    items = workload.mix(count, 0.0, seed=4)
    mplan = mixed.Plan(normal_only=count, mixed=0, concurrency=plan.concurrency,
                       worker_timeout=plan.worker_timeout)
    records, wall = await mixed.run_phase(http, service, items, mplan, "saturation")
    return sum(1 for r in records if r.verdict.good) / wall


def drift(values: list[tuple[float, float]], start: float, window: float) -> tuple[float, float,
                                                                                    float]:
    """Median of the first window after `start`, median of the last window, and the change
    between them as a fraction of the first."""
    after = [(t, v) for t, v in values if t >= start]
    if not after:
        return float("nan"), float("nan"), float("nan")
    first = statistics.median(v for t, v in after if t < start + window)
    last_start = after[-1][0] - window
    last = statistics.median(v for t, v in after if t >= last_start)
    return first, last, (last - first) / first if first else float("nan")


def per_kernel(samples: list[resources.Sample], start: float) -> float:
    """Descriptors the service holds per kernel process alive (least squares over the samples
    after warm-up): every kernel it has out, pooled or closing has a client with its sockets."""
    after = [s for s in samples if s.t >= start]
    try:
        slope, _ = statistics.linear_regression([float(s.kernels) for s in after],
                                                [float(s.service_fds) for s in after])
    except statistics.StatisticsError:  # too few samples, or the kernel count never moved
        return 0.0
    return max(slope, 0.0)


async def run(plan: Plan, quick: bool) -> ScenarioResult:
    result = ScenarioResult("soak", quick=quick)
    settings = mixed.service_settings(mixed.Plan(0, 0, concurrency=plan.concurrency,
                                                 worker_timeout=plan.worker_timeout))
    result.settings = {"plan": plan.__dict__, "service_flags": settings.flags()}
    with Service(settings) as service:
        rate = plan.rate
        if rate is None:
            saturation = saturation_from_mixed()
            source = "the last full mixed run's normal-only throughput"
            if saturation is None or quick:
                async with driver.client(service.url, plan.concurrency, 120) as http:
                    saturation = await measure_saturation(http, service, plan,
                                                          48 if quick else 200)
                source = "measured here, normal runs at concurrency 16"
            rate = saturation / 2
            result.figure("saturation throughput (normal runs, concurrency 16)",
                          f"{saturation:.2f} runs/s ({source})")
        sampler = resources.Sampler(service.pid, service.marker, service.scratch_root,
                                    service.url, interval=plan.sample_every)
        idle_before = await resources.steady(sampler)
        items = workload.mix(int(rate * plan.duration), 0.0, seed=5)
        skipped: list[int] = []
        records: list[mixed.Record] = []
        async with driver.client(service.url, plan.concurrency * 2, 120) as http:

            async def send(index: int) -> check.Answer:
                item = items[index]
                answer = await driver.post_run(http, item.body(), service.api_key)
                records.append(mixed.Record("soak", item, answer,
                                            check.judge_normal(item, answer)))
                return answer

            sampler.t0 = time.monotonic()
            sampler.start()
            await driver.open_loop(rate, plan.duration, send, max_in_flight=plan.concurrency * 2,
                                   on_overflow=skipped.append)
            await sampler.stop()
        idle_after, settle_time = await resources.settle(sampler, idle_before, timeout=60)
        result.series = {"requests": [r.row(sampler.t0) for r in records],
                         "samples": [s.as_dict() for s in sampler.samples], "rate": rate}
        result.notes.append(f"service log tail:\n{service.log_tail(5)}")
    summarize(result, plan, rate, records, skipped, sampler.samples, idle_before, idle_after,
              settle_time)
    return result


def summarize(result: ScenarioResult, plan: Plan, rate: float, records: list[mixed.Record],
              skipped: list[int], samples: list[resources.Sample], idle_before: resources.Sample,
              idle_after: resources.Sample, settle_time: float) -> None:
    verdicts = collections.Counter(r.verdict.verdict for r in records)
    failed = [f"#{r.item.index} {r.item.kind}: {r.verdict.verdict}: {r.verdict.reason}"
              for r in records if not r.verdict.good]
    latencies = [r.answer.latency for r in records if r.answer.status]
    result.figure("offered rate, duration", f"{rate:.2f} runs/s for {plan.duration:g} s = "
                  f"{int(rate * plan.duration)} runs; sent {len(records)}, skipped "
                  f"{len(skipped)} (all slots busy)")
    result.figure("latency p50 / p99", f"{fmt_ms(driver.percentile(latencies, 0.5))} / "
                  f"{fmt_ms(driver.percentile(latencies, 0.99))}")
    result.goal("zero failed normal runs", "0 wrong, missing or rejected; none skipped",
                f"{verdicts[check.CORRECT]}/{len(records)} correct, {len(skipped)} skipped",
                not failed and not skipped, "\n".join(failed[:10]))
    result.figure("where the CPU went", resources.cpu_split(samples))
    start = plan.warmup
    for label, key, fmt in (("service RSS", "service_rss", fmt_mib),
                            ("service descriptors", "service_fds", str),
                            ("RSS of all its processes", "total_rss", fmt_mib)):
        series = [(s.t, float(getattr(s, key))) for s in samples]
        after = [v for t, v in series if t >= start]
        first, last, change = drift(series, start, plan.window)
        text = (f"first {plan.window:g} s after warm-up (median) {fmt(first)}, last "
                f"{plan.window:g} s {fmt(last)}: {change * 100:+.1f} %; range after warm-up "
                f"{fmt(min(after, default=0))} to {fmt(max(after, default=0))}")
        result.figure(f"{label} over time", text)
        if key == "service_rss":  # the kernels come and go with the load; the service must not grow
            result.goal(f"{label} flat after warm-up", "within 10 % (last vs first window)",
                        f"{change * 100:+.1f} %", abs(change) <= 0.10)
    # The raw descriptor count follows the kernels out at that moment (each one's client holds
    # its sockets), so two windows compare two loads. A leak is what is left net of them.
    # The change is measured against what the service held in the first window, raw: the net
    # count itself is a small remainder, whose relative change would mean little.
    share = per_kernel(samples, start)
    net = [(s.t, s.service_fds - share * s.kernels) for s in samples]
    first, last, _ = drift(net, start, plan.window)
    held, _, _ = drift([(s.t, float(s.service_fds)) for s in samples], start, plan.window)
    change = (last - first) / held if held else float("nan")
    result.figure("service descriptors net of the kernels it holds",
                  f"{share:.1f} descriptors per live kernel (least squares after warm-up); "
                  f"net, first {plan.window:g} s after warm-up (median) {first:.1f}, last "
                  f"{plan.window:g} s {last:.1f}: {last - first:+.1f} descriptors, "
                  f"{change * 100:+.1f} % of the {held:.0f} held in the first window")
    result.goal("service descriptors flat after warm-up",
                "within 10 % (last vs first window), net of the kernels held at each sample",
                f"{change * 100:+.1f} % net ({share:.1f} per kernel); idle "
                f"{idle_before.service_fds} → {idle_after.service_fds}",
                abs(change) <= 0.10 and idle_after.service_fds <= idle_before.service_fds)
    result.figure("idle before → idle after: processes, scratch dirs, service fds",
                  f"{idle_before.processes} → {idle_after.processes}, {idle_before.scratch_dirs} →"
                  f" {idle_after.scratch_dirs}, {idle_before.service_fds} → "
                  f"{idle_after.service_fds} (settled in {settle_time:.1f} s)")
