"""Jupyter Enterprise Gateway in a virtualenv of its own, for the tests (and `.ci/run`).

EG 3.3 pins jupyter-client<7, jupyter-server<2 and pyzmq<25, which cannot share an environment
with the kernel's. The venv lives in a cache directory keyed on EG's version and is reused
between runs; `python tests/eg_venv.py` creates it ahead of time (CI does).
"""

from __future__ import annotations

import fcntl
import os
import pwd
import subprocess
import sys
from pathlib import Path

EG_VERSION = "3.3.0"
INSTALL_TIMEOUT = 1200  # seconds; a cold install on a slow machine takes several minutes


def venv_dir() -> Path:
    """$SANDBOX_KERNEL_EG_VENV, else ~/.cache/sandbox-kernel/eg-<version> of the real user."""
    given = os.environ.get("SANDBOX_KERNEL_EG_VENV")
    if given:
        return Path(given)
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)  # the tests point $HOME at a temp dir
    return home / ".cache" / "sandbox-kernel" / f"eg-{EG_VERSION}"


def _usable(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import enterprise_gateway, sys; "
         f"sys.exit(enterprise_gateway.__version__ != {EG_VERSION!r})"],
        capture_output=True, timeout=120)
    return probe.returncode == 0


def ensure() -> Path:
    """The venv's python, creating the venv first if needed; raises RuntimeError with pip's
    reason when EG cannot be installed."""
    root = venv_dir()
    python = root / "bin" / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one creator at a time; the others wait and reuse it
        if _usable(python):
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True,
                       timeout=300)
        result = subprocess.run(
            [str(python), "-m", "pip", "install", "-q",
             f"jupyter_enterprise_gateway=={EG_VERSION}"],
            capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        if result.returncode != 0 or not _usable(python):
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"pip could not install jupyter_enterprise_gateway=={EG_VERSION} "
                               f"into {root}: {' / '.join(tail)}")
    return python


if __name__ == "__main__":
    print(ensure())
