"""Files in a session's scratch directory, moved through the session's own kernel.

Not through the scratch directory from outside (client/files.py says why): the operation runs
in the kernel. This module keeps the service's own part: the routes, paths checked before they
are sent, the size limit, the kernel's answer checked again, errors as HTTP statuses.
"""

from __future__ import annotations

import base64
import posixpath
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, HTTPException, Query, Request
from starlette.responses import Response

from ...client.files import file_op, list_request, listed
from ...hosting.fresh import RunRecord, bounded
from ...hosting.keys import ApiKey
from ...hosting.sessions import SessionError
from ..core import Service
from ..deps import Key, ServiceDep, session_of
from ..openapi import UPLOAD_BODY
from ..validation import sendable
from .schemas import FileListShape, FileShape

router = APIRouter()
FILE_TIMEOUT = 60.0  # seconds a file transfer may take inside the kernel
_FILE_ERRORS = {"NotADirectoryError": 400, "PermissionError": 403, "ValueError": 413,
                "FileExistsError": 409}


def scratch_path(path: str, session_id: str, folder: bool = False) -> str:
    """A relative path inside the scratch directory, or 400; with folder, "." (the scratch
    itself) too. A file's path that names a folder ("", ".", "data/") is told where the
    folder's listing is."""
    if not folder and (not path or path.endswith("/") or posixpath.normpath(path) == "."):
        raise _a_folder(session_id, path)
    if not path or "\x00" in path or len(path) > 1024:
        raise HTTPException(400, "the file path must be 1-1024 characters without NUL")
    try:
        sendable(path)
    except ValueError as exc:
        raise HTTPException(400, f"the file path {exc}") from None
    normal = posixpath.normpath(path)
    if path.startswith("/") or normal.startswith("..") or ".." in path.split("/"):
        raise HTTPException(400, f"{path!r} is not a path inside the session's scratch "
                            "directory: give it relative, without '..'")
    return normal


def _a_folder(session_id: str, path: str) -> HTTPException:
    """400 for a folder where a file was meant, pointing at the folder's listing."""
    normal = posixpath.normpath(path) if path else "."
    shown = "the scratch directory" if normal == "." else repr(path)
    query = "" if normal == "." else f"?path={quote(normal)}"
    return HTTPException(400, f"{shown} is a folder, not a file: name a file in it (GET "
                         f"/api/v1/sessions/{session_id}/files{query} lists them)")


async def _file_op(request: Request, service: Service, key: ApiKey, session_id: str,
                   inputs: dict) -> dict:
    session = await session_of(request, service, key, session_id)
    timeout = min(service.config.max_timeout, FILE_TIMEOUT)
    try:
        async with service.sessions.using(session) as sandbox:
            execution, lost = await bounded(
                file_op(sandbox, inputs, timeout),
                timeout, 2 * service.config.kernel_grace + service.restart_allowance,
                RunRecord(), service.runner.stopping)
            if lost:
                service.sessions.mark_dead(session, "it did not stop after its time limit")
    except SessionError:  # busy or gone: the app's handler answers it
        raise
    except Exception as exc:
        # Deleted or culled while the operation ran, or its kernel's restart failed: the
        # session cannot be trusted to work again.
        if session.dead is None:
            service.sessions.mark_dead(session, f"the connection to its kernel failed ({exc})")
        raise SessionError(410, f"session {session.id}'s kernel is gone: {session.dead}",
                           "gone", session=session.id, why=session.dead) from None
    if execution.error is not None:
        name, path = execution.error.name, str(inputs.get("path"))
        if name == "IsADirectoryError":
            raise _a_folder(session.id, path)
        if name == "FileNotFoundError":  # the kernel's text names the host's path: not said
            raise HTTPException(404, f"there is no file {path!r} in the session's scratch "
                                f"directory (GET /api/v1/sessions/{session.id}/files lists "
                                "them)")
        text = f"{name}: {execution.error.value}"
        raise HTTPException(_FILE_ERRORS.get(name, 500),
                            text.encode("utf-8", "replace").decode("utf-8"))
    if not isinstance(execution.result, dict):
        raise HTTPException(502, "the kernel did not answer the file operation")
    return execution.result


@router.get("/sessions/{session_id}/files", response_model=FileListShape,
            summary="List the files in the scratch, or in one folder of it (hidden ones left "
            "out); GET files/PATH downloads one")
async def list_files(session_id: str, request: Request, key: Key, service: ServiceDep,
                     path: Annotated[str, Query(description="A folder in the scratch directory "
                                                "(default: all of it).")] = ".") -> Any:
    """The files under a folder of the session's working directory, with their sizes and
    modification times; `truncated` when there were more than LIST_LIMIT."""
    folder = "." if path in ("", ".") else scratch_path(path, session_id, folder=True)
    found = listed(await _file_op(request, service, key, session_id, list_request(folder)))
    if found is None:
        raise HTTPException(502, "the kernel did not answer the file listing")
    files, more = found
    return {"files": [{"path": name, "size": size, "modified": modified}
                      for name, size, modified in files], "truncated": more}


@router.put("/sessions/{session_id}/files/{path:path}", status_code=201,
            response_model=FileShape, summary="Upload a file (the raw body) to the scratch",
            openapi_extra=UPLOAD_BODY)
async def upload(session_id: str, path: str, request: Request, key: Key,
                 service: ServiceDep) -> Any:
    """Write the request's body to a file in the session's working directory."""
    limit = service.config.max_file_bytes
    relative = scratch_path(path, session_id)
    content = bytearray()
    async for chunk in request.stream():
        content += chunk
        if len(content) > limit:
            raise HTTPException(413, f"the file is larger than {limit} bytes (--max-file)")
    result = await _file_op(request, service, key, session_id, {
        "op": "write", "path": relative, "data": base64.b64encode(bytes(content)).decode()})
    return {"path": relative, "size": int(result.get("size", -1))}


@router.get("/sessions/{session_id}/files/{path:path}", summary="Download a file from the scratch",
            responses={200: {"content": {"application/octet-stream": {}}}})
async def download(session_id: str, path: str, request: Request, key: Key,
                   service: ServiceDep) -> Response:
    """The content of a file in the session's working directory."""
    limit = service.config.max_file_bytes
    result = await _file_op(request, service, key, session_id,
                            {"op": "read", "path": scratch_path(path, session_id),
                             "limit": limit})
    data = result.get("data")
    # Never trust the kernel: its answer is checked here, not only by the code that made it.
    if not isinstance(data, str) or len(data) > 4 * (limit // 3 + 1):
        raise HTTPException(502, "the kernel's answer is not a file within the size limit")
    try:
        content = base64.b64decode(data, validate=True)
    except ValueError:
        raise HTTPException(502, "the kernel's answer is not base64") from None
    return Response(content, media_type="application/octet-stream")
