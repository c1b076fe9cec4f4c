"""The results file (a markdown table plus method and evidence) and the chart."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import payload, runtime_import
from bench.stats import Sample
from bench.suite import Results
from bench.targets import TARGET_BY_ROW, TARGETS, verdict

ROWS = (  # (row id, what it measures), in table order
    ("start.plain", "1. Start-to-ready, plain ipykernel"),
    ("start.sandbox", "1. Start-to-ready, sandbox kernel"),
    ("execute.plain", "2. Warm execute round trip of `pass`, plain ipykernel"),
    ("execute.sandbox", "2. Warm execute round trip of `pass`, sandbox kernel"),
    ("main.small", "3. Warm `main()` call through `Sandbox.run`, small inputs"),
    ("main.1mb", "4. `main()` moving 1 MB of JSON in and 1 MB out"),
    ("main.10mb", "4. `main()` moving 10 MB of JSON in and 10 MB out"),
    ("process.small", "5. Process per request: fresh `python -I` + seccomp + the same `main()`"),
    ("rss.plain", "6. Peak RSS (VmHWM) after start + one execute, plain ipykernel"),
    ("rss.sandbox", "6. Peak RSS (VmHWM) after start + one execute, sandbox kernel"),
    ("concurrency.1", "7. Throughput, 1 sandbox driven by 1 thread"),
    ("concurrency.2", "7. Throughput, 2 sandboxes driven at once (one thread each)"),
    ("concurrency.4", "7. Throughput, 4 sandboxes driven at once (one thread each)"),
    ("start.fork", "1. Start-to-ready, sandbox kernel forked from the fork server"),
    ("cpu.plain", "1. Kernel CPU (user + system) to ready, plain ipykernel"),
    ("cpu.sandbox", "1. Kernel CPU to ready, sandbox kernel started cold"),
    ("cpu.fork", "1. Kernel CPU to ready, fork-served sandbox kernel"),
    ("pss.sandbox", "6. PSS per kernel, several cold sandbox kernels alive at once"),
    ("pss.fork", "6. PSS per kernel, as many fork-served kernels alive at once (and the server)"),
    ("fresh.cold", "8. Fresh kernel per request (start, small `main()`, shut down), cold"),
    ("fresh.fork", "8. Fresh kernel per request, fork-served"),
    ("fresh.pool", "8. Fresh kernel per request from a warm pool of 2 (get, call, close)"),
    ("rate.cold", "8. Fresh-kernel requests/s, 2 at a time, cold"),
    ("rate.fork", "8. Fresh-kernel requests/s, 2 at a time, fork-served"),
    ("rate.pool", "8. Fresh-kernel requests/s, 2 at a time, warm pool of 2"),
    ("rate.process", "8. Process-per-request requests/s, 2 at a time"),
    ("pool.first", "8. Pool hand-out + first small `main()` call (pool full)"),
    ("pandas.fork", "9. Code node importing pandas, fresh fork-served kernel (pandas preloaded)"),
    ("pandas.process", "9. Code node importing pandas, process per request"),
    ("pandas.rate.fork", "9. pandas code node requests/s, 2 at a time, fork-served"),
    ("pandas.rate.process", "9. pandas code node requests/s, 2 at a time, process per request"),
    ("mcp.fresh", "10. MCP `run_python` round trip over stdio, on a one-shot kernel"),
    ("mcp.session", "10. MCP `run_python` round trip over stdio, in a session (cf. `main.small`)"),
    *runtime_import.ROWS,
    *payload.ROWS,
)
PACKAGES = ("sandbox-kernel", "ipykernel", "ipython", "jupyter_client", "pyzmq", "tornado",
            "traitlets", "pyseccomp", "matplotlib")


def _value(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1000:.2f} ms" if value < 0.01 else f"{value * 1000:.1f} ms"
    if unit == "bytes":
        return f"{value / 2**20:.1f} MiB"
    if unit == "MB/s":
        return f"{value:.1f} MB/s"
    return f"{value:.1f} {unit}"


def _compared(results: Results, row: str) -> str:
    """The comparison column: the target ratio, latency behind a rate, or scaling."""
    samples = results.samples
    ours = payload.compared(results, row)
    if ours is not None:
        return ours
    target = TARGET_BY_ROW.get(row)
    found = verdict(results, target) if target else None
    if found and found.ratio is not None:
        if target and target.key == "speedup":
            return f"warm `main()` call is {found.ratio:.1f}x faster"
        return f"{found.ratio:.3f}x `{target.denominator}`" if target else ""
    latency = samples.get(f"{row}.latency")
    if latency:
        return (f"latency median {_value(latency.median, 's')}, p90 {_value(latency.p90, 's')}; "
                "MB counted in + out")
    if row == "runtime.fork" and row in samples and "runtime.cold" in samples:
        return f"{samples[row].median / samples['runtime.cold'].median:.3f}x `runtime.cold`"
    if row.startswith("concurrency.") and row != "concurrency.1" and row in samples:
        single = samples.get("concurrency.1")
        if single:
            return f"{samples[row].median / single.median:.2f}x the 1-sandbox rate"
    return ""


def _target_cells(results: Results, row: str) -> tuple[str, str]:
    target = TARGET_BY_ROW.get(row)
    if target is None:
        return "", ""
    met = verdict(results, target).met
    mark = {True: "yes", False: "**NO**", None: "not measured"}[met]
    if target.key == "speedup" and results.returns_results is False:
        mark += " (provisional: the kernel returns no `main()` result yet)"
    return target.text, mark


def table(results: Results) -> list[str]:
    """The markdown table, one row per measurement, every row present."""
    lines = ["| Row | Measurement | Median | p90 (slow end) | n | Compared | Target | Met |",
             "|---|---|---|---|---|---|---|---|"]
    for row, label in ROWS:
        target, met = _target_cells(results, row)
        sample: Sample | None = results.samples.get(row)
        if row in results.failed:
            cells = ["FAILED", "", "0", f"`{results.failed[row]}`"]
        elif sample:
            cells = [_value(sample.median, sample.unit), _value(sample.p90, sample.unit),
                     str(len(sample)), _compared(results, row)]
        else:
            cells = ["skipped", "", "0", results.skipped.get(row, "not measured")]
        lines.append(f"| `{row}` | {label} | " + " | ".join([*cells, target, met]) + " |")
    return lines


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _libseccomp() -> str:
    import pyseccomp  # noqa: F401  # maps the library into this process

    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libseccomp" in line:
            return Path(line.split()[-1]).name
    return "not loaded"


def machine(started: datetime.datetime, load_before: tuple[float, ...]) -> list[str]:
    """Where and when the run happened."""
    load_after = os.getloadavg()
    return [
        f"- Date: {started:%Y-%m-%d %H:%M} UTC",
        f"- Machine: {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), "
        f"{_cpu_model()}, Linux {platform.release()}",
        f"- Load average (1 min) before / after the run: {load_before[0]:.2f} / "
        f"{load_after[0]:.2f}",
        f"- Python {platform.python_version()} ({sys.executable})",
        "- Packages: " + ", ".join(f"{name} {_version(name)}" for name in PACKAGES)
        + f", {_libseccomp()}",
    ]


METHOD = """\
- **Start-to-ready**: `KernelManager.start_kernel()` until the `kernel_info_reply` arrives, with
  the same client code for both kinds. Plain is `python -m ipykernel_launcher -f {connection_file}`;
  sandbox is the kernelspec this package installs (`python -I -m sandbox_kernel -f ...`, default
  policy). Each start is a fresh kernel, killed afterwards; plain and sandbox alternate (ABAB) and
  the first pair is discarded (it fills the page cache).
