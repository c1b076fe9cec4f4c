"""Scenario 3, faults: a kernel killed mid-run, the fork server killed, a full scratch, an
unwritable audit log, an exhausted pool, a client that leaves, SIGTERM under load.

Each fault runs against an instance of its own (or one shared by faults that leave it clean) and
reports a goal: met, missed, or not runnable on this service, with the evidence."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable

import psutil

from tests.load import check, driver, native, resources, workload
from tests.load.driver import Http
from tests.load.results import ScenarioResult
from tests.load.service import Service, Settings, serve_command

FIND_TIMEOUT = 30.0


def token() -> str:
    return f"tok-{uuid.uuid4().hex[:12]}"


def kernel_running(service: Service, tag: str) -> psutil.Process | None:
    """The kernel whose scratch (its cwd) holds the file `tag`."""
    for process in resources.instance_processes(service.pid, service.marker):
        if resources.is_kernel(process):
            with contextlib.suppress(OSError):
                if os.path.exists(f"/proc/{process.pid}/cwd/{tag}"):
                    return process
    return None


async def wait_for_kernel(service: Service, tag: str) -> psutil.Process | None:
    deadline = time.monotonic() + FIND_TIMEOUT
    while time.monotonic() < deadline:
        found = await asyncio.to_thread(kernel_running, service, tag)
        if found is not None:
            return found
        await asyncio.sleep(0.1)
    return None


def sampler_of(service: Service) -> resources.Sampler:
    return resources.Sampler(service.pid, service.marker, service.scratch_root, service.url)


async def next_run_works(http: Http, service: Service, seed: int) -> check.Verdict:
    """A normal node right after the fault: it must be answered correctly."""
    item = workload.mix(1, 0.0, seed=seed)[0]
    return check.judge_normal(item, await driver.post_run(http, item.body(), service.api_key))


# ---------------------------------------------------------------------------------------------

async def kill_kernel_dify(result: ScenarioResult, service: Service, http: Http) -> None:
    """kill -9 the kernel of a running dify run: an error envelope at once, the next run works."""
    sampler = sampler_of(service)
    before = await resources.steady(sampler)
    tag = token()
    item = workload.sleeper_item(0, 30, tag)
    run = asyncio.create_task(driver.post_run(http, item.body(), service.api_key))
    kernel = await wait_for_kernel(service, tag)
    if kernel is None:
        run.cancel()
        result.goal("kill -9 a kernel mid-run (dify route)", "error envelope, next run works",
                    "the run's kernel was not found", False, service.log_tail(5))
        return
    killed_at = time.monotonic()
    kernel.send_signal(signal.SIGKILL)
    answer = await run
    after_kill = time.monotonic() - killed_at
    verdict = check.judge_hostile(item, answer, deadline=60)
    following = await next_run_works(http, service, 21)
    after, settle_time = await resources.settle(sampler, before, timeout=30)
    met = (verdict.good and following.good and after_kill < 10
           and after.processes <= before.processes)
    result.goal("kill -9 a kernel mid-run (dify route)",
                "error envelope within seconds, next run correct, nothing left behind",
                f"{verdict.verdict} {after_kill:.1f} s after the kill: "
                f"{check.error_text(answer)!r}; next run {following.verdict}; processes "
                f"{before.processes}→{after.processes} in {settle_time:.1f} s", met,
                f"{verdict.reason} {following.reason}".strip())


async def kill_kernel_native(result: ScenarioResult, service: Service, http: Http) -> None:
    """kill -9 a session's kernel mid-execution on the native API: state_lost, next call works."""
    outcome = await native.kill_kernel_mid_run(service, http, wait_for_kernel)
    result.goal("kill -9 a kernel mid-run (native API)",
                "the execution fails cleanly with state_lost, the next one works",
                outcome.value, outcome.met, outcome.evidence)


def fork_servers(service: Service) -> list[psutil.Process]:
    """The instance's fork server(s), if its kernels come from one."""
    return [process for process in resources.instance_processes(service.pid, service.marker)
            if resources.is_fork_server(process)]


