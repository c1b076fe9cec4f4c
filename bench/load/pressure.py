"""Scenario 5, pressure: hostile results and floods beside normal requests, and idle sockets.

Waves of four hostile runs at once — two main() results of 13 MB of nested empty lists (one as
JSON, one as server-sent events), a flood of 1-byte stdout messages, a flood of log lines on
the kernel's stderr — while normal Dify-style runs go on and a probe asks for /health every
50 ms. Measured: /health latency (its p99 and its worst, the longest the service's event loop
was kept from answering), the service's RSS before, at its peak (VmHWM, exact) and after, and
whether the normal runs stayed correct. Then 200 TCP connections that send nothing are held
open while a normal run is made: it must be answered within 2 s (#20 items 5 and 7). Last, on
a service of its own with two keys, one key's saturating load beside the other's runs
(tenants.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.load import tenants
from tests.load import check, driver, resources, workload
from tests.load.results import ScenarioResult, fmt_mib, fmt_ms
from tests.load.service import Service, Settings

NESTED = "def main():\n    return {'x': [[] for _ in range(4_300_000)]}\n"  # 12.9 MB of JSON
OUTPUT_FLOOD = ("import sys\ndef main():\n    for _ in range(40_000):\n"
                "        sys.stdout.write('x'); sys.stdout.flush()\n    return {}\n")
LOG_FLOOD = ("import os, time\ndef main():\n    line = b'log flood ' * 20 + b'\\n'\n"
             "    end = time.monotonic() + 4\n    while time.monotonic() < end:\n"
             "        os.write(2, line * 64)\n    return {}\n")
HEALTH_P99 = 0.100  # seconds
RSS_BACK = 1.10  # RSS after the waves, at most this times the baseline
WARM_UP = 20.0  # seconds of normal runs before the baseline is taken
IDLE_SOCKETS = 200
IDLE_ANSWER = 2.0  # seconds for a normal run while the idle sockets are held


@dataclass
class Plan:
    waves: int
    normal_concurrency: int


FULL = Plan(waves=3, normal_concurrency=2)
QUICK = Plan(waves=1, normal_concurrency=1)


def settings() -> Settings:
    return Settings(max_workers=8, max_requests=64, worker_timeout=30, pool_size=2)


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak(pid: int) -> None:
    """Start VmHWM (the peak RSS) over from the current RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class HealthProbe:
    """bench/load/probe.py in a process of its own; the latencies it measured."""

    def __init__(self, url: str) -> None:
        self.url = driver.loopback_only(url)
        self.out = Path(tempfile.mkstemp(prefix="health-", suffix=".txt")[1])
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "bench.load.probe", self.url,
                                         str(self.out)], cwd=Path(__file__).parents[2])

    def read(self) -> tuple[list[float], list[str]]:
        """(latencies, failures) so far."""
        latencies, failures = [], []
        for line in self.out.read_text().splitlines():
            seconds, _, failure = line.partition(" ")
            with contextlib.suppress(ValueError):
                latencies.append(float(seconds))
                if failure:
                    failures.append(failure)
        return latencies, failures

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)


async def _native(http: httpx.AsyncClient, service: Service, code: str,
                  events: bool = False) -> tuple[int | None, int, str]:
    """POST /api/v1/execute with main(); (status, bytes received, what went wrong)."""
    headers = {"Authorization": f"Bearer {service.api_key}"}
    if events:
        headers["Accept"] = "text/event-stream"
    try:
        answer = await http.post("/api/v1/execute", headers=headers, timeout=120,
                                 json={"code": code, "inputs": {}, "timeout": 60})
    except httpx.HTTPError as exc:
        return None, 0, type(exc).__name__
    problem = ""
    if answer.status_code != 200:
        problem = answer.text[:200]
    elif code is NESTED and answer.content.count(b"[]") < 4_300_000:  # not parsed: cheap
        problem = "the result came back changed"
    return answer.status_code, len(answer.content), problem


async def hostile_wave(http: httpx.AsyncClient, service: Service) -> list[str]:
    """The four hostile runs at once; one line per run."""
    runs = {"13 MB result (JSON)": _native(http, service, NESTED),
            "13 MB result (SSE)": _native(http, service, NESTED, events=True),
            "40,000 1-byte outputs": _native(http, service, OUTPUT_FLOOD),
            "4 s log flood": _native(http, service, LOG_FLOOD)}
    started = time.monotonic()
    outcomes = await asyncio.gather(*runs.values())
    took = time.monotonic() - started
    return [f"{name}: status {status}, {size / 2**20:.1f} MiB in, {problem or 'ok'}"
            for name, (status, size, problem) in zip(runs, outcomes, strict=True)] + [
        f"wave took {took:.1f} s"]


async def normal_runs(http: httpx.AsyncClient, service: Service, stop: asyncio.Event,
                      concurrency: int) -> list[check.Verdict]:
    """Normal Dify-style runs, back to back, until stop is set."""
    verdicts: list[check.Verdict] = []
    items = iter(workload.mix(10_000, 0.0, seed=71))

    async def worker() -> None:
        while not stop.is_set():
            item = next(items)
            answer = await driver.post_run(http, item.body(), service.api_key, timeout=60)
            verdicts.append(check.judge_normal(item, answer))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return verdicts


async def rss_after(pid: int, baseline: int, timeout: float = 30.0) -> tuple[int, float]:
    """RSS once it is back within RSS_BACK of baseline (or at timeout); and when."""
    started = time.monotonic()
    while True:
        now = _status(pid, "VmRSS")
        if now <= baseline * RSS_BACK or time.monotonic() - started > timeout:
            return now, time.monotonic() - started
        await asyncio.sleep(0.5)


