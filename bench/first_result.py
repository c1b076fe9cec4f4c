"""`python -m bench.first_result`: time to first result, the way the field publishes it (#48).

Three ways to get a result out of `sandbox-kernel serve`'s native API, timed at the client from
the request sent to the whole answer read:

- **one-shot run**: `POST /api/v1/execute` with `main()` and its inputs; its answer is the whole
  result at once, so the first result is the complete one (the time to the answer's headers is
  kept too: the JSON answer is sent whole, so it is all but the same);
- **new session, first execute**: `POST /api/v1/sessions`, then `POST .../execute` on it (the
  session's kernel included in the time), then `DELETE` (not timed);
- **warm execute**: one more execute on a session that already ran the workload once.

Each in three arrival patterns: sequential (one after another), staggered (one started every
200 ms, each in a thread of its own, so the slow ones overlap) and a burst (all started at once,
threads released together). Reported: p50, p95, p99 of the runs that succeeded and the success
rate, a run counting only if its `result` is exactly the expected dict. Every run opens a
connection of its own (127.0.0.1: the client runs on the same host as the service, sharing its
CPUs). Two workloads: a `main()` returning a dict, and one importing numpy and pandas and
computing on a small DataFrame. By default the service runs on a runtime built here preloading
numpy and pandas (docs/deploy.md: its one-shot runs fork from a zygote holding them, its
sessions' kernels start with them loaded); `--lean` runs serve's defaults instead.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from bench.stats import publish
from tests.load.service import Service, Settings

RESULTS = Path(__file__).parent / "results" / "first-result.md"
REPO = Path(__file__).resolve().parents[1]
RUNTIME = "bench-first-result"
PRELOAD = ("numpy", "pandas")
CLIENT_TIMEOUT = 120.0  # seconds a client waits for one answer; a burst queues behind workers


@dataclass(frozen=True)
class Workload:
    """Code whose `main()` the service calls, and the one answer that counts as right."""

    name: str
    code: str
    expected: dict


TRIVIAL = Workload("main() returns a dict", 'def main() -> dict:\n    return {"a": 1}\n',
                   {"a": 1})
DATAFRAME = Workload(
    "numpy + pandas DataFrame",
    "def main() -> dict:\n"
    "    import numpy as np\n"
    "    import pandas as pd\n"
    '    frame = pd.DataFrame({"x": np.arange(10), "y": np.arange(10) ** 2})\n'
    '    by_parity = frame.groupby(frame["x"] % 2)["y"].sum()\n'
    '    return {"rows": len(frame), "y_sum": int(frame["y"].sum()),\n'
    '            "x_mean": float(frame["x"].mean()), "even_y": int(by_parity[0])}\n',
    {"rows": 10, "y_sum": 285, "x_mean": 4.5, "even_y": 120})
WORKLOADS = {"trivial": TRIVIAL, "dataframe": DATAFRAME}


@dataclass
class Outcome:
    """One run as the client saw it: seconds to the answer's headers and to the whole answer
    (from the first request sent), and what was wrong if it did not count."""

    seconds: float
    headers: float
    why: str = ""

    @property
    def good(self) -> bool:
        return not self.why


@dataclass(frozen=True)
class Reply:
    status: int
    headers_at: float  # perf_counter when the status line and headers were in
    body: bytes


class Api:
    """The native API of one service on 127.0.0.1, one bearer key."""

    def __init__(self, port: int, key: str) -> None:
        self.port = port
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=CLIENT_TIMEOUT)

    def send(self, connection: http.client.HTTPConnection, method: str, path: str,
             payload: dict | None = None) -> Reply:
        """One request on the connection, its answer read whole."""
        body = None if payload is None else json.dumps(payload).encode()
        connection.request(method, path, body=body, headers=self.headers)
        response = connection.getresponse()
        headers_at = time.perf_counter()
        return Reply(response.status, headers_at, response.read())


def execution(workload: Workload) -> dict:
    """The body of an execute: the workload's main() called with no inputs."""
    return {"code": workload.code, "inputs": {}}


def judged(reply: Reply, started: float, workload: Workload) -> Outcome:
    """The run's outcome from its execute's answer: right only if the result is exactly the
    workload's expected dict (timed before the answer is parsed)."""
    outcome = Outcome(time.perf_counter() - started, reply.headers_at - started)
    if reply.status != 200:
        outcome.why = f"HTTP {reply.status}"
        return outcome
    try:
        answer = json.loads(reply.body)
    except ValueError:
        outcome.why = "not JSON"
        return outcome
    if answer.get("error"):
        outcome.why = f"error {answer['error'].get('name')}"
    elif answer.get("result") != workload.expected:
        outcome.why = "wrong result"
    return outcome


