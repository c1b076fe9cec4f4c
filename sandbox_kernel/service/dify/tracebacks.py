"""A Python node's error as Dify's users see it from dify-sandbox: the user's frames, the error.

The kernel reports an uncaught exception as IPython formats it: a rule, a header, one entry per
frame ("Cell In[1], line 5, in main(x)" and a window of numbered source lines, the current one
marked "---->"), the error line. dify-sandbox's process prints Python's own traceback instead,
and its frames are the user's: Dify's runner around the node's code (the inputs decoded from
base64, the call of main(), the <<RESULT>> print) is what users never wrote. Here each frame
becomes Python's two lines ('File "<string>", line 5, in main' and the current source line) and
the frames of Dify's runner are left out, once the runner is recognised by its fixed tail.
"""

from __future__ import annotations

import re

SOURCE_NAME = '"<string>"'  # dify-sandbox exec()s the code: its frames are File "<string>"
# The start of what Dify's Python3 and Jinja2 transformers put after the user's part.
_PYTHON_TAIL = re.compile(r"\n\s*import json\s*\n\s*from base64 import b64decode\s*\n"
                          r"(?:\s*#[^\n]*\n)*\s*inputs_obj = json\.loads\(b64decode\(")
_JINJA2_HEAD = re.compile(r"\A\s*(?:#[^\n]*\n\s*)?def main\(\*\*inputs\):\s*\n\s*import jinja2\n")
_CELL = re.compile(r"^Cell In\[\d+\], line (\d+)(?:, in ([^(\s]+))?")
_FILE = re.compile(r"^File (.+):(\d+)(?:, in ([^(\s]+))?")
_CURRENT = re.compile(r"^-*> +\d+ (.*)$")
_SOURCE = re.compile(r"^(?:-*>| ) *(?:\d+(?: |$)|\(\.\.\.\))")  # the frame's numbered window
_NO_SOURCE = "Could not get source"
_RULE = re.compile(r"^-{20,}$")
_HEADER = re.compile(r"^\S+\s+Traceback \(most recent call last\)$")


def user_lines(code: str) -> int | None:
    """How many of code's lines are the user's when code is Dify's runner, else None.

    0 for the Jinja2 runner: every line is the runner's, the template's frames are jinja2's.
    """
    if _JINJA2_HEAD.match(code):
        return 0
    tail = _PYTHON_TAIL.search(code)
    return None if tail is None else code.count("\n", 0, tail.start()) + 1


def plain(entries: list[str], users: int | None) -> str:
    """IPython's traceback entries as Python's traceback, without the runner's frames."""
    lines = "\n".join(entry.rstrip("\n") for entry in entries).split("\n")
    shown: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if _RULE.match(line):
            continue
        if _HEADER.match(line):
            shown.append("Traceback (most recent call last):")
        elif _CELL.match(line) or _FILE.match(line):
            end = index
            while end < len(lines) and _SOURCE.match(lines[end]):
                end += 1
            shown += _frame(line, lines[index:end], users)
            while end < len(lines) and not lines[end].strip():  # IPython's space between
                end += 1
            index = end
        else:
            shown.append(_located(line))
    return "\n".join(shown).rstrip("\n") + "\n"


def _frame(location: str, window: list[str], users: int | None) -> list[str]:
    """One frame as Python's two lines; none when it is Dify's runner's."""
    cell, file = _CELL.match(location), _FILE.match(location)
    current = next((found.group(1).strip() for line in window
                    if (found := _CURRENT.match(line))), "")
    if _NO_SOURCE in current:  # IPython's placeholder (a jinja2 template's frame): Python's none
        current = ""
    if cell is not None:
        number = int(cell.group(1))
        if users is not None and number > users:
            return []  # Dify's runner
        where = f"  File {SOURCE_NAME}, line {number}, in {cell.group(2) or '<module>'}"
    else:
        assert file is not None
        where = f'  File "{file.group(1)}", line {file.group(2)}, in {file.group(3) or "<module>"}'
    return [where, f"    {current}"] if current else [where]


def _located(line: str) -> str:
    """A SyntaxError's "Cell In[1], line 1" as Python's 'File "<string>", line 1'."""
    cell = _CELL.match(line.strip())
    return f"  File {SOURCE_NAME}, line {cell.group(1)}" if cell is not None else line
