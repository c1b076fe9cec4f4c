"""Creating, updating and removing runtimes, and the kernelspec `sandbox-NAME` of each.

A runtime never changes under a running kernel: update builds a new environment next to the old
one and points the kernelspec at it, and refuses to do even that while kernels run on the
current build unless asked (force): then new kernels get the new build and running ones keep
theirs, which is removed by a later update or remove once no kernel runs on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .. import install as kernelspecs
from ..policy import SandboxPolicy
from . import build, in_use
from .modules import Preloads
from .store import Runtime, RuntimesError, check_name, find, kernel_name

DISPLAY_NAME = "Python 3 (sandbox: {name})"
INSTALLED = "installed"  # preload what the runtime installs (modules.py): the default


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One create, update or remove of a runtime at a time."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimesError(f"another command is changing the runtime in {directory}; "
                                "wait for it to finish") from None
        yield


def _copy_requirements(source: Path, runtime: Runtime) -> Path:
    try:
        text = source.read_text()
    except OSError as exc:
        raise RuntimesError(f"cannot read the requirements file {source}: "
                            f"{exc.strerror or exc}") from None
    staged = runtime.directory / "requirements.txt.new"
    staged.write_text(text)
    return staged


def _busy(runtime: Runtime, build_number: int, verb: str) -> RuntimesError:
    kernels = in_use.processes_on(runtime.build_dir(build_number)).kernels
    shown = ", ".join(map(str, kernels[:10])) + (" ..." if len(kernels) > 10 else "")
    return RuntimesError(
        f"{len(kernels)} kernel(s) run on runtime {runtime.name!r} (pid {shown}); refusing to "
        f"{verb} it under them. Stop them, or pass --force: new kernels then get the new "
        "environment and running ones keep theirs until they end")


def _running_kernels(runtime: Runtime, build_number: int) -> bool:
    return bool(in_use.processes_on(runtime.build_dir(build_number)).kernels)


def create(name: str, requirements: Path, policy: SandboxPolicy | None = None, *,
           base_python: str | None = None, preload: Sequence[str] | None = None,
           user: bool = False,
           prefix: str | None = None, display_name: str | None = None,
           cold_start: bool = False) -> Runtime:
    """Build runtime NAME from a requirements file and install its kernelspec. preload: the
    modules its fork servers import; None (the default): what it installs (modules.py)."""
    check_name(name)
    runtime = Runtime(name=name, base_python=base_python or sys.executable,
                      preload_from=_preload_from(preload), build=1, created=_now(),
                      updated=_now(), source=str(requirements.absolute()))
    if (runtime.directory / "runtime.json").exists():
        raise RuntimesError(f"runtime {name!r} exists already; `sandbox-kernel runtime update "
                            f"{name} -r FILE` changes it, `runtime remove {name}` removes it")
    fresh = not runtime.directory.exists()
    try:
        with _locked(runtime.directory):
            staged = _copy_requirements(requirements, runtime)
            runtime.installer, preloads = build.build(runtime.base_python, staged,
                                                      runtime.build_dir(), _listed(preload))
            _record(runtime, preloads)
            os.replace(staged, runtime.requirements)
            spec = kernelspecs.install(
                policy or SandboxPolicy(), name=runtime.kernel_name,
                display_name=display_name or DISPLAY_NAME.format(name=name), user=user,
                prefix=prefix, cold_start=cold_start, preload=runtime.preload,
                python=str(runtime.python()), runtime=name)
            runtime.kernelspec = spec
            runtime.save()
    except BaseException:
        if fresh:
            shutil.rmtree(runtime.directory, ignore_errors=True)
        raise
    return runtime


def update(name: str, requirements: Path | None = None, *,
           preload: Sequence[str] | str | None = None, force: bool = False) -> Runtime:
    """Build a new environment for NAME from a requirements file: the one given, else the
    operator's file it was last built from (read again, as dify-sandbox reads its own).
    preload: the modules to preload instead, INSTALLED for what it installs, None: as before."""
    runtime = find(name)
    with _locked(runtime.directory):
        if not force and _running_kernels(runtime, runtime.build):
            raise _busy(runtime, runtime.build, "update")
        if requirements is not None:
            runtime.source = str(requirements.absolute())
        source = Path(runtime.source) if runtime.source else runtime.requirements
        staged = _copy_requirements(source, runtime)
        if preload is None:  # as the record says: what it installs now, or the same list
            wanted = None if runtime.preload_from == INSTALLED else list(runtime.preload)
        else:
            wanted = None if preload == INSTALLED else list(preload)
        number = max(runtime.builds(), default=0) + 1
        runtime.installer, preloads = build.build(runtime.base_python, staged,
                                                  runtime.build_dir(number), wanted)
        os.replace(staged, runtime.requirements)
        runtime.build, runtime.updated = number, _now()
        runtime.preload_from = _preload_from(wanted)
        _record(runtime, preloads)
        _point_kernelspec(runtime)
        runtime.save()  # from here on new kernels start on the new build
        _retire_old_builds(runtime)
    return runtime


def _preload_from(preload: Sequence[str] | None) -> str:
    return INSTALLED if preload is None else "given" if preload else "none"


def _listed(preload: Sequence[str] | None) -> list[str] | None:
    return None if preload is None else sorted(set(preload))


def _record(runtime: Runtime, preloads: Preloads) -> None:
    """Note in the record what the build preloads and what it skipped."""
    for key, value in preloads.as_record().items():
        setattr(runtime, key, value)


def _point_kernelspec(runtime: Runtime) -> None:
    """Make the runtime's kernelspec start the current build (policy and the rest kept)."""
    path = Path(runtime.kernelspec) / "kernel.json"
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RuntimesError(f"cannot read the runtime's kernelspec {path}: {exc}; `runtime "
                            f"remove {runtime.name} --force` and create it again") from None
    spec["argv"][0] = str(runtime.python())
    provisioner = spec.get("metadata", {}).get("kernel_provisioner", {})
    if isinstance(provisioner.get("config"), dict):
        provisioner["config"]["preload"] = runtime.preload
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(spec, indent=2))
    os.replace(temporary, path)


