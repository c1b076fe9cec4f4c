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


def measure_floor(results: Any, sizes: list[tuple[str, int, int]]) -> None:
    """floor.1mb, floor.10mb: the echo's throughput, counted as main()'s rows count it."""
    echo = Echo()
    try:
        for row, size, count in sizes:
            call = calls.echo_call(size)
            moved = call.json_bytes() / MB
            echo.round_trip(call)  # warm-up
            for _ in range(count):
                seconds = echo.round_trip(call)
                results.sample(row, "MB/s", higher_is_better=True).add(moved / seconds)
                results.sample(f"{row}.latency", "s").add(seconds)
    finally:
        echo.close()


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
    for _ in range(rounds):
        kernel_before, client_before = _process_cpu(pid), _client_cpu()
        for _ in range(count):
            calls.call_in_sandbox(sandbox, calls.SMALL_CALL)
        kernel = (_process_cpu(pid) - kernel_before) / count
        client = (_client_cpu() - client_before) / count
        results.sample("cpu.small", "s").add(kernel)
        results.sample("capacity.small", "calls/s", higher_is_better=True).add(
            len(os.sched_getaffinity(0)) / (kernel + client))


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


def per_thread(call: calls.Call, count: int) -> list[str]:
    """Kernel CPU per call, thread by thread, over `count` warm calls in a fresh sandbox."""
    import json

    with Sandbox(None) as sandbox:
        for _ in range(3):
            calls.call_in_sandbox(sandbox, call)
        pid = sandbox.manager.provisioner.process.pid  # type: ignore[union-attr]
        names = {int(k): v for k, v in json.loads(sandbox.run(_THREAD_NAMES).stdout).items()}
        before = _thread_cpu(pid)
        for _ in range(count):
            calls.call_in_sandbox(sandbox, call)
        after = _thread_cpu(pid)
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    total = sum(spent.values()) / count
    parts = sorted(((seconds / count, names.get(tid, f"thread {tid}") if tid != pid
                     else "main thread") for tid, seconds in spent.items() if seconds),
                   reverse=True)
    return [f"Kernel CPU per call, measured over {count} calls: {total * 1000:.2f} ms, of which "
            + ", ".join(f"{name} {seconds * 1000:.2f} ms" for seconds, name in parts) + "."]


def explain_cpu() -> list[str]:
    """Where a warm small call's kernel CPU goes."""
    return per_thread(calls.SMALL_CALL, 300)


def explain(results: Any, size: str) -> list[str]:
    """Where main()'s time goes against the floor's, for the 1mb or 10mb row."""
    main = results.samples[f"main.{size}.latency"].median
    floor = results.samples[f"floor.{size}.latency"].median
    call = calls.echo_call(int(size.removesuffix("mb")) * MB)
    return [f"`main.{size}` takes {main * 1000:.1f} ms against the floor's {floor * 1000:.1f} ms.",
            *per_thread(call, 3)]