async def kill_fork_server(result: ScenarioResult, service: Service, http: Http) -> None:
    """kill -9 the fork server under load: kernels start cold or it is restarted; no hang."""
    servers = await asyncio.to_thread(fork_servers, service)
    if not servers:
        result.goal("kill -9 the fork server mid-load", "no request hangs; later runs work",
                    "not runnable", None,
                    "the service under test starts no fork server (no process of it runs "
                    "sandbox_kernel.launch.forkserver): its kernels are started cold")
        return
    items = workload.mix(32, 0.0, seed=31)
    records: list[check.Verdict] = []

    async def send(index: int) -> check.Answer:
        answer = await driver.post_run(http, items[index].body(), service.api_key, timeout=90)
        records.append(check.judge_normal(items[index], answer))
        return answer

    load = asyncio.create_task(driver.closed_loop(len(items), 8, send, deadline=300))
    await asyncio.sleep(2)
    names = [" ".join(p.cmdline())[:120] for p in servers]
    for process in servers:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    await load
    after = await next_run_works(http, service, 32)
    good = sum(1 for v in records if v.good)
    hung = [v for v in records if v.verdict in (check.HUNG, check.MISSING)]
    result.goal("kill -9 the fork server mid-load", "no request hangs; later runs work",
                f"{good}/{len(records)} correct during the load, {len(hung)} hung; next run "
                f"{after.verdict}", not hung and after.good,
                f"killed: {names}; next run: {after.reason or 'correct'}; "
                + "; ".join(v.reason for v in records if not v.good)[:600])


async def fill_scratch(result: ScenarioResult, service: Service, http: Http) -> None:
    """A node fills its scratch to the quota: it gets ENOSPC, a neighbour is unharmed."""
    fill = workload.code_item(0, "fill_scratch", '''
def main() -> dict:
    chunk = b"x" * 2**20
    written = 0
    with open("fill.bin", "wb") as f:
        while True:
            f.write(chunk)
            written += 1
''')
    neighbour = workload.mix(1, 0.0, seed=41)[0]
    sampler = sampler_of(service)
    before = await resources.steady(sampler)
    answers = await asyncio.gather(driver.post_run(http, fill.body(), service.api_key),
                                   driver.post_run(http, neighbour.body(), service.api_key))
    filled = check.judge_hostile(fill, answers[0], deadline=30)
    text = check.error_text(answers[0])
    unharmed = check.judge_normal(neighbour, answers[1])
    following = await next_run_works(http, service, 42)
    after, settle_time = await resources.settle(sampler, before, timeout=30)
    met = (filled.good and "No space left" in text and unharmed.good and following.good
           and after.scratch_dirs <= before.scratch_dirs)
    result.goal("fill a kernel's scratch to its quota",
                "ENOSPC error envelope; a concurrent run and the next run correct; scratch freed",
                f"{filled.verdict}: {text!r}; concurrent run {unharmed.verdict}; next run "
                f"{following.verdict}; scratch dirs {before.scratch_dirs}→{after.scratch_dirs} "
                f"in {settle_time:.1f} s", met, f"{filled.reason} {unharmed.reason}".strip())


def serve_flags() -> str:
    """The text of `sandbox-kernel serve --help`."""
    return subprocess.run([*serve_command(), "--help"], capture_output=True, text=True,
                          timeout=60).stdout


async def audit_log_unwritable(result: ScenarioResult) -> None:
    """The audit log cannot be written: runs still answer (or the service says why it stops)."""
    if "--audit-log" not in serve_flags():
        result.goal("make the audit log unwritable", "runs answered; the failure logged",
                    "not runnable", None, "`sandbox-kernel serve --help` has no --audit-log "
                    "option on this branch: the service writes no audit log yet")
        return
    # /dev/full accepts the open and fails every write with ENOSPC, even for root.
    settings = Settings(max_workers=2, max_requests=8, pool_size=1,
                        extra=["--audit-log", "/dev/full"])
    try:
        with Service(settings) as service:
            async with driver.client(service.url, 4, 60) as http:
                first = await next_run_works(http, service, 51)
                hostile = workload.hostile_item(1, "fork", __import__("random").Random(5))
                answer = await driver.post_run(http, hostile.body(), service.api_key)
                denied = check.judge_hostile(hostile, answer, deadline=30)
                second = await next_run_works(http, service, 52)
            log = service.log_tail(15)
        met = first.good and denied.good and second.good
        result.goal("make the audit log unwritable (--audit-log /dev/full)",
                    "runs still answered correctly, denials still reported",
                    f"run {first.verdict}, denied run {denied.verdict}, next {second.verdict}",
                    met, log[-800:])
    except RuntimeError as exc:  # refusing to start with an unwritable log is also clean
        result.goal("make the audit log unwritable (--audit-log /dev/full)",
                    "runs answered, or the service refuses to start saying why",
                    "refused to start", "audit" in str(exc).lower(), str(exc)[-600:])