def _stop_fork_servers(build_dir: Path) -> None:
    """End the fork servers of a build no new kernel will start on (its kernels live on)."""
    for pid in in_use.processes_on(build_dir).fork_servers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _retire_old_builds(runtime: Runtime) -> list[int]:
    """Remove the builds before the current one that no kernel runs on; the ones kept.

    A build something runs on keeps its fork servers too: a running service's one-shot pools
    (their zygotes and waiting processes, counted as kernels here) are served by them until the
    service has moved to the new build (service/core.py follows the record), and it stops them
    then. Stopped now, the service's runs in between would find no pool, and a build removed
    under them no interpreter (#49)."""
    kept = []
    for number in runtime.builds():
        if number == runtime.build:
            continue
        if _running_kernels(runtime, number):
            kept.append(number)
        else:
            _stop_fork_servers(runtime.build_dir(number))  # idle ones: nothing forked lives
            shutil.rmtree(runtime.build_dir(number), ignore_errors=True)
    return kept


def remove(name: str, force: bool = False) -> Runtime:
    """Remove runtime NAME and its kernelspec; refuse while kernels run on it unless force."""
    runtime = find(name)
    with _locked(runtime.directory):
        for number in runtime.builds():
            if not force and _running_kernels(runtime, number):
                raise _busy(runtime, number, "remove")
        for number in runtime.builds():
            _stop_fork_servers(runtime.build_dir(number))
        spec_dir = Path(runtime.kernelspec)
        if spec_dir.is_dir() and spec_dir.name == runtime.kernel_name:
            shutil.rmtree(spec_dir, ignore_errors=True)
        shutil.rmtree(runtime.directory / "builds", ignore_errors=True)
        (runtime.directory / "runtime.json").unlink(missing_ok=True)
    shutil.rmtree(runtime.directory, ignore_errors=True)
    return runtime


def summary(runtime: Runtime) -> dict[str, object]:
    """What `runtime list` shows of one runtime."""
    return {"name": runtime.name, "kernel_name": kernel_name(runtime.name),
            "build": runtime.build, "packages": len(runtime.frozen()),
            "kernels": len(in_use.processes_on(runtime.build_dir()).kernels),
            "preload": runtime.preload, "updated": runtime.updated,
            "directory": str(runtime.directory)}

