"""Payload rows: main() throughput against its floor, kernel CPU per warm call, and capacity.

- `floor.1mb`, `floor.10mb`: the same JSON moved by a fast-JSON echo over one ZMQ hop (one
  orjson dumps and one GC-paused loads per side): what any kernel protocol costs at least.
  `main.1mb` and `main.10mb` are compared with them (target: at most 2x).
- `cpu.small`: kernel CPU (all its threads) per warm small main() call, from /proc.
- `capacity.small`: calls/s two cores allow at the measured kernel + client CPU per call;
  `concurrency.4` is compared with it.
"""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import zmq

from bench import calls
from sandbox_kernel.client import Sandbox

MB = 1_000_000
ECHO = Path(__file__).with_name("_echo.py")
ROWS = (  # (row id, what it measures), after the main() rows of the table
    ("floor.1mb", "8. Floor: the 1 MB JSON echoed by a fast-JSON server over one ZMQ hop"),
    ("floor.10mb", "8. Floor: the 10 MB JSON echoed by a fast-JSON server over one ZMQ hop"),
    ("cpu.small", "9. Kernel CPU (every thread) per warm small `main()` call"),
    ("capacity.small", "9. Calls/s 2 cores allow at the measured kernel + client CPU per call"),
)
METHOD = """\
- **Floor** (rows 8): the inputs of `main.1mb` / `main.10mb` sent as orjson bytes over one ZMQ
  REQ/REP hop to `bench/_echo.py`, which parses them (GC paused), encodes `{"rows": ...}` and
  sends it back; the client parses it (GC paused) and checks it. No signing, no kernel: the
  least any protocol can cost. Floor and `main()` calls of a size alternate call by call, and
  the targets compare their median latencies.
- **Kernel CPU per call** (row 9): user + system ticks of the kernel process (all threads, from
  `/proc/<pid>/stat`) over blocks of warm small `main()` calls, divided by the calls. The
  capacity is the machine's cores divided by kernel + client CPU per call (the client's from
  `getrusage`); `concurrency.4` is compared with it.
"""
_TICK = os.sysconf("SC_CLK_TCK")


class Echo:
    """The floor's echo server, in a process of its own, and a client socket to it."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-I", str(ECHO)],
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        port = int(self.process.stdout.readline())
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.REQ)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def round_trip(self, call: calls.Call) -> float:
        """Seconds to send the inputs and get the result back, both as fast JSON."""
        started = time.perf_counter()
        self.socket.send(orjson.dumps(call.inputs))
        reply = self.socket.recv(copy=False).buffer
        gc.disable()
        try:
            result = orjson.loads(reply)
        finally:
            gc.enable()
        elapsed = time.perf_counter() - started
        if result != call.expected:
            raise RuntimeError("the echo returned a different result")
        return elapsed

    def close(self) -> None:
        """Stop the server and wait for it."""
        self.socket.send(b"")
        self.socket.recv()
        self.context.destroy(linger=0)
        self.process.wait(timeout=10)


def record(results: Any, row: str, call: calls.Call, seconds: float) -> None:
    """One floor round trip, counted as main()'s rows count theirs."""
    results.sample(row, "MB/s", higher_is_better=True).add(call.json_bytes() / MB / seconds)
    results.sample(f"{row}.latency", "s").add(seconds)


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_cpu(results: Any, sandbox: Sandbox, count: int, rounds: int) -> None:
    """cpu.small and capacity.small: CPU per warm call, kernel side and both sides."""
    pid = sandbox.manager.provisioner.process.pid  # type: ignore[union-attr]
    threads_before = _thread_cpu(pid)
    for _ in range(rounds):
        kernel_before, client_before = _process_cpu(pid), _client_cpu()
        for _ in range(count):
            calls.call_in_sandbox(sandbox, calls.SMALL_CALL)
        kernel = (_process_cpu(pid) - kernel_before) / count
        client = (_client_cpu() - client_before) / count
        results.sample("cpu.small", "s").add(kernel)
        results.sample("capacity.small", "calls/s", higher_is_better=True).add(
            len(os.sched_getaffinity(0)) / (kernel + client))
    CPU_BY_THREAD[id(results)] = _by_thread(sandbox, pid, threads_before, count * rounds)


