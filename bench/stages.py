"""Where a fork-served kernel's start goes, stage by stage: wall, CPU and page faults.

Usage: python -I -m bench.stages [KERNELS]. A fork server (in this process, no socket) prepares
as it always does; each of KERNELS forked children (default 15) runs `become_kernel` with a
connection file of its own, times each step of the application's `initialize()` (wrapped, no
profiler: its overhead would distort the copy-on-write picture), and exits before serving.
Medians are printed; nested stages overlap (init_sockets contains init_confinement, ...).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # bench's modules must not shadow anything the kernel imports

import sandbox_kernel.kernel.app
from bench._profiled_fork import marked_lines
from sandbox_kernel.confine import environment, privileges, seccomp, sequence
from sandbox_kernel.kernel import prebuilt
from sandbox_kernel.launch.forkserver import Server

MARKER = "BENCH-STAGE "
APP_STEPS = ("parse_command_line", "init_connection_file", "init_profile_dir",
             "load_config_file", "init_sockets", "init_confinement", "init_iopub",
             "init_control", "init_heartbeat", "init_io", "init_kernel")
# The layers' steps (confine/sequence.py), named as the application's steps were.
CONFINEMENT_STEPS = {"apply_identity": "init_identity", "apply_landlock": "init_landlock",
                     "apply_seccomp": "init_seccomp"}
Sample = tuple[float, float, int]  # wall seconds, CPU seconds, minor faults

STAGES: dict[str, Sample] = {}


def _now() -> Sample:
    return (time.perf_counter(), time.process_time(),
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def _since(start: Sample) -> Sample:
    wall, cpu, faults = _now()
    return wall - start[0], cpu - start[1], faults - start[2]


def _timed(owner: Any, name: str, label: str) -> None:
    """Replace owner.name with a wrapper that adds its cost to STAGES[label]."""
    original: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = _now()
        try:
            return original(*args, **kwargs)
        finally:
            spent = _since(start)
            before = STAGES.get(label, (0.0, 0.0, 0))
            STAGES[label] = (before[0] + spent[0], before[1] + spent[1], before[2] + spent[2])

    setattr(owner, name, timed)


def _instrument() -> None:
    app_class = sandbox_kernel.kernel.app.SandboxKernelApp
    for name in APP_STEPS:
        _timed(app_class, name, name)
    for name, label in CONFINEMENT_STEPS.items():
        _timed(sequence.Confinement, name, label)
    _timed(environment, "prepare", "prepare (scratch, reaper)")
    _timed(seccomp, "install", "seccomp.install")
    _timed(privileges, "switch", "privileges.switch")
    # The server's shell made the kernel's (kernel/prebuilt.py), inside init_kernel.
    _timed(prebuilt.ZMQInteractiveShell, "adopt", "shell adopt")


def _measured_main(argv: list[str] | None = None) -> None:
    """In the child, instead of app.main: initialize, report over the log pipe, exit."""
    log = os.dup(2)  # the pipe to the reaper, before ipykernel puts a capture pipe on fd 2
    start = _now()
    sandbox_kernel.kernel.app.SandboxKernelApp.instance().initialize(argv)
    STAGES["initialize (all)"] = _since(start)
    STAGES["fork to ready"] = _since(FORKED)
    with os.fdopen(log, "wb") as stream:  # one short line each: the reaper relays lines
        for label, sample in STAGES.items():
            stream.write(f"\n{MARKER}{json.dumps([label, sample])}\n".encode())
    os._exit(0)


FORKED: Sample = (0.0, 0.0, 0)


def _mark_fork() -> None:
    global FORKED
    FORKED = _now()


def _one_kernel(server: Server, directory: str, number: int) -> dict[str, Sample]:
    found = {}
    for line in marked_lines(server, directory, f"kernel-{number}", MARKER, _mark_fork):
        label, sample = json.loads(line)
        found[label] = tuple(sample)
    return found


def run(kernels: int) -> None:
    directory = tempfile.mkdtemp()
    server = Server(os.path.join(directory, "server.sock"))
    server.prepare()
    server.bind()
    _instrument()
    sandbox_kernel.kernel.app.main = _measured_main
    runs = [_one_kernel(server, directory, number) for number in range(kernels)]
    runs = [found for found in runs if found]
    if not runs:
        sys.exit("no kernel reported its stages")
    print(f"median of {len(runs)} fork-served kernels: wall ms, CPU ms, minor page faults")
    labels = sorted(runs[0], key=lambda label: -runs[0][label][1])
    for label in labels:
        wall, cpu, faults = (statistics.median(found[label][i] for found in runs if label in found)
                             for i in range(3))
        print(f"{label:28s} {wall * 1000:7.2f} {cpu * 1000:7.2f} {faults:7.0f}")


if __name__ == "__main__":
    run(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