async def exhaust_pool(result: ScenarioResult) -> None:
    """MAX_WORKERS busy: the next runs queue; MAX_REQUESTS in flight: 503 at once."""
    settings = Settings(max_workers=2, max_requests=4, pool_size=1, worker_timeout=15)
    with Service(settings) as service:
        async with driver.client(service.url, 8, 60) as http:
            sleepers = [workload.sleeper_item(i, 3, token()) for i in range(4)]
            running = [asyncio.create_task(driver.post_run(http, s.body(), service.api_key))
                       for s in sleepers]
            await asyncio.sleep(1.0)
            extra = workload.mix(3, 0.0, seed=61)
            refused = await asyncio.gather(*(driver.post_run(http, e.body(), service.api_key)
                                             for e in extra))
            answers = await asyncio.gather(*running)
            following = await next_run_works(http, service, 62)
    verdicts = [check.judge_normal(s, a) for s, a in zip(sleepers, answers, strict=True)]
    latencies = sorted(a.latency for a in answers)
    # dify-sandbox's envelope; Go also writes "data": null, which the contract leaves out.
    exact = [a.status == 503 and isinstance(a.json(), dict)
             and {k: v for k, v in a.json().items() if k != "data" or v is not None}
             == {"code": -503, "message": "Too many requests"} for a in refused]
    queued = latencies[2] >= 5.5  # the third and fourth waited for a worker (3 s) first
    result.goal("exhaust the pool: queue, then 503 past MAX_REQUESTS",
                "MAX_WORKERS=2, MAX_REQUESTS=4: 4 sleepers (3 s) all correct, the last two "
                "queued; 3 more get 503 {code:-503} at once; the next run works",
                f"sleepers {[v.verdict for v in verdicts]}, latencies "
                f"{[round(x, 1) for x in latencies]} s; refusals {[a.status for a in refused]} in "
                f"≤ {max(a.latency for a in refused):.2f} s, exact body {all(exact)}; next run "
                f"{following.verdict}",
                all(v.good for v in verdicts) and all(exact) and queued and following.good
                and max(a.latency for a in refused) < 1.0,
                "; ".join(v.reason for v in verdicts if not v.good))


async def client_leaves(result: ScenarioResult, service: Service, http: Http) -> None:
    """A client gives up mid-run: the service cancels the run and frees its kernel."""
    sampler = sampler_of(service)
    before = await resources.steady(sampler)
    tag = token()
    item = workload.sleeper_item(0, 30, tag)
    run = asyncio.create_task(driver.post_run(http, item.body(), service.api_key, timeout=2.0))
    kernel = await wait_for_kernel(service, tag)
    answer = await run  # the client's read timeout closes the connection
    left_at = time.monotonic()
    gone = None
    while time.monotonic() - left_at < 25:
        if kernel is None or not resources.alive(kernel):
            gone = time.monotonic() - left_at
            break
        await asyncio.sleep(0.2)
    after, _ = await resources.settle(sampler, before, timeout=30)
    result.goal("a client disconnects mid-run (dify route)",
                "its kernel is shut down within seconds (not after the 30 s run); nothing leaks",
                f"client gave up ({answer.failure or answer.status}); kernel "
                + (f"gone {gone:.1f} s later" if gone is not None else "still alive after 25 s")
                + f"; processes {before.processes}→{after.processes}, scratch "
                f"{before.scratch_dirs}→{after.scratch_dirs}",
                kernel is not None and gone is not None and gone < 10
                and after.processes <= before.processes,
                "" if kernel else "the run's kernel was not found")
    streamed = await native.client_leaves_stream(service, http, wait_for_kernel)
    result.goal("a client disconnects mid-stream (native SSE)",
                "its kernel is shut down within seconds; nothing leaks",
                streamed.value, streamed.met, streamed.evidence)


