"""Evidence for a missed target: import times, cProfiles of start-up, syscall cost, mappings.

Each `explain_*` function returns markdown lines for the results file.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import calls
from bench.kernels import PLAIN, SANDBOX, Kernel, kernel_argv

WRAPPER = Path(__file__).with_name("_profiled_kernel.py")
MARKER = "BENCH-PROFILE "
SANDBOX_CODE = ("/sandbox_kernel/", "pyseccomp")  # where the sandbox's own start-up work lives
# where the init_* steps live
APP_STEPS = ("ipykernel/kernelapp.py", "sandbox_kernel/kernel/app.py")
STDLIB = sysconfig.get_paths()["stdlib"]
IMPORTTIME_HEADER = "self [us]"  # each interpreter image starts its importtime output with it
SYSCALLS = 1_000_000
# Run inside a kernel: nanoseconds per getppid(), the cheapest syscall seccomp must still judge;
# best of three, because a busy neighbour only ever makes a loop slower.
SYSCALL_LOOP = f"""
import os as _os, time as _time
def _loop():
    _t = _time.perf_counter()
    for _ in range({SYSCALLS}):
        _os.getppid()
    return (_time.perf_counter() - _t) / {SYSCALLS} * 1e9
min(_loop() for _ in range(3))
"""


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _run_kernel(kind: str, argv: list[str]) -> str:
    """Start a kernel with this argv, execute once, stop it; return what it wrote to stderr."""
    with tempfile.TemporaryFile() as stderr:
        kernel = Kernel(kind, argv)
        try:
            kernel.start(stderr=stderr)
            kernel.warm_up()
        finally:
            kernel.close()
        stderr.seek(0)
        return stderr.read().decode(errors="replace")


def _command_seconds(argv: list[str], repeats: int = 5) -> float:
    """Median wall-clock seconds of a short command."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# --- imports -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Import:
    """One line of `python -X importtime`."""

    module: str
    depth: int  # 0: imported by the top-level code; children are listed before their importer
    own_us: int
    cumulative_us: int


@functools.cache
def import_times(kind: str) -> tuple[tuple[Import, ...], ...]:
    """Every import a kernel of this kind makes up to its first execute, per interpreter image.

    The sandbox re-executes itself with a clean environment, so it has two images.
    """
    argv = kernel_argv(kind)
    output = _run_kernel(kind, [argv[0], "-X", "importtime", *argv[1:]])
    images: list[list[Import]] = []
    for line in output.splitlines():
        if not line.startswith("import time:"):
            continue
        own, cumulative, name = line[len("import time:"):].split("|", 2)
        if IMPORTTIME_HEADER in line:
            images.append([])
        elif images:
            depth = (len(name) - len(name.lstrip()) - 1) // 2
            images[-1].append(Import(name.strip(), depth, int(own), int(cumulative)))
    return tuple(tuple(image) for image in images)


def _total_ms(imports: Iterable[Import]) -> str:
    return _ms(sum(i.own_us for i in imports) / 1e6)


def _heaviest_top_level(image: Iterable[Import], count: int = 3) -> str:
    """The costliest top-level imports of an image, each with its costliest direct imports."""
    tops: list[Import] = []
    children: dict[str, list[Import]] = {}
    pending: list[Import] = []
    for item in image:
        if item.depth == 0:
            tops.append(item)
            children[item.module] = sorted(pending, key=lambda i: -i.cumulative_us)
            pending = []
        elif item.depth == 1:
            pending.append(item)
    parts = []
    for top in sorted(tops, key=lambda i: -i.cumulative_us)[:count]:
        inner = ", ".join(f"`{c.module}` {_ms(c.cumulative_us / 1e6)}"
                          for c in children[top.module][:2])
        parts.append(f"`{top.module}` {_ms(top.cumulative_us / 1e6)}"
                     + (f" (of which {inner})" if inner else ""))
    return "; ".join(parts)


def explain_reexec() -> list[str]:
    """What the sandbox's clean re-exec costs: a whole interpreter image before the real one."""
    lines = []
    for number, image in enumerate(import_times(SANDBOX)[:-1], start=1):
        lines.append(
            f"- Clean re-exec (`environment.ensure_clean`): the interpreter starts twice. Image "
            f"{number} imports {len(image)} modules ({_total_ms(image)} of import time) before "
            f"it execs itself; costliest: {_heaviest_top_level(image)}. A bare "
            f"`python -I -c pass` takes {_ms(_bare_interpreter())} here.")
    return lines