@contextmanager
def kernel_cpu(results: Any, sandbox: Sandbox, row: str, keep: bool) -> Iterator[None]:
    """Record the kernel CPU seconds the block used, as `<row>.kernel_cpu`."""
    pid = sandbox.manager.provisioner.process.pid  # type: ignore[union-attr]
    before = _process_cpu(pid)
    yield
    if keep:
        results.sample(f"{row}.kernel_cpu", "s").add(_process_cpu(pid) - before)


def compared(results: Any, row: str) -> str | None:
    """The comparison column of a payload row, or of a row compared with one (None: not ours)."""
    samples = results.samples
    if row in ("main.1mb", "main.10mb", "floor.1mb", "floor.10mb"):
        latency = samples.get(f"{row}.latency")
        floor = samples.get(f"floor.{row.split('.')[1]}.latency")
        if not latency:
            return None
        text = (f"latency median {latency.median * 1000:.1f} ms, p90 {latency.p90 * 1000:.1f} ms"
                "; MB counted in + out")
        if row.startswith("main.") and floor:
            text += f"; {latency.median / floor.median:.2f}x the floor's latency"
        return text
    if row == "concurrency.4" and "capacity.small" in samples and row in samples:
        return (f"{samples[row].median / samples['capacity.small'].median:.2f}x what 2 cores "
                "allow at the measured CPU per call")
    if row == "capacity.small" and "cpu.small" in samples:
        return "2 cores / (kernel + client CPU per call)"
    if row == "cpu.small" and row in samples:
        return "user + system time of every kernel thread, from /proc"
    return None


# --- evidence for a missed target ----------------------------------------------------------------

_THREAD_NAMES = ("import threading, json\n"
                 "print(json.dumps({t.native_id: t.name for t in threading.enumerate()}))")


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of a process."""
    cpu = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        cpu[int(task.name)] = (int(fields[11]) + int(fields[12])) / _TICK
    return cpu


CPU_BY_THREAD: dict[int, list[str]] = {}  # results id -> the cpu.small breakdown


def _by_thread(sandbox: Sandbox, pid: int, before: dict[int, float], count: int) -> list[str]:
    """Kernel CPU per call since `before`, thread by thread, named as threading names them."""
    import json

    after = _thread_cpu(pid)
    names = {int(k): v for k, v in json.loads(sandbox.run(_THREAD_NAMES).stdout).items()}
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    total = sum(spent.values()) / count
    parts = sorted(((seconds / count, names.get(tid, f"thread {tid}") if tid != pid
                     else "main thread") for tid, seconds in spent.items() if seconds),
                   reverse=True)
    return [f"Kernel CPU per call over the {count} calls of `cpu.small`: {total * 1000:.2f} ms, "
            "of which " + ", ".join(f"{name} {seconds * 1000:.2f} ms"
                                    for seconds, name in parts) + "."]


def explain_cpu(results: Any) -> list[str]:
    """Where a warm small call's kernel CPU goes (measured with cpu.small)."""
    return CPU_BY_THREAD.get(id(results), ["No per-thread breakdown was recorded."])


def explain(results: Any, size: str) -> list[str]:
    """Where main()'s time goes against the floor's, for the 1mb or 10mb row."""
    samples = results.samples
    main = samples[f"main.{size}.latency"].median
    floor = samples[f"floor.{size}.latency"].median
    cpu = samples.get(f"main.{size}.kernel_cpu")
    lines = [f"`main.{size}` takes {main * 1000:.1f} ms against the floor's {floor * 1000:.1f} ms "
             "(medians of calls alternating with the floor's)."]
    if cpu:
        lines.append(f"The kernel spends {cpu.median * 1000:.0f} ms of CPU per call (all "
                     "threads: parse, run, encode, sign, send); the rest is the client's parse "
                     "and the wire.")
    return lines
