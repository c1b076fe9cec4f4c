"""Scenario 1, mixed load: normal code nodes alone, then with a hostile share, at a fixed
concurrency; every answer checked; the service's resources before and after."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any

from tests.load import check, driver, resources, watchdog, workload
from tests.load.results import ScenarioResult, fmt_mib, fmt_ms
from tests.load.service import Service, Settings


@dataclass
class Plan:
    """The sizes of one mixed run."""

    normal_only: int  # requests of the normal-only phase (the latency without hostile code)
    mixed: int  # requests of the mixed phase
    hostile_share: float = 0.2
    concurrency: int = 16
    worker_timeout: float = 5.0
    kernel_grace: float = 2.0
    start_allowance: float = 10.0  # getting a fresh kernel on a loaded 2-core host, and discarding
    warmup: int = 8


FULL = Plan(normal_only=400, mixed=2000)
QUICK = Plan(normal_only=32, mixed=80, worker_timeout=3.0)


def service_settings(plan: Plan) -> Settings:
    # One worker per client connection: a request never waits for a worker, so its latency is
    # its own run (fresh kernel + execution) and "past timeout + grace" means exactly that.
    return Settings(max_workers=plan.concurrency, max_requests=4 * plan.concurrency,
                    worker_timeout=plan.worker_timeout, pool_size=2,
                    extra=["--kernel-grace", f"{plan.kernel_grace:g}"])


@dataclass
class Record:
    """One request's outcome, for the figures and the chart."""

    phase: str
    item: workload.Item
    answer: check.Answer
    verdict: check.Verdict

    def row(self, t0: float) -> list[Any]:
        data = self.answer.json()
        stdout = (data.get("data") or {}).get("stdout") if isinstance(data, dict) else None
        return [round(self.answer.started - t0, 3), round(self.answer.latency, 4), self.phase,
                self.item.kind, self.item.hostile, self.verdict.verdict,
                len(stdout) if isinstance(stdout, str) else None]


async def run_phase(http: Any, service: Service, items: list[workload.Item], plan: Plan,
                    phase: str, hung: list[str] | None = None) -> tuple[list[Record], float]:
    """Send items at the plan's concurrency; each judged; the records and the wall time.
    If the service stops answering /health, the phase ends early and `hung` gets why."""
    deadline = plan.worker_timeout + plan.kernel_grace + plan.start_allowance
    records: list[Record] = []

    async def send(index: int) -> check.Answer:
        item = items[index]
        answer = await driver.post_run(http, item.body(), service.api_key)
        verdict = (check.judge_hostile(item, answer, deadline) if item.hostile
                   else check.judge_normal(item, answer))
        records.append(Record(phase, item, answer, verdict))
        return answer

    loop = asyncio.get_running_loop()
    started = loop.time()
    # Bounded: count fixed, and no new request starts after 30 minutes.
    _, evidence = await watchdog.guarded(
        service, driver.closed_loop(len(items), plan.concurrency, send, deadline=1800))
    if evidence and hung is not None:
        hung.append(f"{phase}, after {len(records)} of {len(items)} runs: {evidence}")
    return records, loop.time() - started


def latency_figures(records: list[Record]) -> tuple[float, float, float]:
    latencies = [r.answer.latency for r in records if not r.item.hostile and r.answer.status]
    return (driver.percentile(latencies, 0.5), driver.percentile(latencies, 0.99),
            max(latencies, default=float("nan")))


async def run(plan: Plan, quick: bool) -> ScenarioResult:
    """The whole scenario against a fresh service instance."""
    result = ScenarioResult("mixed", quick=quick)
    settings = service_settings(plan)
    result.settings = {"plan": plan.__dict__, "service_flags": settings.flags()}
    normal_items = workload.mix(plan.normal_only, 0.0, seed=1)
    mixed_items = workload.mix(plan.mixed, plan.hostile_share, seed=2)
    # Every normal kind at least once, so no kind's first use in this service is measured: in
    # CI the measured phase's first numpy run once passed its 3 s limit (its others: 0.3-0.8 s).
    warm_items = workload.mix(max(plan.warmup, len(workload.NORMAL)), 0.0, seed=3)
    client_timeout = plan.worker_timeout + plan.kernel_grace + plan.start_allowance + 60
    with Service(settings) as service:
        # Each phase has its own client, closed before the service is looked at: the keep-alive
        # connections it holds are the service's descriptors too.
        async with driver.client(service.url, plan.concurrency, client_timeout) as http:
            await run_phase(http, service, warm_items, plan, "warm-up")
        sampler = resources.Sampler(service.pid, service.marker, service.scratch_root,
                                    service.url, interval=1.0)
        before = await resources.steady(sampler)
        sampler.start()
        hung: list[str] = []
        async with driver.client(service.url, plan.concurrency, client_timeout) as http:
            normal_records, normal_wall = await run_phase(http, service, normal_items, plan,
                                                          "normal only", hung)
            mixed_records: list[Record] = []
            mixed_wall = float("nan")
            if not hung:
                mixed_records, mixed_wall = await run_phase(http, service, mixed_items, plan,
                                                            "mixed", hung)
        await sampler.stop()
        after, settle_time = await resources.settle(sampler, before, timeout=60)
        result.series = {
            "requests": [r.row(sampler.t0) for r in normal_records + mixed_records],
            "samples": [s.as_dict() for s in sampler.samples],
        }
        result.notes.append(f"service log tail:\n{service.log_tail(8)}")
    report(result, plan, normal_records, normal_wall, mixed_records, mixed_wall, before, after,
           settle_time)
    result.goal("the service keeps answering", "/health answered throughout (a 30 s silence "
                "ends the run)", "hung" if hung else "answered throughout", not hung,
                "\n".join(hung))
    if hung:
        result.notes.insert(0, f"the service stopped answering; the run ended early: "
                               f"{len(normal_records)} + {len(mixed_records)} runs sent")
    return result


