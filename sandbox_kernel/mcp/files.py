"""Files in a session's scratch directory for a model, moved through the session's kernel.

As the service's files API does, every operation runs inside the kernel (client/files.py says
why); this module keeps the MCP server's own part: paths checked before they are sent, the
answers checked again (nothing the kernel answers is trusted), errors worded for a model.
"""

from __future__ import annotations

import base64
import posixpath
from typing import Any

from ..client import AsyncSandbox
from ..client.files import LIST_LIMIT, Listing, file_op, list_request, listed

EMBED_TOTAL = 4  # files a fresh run wrote come back embedded up to this many times embed_bytes
HELPER_TIMEOUT = 30.0


class FileError(Exception):
    """A file operation that failed; the message is for a model."""


def relative(path: str) -> str:
    """A path inside the working directory, normalised; FileError if it leads elsewhere."""
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 1024:
        raise FileError("give the file's path (1-1024 characters) relative to the working "
                        "directory")
    normal = posixpath.normpath(path)
    if path.startswith("/") or normal.startswith("..") or ".." in path.split("/"):
        raise FileError(f"{path!r} is not inside the working directory: give a relative path "
                        "without '..' (list_files shows what is there)")
    return normal


async def _call(sandbox: AsyncSandbox, inputs: dict[str, Any]) -> dict[str, Any]:
    execution = await file_op(sandbox, inputs, HELPER_TIMEOUT)
    if execution.error is not None:
        error = execution.error
        what = {"FileNotFoundError": "there is no such file",
                "IsADirectoryError": "that is a folder, not a file",
                "NotADirectoryError": "a part of that path is a file, not a folder",
                "PermissionError": "that path is outside the working directory or not "
                                   "readable"}.get(error.name)
        raise FileError(f"{inputs.get('path')}: {what}" if what else
                        f"{error.name}: {error.value}")
    if not isinstance(execution.result, dict):
        raise FileError("the sandbox did not answer the file operation")
    return execution.result


async def write(sandbox: AsyncSandbox, path: str, content: bytes) -> int:
    """Write content to path in the scratch; its size as the kernel reports it."""
    result = await _call(sandbox, {"op": "write", "path": relative(path),
                                   "data": base64.b64encode(content).decode()})
    size = result.get("size")
    return size if isinstance(size, int) else len(content)


async def read(sandbox: AsyncSandbox, path: str, limit: int) -> bytes:
    """The bytes of path in the scratch, at most limit of them (FileError above it)."""
    return _content(await _call(sandbox, {"op": "read", "path": relative(path),
                                          "limit": limit}), path, limit)


def _content(result: Any, path: str, limit: int) -> bytes:
    """The bytes of a read's answer, checked (at most limit of them)."""
    data = result.get("data") if isinstance(result, dict) else None
    if not isinstance(data, str) or len(data) > 4 * (limit // 3 + 1):
        raise FileError(f"{path} is larger than this server returns ({limit:,} bytes): read "
                        "the part you need with run_python")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        raise FileError("the sandbox's answer was not a file") from None


async def listing(sandbox: AsyncSandbox, path: str = ".", since: float = 0.0,
                  limit: int = LIST_LIMIT) -> Listing:
    """Files under path (hidden ones skipped) changed since `since`; and whether more exist."""
    folder = "." if path in ("", ".") else relative(path)
    return _listed(await _call(sandbox, list_request(folder, since, limit)), limit)


def _listed(result: dict[str, Any], limit: int) -> Listing:
    """A listing's answer, checked (client/files.py)."""
    found = listed(result, limit)
    if found is None:
        raise FileError("the sandbox did not answer the file listing")
    return found


def keep_request(since: float, limit: int, embed: int) -> dict[str, Any]:
    """The inputs of the operation that lists the files a run wrote (changed since `since`,
    at most `limit`) and reads those up to `embed` bytes, EMBED_TOTAL times that in all."""
    return {"op": "keep", "path": ".", "limit": limit, "since": since, "embed": embed,
            "budget": EMBED_TOTAL * embed}


def kept(result: Any, limit: int, embed: int
         ) -> tuple[list[tuple[str, int, float]], dict[str, bytes]]:
    """The files a keep operation listed and the bytes of those it read, checked: no file
    above `embed` bytes, none beyond the budget, none it did not list."""
    if isinstance(result, dict) and isinstance(result.get("error"), str):
        raise FileError(result["error"][:500])  # the kernel's own, as a run's would be
    if not isinstance(result, dict) or not isinstance(result.get("embedded"), dict):
        raise FileError("the sandbox did not answer which files the run wrote")
    written, _ = _listed(result, limit)
    sizes = {path: size for path, size, _ in written}
    embedded, budget = {}, EMBED_TOTAL * embed
    for path, answer in result["embedded"].items():
        if path in sizes and sizes[path] <= min(embed, budget):
            embedded[path] = _content(answer, path, embed)
            budget -= len(embedded[path])
    return written, embedded


async def keep(sandbox: AsyncSandbox, since: float, limit: int, embed: int
               ) -> tuple[list[tuple[str, int, float]], dict[str, bytes]]:
    """The files a run in this kernel wrote, and the small ones' bytes (a fresh kernel's
    scratch ends with it)."""
    return kept(await _call(sandbox, keep_request(since, limit, embed)), limit, embed)