def explain_imports() -> list[str]:
    """What importing costs each kernel's serving image, and what only the sandbox imports."""
    plain, sandbox = import_times(PLAIN)[-1], import_times(SANDBOX)[-1]
    extra = {i.module for i in sandbox} - {i.module for i in plain}
    extras = [i for i in sandbox if i.module in extra]
    own = sorted(((i.own_us, i.module) for i in extras), reverse=True)
    return [
        f"- `python -X importtime` of the serving image up to the first execute: plain imports "
        f"{len(plain)} modules in {_total_ms(plain)}, sandbox {len(sandbox)} in "
        f"{_total_ms(sandbox)}; {len(extra)} modules only in the sandbox, {_total_ms(extras)} in "
        "all; the costliest: " + ", ".join(f"`{m}` {_ms(us / 1e6)}" for us, m in own[:5]) + ".",
    ]


def _sandbox_only_imports() -> float:
    """Seconds the serving image spends importing modules plain ipykernel never imports."""
    plain = {i.module for i in import_times(PLAIN)[-1]}
    return sum(i.own_us for i in import_times(SANDBOX)[-1] if i.module not in plain) / 1e6


@functools.cache
def _bare_interpreter() -> float:
    return _command_seconds([sys.executable, "-I", "-c", "pass"])


# --- cProfile of start-up ---------------------------------------------------------------------

def start_profiles(runs: int = 3) -> dict[str, list[dict[str, Any]]]:
    """Several cProfiles of each kind of kernel's start-up, taken alternately (one is noise)."""
    profiles: dict[str, list[dict[str, Any]]] = {PLAIN: [], SANDBOX: []}
    for _ in range(runs):
        for kind, found in profiles.items():
            found.append(start_profile(kind))
    return profiles