- **Warm execute**: one plain and one sandbox kernel, both warm; `client.execute("pass")` until
  the `idle` status on IOPub, alternating between the two kernels on every call.
- **`main()` calls** go through `Sandbox.run(code, inputs=...)`, i.e. the `execute_request`
  metadata `{"sandbox": {"entrypoint": "main", "inputs": ...}}`; each call sends the code again.
  When the kernel implements the convention, every result is checked against the expected dict.
- **Throughput**: bytes of JSON of the inputs plus the returned dict, divided by the call's
  wall-clock time (1 MB = 10^6 bytes). Payloads are lists of small records.
- **Process per request**: `python -I bench/_child.py` per call: reads the request on stdin,
  loads the kernel's seccomp filter (`confine.seccomp.install`), runs the same code and
  `main()`, prints the JSON. Warm calls and per-request calls alternate in blocks of 10.
- **Peak RSS**: `VmHWM` of the kernel process after start-to-ready and one `pass`, one reading
  per fresh kernel of the start-up measurement.
- **Fork-served start** (`start.fork`): the same kernelspec with `metadata.kernel_provisioner`
  naming the fork-server provisioner; the server is already running (started by the first,
  discarded start). **Kernel CPU to ready**: user + system time of the kernel process when
  its `kernel_info_reply` arrives (`/proc/<pid>/stat`; clock ticks, 10 ms). For a cold sandbox
  kernel this includes the first interpreter that re-executes itself; the fork server's own
  imports are paid once per server and not counted.
- **PSS**: `Pss` of `/proc/<pid>/smaps_rollup` with several kernels of one kind alive at once
  (4 in a full run), after one `pass` each; each kernel is one reading.
