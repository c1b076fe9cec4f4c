"""Which kernels run on a runtime's build: processes whose interpreter lives in its directory.

A kernel started cold runs `BUILD/bin/python -I -m sandbox_kernel`; a fork-served one keeps the
command line of its fork server, `BUILD/bin/python -I -m sandbox_kernel.launch.forkserver...`, whose
child it is. The interpreter itself is a link to the base Python, so /proc/PID/exe cannot tell
builds apart: the command line can. Children of a kernel (its reaper) are the same kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

FORK_SERVER_PACKAGE = "sandbox_kernel.launch.forkserver"  # its server module, any layout


def _is_fork_server(argv: list[str]) -> bool:
    """Whether a command line runs `python -m sandbox_kernel.launch.forkserver[.server]`."""
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return module == FORK_SERVER_PACKAGE or module.startswith(FORK_SERVER_PACKAGE + ".")


@dataclass
class Processes:
    """The processes running on one build."""

    kernels: list[int]
    fork_servers: list[int]


def _command_lines() -> dict[int, tuple[int, list[str]]]:
    """Every process's parent and command line that we may read."""
    found: dict[int, tuple[int, list[str]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile, or hidden from us
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        found[int(entry.name)] = (parent, [os.fsdecode(arg) for arg in argv if arg])
    return found


def processes_on(build_dir: Path) -> Processes:
    """The kernels (one pid each) and fork servers whose interpreter is in build_dir."""
    prefix = str(build_dir.absolute()).rstrip("/") + "/"
    on_build = {pid: (parent, argv) for pid, (parent, argv) in _command_lines().items()
                if argv and argv[0].startswith(prefix)}
    servers = {pid for pid, (parent, argv) in on_build.items()
               if _is_fork_server(argv) and parent not in on_build}
    kernels = [pid for pid, (parent, _argv) in on_build.items()
               if pid not in servers and (parent not in on_build or parent in servers)]
    return Processes(sorted(kernels), sorted(servers))
