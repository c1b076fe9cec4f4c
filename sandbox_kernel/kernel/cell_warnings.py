"""Warnings name the cell they came from, as tracebacks do ("Cell In[3], line 2").

ipykernel compiles each cell into a file of its temporary directory (`.../ipykernel_NNN/NNN.py`,
for debuggers); IPython's tracebacks show such a file as its cell, but the warnings module shows
the path, which a user cannot find and a model cannot act on.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any


def load_ipython_extension(shell: Any) -> None:
    """Make the warnings module show a cell's file as the cell (once per process)."""
    original = warnings.formatwarning
    if getattr(original, "names_cells", False):
        return

    @functools.wraps(original)
    def formatwarning(message: Any, category: Any, filename: str, lineno: int,
                      line: str | None = None) -> str:
        text = original(message, category, filename, lineno, line)  # reads the cell's line
        cell = shell.compile._filename_map.get(filename)
        if cell is None:
            return text
        return text.replace(f"{filename}:{lineno}:", f"Cell In[{cell}], line {lineno}:", 1)

    formatwarning.names_cells = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning
