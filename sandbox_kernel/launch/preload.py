"""Whether the modules a face was told to preload are there, checked once before it starts.

A fork server that cannot import a module it must preload does not start, and kernels then
start cold, each one slow, while the code they run meets `No module named ...` anyway: a
missing preload is a mistake in the command line, said once, before any kernel starts.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

# Run with the kernels' Python (-I, as kernels are): the names of the modules it cannot find,
# one a line. find_spec imports nothing but a dotted name's parents.
_PROBE = """import importlib.util, sys
for name in sys.argv[1:]:
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        print(name)
"""


def missing(python: str, modules: Sequence[str]) -> list[str]:
    """The modules of `modules` that `python` cannot import."""
    if not modules:
        return []
    done = subprocess.run([python, "-I", "-c", _PROBE, *modules],  # noqa: S603 (our argv)
                          capture_output=True, text=True, timeout=120, check=False)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"{python} could not be asked which modules it has: {last}")
    return done.stdout.split()


def refusal(python: str, modules: Sequence[str]) -> str | None:
    """Why these preloads cannot be used with `python` (the fix included), or None."""
    absent = missing(python, modules)
    if not absent:
        return None
    names, them = ", ".join(absent), "them" if len(absent) > 1 else "it"
    return (f"--preload names {names}, which {python} cannot import (kernels would start cold "
            f"and their code fail on the import): install {them} into that environment "
            f"({python} -m pip install {' '.join(absent)}, or the package that provides {them}), "
            f"or drop {names} from --preload")
