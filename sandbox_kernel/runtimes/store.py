"""Where runtimes live and what each one records (runtime.json, its requirements, its builds).

A runtime NAME is a directory under root(): `requirements.txt` (the operator's, as last given),
`runtime.json` (the record below) and `builds/N/`, one virtual environment per create or update
with its `frozen.txt` (the resolved requirements, `pip freeze` form). Kernels run on the build
the record names; an update makes a new build, so a running kernel keeps the files it started on.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..confine.paths import RUNTIMES_DATA
from ..confine.paths import RUNTIMES_VAR as ROOT_VAR  # where runtimes live, if not in the data

RECORD = "runtime.json"
# A kernelspec name is sandbox-NAME: Jupyter allows [a-zA-Z0-9._-] and prefers lower case.
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,39}")


class RuntimesError(Exception):
    """A runtime could not be found, built or changed; the message says why and what to do."""


def root() -> Path:
    """The directory holding every runtime: $SANDBOX_KERNEL_RUNTIMES, else this environment's
    share/sandbox-kernel/runtimes (inside its prefix: kernels' Landlock grants leave it out,
    confine/paths.py)."""
    given = os.environ.get(ROOT_VAR)
    return Path(given).absolute() if given else Path(sys.prefix) / RUNTIMES_DATA


def check_name(name: str) -> str:
    """The name, or RuntimesError saying what a name may be."""
    if not _NAME.fullmatch(name):
        raise RuntimesError(f"invalid runtime name {name!r}: use 1-40 lower-case letters, digits, "
                            "'.', '_' or '-', starting with a letter or digit")
    return name


@dataclass
class Runtime:
    """One runtime's record."""

    name: str
    base_python: str  # the interpreter its builds were made from
    preload: list[str] = field(default_factory=list)  # modules its fork servers import
    # "installed": what it installs (modules.py, the default), "given": --preload's, "none"
    # (a record from before the default is what --preload gave: "given")
    preload_from: str = "given"
    preload_modules: dict[str, dict] = field(default_factory=dict)  # name: modules.Module
    preload_skipped: dict[str, str] = field(default_factory=dict)  # installed, not preloaded
    build: int = 0  # the build new kernels run on
    kernelspec: str = ""  # the directory of its kernelspec
    created: str = ""
    updated: str = ""
    installer: str = ""  # uv or pip, as used for the current build
    source: str = ""  # the operator's requirements file, read again by an update without one

    @property
    def directory(self) -> Path:
        """The runtime's own directory."""
        return root() / self.name

    @property
    def kernel_name(self) -> str:
        """The name of its kernelspec."""
        return kernel_name(self.name)

    @property
    def requirements(self) -> Path:
        """The operator's requirements file, as last given to create or update."""
        return self.directory / "requirements.txt"

    def build_dir(self, build: int | None = None) -> Path:
        """The virtual environment of a build (the current one by default)."""
        return self.directory / "builds" / str(self.build if build is None else build)

    def python(self, build: int | None = None) -> Path:
        """The interpreter kernels of a build run (the current one by default)."""
        return self.build_dir(build) / "bin" / "python"

    def builds(self) -> list[int]:
        """Every build still on disk, oldest first."""
        builds = self.directory / "builds"
        return sorted(int(entry.name) for entry in builds.iterdir() if entry.name.isdigit()) \
            if builds.is_dir() else []

    def frozen(self, build: int | None = None) -> list[str]:
        """The resolved requirements of a build, one `name==version` (or `-e path`) per line."""
        path = self.build_dir(build) / "frozen.txt"
        try:
            return [line for line in path.read_text().splitlines()
                    if line.strip() and not line.startswith("#")]  # pip freeze's notes
        except OSError:
            return []

    def save(self) -> None:
        """Write the record (atomically: a reader never sees half of it)."""
        path = self.directory / RECORD
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(temporary, path)

    def as_dict(self) -> dict[str, object]:
        """The record plus where things are and what is installed, for `runtime show`."""
        return {**asdict(self), "kernel_name": self.kernel_name,
                "directory": str(self.directory), "python": str(self.python()),
                "requirements": self.requirements.read_text().splitlines()
                if self.requirements.is_file() else [],
                "packages": self.frozen(), "builds": self.builds()}


def kernel_name(name: str) -> str:
    """The kernelspec name of runtime NAME."""
    return f"sandbox-{name}"


def names() -> list[str]:
    """The names of every runtime, sorted."""
    base = root()
    if not base.is_dir():
        return []
    return sorted(entry.name for entry in base.iterdir() if (entry / RECORD).is_file())


def find(name: str) -> Runtime:
    """The runtime NAME, or RuntimesError naming the ones there are."""
    path = root() / check_name(name) / RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        known = ", ".join(names()) or "none"
        raise RuntimesError(f"no runtime named {name!r} in {root()} (runtimes there: {known}); "
                            f"`sandbox-kernel runtime create {name} -r requirements.txt` "
                            "builds one") from None
    except (OSError, ValueError) as exc:
        raise RuntimesError(f"cannot read {path}: {exc}") from None
    return Runtime(**{key: value for key, value in record.items()
                      if key in Runtime.__dataclass_fields__})