async def sigterm_under_load(result: ScenarioResult) -> None:
    """SIGTERM while runs are in flight: short ones finish, long ones are cancelled within the
    grace period, the service exits, no process or scratch dir is left."""
    grace = 4.0
    settings = Settings(max_workers=16, max_requests=64, pool_size=2, worker_timeout=20,
                        extra=["--shutdown-grace", f"{grace:g}"])
    service = Service(settings)
    service.start()
    try:
        async with driver.client(service.url, 16, 60) as http:
            seconds = [2, 3] * 4 + [15] * 4  # 8 can finish within the grace, 4 cannot
            items = [workload.sleeper_item(i, s, token()) for i, s in enumerate(seconds)]
            runs = [asyncio.create_task(driver.post_run(http, it.body(), service.api_key,
                                                        timeout=60)) for it in items]
            # SIGTERM once the long runs are executing in their kernels (each has marked its
            # scratch); the short ones still in flight then are the ones that must finish.
            found = await asyncio.gather(*(wait_for_kernel(service, it.expected["tag"])
                                           for it in items
                                           if it.expected and it.expected["slept"] > grace))
            in_flight = [it for it, run in zip(items, runs, strict=True) if not run.done()]
            seen = {p.pid: p for p in resources.instance_processes(service.pid, service.marker)}
            exit_time = await asyncio.to_thread(service.terminate, grace + 30)
            answers = await asyncio.gather(*runs)
        await asyncio.sleep(3)  # reapers remove scratch dirs once their kernel is gone
        left = [p for p in resources.instance_processes(None, service.marker)]
        left += [p for p in seen.values()
                 if resources.alive(p) and p.pid not in {x.pid for x in left}]
        await asyncio.sleep(1)
        left = [p for p in left if resources.alive(p)]  # not those that were just exiting
        scratch_left = resources.scratch_dirs(service.scratch_root, set(seen))
        log = service.log_tail(12)
    finally:
        service.stop()
    outcomes, clean_ends = [], []
    for item, answer in zip(items, answers, strict=True):
        verdict = check.judge_normal(item, answer)
        seconds_asked = item.expected["slept"] if item.expected else 0
        why = "" if verdict.good else check.error_text(answer)[:60] or answer.failure[:40]
        outcomes.append(f"{seconds_asked:g}s→{verdict.verdict}" + (f"({why})" if why else ""))
        if seconds_asked > grace:  # cancelled: the answer must still be an error envelope
            clean_ends.append(check.judge_hostile(item, answer, deadline=grace + 12).good)
    short_ok = all(check.judge_normal(it, a).good for it, a in zip(items, answers, strict=True)
                   if it.expected and it.expected["slept"] <= 3)
    slowest = max(a.latency for a in answers)
    running = sum(1 for k in found if k is not None)
    short_in_flight = sum(1 for it in in_flight if it.expected and it.expected["slept"] <= 3)
    met = (exit_time is not None and exit_time <= grace + 10 and short_ok and all(clean_ends)
           and not left and scratch_left == 0 and running == len(found))
    result.goal("SIGTERM to the service under load",
                f"SIGTERM with 12 runs executing: those of 2-3 s finish correctly, the 15 s "
                f"ones are cancelled within the {grace:g} s grace with an error answer; the "
                "service exits; no orphans or scratch dirs",
                f"at SIGTERM: {running}/{len(found)} long runs executing, {short_in_flight} short "
                f"ones in flight; exited "
                f"{exit_time if exit_time is None else round(exit_time, 1)} s after "
                f"SIGTERM; slowest answer {slowest:.1f} s; {', '.join(outcomes)}; left: "
                f"{len(left)} processes, {scratch_left} scratch dirs", met,
                "; ".join(resources.describe(p) for p in left)[:500]
                + "\n" + log[-900:])


Fault = Callable[[ScenarioResult, Service, Http], Awaitable[None]]
SHARED: tuple[Fault, ...] = (kill_kernel_dify, kill_kernel_native, fill_scratch, client_leaves,
                             kill_fork_server)


async def run(quick: bool) -> ScenarioResult:
    result = ScenarioResult("faults", quick=quick)
    settings = Settings(max_workers=4, max_requests=16, pool_size=1, worker_timeout=40,
                        extra=["--scratch-size", "32M"])
    result.settings = {"shared_instance_flags": settings.flags()}
    with Service(settings) as service:
        async with driver.client(service.url, 8, 90) as http:
            for fault in SHARED:
                await guarded(result, fault.__name__, fault(result, service, http))
    for name, alone in (("exhaust_pool", exhaust_pool(result)),
                        ("audit_log_unwritable", audit_log_unwritable(result)),
                        ("sigterm_under_load", sigterm_under_load(result))):
        await guarded(result, name, alone)
    return result


async def guarded(result: ScenarioResult, name: str, fault: Awaitable[None]) -> None:
    """Run one fault; a harness exception is a missed goal with its traceback, not a crash."""
    try:
        await asyncio.wait_for(fault, 300)
    except Exception as exc:
        import traceback
        result.goal(name, "(the fault ran to its end)", f"harness error: {exc!r}", False,
                    "".join(traceback.format_exception(exc))[-1500:])
