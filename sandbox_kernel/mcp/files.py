"""Files in a kernel's scratch directory, moved through the kernel itself.

As the service's files API does (service/native/files.py), every operation is a small function run
inside the session's own kernel with the caller's path: the scratch is the kernel's private
mount, and a server that followed paths (and symlinks) planted there by user code would act
with the server's rights. Inside the kernel an operation reaches only what user code could.
Nothing the kernel answers is trusted: sizes and shapes are checked again here.
"""

from __future__ import annotations

import base64
import posixpath
import weakref
from pathlib import Path
from typing import Any

from ..client import AsyncSandbox, Execution

HELPER = "__sandbox_mcp_files__"
LIST_LIMIT = 1000  # entries list_files returns at most
HELPER_TIMEOUT = 30.0

_CODE = Path(__file__).with_name("files_in_kernel.py").read_text()


_NOT_DEFINED = ("EntrypointNotFound", "SignatureMismatch")
# Per kernel, the client (one per start or restart) whose kernel has the helper defined.
_defined_for: weakref.WeakKeyDictionary[AsyncSandbox, Any] = weakref.WeakKeyDictionary()


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
    # The helper is defined once per kernel (defining it costs the kernel more than calling
    # it); a kernel that lost or replaced it gets it again.
    defined = _defined_for.get(sandbox) is sandbox.client  # a restart replaces the client
    execution: Execution = await sandbox.run("" if defined else _CODE, inputs,
                                             timeout=HELPER_TIMEOUT, entrypoint=HELPER)
    _defined_for[sandbox] = sandbox.client
    if defined and execution.error is not None and execution.error.name in _NOT_DEFINED:
        execution = await sandbox.run(_CODE, inputs, timeout=HELPER_TIMEOUT, entrypoint=HELPER)
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
