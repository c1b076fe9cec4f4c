"""This checkout installed with one extra alone, in a virtualenv of its own, for
tests/test_extras.py (and `.ci/run`).

The test venv installs every extra, so it cannot show that an extra works by itself. Each venv
here is `pip install -e` of the checkout with one extra (or none: "base"), cached under the real
user's ~/.cache/sandbox-kernel/extras-<extra>-<hash>, the hash taken over the pins it installs
(the project's dependencies and the extra's, its `sandbox-kernel[...]` references followed) and
Python's version, so a changed pin makes a new venv. A cached venv whose editable install points
at another checkout, or was made from another [project] table (scripts, entry points), is
re-installed without its dependencies, which takes seconds. `python tests/extras_venv.py`
builds them all ahead of time (CI does); `python tests/extras_venv.py mcp` builds one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pwd
import re
import subprocess
import sys
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

CHECKOUT = Path(__file__).resolve().parent.parent
BASE = "base"  # no extra: `pip install -e .`
# Every extra a user installs for a command of its own ([test] and [bench] are the project's own).
EXTRAS = (BASE, "examples", "mcp", "server", "dify", "eg", "lab", "gateway")
# The agent frameworks' extras (sandbox_kernel/frameworks/): tests/test_frameworks.py drives each
# framework in its venv; their pins conflict with [test]'s, so none is in it.
FRAMEWORKS = ("smolagents", "autogen", "llamaindex", "langchain", "pydantic-ai",
              "openai-agents")
INSTALL_TIMEOUT = 1200  # seconds; a cold install on a slow machine takes minutes
STAMP = ".sandbox-kernel-install"  # in the venv: what its editable install was made from
_SELF = re.compile(r"sandbox-kernel\[([\w,-]+)\]")


def _project() -> dict:
    with (CHECKOUT / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)


def requirements(extra: str) -> list[str]:
    """The pins `pip install -e '.[extra]'` asks for, self-references followed."""
    project = _project()["project"]
    found, pending, seen = list(project["dependencies"]), [] if extra == BASE else [extra], set()
    while pending:
        name = pending.pop()
        if name not in seen:
            seen.add(name)
            for requirement in project["optional-dependencies"][name]:
                nested = _SELF.fullmatch(requirement)
                pending += nested.group(1).split(",") if nested else []
                found += [] if nested else [requirement]
    return sorted(set(found))


def venv_dir(extra: str) -> Path:
    """~/.cache/sandbox-kernel/extras-<extra>-<hash of its pins> of the real user (the tests
    point $HOME at a temp dir), or under $SANDBOX_KERNEL_EXTRAS_CACHE."""
    key = json.dumps([list(sys.version_info[:2]), requirements(extra)])
    name = f"extras-{extra}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    given = os.environ.get("SANDBOX_KERNEL_EXTRAS_CACHE")
    if given:
        return Path(given) / name
    return Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "sandbox-kernel" / name


def _stamp() -> str:
    """What an editable install depends on beyond its pins: where the checkout is, and its
    pyproject.toml's [project] and [build-system] (console scripts, entry points; not the tools'
    settings, whose edits would cost every venv a re-install)."""
    wanted = {key: _project().get(key) for key in ("project", "build-system")}
    digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()
    return f"{CHECKOUT}\n{digest}\n"


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", *args],
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip install {' '.join(args)} failed in {python.parent.parent}: "
                           f"{' / '.join(tail)}")


def ensure(extra: str) -> Path:
    """The python of extra's venv, building it first if needed (RuntimeError with pip's reason
    when it cannot be)."""
    root = venv_dir(extra)
    python, stamp = root / "bin" / "python", root / STAMP
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others wait and reuse it
        if python.exists() and stamp.exists():
            if stamp.read_text() != _stamp():
                _pip(python, "--no-deps", "-e", str(CHECKOUT))
                stamp.write_text(_stamp())
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True,
                       timeout=300)
        _pip(python, "-e", str(CHECKOUT) if extra == BASE else f"{CHECKOUT}[{extra}]")
        stamp.write_text(_stamp())  # last: a build cut short is built again
    return python


if __name__ == "__main__":
    for wanted in sys.argv[1:] or (*EXTRAS, *FRAMEWORKS):
        started = time.monotonic()
        print(ensure(wanted), f"({time.monotonic() - started:.0f} s)", flush=True)
