"""`python -m bench.service`: our service against the real dify-sandbox, side by side.

Both run on this machine at once, each on 127.0.0.1: `sandbox-kernel serve` (tests/load/service.py
starts it, with dify-sandbox's defaults: MAX_WORKERS 4, WORKER_TIMEOUT 5) and the dify-sandbox
built from its source in `../shared/anchors/dify-sandbox/` (its own start.sh and stop.sh; skipped,
saying so, when that folder is absent). Every request is the one Dify sends: its wrapping of
`def main() -> dict: return {"a": 1}` (base64 inputs, `<<RESULT>>` markers), counted only if its
stdout is exactly the marked JSON. Our native API's one-shot execute (`POST /api/v1/execute`,
the same `main()` with inputs) is measured beside it, and so is the MCP server's `run_python`
without a session (`sandbox-kernel mcp --http`, tests/mcp_clients.py starts it; each client
opens its MCP session once, then sends tools/call requests, the same `main()` with inputs).

Phases are interleaved, target by target, round after round, so load from elsewhere on the
machine falls on all of them alike: N sequential requests (p50, p90), then C clients for S
seconds (requests/s). CPU per request is given twice: the machine's busy time from /proc/stat
(everything that ran, other work included), and the CPU of the target's own process tree
(the server, the children it waited for; for ours also the fork server and the kernels it
reaped), which other work on the machine does not inflate.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.stats import publish
from sandbox_kernel.launch.forkserver.zygote import NAME as ZYGOTE_NAME
from tests.load.service import Service, Settings, free_port
from tests.mcp_clients import FLAGS as MCP_FLAGS
from tests.mcp_clients import HttpServer

ANCHOR = Path(os.environ.get("SANDBOX_BENCH_DIFY_SANDBOX",
                             Path(__file__).resolve().parents[2] / "shared/anchors/dify-sandbox"))
RESULTS = Path(__file__).parent / "results" / "service.md"
KEY = "bench-service-key"
MCP_KEY = "bench-mcp-key-0123456789abcdef"
MCP_ACCEPT = "application/json, text/event-stream"  # a Streamable HTTP client's
TICK = os.sysconf("SC_CLK_TCK")
# The stateless issue's (#48) targets against dify-sandbox: sequential p50, requests/s with 4
# clients, machine CPU per request.
TARGET_P50, TARGET_RATE, TARGET_CPU = 0.25, 2.5, 0.4

USER_CODE = 'def main() -> dict:\n    return {"a": 1}\n'
EXPECTED_STDOUT = '<<RESULT>>{\n    "a": 1\n}<<RESULT>>\n'


def dify_wrapped(code: str, inputs: dict) -> str:
    """The program Dify sends to /v1/sandbox/run for a code node (its Python template)."""
    encoded = base64.b64encode(json.dumps(inputs).encode()).decode()
    return (f"{code}\nimport json\nfrom base64 import b64decode\n"
            f"inputs_obj = json.loads(b64decode('{encoded}').decode('utf-8'))\n"
            "output_obj = main(**inputs_obj)\n"
            "output_json = json.dumps(output_obj, indent=4)\n"
            "result = f'<<RESULT>>{output_json}<<RESULT>>'\n"
            "print(result)\n")


@dataclass(frozen=True)
class Route:
    """One way to ask for a run, and how to tell that it worked; `opening`, for a protocol
    with sessions, opens one on a client's connection and gives the headers naming it."""

    path: str
    headers: dict[str, str]
    body: bytes
    check: Callable[[dict], bool]
    opening: Callable[[http.client.HTTPConnection, dict[str, str]], dict[str, str]] | None = None


def dify_route(key: str) -> Route:
    body = {"language": "python3", "code": dify_wrapped(USER_CODE, {}), "preload": "",
            "enable_network": True}  # as Dify sends it by default
    return Route("/v1/sandbox/run", {"X-Api-Key": key, "Content-Type": "application/json"},
                 json.dumps(body).encode(),
                 lambda reply: reply.get("code") == 0
                 and reply["data"]["stdout"] == EXPECTED_STDOUT)


def native_route(key: str) -> Route:
    body = {"code": USER_CODE, "inputs": {}}
    return Route("/api/v1/execute", {"Authorization": f"Bearer {key}",
                                     "Content-Type": "application/json"},
                 json.dumps(body).encode(),
                 lambda reply: reply.get("result") == {"a": 1} and reply.get("error") is None)


