"""`python -m bench.service --imports RUNTIME`: what real Dify nodes import, against dify-sandbox.

Dify's Python nodes import things: a Template node jinja2, an HTTP node requests, data nodes
numpy and pandas, chart nodes matplotlib. Each node kind below is sent through the dify route
(Dify's wrapping, `<<RESULT>>` markers, counted only if its stdout is exactly the marked JSON)
to three targets, interleaved node by node and target by target, round after round: the real
dify-sandbox (its Python given Debian's python3-jinja2, -requests, -numpy, -pandas and
-matplotlib, as its own image ships them), `sandbox-kernel serve` with its defaults (the lean
path: no runtime), and `serve --runtime RUNTIME` (a runtime built with no preload flag, so it
preloads what it installs, served by preload set: launch/imports.py). Then a mixed load, 70 %
nodes importing nothing, 20 % jinja2, 10 % pandas, from 4 clients for S seconds per target.

Before the rounds each node is sent for a few seconds (a set's first runs take the lean pool
while that set's pool starts), in an order that leaves the sets of the rounds running.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import service
from bench.service import (
    KEY,
    Client,
    Phase,
    Route,
    Target,
    concurrent,
    dify_route,
    dify_wrapped,
    start_anchor,
    stop_anchor,
)
from tests.load.service import Service, Settings

NODES = {  # each imports its module and touches it, nothing more: the import is what is measured
    "nothing": 'def main() -> dict:\n    return {"a": 1}\n',
    "jinja2 (Template node)": 'def main() -> dict:\n    from jinja2 import Template\n'
                              '    return {"a": len([Template])}\n',
    "requests": 'def main() -> dict:\n    import requests\n'
                '    return {"a": len([requests.get])}\n',
    "numpy": 'def main() -> dict:\n    import numpy as np\n'
             '    return {"a": len([np.ones])}\n',
    "pandas": 'def main() -> dict:\n    import pandas as pd\n'
              '    return {"a": len([pd.DataFrame])}\n',
    "matplotlib.pyplot": 'def main() -> dict:\n    import matplotlib.pyplot as plt\n'
                         '    return {"a": len([plt.figure])}\n',
}
# Warmed in this order, so that numpy finds pandas's set running (launch/imports.py takes a
# running set that holds a run's modules) and the sets fit --max-preload-pools' default 3.
WARM_ORDER = ["nothing", "pandas", "numpy", "matplotlib.pyplot", "requests",
              "jinja2 (Template node)"]
RESULTS = Path(__file__).parent / "results" / "service-imports.md"
MIX = [("nothing", 70), ("jinja2 (Template node)", 20), ("pandas", 10)]


@dataclass
class Cell:
    """One node kind on one target: its sequential phases."""

    phases: list[Phase] = field(default_factory=list)

    def latencies(self) -> list[float]:
        return sorted(x for phase in self.phases for x in phase.latencies)

    def p50(self) -> float:
        values = self.latencies()
        return statistics.median(values) * 1000 if values else float("nan")

    def failures(self) -> int:
        return sum(phase.failures for phase in self.phases)

    def cpu_ms(self) -> float:
        count = sum(phase.count for phase in self.phases)
        return 1000 * sum(phase.own_cpu for phase in self.phases) / count if count else 0.0


def dify_route_for(target: Target, node: str) -> Route:
    """The dify route's request for a node, with the target's key."""
    route = target.route
    body = json.loads(route.body)
    body["code"] = dify_wrapped(NODES[node], {})
    return Route(route.path, route.headers, json.dumps(body).encode(), route.check)


def sequential(target: Target, node: str, count: int) -> Phase:
    """`count` requests of one node, one after another, after one that warms the connection."""
    return service.sequential(target, count, dify_route_for(target, node), warm=1)


def mixed(target: Target, clients: int, seconds: float, seed: int) -> Phase:
    """The MIX from `clients` threads, each choosing its nodes with a seed of its own."""
    routes = {node: dify_route_for(target, node) for node, _ in MIX}
    names, weights = zip(*MIX, strict=True)

    def picker(index: int) -> Callable[[], Client]:
        pick = random.Random(seed + index)  # noqa: S311 (a load mix, not a secret)
        connections = {node: Client(target.port, route) for node, route in routes.items()}
        return lambda: connections[pick.choices(names, weights)[0]]
    return concurrent(target, clients, seconds, picker)


def warm(target: Target, node: str, settle: float) -> str:
    """Send the node for `settle` seconds after its first right answer (its preload set's pool
    starts meanwhile: its first runs take the lean pool); what went wrong, if anything."""
    client = Client(target.port, dify_route_for(target, node))
    deadline, first, seen = time.monotonic() + settle + 30, None, []
    while time.monotonic() < deadline:
        _, good = client.request()
        seen.append(good)
        if good and first is None:
            first = time.monotonic()
        if first is not None and time.monotonic() - first > settle:
            break
        time.sleep(0.2)
    right = sum(1 for good in seen if good)
    return "" if right == len(seen) else \
        f"{target.name} / {node}: {right} of {len(seen)} right while warming up"


def run(args: argparse.Namespace) -> str:
    anchor = start_anchor() if not args.no_anchor else "dify-sandbox not measured: --no-anchor"
    base = Settings(max_workers=4, max_requests=50, worker_timeout=5.0,
                    pool_size=args.pool_size, extra=args.serve_flag or [])
    on_runtime = Settings(max_workers=4, max_requests=50, worker_timeout=5.0,
                          pool_size=args.pool_size,
                          extra=["--runtime", args.imports, *(args.serve_flag or [])])
    notes: list[str] = []
    with Service(base) as lean, Service(on_runtime) as preloading:
        targets = [Target("serve, defaults (lean path)", lean.port, dify_route(lean.api_key),
                          lean.pid, tree=True),
                   Target(f"serve --runtime {args.imports}", preloading.port,
                          dify_route(preloading.api_key), preloading.pid, tree=True)]
        if isinstance(anchor, tuple):
            targets.insert(0, Target("dify-sandbox", anchor[0], dify_route(KEY), anchor[1]))
        else:
            notes.append(anchor)
        cells = {(t.name, node): Cell() for t in targets for node in NODES}
        mixes: dict[str, list[Phase]] = {t.name: [] for t in targets}
        load_before = os.getloadavg()
        try:
            for target in targets:
                for node in WARM_ORDER:
                    said = warm(target, node, 2.0 if target.name == "dify-sandbox" else 8.0)
                    if said:
                        notes.append(said)
            for round_ in range(args.rounds):
                for node in NODES:
                    for target in targets:
                        cells[(target.name, node)].phases.append(
                            sequential(target, node, args.seq))
                for target in targets:
                    mixes[target.name].append(mixed(target, args.clients, args.seconds,
                                                    seed=round_ * 100))
        finally:
            if isinstance(anchor, tuple):
                stop_anchor(anchor[0])
        load_after = os.getloadavg()
    return report(args, targets, cells, mixes, notes, load_before, load_after)


def right_per_second(phase: Phase) -> float:
    """Requests answered right per second of a phase."""
    return (phase.count - phase.failures) / phase.wall


def report(args: argparse.Namespace, targets: list[Target],
           cells: dict[tuple[str, str], Cell], mixes: dict[str, list[Phase]],
           notes: list[str], before: tuple[float, ...], after: tuple[float, ...]) -> str:
    names = [t.name for t in targets]
    lines = [
        "# What real nodes import: the dify route, node by node, against dify-sandbox", "",
        f"Command: `python -m bench.service {' '.join(sys.argv[1:])}`", "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} "
        f"CPUs; load average (1, 5 min) before {before[0]:.2f}, {before[1]:.2f} / after "
        f"{after[0]:.2f}, {after[1]:.2f}",
        f"- {args.rounds} rounds, interleaved node by node and target by target; each: "
        f"{args.seq} sequential requests per node and target, then the mix "
        f"({', '.join(f'{w} % {n}' for n, w in MIX)}) from {args.clients} clients for "
        f"{args.seconds:g} s per target",
        "- Our services: `sandbox-kernel serve` with MAX_WORKERS 4, WORKER_TIMEOUT 5, pool size "
        f"{args.pool_size} {' '.join(args.serve_flag or [])}",
        *[f"- {note}" for note in notes], "",
        "Sequential p50 (failures where any), ms:", "",
        "| node imports | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names)]
    for node in NODES:
        row = []
        for name in names:
            cell = cells[(name, node)]
            failed = cell.failures()
            total = len(cell.latencies())
            row.append(f"fails ({total - failed}/{total} right)" if failed == total else
                       f"{cell.p50():.1f}" + (f" ({failed} failed)" if failed else ""))
        lines.append(f"| {node} | " + " | ".join(row) + " |")
    lines += ["", "Own CPU per request (the target's process tree), ms:", "",
              "| node imports | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for node in NODES:
        lines.append(f"| {node} | " + " | ".join(f"{cells[(name, node)].cpu_ms():.1f}"
                                                  for name in names) + " |")
    lines += ["", f"Mixed load, {args.clients} clients: right answers per second, per round "
              "(and requests that failed):", ""]
    for name in names:
        rates = [right_per_second(phase) for phase in mixes[name]]
        failed = sum(phase.failures for phase in mixes[name])
        lines.append(f"- {name}: median {statistics.median(rates):.1f} "
                     f"({', '.join(f'{r:.1f}' for r in rates)}), {failed} failed")
    ours, lean = names[-1], names[-2]
    bare = cells[(ours, "nothing")]
    lines += ["", "The issue's figures:", "",
              "| figure | value | target | met |", "|---|---|---|---|"]
    for node in list(NODES)[1:]:
        ratio = cells[(ours, node)].p50() / bare.p50()
        lines.append(f"| {node} p50 / no-import p50 on the runtime | {ratio:.2f}x | ≤ 1.5x | "
                     f"{'yes' if ratio <= 1.5 and not cells[(ours, node)].failures() else 'no'} |")
    for what, mine, theirs in (("p50", bare.p50(), cells[(lean, "nothing")].p50()),
                               ("own CPU", bare.cpu_ms(), cells[(lean, "nothing")].cpu_ms())):
        ratio = mine / theirs
        lines.append(f"| no-import {what} on the runtime / lean path | {ratio:.2f}x | ≤ 1.25x | "
                     f"{'yes' if ratio <= 1.25 else 'no'} |")
    if "dify-sandbox" in mixes:
        rate = statistics.median(right_per_second(p) for p in mixes[ours])
        theirs = statistics.median(right_per_second(p) for p in mixes["dify-sandbox"])
        every = statistics.median(p.count / p.wall for p in mixes["dify-sandbox"])
        lines.append(f"| mixed load right answers/s, runtime / dify-sandbox | {rate / theirs:.2f}x "
                     f"(over all its answers, failed ones too: {rate / every:.2f}x) | ≥ 3x | "
                     f"{'yes' if rate / theirs >= 3 else 'no'} |")
    return "\n".join(lines) + "\n"