def failed(started: float, exc: BaseException) -> Outcome:
    """A run the connection gave up on (refused, reset, timed out)."""
    seconds = time.perf_counter() - started
    return Outcome(seconds, seconds, type(exc).__name__)


def one_shot(api: Api, workload: Workload) -> Outcome:
    """A stateless run on a fresh kernel: POST /api/v1/execute."""
    connection = api.connect()
    started = time.perf_counter()
    try:
        return judged(api.send(connection, "POST", "/api/v1/execute", execution(workload)),
                      started, workload)
    except (OSError, http.client.HTTPException) as exc:
        return failed(started, exc)
    finally:
        connection.close()


def new_session(api: Api, workload: Workload) -> Outcome:
    """A session opened and its first execute, timed together; the session closed after."""
    connection = api.connect()
    started = time.perf_counter()
    try:
        opened = api.send(connection, "POST", "/api/v1/sessions", {})
        if opened.status != 201:
            return Outcome(time.perf_counter() - started, opened.headers_at - started,
                           f"create: HTTP {opened.status}")
        session = str(json.loads(opened.body)["id"])
        try:
            return judged(api.send(connection, "POST", f"/api/v1/sessions/{session}/execute",
                                   execution(workload)), started, workload)
        finally:
            api.send(connection, "DELETE", f"/api/v1/sessions/{session}")
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        return failed(started, exc)
    finally:
        connection.close()


def warm_execute(api: Api, workload: Workload, sessions: queue.Queue[str]) -> Outcome:
    """One more execute on an idle session that already ran the workload (taken from the
    queue and given back, so overlapping runs never share one: a busy session answers 409)."""
    session = sessions.get()
    connection = api.connect()
    started = time.perf_counter()
    try:
        return judged(api.send(connection, "POST", f"/api/v1/sessions/{session}/execute",
                               execution(workload)), started, workload)
    except (OSError, http.client.HTTPException) as exc:
        return failed(started, exc)
    finally:
        connection.close()
        sessions.put(session)


@contextlib.contextmanager
def warm_sessions(api: Api, workload: Workload, count: int,
                  notes: list[str]) -> Iterator[queue.Queue[str]]:
    """`count` sessions, each having run the workload once, closed after; opened four at a
    time (the service's workers), since nothing of this is measured. A session whose first run
    went wrong is kept (the warm runs on it are measured as they go) and said in `notes`."""
    def open_one(_: int) -> tuple[str | None, str]:
        connection = api.connect()
        try:
            opened = api.send(connection, "POST", "/api/v1/sessions", {})
            if opened.status != 201:
                return None, f"not opened: HTTP {opened.status}"
            session = str(json.loads(opened.body)["id"])
            first = judged(api.send(connection, "POST", f"/api/v1/sessions/{session}/execute",
                                    execution(workload)), time.perf_counter(), workload)
            return session, first.why and f"first run {first.why}"
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            return None, f"not opened: {type(exc).__name__}"
        finally:
            connection.close()

    opened: queue.Queue[str] = queue.Queue()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(open_one, range(count)))
        for session, _ in answers:
            if session is not None:
                opened.put(session)
        wrong = Counter(why for _, why in answers if why)
        if wrong:
            notes.append(f"{workload.name}: of the {count} sessions opened for the warm runs, "
                         + ", ".join(f"{n} {why}" for why, n in wrong.most_common()))
        yield opened
    finally:
        close_sessions(api, opened)


def close_sessions(api: Api, sessions: queue.Queue[str]) -> None:
    connection = api.connect()
    try:
        while not sessions.empty():
            api.send(connection, "DELETE", f"/api/v1/sessions/{sessions.get()}")
    finally:
        connection.close()


def sequential(run: Callable[[], Outcome], count: int) -> list[Outcome]:
    """`count` runs one after another."""
    return [run() for _ in range(count)]


