"""Command line: run the benchmarks, write `latest.md` and `latest.png` into the output dir."""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path

from bench import report, suite, targets

DEFAULT_OUT = Path(__file__).with_name("results")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command's options."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="What the sandbox costs, side by side with plain ipykernel and a "
        "process-per-request runner.")
    parser.add_argument("--quick", action="store_true",
                        help="tiny repetition counts, no 10 MB case, concurrency 1 and 2 only "
                        "(a smoke run; the figures are not stable)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"directory for latest.md and latest.png (default: {DEFAULT_OUT})")
    parser.add_argument("--profile", choices=("missed", "all", "none"), default="none",
                        help="also profile the targets that were missed, or all of them: a "
                        "one-off investigation (bench/profiling.py) that adds minutes and "
                        "prose to latest.md; none by default")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run everything; exit 1 if any measurement failed (the files are written regardless)."""
    args = parse(argv)
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    plan = suite.QUICK if args.quick else suite.FULL
    results = suite.run(plan, targets.explainer(args.profile),
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    table = args.out / "latest.md"
    table.write_text(report.markdown(results, command, started, load_before))
    report.chart(results, args.out / "latest.png")
    print(table.read_text())
    if results.failed:
        print(f"failed: {', '.join(sorted(results.failed))}", file=sys.stderr)
        return 1
    return 0
