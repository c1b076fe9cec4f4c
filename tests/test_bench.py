"""Smoke test of the benchmark: a --quick run writes the table and the chart with every row.

No timing is asserted here (timings live in bench/results); only that the benchmark runs.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROWS = ("start.plain", "start.sandbox", "execute.plain", "execute.sandbox", "main.small",
        "main.1mb", "main.10mb", "process.small", "rss.plain", "rss.sandbox",
        "concurrency.1", "concurrency.2", "concurrency.4", "start.fork", "cpu.plain",
        "cpu.sandbox", "cpu.fork", "pss.sandbox", "pss.fork", "fresh.cold", "fresh.fork",
        "fresh.pool", "rate.cold", "rate.fork", "rate.pool", "rate.process", "pool.first",
        "pandas.fork", "pandas.process", "pandas.rate.fork", "pandas.rate.process",
        "runtime.fork", "runtime.cold", "floor.1mb", "floor.10mb", "cpu.small",
        "capacity.small", "mcp.fresh", "mcp.session")
SKIPPED_IN_QUICK = {"main.10mb", "floor.10mb", "concurrency.4", "pandas.fork", "pandas.process",
                    "pandas.rate.fork", "pandas.rate.process", "fresh.pool", "rate.cold",
                    "rate.fork", "rate.pool", "rate.process", "runtime.fork", "runtime.cold"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MEDIAN, COMPARED, MET = 1, 4, 6  # cells after the row id: label, median, p90, n, compared, ...


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `python -m bench --quick` run (profiling every target, to exercise that code too)."""
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--profile", "all", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=110, check=False)
    return done, out


def _rows(table: str) -> dict[str, list[str]]:
    """Row id -> its cells after the id."""
    rows = {}
    for line in table.splitlines():
        match = re.match(r"\| `([a-z0-9.]+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_quick_run_writes_every_row(quick_run):
    done, out = quick_run
    rows = _rows((out / "latest.md").read_text())
    assert set(rows) == set(ROWS), done.stderr[-3000:]
    for row in SKIPPED_IN_QUICK:
        assert rows[row][MEDIAN] == "skipped" and "--quick" in rows[row][COMPARED]
    for row in set(ROWS) - SKIPPED_IN_QUICK:
        assert rows[row][MEDIAN] != "skipped", (row, rows[row])


def test_quick_run_measures_without_failure(quick_run):
    done, out = quick_run
    rows = _rows((out / "latest.md").read_text())
    failed = {row: cells[COMPARED] for row, cells in rows.items() if cells[MEDIAN] == "FAILED"}
    assert not failed, f"measurements failed: {failed}"
    assert done.returncode == 0, done.stderr[-3000:]


def test_quick_run_reports_targets_machine_and_profiles(quick_run):
    _done, out = quick_run
    text = (out / "latest.md").read_text()
    rows = _rows(text)
    for row in ("start.sandbox", "execute.sandbox", "process.small", "rss.sandbox"):
        assert rows[row][MET].startswith(("yes", "**NO**")), rows[row]
    assert "nproc" in text and "Python 3." in text and "ipykernel" in text
    for target in ("start.sandbox", "execute.sandbox", "process.small", "rss.sandbox"):
        assert f"## `{target}`" in text  # --profile all: evidence for every target
    assert "MiB private dirty" in text  # pss.fork's evidence: what a forked kernel wrote


def test_quick_run_draws_the_chart(quick_run):
    _done, out = quick_run
    png = (out / "latest.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000


def test_execution_phases_of_fork_served_kernels():
    done = subprocess.run([sys.executable, "-I", "-m", "bench.executions", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line[:28].strip(): [float(x) for x in line[28:].split()]
            for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"ready (warmed kernel)", "warm-up (warmed kernel)",
                         "first run (warmed kernel)", "later run (warmed kernel)",
                         "ready (no warm-up)", "first run (no warm-up)",
                         "later run (no warm-up)", "warm-up + first run", "first run, cold"}
    assert all(len(row) == 3 for row in rows.values()), done.stdout
    assert rows["ready (no warm-up)"][0] > rows["later run (no warm-up)"][0] > 0


def test_stage_timings_cover_a_fork_served_start():
    done = subprocess.run([sys.executable, "-I", "-m", "bench.stages", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[1:]}
    for stage in ("fork", "initialize", "init_kernel", "init_sockets", "parse_command_line",
                  "seccomp.install", "prepare"):
        assert stage in rows, done.stdout
    assert float(rows["fork"][-1]) > 0  # "fork to ready": minor faults counted


FIRST_RESULT_WAYS = ("one-shot run", "new session, first execute", "warm execute")


def test_first_result_measures_every_way_pattern_and_workload(tmp_path):
    """`python -m bench.first_result` at tiny counts on serve's defaults: a row for each
    workload, way to a result and arrival pattern, every run right, and the facts it must say
    (same host, commit, load)."""
    out = tmp_path / "first-result.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench.first_result", "--lean", "--runs", "2", "--burst", "3",
         "--stagger", "0.05", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[1] in FIRST_RESULT_WAYS:
            rows[(cells[0], cells[1], cells[2])] = cells
    expected = {(workload, way, pattern)
                for workload in ("main() returns a dict", "numpy + pandas DataFrame")
                for way in FIRST_RESULT_WAYS
                for pattern in ("sequential", "staggered 50 ms", "burst of 3")}
    assert set(rows) == expected, text
    for (_, _, pattern), cells in rows.items():
        runs = 3 if pattern.startswith("burst") else 2
        assert cells[3] == f"{runs}/{runs} (100 %)" and cells[9] == "-", cells
        assert all(re.fullmatch(r"\d+\.\d ms", cell) for cell in cells[4:8]), cells
    assert "same host" in text and re.search(r"commit [0-9a-f]{7}", text)
    assert re.search(r"load average \(1, 5 min\) before [\d.]+, [\d.]+ / after", text)
