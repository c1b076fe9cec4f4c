"""matplotlib's font list, built once per fork server instead of in every kernel's scratch.

matplotlib keeps the fonts it found in `fontlist-v*.json` under MPLCONFIGDIR, which for a kernel
is inside its fresh scratch: every kernel would rebuild it on its first `import matplotlib`
(a scan of the system's fonts, and `fc-list`, which the sandbox refuses to start). The fork
server builds it once in its own MPLCONFIGDIR, in a subprocess (the server must not import
matplotlib's threads and state), and each kernel it forks starts with a copy.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys

BUILD_TIMEOUT = 120.0  # seconds; a host with very many fonts


def font_lists(directory: str) -> list[str]:
    """The font lists matplotlib wrote in directory (one per matplotlib version)."""
    return sorted(glob.glob(os.path.join(glob.escape(directory), "fontlist-v*.json")))


def build(directory: str) -> bool:
    """Have matplotlib write its font list into directory unless one is there; True if there."""
    if not directory or importlib.util.find_spec("matplotlib") is None:
        return False
    if font_lists(directory):
        return True
    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:  # the server's own, unconfined environment: fc-list may run here
        subprocess.run([sys.executable, "-I", "-c", "import matplotlib.font_manager"],
                       env={**os.environ, "MPLCONFIGDIR": directory}, cwd=directory,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=BUILD_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(font_lists(directory))


def copy_into(source: str, target: str) -> None:
    """Give a kernel's MPLCONFIGDIR (target) the server's font lists; quietly none if none."""
    copy_lists(font_lists(source) if source else [], target)


def copy_lists(lists: list[str], target: str) -> None:
    """Copy font lists already found (font_lists) into a kernel's MPLCONFIGDIR (target)."""
    if not lists or not target:
        return
    os.makedirs(target, mode=0o700, exist_ok=True)
    for path in lists:
        shutil.copyfile(path, os.path.join(target, os.path.basename(path)))
