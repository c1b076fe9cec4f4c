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
from ..client.files import file_op

LIST_LIMIT = 1000  # entries list_files returns at most
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
    result = await _call(sandbox, {"op": "read", "path": relative(path), "limit": limit})
    data = result.get("data")
    if not isinstance(data, str) or len(data) > 4 * (limit // 3 + 1):
        raise FileError(f"{path} is larger than this server returns ({limit:,} bytes): read "
                        "the part you need with run_python")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        raise FileError("the sandbox's answer was not a file") from None


async def listing(sandbox: AsyncSandbox, path: str = ".", since: float = 0.0,
                  limit: int = LIST_LIMIT) -> tuple[list[tuple[str, int, float]], bool]:
    """Files under path (hidden ones skipped) changed since `since`; and whether more exist."""
    folder = "." if path in ("", ".") else relative(path)
    result = await _call(sandbox, {"op": "list", "path": folder, "limit": limit,
                                   "since": since})
    found = result.get("files")
    if not isinstance(found, list):
        raise FileError("the sandbox did not answer the file listing")
    files = [(str(entry[0]), int(entry[1]), float(entry[2])) for entry in found[:limit]
             if isinstance(entry, list) and len(entry) == 3
             and isinstance(entry[1], int) and isinstance(entry[2], (int, float))]
    return files, bool(result.get("more")) or len(found) > limit
