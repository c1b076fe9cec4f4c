"""Where a fork-served kernel's CPU goes once initialize() is done: readiness, warm-up, runs.

Usage: python -I -m bench.executions [KERNELS] (default 15 of each kind). Each kernel is a real
AsyncSandbox (fork-served, every layer on, network off) taken the way a pool takes one: start()
until the kernel_info_reply, the pool's silent warm-up (Sandbox.warm_up), then Dify's wrapped
main() twice (the first run, then a later one). Kernels of the other kind skip the warm-up, so
"warm-up + first run" can be set against "first run, cold". Kinds alternate, kernel by kernel,
so load from elsewhere on the machine falls on both alike; the first kernel of each kind is
not counted (it may have started the fork server).

CPU in ms from /proc/PID/task/TID/schedstat (sub-ms resolution): the kernel's main thread, its
other threads (IOPub, shell channel, control, heartbeat, libzmq's), and this process (the
launcher's side: jupyter_client, the provisioner). Medians are printed.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # bench's modules must not shadow anything the kernel imports

from bench.service import EXPECTED_STDOUT, USER_CODE, dify_wrapped
from sandbox_kernel.client import AsyncSandbox
from sandbox_kernel.policy import SandboxPolicy

Sample = tuple[float, float, float]  # kernel main thread, kernel's other threads, launcher


def _thread_ms(pid: int, tid: int) -> float:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as stats:
        return int(stats.read().split()[0]) / 1e6


def _sample(pid: int) -> Sample:
    """CPU so far of the kernel's main thread, of its other threads, and of this process."""
    others = 0.0
    for name in os.listdir(f"/proc/{pid}/task"):
        if int(name) != pid:
            try:
                others += _thread_ms(pid, int(name))
            except OSError:  # ended meanwhile
                pass
    return _thread_ms(pid, pid), others, time.process_time() * 1000


def _spent(before: Sample, after: Sample) -> Sample:
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


async def _one_kernel(warm_up: bool, code: str) -> dict[str, Sample]:
    """The phases of one kernel: CPU spent in each."""
    sandbox = AsyncSandbox(None, policy=SandboxPolicy(network="off"))
    launcher = time.process_time() * 1000
    await sandbox.start()
    pid = sandbox.manager.provisioner.pid
    now = _sample(pid)
    phases = {"ready": (now[0], now[1], now[2] - launcher)}  # threads: since the fork
    try:
        steps = [("warm-up", sandbox.warm_up)] if warm_up else []
        steps += [("first run", lambda: sandbox.run(code, timeout=10)),
                  ("later run", lambda: sandbox.run(code, timeout=10))]
        for label, step in steps:
            before = _sample(pid)
            result = await step()
            phases[label] = _spent(before, _sample(pid))
            if label.endswith("run") and result.stdout != EXPECTED_STDOUT:
                raise SystemExit(f"the {label} printed {result.stdout!r}, not the Dify result")
    finally:
        await sandbox.close(now=True)
    return phases


def _median(runs: list[dict[str, Sample]], label: str) -> Sample:
    a, b, c = (statistics.median(run[label][i] for run in runs) for i in range(3))
    return a, b, c


def _line(label: str, sample: Sample) -> str:
    main, threads, launcher = sample
    return f"{label:28s} {main:7.2f} {threads:8.2f} {launcher:9.2f}"


async def measure(kernels: int) -> None:
    """Print the median CPU of each phase, with and without the warm-up."""
    code = dify_wrapped(USER_CODE, {})
    runs: dict[bool, list[dict[str, Sample]]] = {True: [], False: []}
    for number in range(kernels + 1):
        for warm_up in (True, False):
            phases = await _one_kernel(warm_up, code)
            if number:  # the first of each kind may have started the server
                runs[warm_up].append(phases)
    print(f"median of {kernels} fork-served kernels of each kind, CPU ms: kernel main thread, "
          "kernel's other threads, launcher")
    print(f"{'phase':28s} {'main':>7s} {'threads':>8s} {'launcher':>9s}")
    warmed, cold = runs[True], runs[False]
    for label in ("ready", "warm-up", "first run", "later run"):
        print(_line(f"{label} (warmed kernel)", _median(warmed, label)))
    for label in ("ready", "first run", "later run"):
        print(_line(f"{label} (no warm-up)", _median(cold, label)))
    both = [tuple(w + r for w, r in zip(run["warm-up"], run["first run"], strict=True))
            for run in warmed]
    together = tuple(statistics.median(sample[i] for sample in both) for i in range(3))
    print(_line("warm-up + first run", together))  # type: ignore[arg-type]
    print(_line("first run, cold", _median(cold, "first run")))


if __name__ == "__main__":
    asyncio.run(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 15))
