"""Jupyter Enterprise Gateway in a virtualenv of its own, for the tests (and `.ci/run`).

EG 3.3 pins jupyter-client<7, jupyter-server<2 and pyzmq<25, which cannot share an environment
with the kernel's. The venv lives in a cache directory keyed on EG's version and is reused
between runs; `python tests/eg_venv.py` creates it ahead of time (CI does), with EG's own
kubernetes launcher (launch_kubernetes.py, which renders the kernel pod's template): it is not
in EG's wheel, only in its source distribution, from which it is taken.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import subprocess
import sys
import tarfile
import tempfile
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


def kubernetes_launcher() -> Path:
    """EG's own etc/kernel-launchers/kubernetes/scripts/launch_kubernetes.py, kept in the venv's
    directory (run it with the venv's python: it needs EG's jinja2, yaml and kubernetes)."""
    python = ensure()
    script = venv_dir() / "kernel-launchers" / "kubernetes" / "launch_kubernetes.py"
    with open(venv_dir().parent / f".{venv_dir().name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not script.is_file():
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_bytes(_from_sdist(python, "etc/kernel-launchers/kubernetes/scripts/"
                                                   "launch_kubernetes.py"))
    return script


def _from_sdist(python: Path, member: str) -> bytes:
    """One file of EG's source distribution, downloaded by the venv's pip."""
    with tempfile.TemporaryDirectory() as where:
        result = subprocess.run(
            [str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "-d", where, f"jupyter_enterprise_gateway=={EG_VERSION}"],
            capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        archives = list(Path(where).glob(f"jupyter_enterprise_gateway-{EG_VERSION}.tar.gz"))
        if result.returncode != 0 or not archives:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"pip could not download EG {EG_VERSION}'s source distribution: "
                               f"{' / '.join(tail)}")
        with tarfile.open(archives[0]) as archive:
            found = archive.extractfile(f"jupyter_enterprise_gateway-{EG_VERSION}/{member}")
            if found is None:
                raise RuntimeError(f"EG {EG_VERSION}'s source distribution has no {member}")
            return found.read()


if __name__ == "__main__":
    print(ensure())
    print(kubernetes_launcher())