def _median_by_key(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over the runs (a key absent from a run counts as 0 there)."""
    keys = set().union(*runs)
    return {key: statistics.median(run.get(key, 0.0) for run in runs) for key in keys}


def start_profile(kind: str) -> dict[str, Any]:
    """cProfile of a kernel's serving image from interpreter start to its application's start()."""
    argv = kernel_argv(kind)
    module_at = argv.index("-m")
    wrapped = [argv[0], *argv[1:module_at], str(WRAPPER), *argv[module_at + 1:]]
    for line in _run_kernel(kind, wrapped).splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RuntimeError(f"the profiled {kind} kernel wrote no profile")


def _is_sandbox(path: str) -> bool:
    return any(marker in path for marker in SANDBOX_CODE)


def _is_stdlib_work(path: str) -> bool:
    """Builtins and the standard library, but not the import machinery (importtime covers it)."""
    if path == "~" or path.startswith("<built-in"):
        return True
    if "importlib" in path or "runpy" in path or "site-packages" in path:
        return False
    return path.startswith((STDLIB, "<frozen"))


def _where(path: str, line: int, name: str) -> str:
    return f"{path.split('site-packages/')[-1].split('/sandbox_kernel/')[-1]}:{line} {name}"


def own_work(functions: list[list[Any]]) -> dict[str, float]:
    """Seconds each sandbox function spends itself or in the standard library it calls directly.

    Calls into ipykernel and the other Jupyter packages, into imports, and into other sandbox
    functions are not counted, so the figures are disjoint and add up to the sandbox's own cost.
    """
    work: dict[str, float] = {}
    for path, line, name, _own, cumulative, _callers in functions:
        if _is_sandbox(path):
            work[_where(path, line, name)] = cumulative
    for path, _line, _name, _own, _cumulative, callers in functions:
        if _is_stdlib_work(path) and not _is_sandbox(path):
            continue
        for caller_path, caller_line, caller_name, seconds in callers:
            caller = _where(caller_path, caller_line, caller_name)
            if caller in work:
                work[caller] -= seconds
    return work


def app_steps(functions: list[list[Any]]) -> dict[str, float]:
    """Cumulative seconds of each application init step (IPKernelApp's and the sandbox's)."""
    return {
        f"{'sandbox' if 'sandbox_kernel' in path else 'ipykernel'} {name}": cumulative
        for path, _line, name, _own, cumulative, _callers in functions
        if path.endswith(APP_STEPS) and name.startswith("init")
    }


def _compared_steps(plain: dict[str, float], sandbox: dict[str, float]) -> str:
    """ipykernel's steps plain / sandbox, then the sandbox's own steps, largest change first."""
    # A sandbox step named like an ipykernel one wraps it (super()); its ipykernel row says more.
    wrapped = {step.split()[1] for step in sandbox if step.startswith("ipykernel ")}
    steps = [s for s in sandbox if not (s.startswith("sandbox ") and s.split()[1] in wrapped)]
    steps.sort(key=lambda s: plain.get(s, 0) - sandbox[s])
    return ", ".join(f"`{step}` {_ms(plain[step])} / {_ms(sandbox[step])}" if step in plain
                     else f"`{step}` {_ms(sandbox[step])}" for step in steps[:8])


def explain_start(gap: float) -> list[str]:
    """Where the sandbox's extra start-up time goes, from import times and cProfiles."""
    profiles = start_profiles()
    seconds = {kind: statistics.median(p["seconds"] for p in runs)
               for kind, runs in profiles.items()}
    work = _median_by_key([own_work(p["functions"]) for p in profiles[SANDBOX]])
    largest = sorted(work.items(), key=lambda item: -item[1])
    steps = _compared_steps(*(_median_by_key([app_steps(p["functions"]) for p in profiles[kind]])
                              for kind in (PLAIN, SANDBOX)))
    reexec = sum(_bare_interpreter() + sum(i.own_us for i in image) / 1e6
                 for image in import_times(SANDBOX)[:-1])
    calls_only = sum(cost for where, cost in work.items() if not where.endswith("<module>"))
    imports = _sandbox_only_imports()
    accounted = reexec + calls_only + imports
    return [
        f"The sandbox's median start-to-ready is {_ms(gap)} longer than plain ipykernel's. "
        f"About {_ms(accounted)} of it is accounted for below: the re-exec's extra interpreter "
        f"image ≈ {_ms(reexec)} (a bare interpreter start plus image 1's imports), the sandbox's "
        f"own start-up calls {_ms(calls_only)}, and the modules only the sandbox imports "
        f"{_ms(imports)}.",
        "",
        *explain_reexec(),
        "- cProfile of each kernel's serving image from interpreter start to `start()`, median "
        f"of {len(profiles[PLAIN])} runs each (profiler overhead included): plain "
        f"{_ms(seconds[PLAIN])}, sandbox {_ms(seconds[SANDBOX])}. The sandbox's own code in it "
        f"(excluding what it delegates to ipykernel and to imports) costs "
        f"{_ms(sum(work.values()))}; the largest: "
        + ", ".join(f"`{where}` {_ms(cost)}" for where, cost in largest[:6]) + ".",
        f"- Application steps (cumulative), plain / sandbox, largest increase first: {steps}.",
        *explain_imports(),
    ]


# --- execute -------------------------------------------------------------------------------------

def syscall_cost(kernel: Kernel) -> float:
    """Nanoseconds one getppid() takes inside this kernel."""
    return float(kernel.evaluate(SYSCALL_LOOP))


def explain_execute(plain: Kernel, sandbox: Kernel, median_gap: float) -> list[str]:
    """What the filter adds per system call, against the gap between the two round trips."""
    plain_ns, sandbox_ns = syscall_cost(plain), syscall_cost(sandbox)
    per_call = sandbox_ns - plain_ns
    lines = [
        f"A getppid() loop inside each warm kernel (best of 3 x {SYSCALLS:,}): plain "
        f"{plain_ns:.0f} ns per call, sandbox {sandbox_ns:.0f} ns; the seccomp filter adds "
        f"about {per_call:.0f} ns per system call.",
    ]
    if per_call > 0:
        lines.append(
            f"- The median round trips differ by {median_gap * 1e6:.0f} µs; the filter alone "
            f"would need about {median_gap * 1e9 / per_call:.0f} system calls per execute to "
            "explain it.")
    return lines


# --- memory --------------------------------------------------------------------------------------

def _libraries(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in maps if ".so" in line.split()[-1]}


def explain_rss() -> list[str]:
    """What only the sandbox kernel maps and imports."""
    kernels = {kind: Kernel(kind) for kind in (PLAIN, SANDBOX)}
    try:
        for kernel in kernels.values():
            kernel.start()
            kernel.warm_up()
        extra = _libraries(kernels[SANDBOX].pid) - _libraries(kernels[PLAIN].pid)
    finally:
        for kernel in kernels.values():
            kernel.close()
    return [
        "- Shared libraries mapped only by the sandbox kernel: "
        + (", ".join(f"`{name}`" for name in sorted(extra)) or "none") + ".",
        *explain_imports(),
    ]


# --- warm call against a process per request ----------------------------------------------------

def _kernel_busy(kernel: Kernel, call: calls.Call) -> tuple[float, float]:
    """(round-trip seconds, seconds between the kernel's busy and idle) for one main() call."""
    content = {"code": call.code, "silent": False, "store_history": True,
               "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}
    msg = kernel.client.session.msg("execute_request", content)
    msg["metadata"]["sandbox"] = {"entrypoint": "main", "inputs": call.inputs}
    started = time.perf_counter()
    kernel.client.shell_channel.send(msg)
    stamps = {}
    while "idle" not in stamps:
        reply = kernel.client.get_iopub_msg(timeout=30)
        if (reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]
                and reply["msg_type"] == "status"):
            stamps[reply["content"]["execution_state"]] = reply["header"]["date"]
    elapsed = time.perf_counter() - started
    kernel.await_reply(msg["header"]["msg_id"])
    return elapsed, (stamps["idle"] - stamps["busy"]).total_seconds()


def explain_speedup(repeats: int = 20) -> list[str]:
    """Where a warm call's time goes, against what a fresh process has to pay first."""
    kernel = Kernel(SANDBOX)
    try:
        kernel.start()
        kernel.warm_up()
        pairs = [_kernel_busy(kernel, calls.SMALL_CALL) for _ in range(repeats)]
    finally:
        kernel.close()
    round_trip = statistics.median(p[0] for p in pairs)
    busy = statistics.median(p[1] for p in pairs)
    seccomp = _command_seconds([sys.executable, "-I", "-c", "import os; from sandbox_kernel "
                                "import seccomp; seccomp.install(os.getpid(), False)"])
    fresh = statistics.median(calls.call_in_fresh_process(calls.SMALL_CALL) for _ in range(5))
    return [
        f"Warm `main()` call (raw client, median of {repeats}): {_ms(round_trip)} round trip, of "
        f"which the kernel is busy {_ms(busy)} (running the code, calling `main`, encoding the "
        f"result) and {_ms(round_trip - busy)} is messaging, serialisation and the client.",
        f"- Process per request ({_ms(fresh)}): a bare `python -I -c pass` takes "
        f"{_ms(_bare_interpreter())}; importing and loading the seccomp filter brings it to "
        f"{_ms(seccomp)}; the rest is the request itself.",
    ]


# --- fork-served start ---------------------------------------------------------------------------

FORK_WRAPPER = Path(__file__).with_name("_profiled_fork.py")
# The IPython and ipykernel work a forked child still does (the server cannot do it: it creates
# the shell, traitlets singletons, sockets and threads that must be the kernel's own).
FORK_STEPS = ("IPython/core/interactiveshell.py", "ipykernel/ipkernel.py", "ipykernel/zmqshell.py",
              "IPython/core/history.py", "traitlets/config/application.py",
              "sandbox_kernel/confine/", "sandbox_kernel/kernel/app.py", "ipykernel/kernelapp.py")


def explain_fork(cpu_seconds: float) -> list[str]:
    """Where a fork-served kernel's own start-up goes: cProfile of the child's initialize()."""
    done = subprocess.run([sys.executable, "-I", str(FORK_WRAPPER)], capture_output=True,
                          text=True, timeout=120, check=True)
    profile = json.loads(done.stdout.strip().splitlines()[-1])
    steps = sorted(((cumulative, f"{Path(path).name}:{name}")
                    for path, _line, name, _own, cumulative, _callers in profile["functions"]
                    if any(path.endswith(step) or step in path for step in FORK_STEPS)
                    and (name.startswith(("init", "__init__", "install", "apply", "parse"))
                         or name == "initialize")), reverse=True)
    return [
        f"A fork-served kernel used {_ms(cpu_seconds)} of CPU to ready (median, clock ticks). "
        f"Under cProfile (overhead included) its initialize() took {_ms(profile['seconds'])}; "
        "the largest steps (cumulative, nested steps overlap): "
        + ", ".join(f"`{where}` {_ms(seconds)}" for seconds, where in steps[:12]) + ".",
        "What remains is per-kernel by nature: the IPython shell (its history database in the "
        "scratch, magics, traceback handlers), ipykernel's sockets and threads, the command line, "
        "the confinement layers. The server has already imported every module a started kernel "
        "imports through its first calls (forkserver.KERNEL_IMPORTS).",
    ]