def report(result: ScenarioResult, plan: Plan, normal_records: list[Record], normal_wall: float,
           mixed_records: list[Record], mixed_wall: float, before: resources.Sample,
           after: resources.Sample, settle_time: float) -> None:
    """Figures and goals of the scenario."""
    normal = [r for r in normal_records + mixed_records if not r.item.hostile]
    verdicts = collections.Counter(r.verdict.verdict for r in normal)
    hostile_planned = round(plan.mixed * plan.hostile_share)
    planned = plan.normal_only + plan.mixed - hostile_planned
    if len(normal) < planned:  # never answered: the run was cut short
        verdicts[check.MISSING] += planned - len(normal)
    correct = verdicts[check.CORRECT]
    result.figure("normal runs answered correctly",
                  f"{correct} / {planned} ({100 * correct / max(1, planned):.2f} %)")
    failures = [f"#{r.item.index} {r.item.kind} ({r.phase}): {r.verdict.verdict}: "
                f"{r.verdict.reason}" for r in normal if not r.verdict.good]
    result.goal("normal runs correct", "100 %, zero wrong or missing",
                f"{correct}/{planned}; " + ", ".join(
                    f"{k}: {v}" for k, v in sorted(verdicts.items()) if k != check.CORRECT),
                correct == planned, "\n".join(failures[:10]))

    hostile = [r for r in mixed_records if r.item.hostile]
    by_kind: dict[str, list[Record]] = collections.defaultdict(list)
    for record in hostile:
        by_kind[record.item.kind].append(record)
    rows = []
    for kind, records in sorted(by_kind.items()):
        counts = collections.Counter(r.verdict.verdict for r in records)
        errors = collections.Counter(check.error_text(r.answer)[:90] for r in records)
        longest = max(r.answer.latency for r in records)
        rows.append(f"{kind}: {counts[check.ERROR_ENVELOPE]}/{len(records)} error envelopes, "
                    f"slowest {longest:.1f} s; "
                    + "; ".join(f"{v} x {k}" for k, v in counts.items()
                                if k != check.ERROR_ENVELOPE)
                    + f" — error: {errors.most_common(1)[0][0]!r}")
    result.series["hostile_by_kind"] = rows
    good = sum(1 for r in hostile if r.verdict.good)
    bad = [f"#{r.item.index} {r.item.kind}: {r.verdict.verdict}: {r.verdict.reason}"
           for r in hostile if not r.verdict.good]
    slowest = max((r.answer.latency for r in hostile), default=float("nan"))
    result.figure("hostile runs answered with an error envelope",
                  f"{good} / {hostile_planned}; slowest answer {slowest:.1f} s")
    result.goal("hostile runs end in an error envelope, none hangs",
                f"all, each within timeout {plan.worker_timeout:g} s + grace "
                f"{plan.kernel_grace:g} s (+ {plan.start_allowance:g} s for a fresh kernel)",
                f"{good}/{hostile_planned}; slowest {slowest:.1f} s", good == hostile_planned,
                "\n".join(bad[:12]))

    p50_a, p99_a, max_a = latency_figures(normal_records)
    p50_b, p99_b, max_b = latency_figures([r for r in mixed_records if not r.item.hostile])
    result.figure("normal runs, without hostile share: p50 / p99 / max",
                  f"{fmt_ms(p50_a)} / {fmt_ms(p99_a)} / {fmt_ms(max_a)} "
                  f"(n={sum(1 for r in normal_records if not r.item.hostile)})")
    result.figure("normal runs, with 20 % hostile share: p50 / p99 / max",
                  f"{fmt_ms(p50_b)} / {fmt_ms(p99_b)} / {fmt_ms(max_b)} "
                  f"(n={sum(1 for r in mixed_records if not r.item.hostile)})")
    result.figure("throughput, normal only / mixed",
                  f"{len(normal_records) / normal_wall:.2f} / {len(mixed_records) / mixed_wall:.2f}"
                  f" runs/s (wall {normal_wall:.0f} s / {mixed_wall:.0f} s)")
    result.series["saturation_rps"] = len(normal_records) / normal_wall
    samples = [resources.Sample(**s) for s in result.series.get("samples", [])]
    result.figure("where the CPU went (normal-only and mixed phases)",
                  resources.cpu_split(samples))
    resource_rows = [
        ("processes (service + kernels + reapers)", before.processes, after.processes),
        ("kernels", before.kernels, after.kernels),
        ("scratch dirs", before.scratch_dirs, after.scratch_dirs),
        ("service descriptors", before.service_fds, after.service_fds),
        ("descriptors of all its processes", before.total_fds, after.total_fds),
        ("service RSS", fmt_mib(before.service_rss), fmt_mib(after.service_rss)),
    ]
    for label, was, now in resource_rows:
        result.figure(f"{label}: before → after", f"{was} → {now}")
    back = (after.processes <= before.processes and after.scratch_dirs <= before.scratch_dirs
            and after.kernels <= before.kernels and after.service_fds <= before.service_fds)
    result.goal("back to baseline after the run",
                "processes, scratch dirs, kernels and service descriptors ≤ before",
                f"processes {before.processes}→{after.processes}, scratch "
                f"{before.scratch_dirs}→{after.scratch_dirs}, fds {before.service_fds}→"
                f"{after.service_fds}, settled in {settle_time:.1f} s", back)
