"""The command that adds an extra to this install, for the faces' errors when one is missing.

The package is on no index: it is installed from its checkout (editable) or from a wheel built
there, so "pip install 'sandbox-kernel[server]'" would fail as written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import __version__


def install_hint(extra: str) -> str:
    """`pip install` of this install's source with `extra`, with this install's Python."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file():
        return f"{sys.executable} -m pip install -e '{checkout}[{extra}]'"
    return (f"{sys.executable} -m pip install 'sandbox_kernel-{__version__}-py3-none-any.whl"
            f"[{extra}]' (the wheel this was installed from)")
