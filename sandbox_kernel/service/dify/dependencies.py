"""dify-sandbox's reading of a requirements file, for `/v1/sandbox/dependencies`.

dify-sandbox lists the lines of its python-requirements.txt as {name, version}: the text before
the first of `==`, `>=`, `<=`, `~=` and the text after it, or the whole line and "" when none
is there. Lines it would list as names (blank ones, comments, pip options such as
--find-links) are left out here: they name no package.
"""

from __future__ import annotations

_DELIMITERS = ("==", ">=", "<=", "~=")


def parse(line: str) -> tuple[str, str]:
    """(name, version) of one requirement line, as dify-sandbox splits it."""
    for delimiter in _DELIMITERS:
        if delimiter in line:
            name, _, rest = line.partition(delimiter)
            return name, rest.split(delimiter)[0]
    return line, ""


def listed(requirements: str) -> list[dict[str, str]]:
    """The packages a requirements file names, in its order."""
    found = []
    for raw in requirements.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        line = raw.strip()
        if not line or line.startswith(("#", "-")):
            continue
        name, version = parse(line)
        found.append({"name": name, "version": version})
    return found
