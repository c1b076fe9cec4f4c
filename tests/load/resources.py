"""What a service instance holds, sampled over time: processes, kernels, RSS, descriptors,
scratch directories, and the service's own gauges from /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil


def _mentions(process: psutil.Process, marker: str) -> bool:
    with contextlib.suppress(psutil.Error, OSError):
        if any(marker in part for part in process.cmdline()):
            return True
        return any(marker in value for value in process.environ().values())
    return False


def instance_processes(root_pid: int | None, marker: str) -> list[psutil.Process]:
    """The service process, its descendants, and every process that mentions the run dir
    (kernels' command lines name its runtime dir; orphans keep the marker variable)."""
    found: dict[int, psutil.Process] = {}
    if root_pid is not None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(root_pid)
            found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
    for process in psutil.process_iter():
        if process.pid not in found and _mentions(process, marker):
            found[process.pid] = process
    return [p for p in found.values() if alive(p)]


def alive(process: psutil.Process) -> bool:
    """Running (a zombie is not: it is only waiting to be reaped)."""
    with contextlib.suppress(psutil.Error):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def describe(process: psutil.Process) -> str:
    """pid and command line, for evidence."""
    with contextlib.suppress(psutil.Error):
        return f"{process.pid}: {' '.join(process.cmdline())[:100]}"
    return f"{process.pid}: gone"


def _command(process: psutil.Process | None) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline() if process is not None else []
    return []


def _kernelish(process: psutil.Process | None) -> bool:
    """Started as a kernel (`-m sandbox_kernel -f ...`) or forked by the fork server."""
    command = _command(process)
    return any("sandbox_kernel" in part for part in command) and (
        "-f" in command or any("forkserver" in part for part in command))


def _parent(process: psutil.Process) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        return process.parent()
    return None


def is_fork_server(process: psutil.Process) -> bool:
    """The fork server itself (its children, the kernels, share its command line)."""
    return (any("launch.forkserver" in part for part in _command(process))
            and not _kernelish(_parent(process)))


def is_kernel(process: psutil.Process) -> bool:
    """A kernel process: not the fork server, and not a kernel's scratch reaper (a child of the
    kernel with the same command line)."""
    if not _kernelish(process) or is_fork_server(process):
        return False
    parent = _parent(process)
    return not _kernelish(parent) or (parent is not None and is_fork_server(parent))


@dataclass
class Sample:
    """One look at the instance."""

    t: float  # seconds since the sampler started
    processes: int
    kernels: int
    service_rss: int
    total_rss: int
    service_fds: int
    total_fds: int
    scratch_dirs: int
    metrics: dict[str, float]
    service_cpu: float = 0.0  # CPU seconds of the service process itself
    kernels_cpu: float = 0.0  # of its live kernels, and of the ones the service reaped itself
    host_busy_cpu: float = 0.0  # of the whole machine (other users' work included)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _owner(entry: Path) -> int | None:
    """The pid a scratch directory is named after (`kernel-<pid>-<random>`)."""
    parts = entry.name.split("-")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "kernel" and parts[1].isdigit() \
        else None


def scratch_dirs(root: Path, pids: set[int]) -> int:
    """Scratch directories of this instance. Under its own scratch root, all (cold-started
    kernels inherit its TMPDIR); in the machine-wide root of this uid, where kernels forked by
    the fork server make theirs whatever the launcher's TMPDIR, and other users' kernels too,
    those named after a process of this instance seen by any sample, alive or gone (a kernel
    that lived between two samples is not seen: its directory, if left, is not counted)."""
    bases = {root: None, machine_scratch_root(): pids}
    found = 0
    for base, owners in bases.items():
        with contextlib.suppress(OSError):
            found += sum(1 for entry in base.iterdir() if (pid := _owner(entry)) is not None
                         and (owners is None or pid in owners))
    return found


def machine_scratch_root() -> Path:
    """Where kernels of this uid put scratch directories by default (confine/scratch.py)."""
    return Path(tempfile.gettempdir()) / f"sandbox-kernel-{os.geteuid()}"


def read_metrics(url: str) -> dict[str, float]:
    """The service's unlabelled gauges and the pooled kernels (summed) from /metrics."""
    wanted = ("sandbox_kernels_live", "sandbox_kernels_pooled", "sandbox_runs_in_flight",
              "sandbox_sessions")
    values: dict[str, float] = {}
    with contextlib.suppress(httpx.HTTPError, ValueError):
        text = httpx.get(f"{url}/metrics", timeout=2, trust_env=False).text
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in wanted:
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def sample(root_pid: int, marker: str, scratch_root: Path, url: str | None,
           t0: float, seen: set[int] | None = None) -> Sample:
    """Look at the instance now; `seen` gathers the pids of its processes across samples."""
    processes = instance_processes(root_pid, marker)
    seen = set() if seen is None else seen
    seen.update(p.pid for p in processes)
    service_cpu, kernels_cpu = _cpu(root_pid, processes)
    host = psutil.cpu_times()
    rss = {p.pid: _rss(p) for p in processes}
    fds = {p.pid: _fds(p) for p in processes}
    return Sample(
        t=time.monotonic() - t0, processes=len(processes),
        kernels=sum(1 for p in processes if is_kernel(p)),
        service_rss=rss.get(root_pid, 0), total_rss=sum(rss.values()),
        service_fds=fds.get(root_pid, 0), total_fds=sum(fds.values()),
        scratch_dirs=scratch_dirs(scratch_root, seen),
        metrics=read_metrics(url) if url else {}, service_cpu=service_cpu,
        kernels_cpu=kernels_cpu, host_busy_cpu=sum(host) - host.idle - host.iowait)


def _cpu(root_pid: int, processes: list[psutil.Process]) -> tuple[float, float]:
    """CPU seconds of the service process, and of every process under it (reaped or live).

    A live process's reaped children count too: the fork server, not the service, reaps the
    kernels it forked, so their CPU time ends up in its children's times.
    """
    with contextlib.suppress(psutil.Error):
        own = psutil.Process(root_pid).cpu_times()
        live = 0.0
        for process in processes:
            if process.pid != root_pid:
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    live += times.user + times.system + times.children_user \
                        + times.children_system
        return own.user + own.system, own.children_user + own.children_system + live
    return 0.0, 0.0


def _rss(process: psutil.Process) -> int:
    with contextlib.suppress(psutil.Error):
        return int(process.memory_info().rss)
    return 0


def _fds(process: psutil.Process) -> int:
    with contextlib.suppress(psutil.Error):
        return int(process.num_fds())
    return 0


class Sampler:
    """Samples an instance every `interval` seconds in a thread while a run goes on."""

    def __init__(self, root_pid: int, marker: str, scratch_root: Path, url: str | None,
                 interval: float = 1.0) -> None:
        self.args = (root_pid, marker, scratch_root, url)
        self.interval = interval
        self.samples: list[Sample] = []
        self.seen: set[int] = set()  # every pid of the instance a sample saw
        self.t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def now(self) -> Sample:
        return sample(*self.args, self.t0, self.seen)

    async def _loop(self) -> None:
        while True:
            self.samples.append(await asyncio.to_thread(self.now))
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def settle(sampler: Sampler, baseline: Sample, timeout: float) -> tuple[Sample, float]:
    """Wait until processes and scratch dirs are back to baseline (or timeout); the last sample
    and how long it took."""
    started = time.monotonic()
    while True:
        now = await asyncio.to_thread(sampler.now)
        # Kernels are closed in the background: their clients' sockets go a little later.
        back = (now.processes <= baseline.processes and now.scratch_dirs <= baseline.scratch_dirs
                and now.service_fds <= baseline.service_fds
                and now.metrics.get("sandbox_runs_in_flight", 0) == 0)
        if back or time.monotonic() - started > timeout:
            return now, time.monotonic() - started
        await asyncio.sleep(0.5)


def is_ready(url: str | None) -> bool:
    """Whether the service says it is ready (every policy's kernels, ZMQ and one-shot, have
    started and answered: its pools exist); True for an instance without a URL."""
    if url is None:
        return True
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/ready", timeout=2, trust_env=False).status_code == 200
    return False


async def steady(sampler: Sampler, timeout: float = 60.0, quiet: float = 3.0) -> Sample:
    """A sample taken once the instance is ready and has stopped changing (its pools refilled,
    nothing in flight) for `quiet` seconds, or after timeout.

    The baseline is the service's standing processes: itself, its ZMQ kernels' pools
    (--pool-size per policy, each with its reaper), the fork server, its one-shot pools
    (--one-shot-pool-size per policy) and their companion. All are bounded by flags; before
    /ready they are still being made, and a baseline taken then would count them as leaks."""
    started = time.monotonic()
    last = await asyncio.to_thread(sampler.now)
    stable_since = time.monotonic()
    while time.monotonic() - started < timeout:
        await asyncio.sleep(0.5)
        now = await asyncio.to_thread(sampler.now)
        same = (now.processes, now.kernels, now.scratch_dirs) == (
            last.processes, last.kernels, last.scratch_dirs)
        if not same or now.metrics.get("sandbox_runs_in_flight", 0) \
                or not await asyncio.to_thread(is_ready, sampler.args[3]):
            stable_since = time.monotonic()
        elif time.monotonic() - stable_since >= quiet:
            return now
        last = now
    return last


def cpu_split(samples: list[Sample]) -> str:
    """Where the machine's CPU went between the first and the last sample: the evidence of what
    limits throughput on a shared host."""
    if len(samples) < 2:
        return "n/a"
    first, last = samples[0], samples[-1]
    wall = last.t - first.t
    capacity = wall * (psutil.cpu_count() or 1)
    busy = last.host_busy_cpu - first.host_busy_cpu
    kernels = last.kernels_cpu - first.kernels_cpu
    service = last.service_cpu - first.service_cpu
    return (f"{busy:.0f} of {capacity:.0f} CPU-s busy ({100 * busy / capacity:.0f} %) over "
            f"{wall:.0f} s: kernels alive at the last sample {kernels:.0f} CPU-s, the service "
            f"process {service:.0f}, everything else on the host {busy - kernels - service:.0f} "
            "(fork-served kernels that ended: the fork server reaps them, outside the service's "
            "tree; other users; this harness)")
