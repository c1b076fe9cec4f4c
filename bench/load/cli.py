"""`python -m bench.load`: run load scenarios against a fresh `sandbox-kernel serve`, then
write bench/results/load.md and load.png."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from bench.load import pressure, report, soak
from bench.load.report import DATA_DIR
from tests.load import faults, fuzz, mixed
from tests.load.results import ScenarioResult, machine, now

ORDER = ("mixed", "soak", "faults", "fuzz", "pressure")
QUICK_OUT = Path(tempfile.gettempdir()) / "sandbox-kernel-load-quick"


def runner(name: str, quick: bool, args: argparse.Namespace
           ) -> Callable[[], Coroutine[Any, Any, ScenarioResult]]:
    if name == "mixed":
        plan = mixed.QUICK if quick else mixed.FULL
        if args.count:
            plan.mixed = args.count
        return lambda: mixed.run(plan, quick)
    if name == "soak":
        soak_plan = soak.QUICK if quick else soak.FULL
        if args.duration:
            soak_plan.duration = args.duration
        soak_plan.rate = args.rate
        return lambda: soak.run(soak_plan, quick)
    if name == "faults":
        return lambda: faults.run(quick)
    if name == "pressure":
        return lambda: pressure.run(pressure.QUICK if quick else pressure.FULL, quick)
    fuzz_plan = fuzz.QUICK if quick else fuzz.FULL
    return lambda: fuzz.run(fuzz_plan, quick)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    parser.add_argument("--scenario", choices=(*ORDER, "all"), default="all",
                        help="which scenario to run (default: all, in order)")
    parser.add_argument("--quick", action="store_true",
                        help="the small, fast versions (what tests/test_load.py runs)")
    parser.add_argument("--count", type=int, help="mixed: requests in the mixed phase")
    parser.add_argument("--duration", type=float, help="soak: seconds")
    parser.add_argument("--rate", type=float,
                        help="soak: requests/s (default: half the last mixed run's saturation)")
    parser.add_argument("--report-only", action="store_true",
                        help="only regenerate load.md and load.png from the saved results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    command = shlex.join(["python", "-m", "bench.load",
                          *(sys.argv[1:] if argv is None else argv)])
    missed = []
    if not args.report_only:
        for name in ORDER if args.scenario == "all" else (args.scenario,):
            print(f"== {name}", file=sys.stderr, flush=True)
            started, host = now(), machine()
            result = asyncio.run(runner(name, args.quick, args)())
            result.command, result.started, result.finished = command, started, now()
            result.machine = {**host, "load_average_end": [round(x, 2) for x in os.getloadavg()]}
            saved = result.save(QUICK_OUT / "load" if args.quick else DATA_DIR)
            print(f"saved {saved}", file=sys.stderr)
            for goal in result.goals:
                print(f"  {goal.name}: {report.MARK[goal.met]} — {goal.value}", file=sys.stderr)
            if not result.passed:
                missed.append(name)
    out = QUICK_OUT if args.quick else report.RESULTS_DIR  # a quick run never replaces the report
    print(f"wrote {report.write(quick=args.quick, out=out)}", file=sys.stderr)
    if missed:
        print(f"goals missed in: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0
