"""Files in a kernel's scratch directory, moved through the kernel itself.

The scratch is the kernel's private mount: a caller that followed paths (and symlinks) planted
there by user code would read and write with the caller's rights. So every operation is the
function in `kernel/file_ops.py` run inside the kernel, where it reaches only what user code
could. The service's files routes and the MCP server's file tools both call `file_op`, and each
checks the answer and words its own errors and limits; a listing is asked for and checked here
(`list_request`, `listed`), for both.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from .execution import Execution
from .sandbox import AsyncSandbox

LIST_LIMIT = 1000  # entries a listing returns at most
ENTRYPOINT = "__sandbox_files__"  # the function kernel/file_ops.py defines
# The kernel's own module (kernel/file_ops.py), sent as text: a ZMQ kernel defines it once.
CODE = (Path(__file__).parent.parent / "kernel" / "file_ops.py").read_text(encoding="utf-8")
_NOT_DEFINED = ("EntrypointNotFound", "SignatureMismatch")  # gone or replaced by user code
# Per kernel, the client (one per start or restart) whose kernel has the function defined.
_defined_for: weakref.WeakKeyDictionary[AsyncSandbox, Any] = weakref.WeakKeyDictionary()


async def file_op(sandbox: AsyncSandbox, inputs: dict[str, Any], timeout: float) -> Execution:
    """Run one file operation (`op`: write, read or list, with its inputs) in the kernel.

    The function is defined once per kernel (defining it costs the kernel more than calling
    it); a kernel that lost or replaced it gets it again.
    """
    defined = _defined_for.get(sandbox) is sandbox.client  # a restart replaces the client
    execution = await sandbox.run("" if defined else CODE, inputs, timeout=timeout,
                                  entrypoint=ENTRYPOINT)
    _defined_for[sandbox] = sandbox.client
    if defined and execution.error is not None and execution.error.name in _NOT_DEFINED:
        execution = await sandbox.run(CODE, inputs, timeout=timeout, entrypoint=ENTRYPOINT)
    return execution


Listing = tuple[list[tuple[str, int, float]], bool]  # (path, size, modified) of each; more?


def list_request(folder: str = ".", since: float = 0.0, limit: int = LIST_LIMIT
                 ) -> dict[str, Any]:
    """The inputs of the operation that lists the files under folder (hidden ones left out),
    changed since `since`, at most `limit` of them."""
    return {"op": "list", "path": folder, "limit": limit, "since": since}


def listed(result: Any, limit: int = LIST_LIMIT) -> Listing | None:
    """A listing's answer, checked (nothing the kernel answers is trusted): (path, size,
    modified) of each file, at most limit, and whether more exist; None if it is no listing."""
    found = result.get("files") if isinstance(result, dict) else None
    if not isinstance(found, list):
        return None
    files = [(str(entry[0]), int(entry[1]), float(entry[2])) for entry in found[:limit]
             if isinstance(entry, list) and len(entry) == 3
             and isinstance(entry[1], int) and isinstance(entry[2], (int, float))]
    return files, bool(result.get("more")) or len(found) > limit