async def pressure(result: ScenarioResult, service: Service, plan: Plan) -> None:
    """The hostile waves beside normal runs, with /health probed throughout."""
    pid = service.pid
    sampler = resources.Sampler(service.pid, service.marker, service.scratch_root, service.url)
    async with driver.client(service.url, 16, 120) as http:
        # Warm: the baseline is the service in steady normal use, what the same normal load
        # and one small answer of each kind make it hold anyway; what the hostile runs leave
        # is measured against that.
        warm = asyncio.Event()
        warming = asyncio.create_task(normal_runs(http, service, warm, plan.normal_concurrency))
        await _native(http, service, "def main():\n    return {}\n")
        await _native(http, service, "def main():\n    return {}\n", events=True)
        await asyncio.sleep(WARM_UP)
        warm.set()
        await warming
        await resources.steady(sampler)
        baseline = int(statistics.median([_status(pid, "VmRSS") for _ in range(5)]))
        _reset_peak(pid)
        probe = HealthProbe(service.url)
        probe.start()
        await asyncio.sleep(3)  # /health alone first: the probe's own floor
        floor, _ = probe.read()
        stop = asyncio.Event()
        normal = asyncio.create_task(normal_runs(http, service, stop, plan.normal_concurrency))
        waves: list[str] = []
        for index in range(plan.waves):
            waves += [f"wave {index + 1}: {line}" for line in await hostile_wave(http, service)]
        stop.set()
        verdicts = await normal
        probe.stop()
        latencies, failures = probe.read()
        during = latencies[len(floor):]
        peak = _status(pid, "VmHWM")
        after, settled = await rss_after(pid, baseline)
    p99, worst = driver.percentile(during, 0.99), max(during) if during else float("nan")
    good = sum(1 for v in verdicts if v.good)
    result.figure("/health alone: p50 / p99 / max",
                  f"{fmt_ms(driver.percentile(floor, 0.5))} / "
                  f"{fmt_ms(driver.percentile(floor, 0.99))} / {fmt_ms(max(floor))} "
                  f"(n={len(floor)})")
    result.figure("/health during the hostile waves: p50 / p99 / max",
                  f"{fmt_ms(driver.percentile(during, 0.5))} / {fmt_ms(p99)} / {fmt_ms(worst)} "
                  f"(n={len(during)}, {len(failures)} failed)")
    result.figure("service RSS: baseline / peak (VmHWM) / after",
                  f"{fmt_mib(baseline)} / {fmt_mib(peak)} / {fmt_mib(after)} "
                  f"({settled:.1f} s after the last wave)")
    result.figure("peak growth over the baseline, 4 hostile runs in flight",
                  f"{fmt_mib(peak - baseline)} ({fmt_mib((peak - baseline) / 4)} per run)")
    result.figure("normal runs during the waves", f"{good}/{len(verdicts)} correct")
    result.series["hostile_by_kind"] = waves
    result.goal("/health while 4 hostile runs go on",
                f"p99 ≤ {HEALTH_P99 * 1000:.0f} ms (13 MB results, 1-byte output floods, log "
                "floods, beside normal runs)",
                f"p99 {fmt_ms(p99)}, max {fmt_ms(worst)} over {len(during)} probes, "
                f"{len(failures)} failed", p99 <= HEALTH_P99 and not failures,
                "\n".join(waves))
    result.goal("the service's RSS after the hostile waves",
                f"back within {round((RSS_BACK - 1) * 100)} % of its baseline",
                f"{fmt_mib(baseline)} → peak {fmt_mib(peak)} → {fmt_mib(after)} "
                f"({100 * (after / baseline - 1):+.0f} %)", after <= baseline * RSS_BACK)
    result.goal("normal runs beside the hostile ones", "all correct",
                f"{good}/{len(verdicts)} correct", good == len(verdicts) and good > 0,
                "; ".join(v.reason for v in verdicts if not v.good)[:800])


async def idle_sockets(result: ScenarioResult, service: Service) -> None:
    """IDLE_SOCKETS connections that never send a byte, held open during a normal run."""
    port = service.port
    held: list[asyncio.StreamWriter] = []
    try:
        for _ in range(IDLE_SOCKETS):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append(writer)
        await asyncio.sleep(1.0)  # every one accepted by the service
        async with driver.client(service.url, 2, 30) as http:
            item = workload.mix(1, 0.0, seed=81)[0]
            answer = await driver.post_run(http, item.body(), service.api_key, timeout=30)
        verdict = check.judge_normal(item, answer)
        still_open = sum(1 for writer in held if not writer.is_closing())
    finally:
        for writer in held:
            writer.close()
    result.figure(f"a normal run with {IDLE_SOCKETS} silent connections held open",
                  f"{verdict.verdict} in {fmt_ms(answer.latency)}")
    result.goal(f"{IDLE_SOCKETS} idle connections held open",
                f"a normal run still answered correctly within {IDLE_ANSWER:g} s",
                f"{verdict.verdict} in {fmt_ms(answer.latency)} ({still_open} of the "
                f"{IDLE_SOCKETS} sockets opened were still open on our side)",
                verdict.good and answer.latency <= IDLE_ANSWER, verdict.reason)


async def run(plan: Plan, quick: bool) -> ScenarioResult:
    result = ScenarioResult("pressure", quick=quick)
    chosen = settings()
    result.settings = {"service_flags": chosen.flags()}
    with Service(chosen) as service:
        await pressure(result, service, plan)
        await idle_sockets(result, service)
        result.notes.append(service.log_errors())
    await tenants.run(result, quick)
    return result