- **Fresh kernel per request** (rows 8): `Sandbox(None)` started, one small `main()` call,
  shut down one-shot (`close(now=True)`: killed once the result is in, as `sandbox-kernel
  run` does; its reaper still removes the scratch), one request at a time. The pool rows
  use `hosting.pool.KernelPool` of 2 kernels (`get()`, the call, `close()`; the pool refills
  behind). Rates: a fixed number of requests
  from two threads at once (two cores), completed requests / wall-clock seconds; the
  process-per-request runner driven the same way.
- **pandas code node** (rows 9): `import pandas` and a small Series sum in `main()`, per request:
  a fresh fork-served kernel from a server that preloaded numpy and pandas, against
  `_child.py` importing pandas.
- **Concurrency**: N warm sandboxes, one thread each, each making the same number of small
  `main()` calls at once; completed calls / wall-clock seconds, over several rounds.
- **Median and p90**: p90 is the slow end: the 90th percentile of a time, the 10th percentile of a
  rate. Ratios are ratios of medians.
"""


def markdown(results: Results, command: str, started: datetime.datetime,
             load_before: tuple[float, ...]) -> str:
    """The whole results file."""
    lines = ["# sandbox-kernel benchmarks", "",
             f"Command: `{command}`", "", *machine(started, load_before), ""]
    if results.returns_results is False:
        lines += ["**The kernel does not implement the `main()` convention yet**: rows 3, 4 and 7 "
                  "time a request that defines `main()` and carries the inputs, but no result "
                  "comes back (throughput counts the inputs only).", ""]
    elif results.returns_results:
        lines += ["Every `main()` result was checked against the expected dict.", ""]
    lines += [*table(results), "", "## Method", "", METHOD + payload.METHOD]
    lines += _findings(results)
    return "\n".join(lines).rstrip() + "\n"


def _findings(results: Results) -> list[str]:
    lines = []
    for target in TARGETS:
        evidence = results.findings.get(target.key)
        if not evidence:
            continue
        found = verdict(results, target)
        state = "missed" if found.met is False else "met"
        ratio = "n/a" if found.ratio is None else f"{found.ratio:.3f}x"
        if not target.denominator and found.ratio is not None:
            ratio = f"{found.ratio * 1000:.2f} ms"
        over = f" / `{target.denominator}`" if target.denominator else ""
        lines += [f"## `{target.numerator}`{over} = {ratio} "
                  f"(target {target.text}, {state}): profile", "", *evidence, ""]
    return lines


def chart(results: Results, path: Path) -> None:
    """Six panels, one per kind of measurement: bars at the median, whiskers to p90."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("Start-to-ready (ms)", (("plain", "start.plain"), ("sandbox", "start.sandbox")), 1000),
        ("Warm execute `pass` (ms)", (("plain", "execute.plain"),
                                      ("sandbox", "execute.sandbox")), 1000),
        ("main() call, small inputs (ms)", (("warm sandbox", "main.small"),
                                                 ("process/request", "process.small")), 1000),
        ("Peak RSS (MiB)", (("plain", "rss.plain"), ("sandbox", "rss.sandbox")), 1 / 2**20),
        ("main() JSON throughput (MB/s)", (("1 MB", "main.1mb"), ("10 MB", "main.10mb")), 1),
        ("Concurrent calls/s", (("1", "concurrency.1"), ("2", "concurrency.2"),
                                ("4", "concurrency.4")), 1),
    )
    figure, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    for axis, (title, bars, scale) in zip(axes.flat, panels, strict=True):
        _panel(axis, results, title, bars, scale)
    figure.suptitle("sandbox-kernel vs plain ipykernel (bars: median, whiskers: p90)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _panel(axis: Any, results: Results, title: str, bars: tuple[tuple[str, str], ...],
           scale: float) -> None:
    medians, lower, upper = [], [], []
    for position, (_label, row) in enumerate(bars):
        sample = results.samples.get(row)
        if sample is None:
            note = "failed" if row in results.failed else "skipped"
            axis.text(position, 0, note, ha="center", va="bottom", color="grey")
        median = sample.median * scale if sample else 0.0
        gap = abs(sample.p90 - sample.median) * scale if sample else 0.0
        slow_end_below = bool(sample and sample.higher_is_better)  # a rate's slow end is lower
        medians.append(median)
        lower.append(gap if slow_end_below else 0.0)
        upper.append(0.0 if slow_end_below else gap)
    axis.bar([label for label, _ in bars], medians, yerr=[lower, upper], capsize=4,
             color=["#888888", "#d2691e", "#4682b4"][:len(bars)])
    axis.set_ylim(bottom=0)
    axis.set_title(title, fontsize=10)
    for position, value in enumerate(medians):
        if value:  # inside the bar, where no whisker can cover it
            axis.text(position, value / 2, f"{value:.3g}", ha="center", va="center",
                      color="white", fontsize=10, fontweight="bold")