def mcp_route(key: str) -> Route:
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "run_python", "arguments": {"code": USER_CODE, "inputs": {}}}}
    return Route("/mcp", {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                          "Accept": MCP_ACCEPT}, json.dumps(call).encode(),
                 lambda reply: not reply["result"].get("isError")
                 and reply["result"]["structuredContent"]["result"] == {"a": 1},
                 opening=open_mcp_session)


def open_mcp_session(connection: http.client.HTTPConnection,
                     headers: dict[str, str]) -> dict[str, str]:
    """initialize, then notifications/initialized: the headers of the session they opened."""
    hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                        "clientInfo": {"name": "bench.service", "version": "1"}}}
    connection.request("POST", "/mcp", body=json.dumps(hello).encode(), headers=headers)
    response = connection.getresponse()
    answer = reply_of(response.read())
    session = {"mcp-session-id": response.getheader("mcp-session-id") or "",
               "mcp-protocol-version": answer["result"]["protocolVersion"]}
    ready = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    connection.request("POST", "/mcp", body=json.dumps(ready).encode(),
                       headers={**headers, **session})
    connection.getresponse().read()
    return session


def reply_of(data: bytes) -> dict:
    """A JSON answer, or the last message of a server-sent event stream (Streamable HTTP)."""
    if data.lstrip().startswith(b"{"):
        return json.loads(data)
    events = [line[5:] for line in data.splitlines() if line.startswith(b"data:")]
    return json.loads(events[-1])


class Client:
    """One keep-alive HTTP connection that sends one route's request."""

    def __init__(self, port: int, route: Route) -> None:
        self.route = route
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.headers = route.headers if route.opening is None else {
            **route.headers, **route.opening(self.connection, route.headers)}

    def request(self) -> tuple[float, bool]:
        """Seconds the request took, and whether its answer was right."""
        started = time.perf_counter()
        self.connection.request("POST", self.route.path, body=self.route.body,
                                headers=self.headers)
        response = self.connection.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - started
        try:
            good = response.status == 200 and self.route.check(reply_of(data))
        except (ValueError, KeyError, IndexError, TypeError):  # not the answer asked for
            good = False
        return elapsed, good


