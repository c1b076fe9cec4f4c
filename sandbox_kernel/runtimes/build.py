"""Building one runtime environment: a virtual environment, its packages, its frozen record.

The installer is `uv` where it is on PATH (much faster at resolving and linking), `pip`
otherwise; both run as subprocesses of the operator's command, outside any sandbox, and their
output goes to the operator's terminal. The sandbox package itself is installed from where this
one came from (its PEP 610 direct_url.json: a source tree, a wheel file) or, failing that, from
the index at this version, so kernels run the same sandbox code as the host's.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

from . import modules
from .modules import Preloads
from .store import RuntimesError

DISTRIBUTION = "sandbox-kernel"


def installer() -> str:
    """`uv` when it is on PATH, else `pip`."""
    return "uv" if shutil.which("uv") else "pip"


def sandbox_requirement() -> list[str]:
    """Installer arguments that install this very sandbox package into another environment."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return [str(Path(__file__).resolve().parents[2])]
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    url = urlparse(direct.get("url", ""))
    if url.scheme == "file":
        path = unquote(url.path)
        editable = direct.get("dir_info", {}).get("editable", False)
        return ["-e", path] if editable else [path]
    return [f"{DISTRIBUTION}=={dist.version}"]


def _run(command: list[str], what: str) -> None:
    """Run an installer step with its output on our stderr, or RuntimesError saying what failed."""
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=sys.stderr, check=False)
    except OSError as exc:
        raise RuntimesError(f"{what} failed: cannot run {command[0]}: {exc.strerror}") from None
    if done.returncode:
        raise RuntimesError(f"{what} failed ({Path(command[0]).name} exited with "
                            f"{done.returncode}; its output is above)")


def make_environment(base_python: str, target: Path, tool: str) -> Path:
    """A new virtual environment at target from base_python; its interpreter."""
    if tool == "uv":
        _run(["uv", "venv", "--quiet", "--seed", "--python", base_python, str(target)],
             "creating the virtual environment")
    else:
        _run([base_python, "-m", "venv", str(target)], "creating the virtual environment "
             "(on Debian and Ubuntu the python3-venv package provides venv)")
    return target / "bin" / "python"


def install(python: Path, requirements: Path, tool: str) -> None:
    """Install the requirements file and the sandbox package into the environment of python."""
    packages = ["-r", str(requirements), *sandbox_requirement()]
    if tool == "uv":
        command = ["uv", "pip", "install", "--python", str(python), *packages]
    else:
        command = [str(python), "-m", "pip", "install", "--disable-pip-version-check",
                   "--no-input", "--progress-bar", "off", *packages]
    _run(command, f"installing {requirements} into {python.parent.parent}")


def freeze(python: Path, tool: str) -> list[str]:
    """The environment's installed packages in `pip freeze` form."""
    command = (["uv", "pip", "freeze", "--python", str(python)] if tool == "uv"
               else [str(python), "-m", "pip", "freeze", "--disable-pip-version-check"])
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimesError(f"listing the packages of {python.parent.parent} failed: "
                            f"{done.stderr.strip()}")
    return [line for line in done.stdout.splitlines() if line.strip()]


def build(base_python: str, requirements: Path, target: Path,
          preload: list[str] | None) -> tuple[str, Preloads]:
    """Build the environment at target (removed again on failure); the installer used and what
    the build preloads (modules.py: the modules given, or by default, None, what it installs)."""
    tool = installer()
    try:
        python = make_environment(base_python, target, tool)
        install(python, requirements, tool)
        preloads = modules.preloads(python, preload)
        frozen = freeze(python, tool)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    (target / "frozen.txt").write_text("\n".join(frozen) + "\n")
    return tool, preloads