def staggered(run: Callable[[], Outcome], count: int, interval: float) -> list[Outcome]:
    """`count` runs, the i-th started at i * interval in a thread of its own: a run slower than
    the interval overlaps the next ones instead of delaying them."""
    outcomes: list[Outcome | None] = [None] * count
    start = time.perf_counter()

    def one(index: int) -> None:
        outcomes[index] = run()
    threads = []
    for index in range(count):
        time.sleep(max(0.0, start + index * interval - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(index,)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    return [outcome for outcome in outcomes if outcome is not None]


def burst(run: Callable[[], Outcome], count: int) -> list[Outcome]:
    """`count` runs in threads started first and released together by a barrier."""
    outcomes: list[Outcome | None] = [None] * count
    gate = threading.Barrier(count)

    def one(index: int) -> None:
        gate.wait()
        outcomes[index] = run()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [outcome for outcome in outcomes if outcome is not None]


@dataclass
class Row:
    """One workload, one way to a result, one arrival pattern: its runs."""

    workload: str
    kind: str
    pattern: str
    outcomes: list[Outcome]
    load: float  # the machine's 1-minute load average as the phase started
    wall: float = 0.0

    def good_seconds(self) -> list[float]:
        return sorted(o.seconds for o in self.outcomes if o.good)

    def percentile(self, q: int, values: list[float] | None = None) -> float:
        """The q-th percentile in ms of the successful runs (of `values` if given)."""
        values = self.good_seconds() if values is None else values
        if not values:
            return float("nan")
        if len(values) == 1:
            return values[0] * 1000
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000

    def headers_p50(self) -> float:
        return self.percentile(50, sorted(o.headers for o in self.outcomes if o.good))

    def failures(self) -> str:
        reasons = Counter(o.why for o in self.outcomes if not o.good)
        return ", ".join(f"{why}: {n}" for why, n in reasons.most_common())


@dataclass
class Plan:
    """What one run of the bench does."""

    runs: int  # sequential and staggered
    burst: int
    interval: float
    workloads: list[Workload]
    settle: float  # seconds the workload is sent before measuring (a preload set's pool starts)
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what went wrong outside the measured runs


def phase(plan: Plan, workload: Workload, kind: str, pattern: str,
          runs: Callable[[], list[Outcome]]) -> None:
    load = os.getloadavg()[0]
    started = time.perf_counter()
    outcomes = runs()
    plan.rows.append(Row(workload.name, kind, pattern, outcomes, load,
                         time.perf_counter() - started))
    time.sleep(0.5)  # kernels closed by the phase finish before the next one starts


def patterns(plan: Plan, workload: Workload, kind: str, run: Callable[[], Outcome]) -> None:
    """The three arrival patterns of one way to a result."""
    phase(plan, workload, kind, "sequential", lambda: sequential(run, plan.runs))
    phase(plan, workload, kind, f"staggered {plan.interval * 1000:g} ms",
          lambda: staggered(run, plan.runs, plan.interval))
    phase(plan, workload, kind, f"burst of {plan.burst}", lambda: burst(run, plan.burst))


def warm_up(api: Api, workload: Workload, settle: float) -> None:
    """Runs not measured: one-shots until one is right and then for `settle` seconds (the
    first runs of a preload set take the lean pool while the set's pool starts), and one
    session of each kind."""
    deadline, first_good = time.monotonic() + settle + 60, None
    while time.monotonic() < deadline:
        if one_shot(api, workload).good and first_good is None:
            first_good = time.monotonic()
        if first_good is not None and time.monotonic() - first_good >= settle:
            break
        time.sleep(0.1)
    if first_good is None:
        raise RuntimeError(f"{workload.name}: no one-shot run was right while warming up")
    new_session(api, workload)


def measure(api: Api, plan: Plan) -> None:
    for workload in plan.workloads:
        warm_up(api, workload, plan.settle)
        patterns(plan, workload, "one-shot run", functools.partial(one_shot, api, workload))
        patterns(plan, workload, "new session, first execute",
                 functools.partial(new_session, api, workload))
        with warm_sessions(api, workload, max(plan.burst, 1), plan.notes) as sessions:
            patterns(plan, workload, "warm execute",
                     functools.partial(warm_execute, api, workload, sessions))


def build_runtime(base: Path) -> dict[str, str]:
    """A runtime in `base` with the host's numpy and pandas, preloading both; the environment
    that finds it (SANDBOX_KERNEL_RUNTIMES)."""
    requirements = base / "requirements.txt"
    requirements.write_text("".join(f"{name}=={metadata.version(name)}\n" for name in PRELOAD))
    environ = {"SANDBOX_KERNEL_RUNTIMES": str(base / "runtimes")}
    subprocess.run([sys.executable, "-m", "sandbox_kernel", "runtime", "create", RUNTIME,
                    "-r", str(requirements), "--preload", ",".join(PRELOAD),
                    "--prefix", str(base)], env={**os.environ, **environ}, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return environ


def commit() -> str:
    """The checkout's commit, and whether its files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain") else "")


def settings(args: argparse.Namespace) -> Settings:
    """serve's flags: dify-sandbox's workers, and room for a whole burst (runs in flight,
    sessions) so the burst queues instead of being refused."""
    extra = ["--max-sessions", str(max(args.burst, 32) + 8)]
    if not args.lean:
        extra += ["--runtime", args.runtime or RUNTIME]
    return Settings(max_workers=args.max_workers, max_requests=max(args.burst, 50) + 8,
                    worker_timeout=args.worker_timeout, pool_size=1, extra=extra)


def run(args: argparse.Namespace) -> str:
    plan = Plan(args.runs, args.burst, args.stagger,
                [WORKLOADS[name] for name in args.workload or WORKLOADS],
                0.0 if args.lean else args.settle)
    chosen = settings(args)
    with tempfile.TemporaryDirectory(prefix="bench-first-result-") as tmp:
        environ = {} if args.lean or args.runtime else build_runtime(Path(tmp))
        load_before = os.getloadavg()
        with Service(chosen, environ=environ) as service:
            measure(Api(service.port, service.api_key), plan)
        load_after = os.getloadavg()
    return report(args, plan, chosen, (load_before, load_after))


def report(args: argparse.Namespace, plan: Plan, chosen: Settings,
           load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    before, after = load
    if args.lean:
        runtime = "no runtime (serve's defaults: the workload imports numpy and pandas itself)"
    elif args.runtime:
        runtime = f"the existing runtime `{args.runtime}`"
    else:
        versions = ", ".join(f"{name} {metadata.version(name)}" for name in PRELOAD)
        runtime = (f"a runtime built here with {versions} and `--preload {','.join(PRELOAD)}`: "
                   "one-shot runs importing them fork from the zygote of that preload set's "
                   "pool, a session's kernel starts with them loaded")
    lines = [
        "# Time to first result: one-shot, a new session's first execute, a warm execute", "",
        f"Command: `python -m bench.first_result {' '.join(sys.argv[1:])}`", "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit {commit()}; "
        f"{os.cpu_count()} CPUs, shared with other work; load average (1, 5 min) before "
        f"{before[0]:.2f}, {before[1]:.2f} / after {after[0]:.2f}, {after[1]:.2f}",
        "- **The client runs on the same host as the service** (127.0.0.1, a connection per "
        "run, Python's http.client in threads): it shares the CPUs, no network is crossed",
        f"- Service: `sandbox-kernel serve {' '.join(chosen.flags())}` (the rest its defaults: "
        "one-shot pool size 2 per network policy, network off for every run)",
        f"- Kernels: {runtime}",
        f"- Per workload, runs not measured first (one-shots for {plan.settle:g} s after the "
        "first right one, one session); then each way to a result: "
        f"{plan.runs} sequential, {plan.runs} staggered (one every {plan.interval * 1000:g} ms, "
        f"a thread each), a burst of {plan.burst} (threads released together). Warm executes "
        f"run on {max(plan.burst, 1)} sessions opened and run once beforehand, each run taking "
        "an idle one",
        "- Times from the first request sent to the whole answer read; percentiles over the "
        "runs that succeeded; success: HTTP 200 with `result` exactly the expected dict; "
        "'headers p50': to the answer's headers (of the execute, for a new session)",
        *[f"- {note}" for note in plan.notes], "",
        "| workload | way to a result | arrival | success | p50 | p95 | p99 | headers p50 "
        "| load at start | failures |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for row in plan.rows:
        good = sum(o.good for o in row.outcomes)
        total = len(row.outcomes)
        lines.append(
            f"| {row.workload} | {row.kind} | {row.pattern} | {good}/{total} "
            f"({100 * good / total if total else 0:.0f} %) | {row.percentile(50):.1f} ms | "
            f"{row.percentile(95):.1f} ms | {row.percentile(99):.1f} ms | "
            f"{row.headers_p50():.1f} ms | {row.load:.2f} | {row.failures() or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.first_result", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100,
                        help="sequential runs, and staggered runs, per way and workload")
    parser.add_argument("--burst", type=int, default=100, help="runs started at once")
    parser.add_argument("--stagger", type=float, default=0.2,
                        help="seconds between staggered starts")
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                        help="measure only this one (repeatable; default: both)")
    parser.add_argument("--lean", action="store_true",
                        help="serve's defaults: no runtime, nothing preloaded")
    parser.add_argument("--runtime", metavar="NAME",
                        help="an existing runtime (found as serve finds it) instead of one "
                        "built here")
    parser.add_argument("--settle", type=float, default=8.0,
                        help="seconds of unmeasured one-shots per workload on a runtime")
    parser.add_argument("--max-workers", type=int, default=4, help="serve's (its default: 4)")
    parser.add_argument("--worker-timeout", type=float, default=5.0,
                        help="serve's, seconds per one-shot run (its default: 5)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    return publish(run(args), args.out or RESULTS)


if __name__ == "__main__":
    sys.exit(main())