def _stat_times(pid: int) -> float:
    """utime + stime + cutime + cstime of a process, in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(value) for value in fields[11:15]) / TICK


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _tree_times(pid: int) -> float:
    """_stat_times of pid and of every live descendant (reaped ones are in their parent's)."""
    return _stat_times(pid) + sum(_tree_times(child) for child in _children(pid))


def _is_companion(pid: int) -> bool:
    """Whether a fork server's child is its companion: it keeps the server's uid, while every
    kernel (started by root) runs as a uid of its own, a pooled one-shot already while waiting;
    a pool's zygote keeps it too, and is named (_is_zygote)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid() and not _is_zygote(pid)
    except OSError:
        return False


def _is_zygote(pid: int) -> bool:
    """Whether a fork server's child is a pool's zygote (launch/forkserver/zygote.py names it)."""
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().strip() == ZYGOTE_NAME
    except OSError:
        return False


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine (every core) so far."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / TICK


@dataclass
class Target:
    """A server under test: where it listens and whose CPU counts as its own."""

    name: str
    port: int
    route: Route
    pid: int
    tree: bool = False  # also count direct children (our fork servers, which reap the kernels)
    seen: dict[int, float] = field(default_factory=dict)
    seen_parts: dict[tuple[str, int], float] = field(default_factory=dict)

    def cpu(self) -> float:
        """CPU seconds of the server, plus (tree) its children's, each child counted once it
        was seen: a fork server that retired and exited stays a zombie child, still readable.
        A child's share is its live tree's: the one-shot kernels it reaped are in its own
        figures, while its companion and waiting pool (alive, not reaped) count by theirs."""
        total = _stat_times(self.pid)
        if self.tree:
            for child in _children(self.pid):
                self.seen[child] = max(self.seen.get(child, 0.0), _tree_times(child))
            total += sum(self.seen.values())
        return total

    def parts(self) -> dict[str, float]:
        """CPU seconds so far of the fork servers themselves (with what they reaped: the
        one-shot kernels) and of their companions, for the per-process split. Each process
        counts with the most it was seen to have: a retired server's zygote and companion
        end (and a successor's start), and what they spent stays counted."""
        if self.tree:
            for child in _children(self.pid):
                self._saw("fork server + reaped kernels", child, _stat_times(child))
                for grandchild in _children(child):
                    if _is_companion(grandchild):
                        self._saw("companion", grandchild, _tree_times(grandchild))
                    elif _is_zygote(grandchild):
                        self._saw("zygotes", grandchild, _stat_times(grandchild))
        split = {"fork server + reaped kernels": 0.0, "companion": 0.0, "zygotes": 0.0}
        for (name, _), seconds in self.seen_parts.items():
            split[name] += seconds
        return split

    def _saw(self, part: str, pid: int, seconds: float) -> None:
        key = (part, pid)
        self.seen_parts[key] = max(self.seen_parts.get(key, 0.0), seconds)


@dataclass
class Phase:
    latencies: list[float]
    failures: int
    wall: float
    own_cpu: float
    machine_cpu: float
    server_cpu: float  # the server process alone (for ours: not its fork servers and kernels)
    parts: dict[str, float] = field(default_factory=dict)  # fork servers, companions

    @property
    def count(self) -> int:
        return len(self.latencies)


def measure(target: Target, work: Callable[[], tuple[list[float], int]]) -> Phase:
    cpu0, busy0, wall0 = target.cpu(), machine_busy(), time.perf_counter()
    server0, parts0 = _stat_times(target.pid), target.parts()
    latencies, failures = work()
    wall = time.perf_counter() - wall0
    time.sleep(0.5)  # kernels closing in the background finish and are reaped
    parts = {name: value - parts0.get(name, 0.0) for name, value in target.parts().items()}
    return Phase(latencies, failures, wall, target.cpu() - cpu0, machine_busy() - busy0,
                 _stat_times(target.pid) - server0, parts)


def sequential(target: Target, count: int, route: Route | None = None, warm: int = 3) -> Phase:
    """`count` requests one after another on one connection (to `route`, else the target's),
    after `warm` unmeasured ones."""
    client = Client(target.port, route or target.route)
    for _ in range(warm):
        client.request()  # a connection and a route warmed up

    def work() -> tuple[list[float], int]:
        latencies, failures = [], 0
        for _ in range(count):
            elapsed, good = client.request()
            latencies.append(elapsed)
            failures += not good
        return latencies, failures
    return measure(target, work)


def concurrent(target: Target, clients: int, seconds: float,
               picker: Callable[[int], Callable[[], Client]] | None = None) -> Phase:
    """`clients` threads sending requests back to back for `seconds`; picker(index) gives a
    thread the function that chooses each request's client (default: one client of its own)."""
    def own_client(index: int) -> Callable[[], Client]:
        client = Client(target.port, target.route)
        return lambda: client

    def work() -> tuple[list[float], int]:
        stop = time.perf_counter() + seconds
        latencies: list[list[float]] = [[] for _ in range(clients)]
        failures = [0] * clients

        def drive(index: int) -> None:
            next_client = (picker or own_client)(index)
            while time.perf_counter() < stop:
                elapsed, good = next_client().request()
                latencies[index].append(elapsed)
                failures[index] += not good
        threads = [threading.Thread(target=drive, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [x for each in latencies for x in each], sum(failures)
    return measure(target, work)


@functools.cache
def anchor_env() -> dict[str, str]:
    """start.sh and stop.sh keep dify-sandbox's config, logs and pid in $DS_RUN: a private dir."""
    return {**os.environ, "DS_RUN": tempfile.mkdtemp(prefix="bench-dify-sandbox-")}


def start_anchor() -> tuple[int, int] | str:
    """(port, pid) of a started dify-sandbox, or why it is not measured."""
    if not (ANCHOR / "start.sh").exists():
        return f"dify-sandbox not measured: no {ANCHOR}/start.sh (set SANDBOX_BENCH_DIFY_SANDBOX)"
    port = free_port()
    done = subprocess.run([str(ANCHOR / "start.sh"), str(port), KEY], capture_output=True,
                          text=True, timeout=600, env=anchor_env())
    if done.returncode != 0:
        return f"dify-sandbox did not start: {(done.stdout + done.stderr).strip()[-500:]}"
    return port, int(Path(anchor_env()["DS_RUN"], "pid").read_text())


def stop_anchor(port: int) -> None:
    subprocess.run([str(ANCHOR / "stop.sh"), str(port)], capture_output=True, timeout=60,
                   env=anchor_env())


@dataclass
class Totals:
    """Every phase of one target, over the rounds."""

    seq: list[Phase] = field(default_factory=list)
    conc: list[Phase] = field(default_factory=list)

    def p(self, q: int) -> float:
        values = sorted(x for phase in self.seq for x in phase.latencies)
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000

    def rps(self) -> list[float]:
        return [phase.count / phase.wall for phase in self.conc]

    def cpu_ms(self, attr: str) -> float:
        phases = self.seq + self.conc
        return 1000 * sum(getattr(p, attr) for p in phases) / sum(p.count for p in phases)

    def failures(self) -> int:
        return sum(p.failures for p in self.seq + self.conc)

    def parts_ms(self) -> dict[str, float]:
        """CPU per request of each part of the tree (fork servers, companions)."""
        phases = self.seq + self.conc
        count = sum(p.count for p in phases)
        names = {name for p in phases for name in p.parts}
        return {name: 1000 * sum(p.parts.get(name, 0.0) for p in phases) / count
                for name in sorted(names)}


def run(args: argparse.Namespace) -> str:
    if args.no_anchor:
        anchor: tuple[int, int] | str = "dify-sandbox not measured: --no-anchor"
    elif args.anchor:
        port, pid = args.anchor.split(":")
        anchor = (int(port), int(pid))
    else:
        anchor = start_anchor()
    settings = Settings(max_workers=4, max_requests=50, worker_timeout=5.0,
                        pool_size=args.pool_size, extra=args.serve_flag or [])
    try:  # the anchor stopped whatever fails, our services' start included
        with Service(settings) as ours, mcp_server(args.mcp_flag or []) as mcp:
            targets = [Target("sandbox-kernel dify route", ours.port, dify_route(ours.api_key),
                              ours.pid, tree=True),
                       Target("sandbox-kernel native execute", ours.port,
                              native_route(ours.api_key), ours.pid, tree=True),
                       Target("sandbox-kernel MCP run_python", mcp.port, mcp_route(MCP_KEY),
                              mcp.process.pid, tree=True)]
            if isinstance(anchor, tuple):
                targets.insert(0, Target("dify-sandbox", anchor[0],
                                         dify_route(args.anchor_key), anchor[1]))
            totals = {target.name: Totals() for target in targets}
            load_before = os.getloadavg()[0]
            for _ in range(args.rounds):
                for target in targets:
                    totals[target.name].seq.append(sequential(target, args.seq))
                for target in targets:
                    totals[target.name].conc.append(
                        concurrent(target, args.clients, args.seconds))
            load_after = os.getloadavg()[0]
    finally:
        if isinstance(anchor, tuple) and not args.anchor:
            stop_anchor(anchor[0])
    return report(args, totals, anchor, (load_before, load_after))


@contextlib.contextmanager
def mcp_server(flags: list[str]) -> Iterator[HttpServer]:
    """`sandbox-kernel mcp --http` on 127.0.0.1 with one key, in a private runtime dir (its
    own fork server, not the service's), stopped after."""
    folder = Path(tempfile.mkdtemp(prefix="bench-mcp-"))
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": [{"id": "bench", "key": MCP_KEY}]}))
    keys.chmod(0o600)  # the MCP server refuses a keys file others may read
    runtime = os.environ.get("JUPYTER_RUNTIME_DIR")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(folder / "runtime")
    try:
        server = HttpServer(folder, keys, *flags)
    finally:
        if runtime is None:
            os.environ.pop("JUPYTER_RUNTIME_DIR")
        else:
            os.environ["JUPYTER_RUNTIME_DIR"] = runtime
    try:
        yield server
    finally:
        server.stop()


def report(args: argparse.Namespace, totals: dict[str, Totals], anchor: object,
           load: tuple[float, float]) -> str:
    lines = [
        "# The service against the real dify-sandbox",
        "",
        f"Command: `python -m bench.service {' '.join(sys.argv[1:])}`",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; "
        f"load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}",
        f"- {args.rounds} rounds, interleaved; each: {args.seq} sequential requests per target, "
        f"then {args.clients} clients for {args.seconds:g} s per target",
        f"- Our service: `sandbox-kernel serve` with MAX_WORKERS 4, WORKER_TIMEOUT 5, "
        f"pool size {args.pool_size} {' '.join(args.serve_flag or [])}",
        f"- Our MCP server: `sandbox-kernel mcp --http` with tests/mcp_clients.py's flags "
        f"{' '.join([*MCP_FLAGS, *(args.mcp_flag or [])])}; the network off, as for the "
        "native execute (the dify route's is on, as Dify sends it)",
    ]
    if not isinstance(anchor, tuple):
        lines.append(f"- {anchor}")
    lines += ["", "| Target | seq p50 | seq p90 | requests/s, "
              f"{args.clients} clients (per round) | own CPU / request (server process) "
              "| machine CPU / request | failures |", "|---|---|---|---|---|---|---|"]
    for name, total in totals.items():
        rps = total.rps()
        lines.append(f"| {name} | {total.p(50):.1f} ms | {total.p(90):.1f} ms | "
                     f"{statistics.median(rps):.1f} ({', '.join(f'{r:.1f}' for r in rps)}) | "
                     f"{total.cpu_ms('own_cpu'):.1f} ms ({total.cpu_ms('server_cpu'):.1f} ms) | "
                     f"{total.cpu_ms('machine_cpu'):.1f} ms "
                     f"| {total.failures()} |")
    lines += ["", "Our CPU per request by process (service: the server process above):", ""]
    for name, total in totals.items():
        if any(any(phase.parts.values()) for phase in total.seq):
            split = ", ".join(f"{part} {ms:.1f} ms" for part, ms in total.parts_ms().items())
            lines.append(f"- {name}: {split}")
    reference = totals.get("dify-sandbox")
    if reference is not None:
        lines += ["", f"| Ours / dify-sandbox | seq p50 (target ≤ {TARGET_P50}x) | requests/s "
                  f"(target ≥ {TARGET_RATE}x) | own CPU / request | machine CPU / request "
                  f"(target ≤ {TARGET_CPU}x) | met |", "|---|---|---|---|---|---|"]
        for name, total in totals.items():
            if total is reference:
                continue
            latency = total.p(50) / reference.p(50)
            rate = statistics.median(total.rps()) / statistics.median(reference.rps())
            cpu = total.cpu_ms("own_cpu") / reference.cpu_ms("own_cpu")
            machine = total.cpu_ms("machine_cpu") / reference.cpu_ms("machine_cpu")
            met = "yes" if latency <= TARGET_P50 and rate >= TARGET_RATE \
                and machine <= TARGET_CPU \
                and not total.failures() else "**NO**"
            lines.append(f"| {name} | {latency:.3f}x | {rate:.3f}x | {cpu:.3f}x | "
                         f"{machine:.3f}x | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq", type=int, default=100, help="sequential requests per round")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0, help="of each concurrent phase")
    parser.add_argument("--pool-size", type=int, default=1,
                        help="our --pool-size (the service's default: 1)")
    parser.add_argument("--serve-flag", action="append", help="one more flag for serve")
    parser.add_argument("--mcp-flag", action="append", help="one more flag for mcp")
    parser.add_argument("--no-anchor", action="store_true", help="measure only our service")
    parser.add_argument("--anchor", metavar="PORT:PID",
                        help="a dify-sandbox already running (its start.sh), instead of one "
                        "started and stopped here")
    parser.add_argument("--anchor-key", default=KEY, help="that dify-sandbox's key")
    parser.add_argument("--imports", metavar="RUNTIME",
                        help="the import mix instead (bench/service_imports.py): nodes "
                        "importing jinja2, requests, numpy, pandas, matplotlib through the "
                        "dify route, against serve's defaults and serve --runtime RUNTIME, "
                        "and the 70/20/10 mixed load")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.imports:
        from bench import service_imports

        return publish(service_imports.run(args), args.out or service_imports.RESULTS)
    return publish(run(args), args.out or RESULTS)


if __name__ == "__main__":
    sys.exit(main())
