"""A session's user state, saved and loaded inside the sandboxed kernel (and only there).

The caller (Sandbox.snapshot and restore, client/sandbox.py) imports this module inside the
kernel and calls `__sandbox_snapshot__(op, ...)` with the main() convention; nothing outside a
sandbox runs its loading or unpickles what it makes (the client reads two of its constants).
A snapshot's payload is the tenant's own untrusted data: loading it here runs whatever it holds
with this kernel's confinement, as the tenant's code would.

What is saved: every name of the user namespace (IPython's own names left out), each pickled on
its own with cloudpickle (session functions, classes, lambdas and closures by value; library
objects by reference) at pickle protocol 5 with out-of-band buffers, so a numpy array's (and a
DataFrame's blocks') memory is sent as it lies, without a copy into the pickle; modules by name
and alias; the `%pip` packages by name and version (re-installed at restore through the same
`%pip`, so the same network policy); the scratch files within a size bound; the working
directory. A name that cannot be pickled is skipped with its reason, the rest saved. Names are
pickled one by one so that one bad name costs only itself, at save and at restore; the price is
that two names sharing one object come back as two copies.

cloudpickle was chosen by measurement (bench/results/snapshot.md): on the objects data work
holds it pickles faster than dill (a pure-Python pickler) and, unlike plain pickle, saves what a
session defines in `__main__`.

The payload moves between caller and kernel as binary ZMQ frames, as comms send theirs: the
kernel publishes it on IOPub in `sandbox_snapshot_chunk` messages (one buffer each, within the
caller's frame limit) during a `read` call, and a `write` call's request carries its chunks as
buffers. (As base64 in main() results it moved at ~20 MB/s: three JSON passes over each chunk.)

The payload: MAGIC, the index's length (8 bytes, big-endian), the index (JSON: names, files,
cwd, packages, the length of every part), then the parts (pickle streams, buffers, file
contents) one after another. Loading checks every length against the bytes it has.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import os
import pickle
import re
import socket
import stat
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

MAGIC = b"SKSNAP1\n"
_LENGTH = 8
DEFAULT_MAX_FILES = 64 * 2**20  # bytes of scratch files a snapshot keeps by default
# IPython's per-cell names (_, __, ___, _i, _ii, _iii, _4, _i4) and its history dicts.
_IPYTHON_NAME = re.compile(r"_{1,3}|_i{1,3}|_i?\d+|_[iod]h")
# Scratch entries (top level) that are the kernel's, not the session's: IPython's profile and
# the caches and settings libraries write to HOME. The session's packages are installed again.
_KERNEL_OWN = (".ipython", ".cache", ".config", ".local", ".jupyter")
CHUNK_MESSAGE = "sandbox_snapshot_chunk"  # IOPub: {"offset"}, the bytes as the one buffer
_OUTGOING: list[Any] = []  # [index bytes, parts...] of the snapshot being read
_INCOMING: list[bytearray] = []  # the payload being written


def __sandbox_snapshot__(op: str, **inputs: Any) -> dict[str, Any]:
    """One step of a snapshot or restore, as the caller asks for it."""
    return _OPS[op](**inputs)


# --- saving ----------------------------------------------------------------------------------


def _user_names(shell: Any) -> dict[str, Any]:
    """The session's own names: IPython's, dunders and this module's entry point left out."""
    hidden = shell.user_ns_hidden
    names = {}
    for name, value in shell.user_ns.items():
        if (name.startswith("__") and name.endswith("__")) or _IPYTHON_NAME.fullmatch(name):
            continue
        if name in hidden and hidden[name] is value:
            continue
        names[name] = value
    return names


def _unsaveable(value: Any) -> str | None:
    """Why a value of this kind cannot be saved at all (None: try it)."""
    if inspect.isgenerator(value) or inspect.isasyncgen(value) or inspect.iscoroutine(value):
        return (f"a {type(value).__name__} (its running frame cannot be saved): create it "
                "again after the restore")
    if isinstance(value, io.IOBase):
        where = getattr(value, "name", None)
        return (f"an open file{f' ({where})' if isinstance(where, str) else ''}: "
                "open it again after the restore")
    if isinstance(value, socket.socket):
        return "a socket (a connection cannot be saved): connect again after the restore"
    if isinstance(value, threading.Thread):
        return "a thread (a running thread cannot be saved): start it again after the restore"
    if isinstance(value, type(threading.Lock())) or isinstance(value, type(threading.RLock())):
        return "a lock (its holder cannot be saved): create it again after the restore"
    return None


def _pickled(value: Any) -> tuple[bytes, list[memoryview]]:
    """The pickle stream of one value and its out-of-band buffers (views, not copies)."""
    import cloudpickle

    buffers: list[memoryview] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        try:
            buffers.append(buffer.raw())
        except BufferError:  # not contiguous: pickled in-band instead
            return True
        return False

    stream = cloudpickle.dumps(value, protocol=5, buffer_callback=out_of_band)
    return stream, buffers


def _save_names(names: dict[str, Any], parts: list[Any], index: dict[str, Any],
                skipped: list[dict[str, str]]) -> list[str]:
    saved = []
    for name, value in names.items():
        if isinstance(value, types.ModuleType):
            index["names"].append({"name": name, "kind": "module", "module": value.__name__})
            saved.append(name)
            continue
        reason = _unsaveable(value)
        if reason is None:
            try:
                stream, buffers = _pickled(value)
            except Exception as exc:  # whatever the value's own pickling raised
                reason = f"cannot be saved: {type(exc).__name__}: {exc}"
        if reason is not None:
            skipped.append({"name": name, "reason": reason})
            continue
        first = len(parts)
        parts.append(stream)
        parts.extend(buffers)
        index["names"].append({"name": name, "kind": "pickle", "stream": first,
                               "buffers": list(range(first + 1, len(parts)))})
        saved.append(name)
    return saved


def _save_files(home: str, max_files: int, parts: list[Any], index: dict[str, Any],
                skipped: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The scratch's regular files, up to max_files bytes in all (links are not followed)."""
    from .pip import SESSION_DIR

    kept_out = {SESSION_DIR, *_KERNEL_OWN}
    files, total = [], 0
    for root, dirs, names in os.walk(home):
        if root == home:
            dirs[:] = [name for name in dirs if name not in kept_out]
            names = [name for name in names if name not in kept_out]
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            relative = os.path.relpath(full, home)
            info = os.lstat(full)
            if not stat.S_ISREG(info.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
                skipped.append({"name": f"file:{relative}", "reason": f"{kind}: not saved"})
                continue
            if total + info.st_size > max_files:
                skipped.append({"name": f"file:{relative}", "reason": (
                    f"{info.st_size} bytes, past the snapshot's bound of {max_files} bytes of "
                    "files (max_files raises it)")})
                continue
            try:
                with open(full, "rb") as file:
                    content = file.read(info.st_size + 1)
            except OSError as exc:
                skipped.append({"name": f"file:{relative}", "reason": f"unreadable: {exc}"})
                continue
            total += len(content)
            index["files"].append({"path": relative, "part": len(parts),
                                   "mode": stat.S_IMODE(info.st_mode)})
            parts.append(content)
            files.append({"path": relative, "size": len(content)})
    return files


def _take(max_files: int = DEFAULT_MAX_FILES) -> dict[str, Any]:
    """Make the snapshot (kept here until read) and return its manifest."""
    import cloudpickle
    from IPython import get_ipython

    from .pip import _installed, session_dir

    _drop()
    shell = get_ipython()
    home = os.path.realpath(os.path.expanduser("~"))
    parts: list[Any] = []
    skipped: list[dict[str, str]] = []
    packages = [{"name": name, "version": version}
                for name, version in sorted(_installed(session_dir(home)).items())]
    cwd = os.getcwd()
    inside = os.path.commonpath([home, cwd]) == home
    index: dict[str, Any] = {"names": [], "files": [], "packages": packages,
                             "cwd": os.path.relpath(cwd, home) if inside else cwd}
    saved = _save_names(_user_names(shell), parts, index, skipped)
    files = _save_files(home, max_files, parts, index, skipped)
    index["parts"] = [memoryview(part).nbytes for part in parts]
    head = json.dumps(index).encode()
    _OUTGOING[:] = [MAGIC + len(head).to_bytes(_LENGTH, "big") + head, *parts]
    return {"saved": saved, "skipped": skipped, "packages": packages, "files": files,
            "cwd": index["cwd"], "bytes": sum(memoryview(part).nbytes for part in _OUTGOING),
            "serializer": f"cloudpickle {cloudpickle.__version__}, pickle protocol 5 with "
                          "out-of-band buffers", "python": sys.version.split()[0]}


def _pieces(offset: int, size: int) -> list[memoryview]:
    """Views of size bytes of the payload from offset (the parts are read where they lie)."""
    pieces, skip = [], offset
    for part in _OUTGOING:
        view = memoryview(part).cast("B")
        if skip >= view.nbytes:
            skip -= view.nbytes
            continue
        piece = view[skip:skip + size]
        pieces.append(piece)
        size -= piece.nbytes
        skip = 0
        if size <= 0:
            break
    return pieces


def _read(offset: int, size: int, chunk: int) -> dict[str, Any]:
    """Publish size bytes of the payload from offset on IOPub, in messages of chunk bytes
    (each a binary buffer, as comms send theirs: no base64, no JSON)."""
    from IPython import get_ipython

    kernel = get_ipython().kernel
    parent = kernel.get_parent("shell")
    end = offset + size
    while offset < end:
        piece = b"".join(_pieces(offset, min(chunk, end - offset)))
        if not piece:
            break
        kernel.session.send(kernel.iopub_socket, CHUNK_MESSAGE, {"offset": offset},
                            parent=parent, buffers=[piece])
        offset += len(piece)
    return {"end": offset}


def _drop() -> dict[str, Any]:
    """Forget the snapshot made and the payload received (their memory goes back)."""
    _OUTGOING.clear()
    _INCOMING.clear()
    return {}


# --- loading ----------------------------------------------------------------------------------


class SnapshotRefused(Exception):
    """The payload is not a snapshot this kernel can load; the message says why."""

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of frames
        return [f"{type(self).__name__}: {self}"]


def _begin(size: int) -> dict[str, Any]:
    """Make room for a payload of size bytes (the kernel's memory limit bounds it)."""
    _drop()
    try:
        _INCOMING.append(bytearray(size))
    except MemoryError:
        raise SnapshotRefused(f"the snapshot's {size} bytes do not fit in this kernel's "
                              "memory: start it with a larger --memory-limit") from None
    return {}


def _write(offset: int) -> dict[str, Any]:
    """Put the request's binary buffers, one after another, at offset of the payload."""
    from IPython import get_ipython

    if not _INCOMING:
        raise SnapshotRefused("no snapshot is being received (begin comes first)")
    payload = _INCOMING[0]
    for buffer in get_ipython().kernel.get_parent("shell").get("buffers", []):
        chunk = memoryview(buffer).cast("B")
        if offset < 0 or offset + chunk.nbytes > len(payload):
            raise SnapshotRefused(f"bytes {offset}..{offset + chunk.nbytes} lie outside the "
                                  f"{len(payload)}-byte snapshot")
        payload[offset:offset + chunk.nbytes] = chunk
        offset += chunk.nbytes
    return {"end": offset}


def _parse(payload: memoryview) -> tuple[dict[str, Any], list[memoryview]]:
    """The index and the parts of a payload, every length checked against what is there."""
    if payload[:len(MAGIC)] != MAGIC:
        raise SnapshotRefused("not a sandbox-kernel snapshot (its first bytes are wrong)")
    start = len(MAGIC) + _LENGTH
    head = int.from_bytes(payload[len(MAGIC):start], "big")
    if head > payload.nbytes - start:
        raise SnapshotRefused(f"the index claims {head} bytes, the snapshot has "
                              f"{payload.nbytes - start} after its header")
    try:
        index = json.loads(bytes(payload[start:start + head]))
        lengths = [int(length) for length in index["parts"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotRefused(f"the snapshot's index is unreadable: {exc}") from None
    offset = start + head
    if any(length < 0 for length in lengths) or sum(lengths) != payload.nbytes - offset:
        raise SnapshotRefused(f"the index claims {sum(lengths)} bytes of parts, the snapshot "
                              f"holds {payload.nbytes - offset}")
    parts = []
    for length in lengths:
        parts.append(payload[offset:offset + length])
        offset += length
    return index, parts


def _install(packages: list[dict[str, str]], shell: Any, home: str,
             skipped: list[dict[str, str]]) -> list[str]:
    """Install the session's packages again through %pip's own path (the same policy)."""
    from .pip import _installed, install, session_dir

    have = _installed(session_dir(home))
    installed = []
    for package in packages:
        requirement = f"{package['name']}=={package['version']}"
        if have.get(package["name"]) != package["version"]:
            try:
                install(f"install {requirement}", shell.kernel.policy, home)
            except Exception as exc:  # PackageInstallError says why (the network policy)
                skipped.append({"name": f"package:{requirement}", "reason": str(exc)})
                continue
        installed.append(requirement)
    return installed


def _load_name(entry: dict[str, Any], parts: list[memoryview]) -> Any:
    if entry.get("kind") == "module":
        return importlib.import_module(str(entry["module"]))
    buffers = [parts[number] for number in entry["buffers"]]
    return pickle.loads(parts[entry["stream"]], buffers=buffers)  # noqa: S301  (the tenant's own, in its sandbox)


def _restore_files(index: dict[str, Any], parts: list[memoryview], home: str,
                   skipped: list[dict[str, str]]) -> list[str]:
    written = []
    for entry in index.get("files", []):
        path = str(entry["path"])
        target = os.path.realpath(os.path.join(home, path))
        if os.path.commonpath([home, target]) != home:
            skipped.append({"name": f"file:{path}", "reason": "leads outside the scratch"})
            continue
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            # The mode given at creation (the sandbox refuses chmod).
            mode = int(entry.get("mode", 0o600)) & 0o777
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
            with open(os.open(target, flags, mode), "wb") as file:
                file.write(parts[entry["part"]])
        except OSError as exc:
            skipped.append({"name": f"file:{path}", "reason": f"not written: {exc}"})
            continue
        written.append(path)
    return written


def _load(packages: bool = True) -> dict[str, Any]:
    """Load the received payload into this session: packages, files, cwd, then the names."""
    from IPython import get_ipython

    if not _INCOMING:
        raise SnapshotRefused("no snapshot was received (begin and write come first)")
    shell = get_ipython()
    home = os.path.realpath(os.path.expanduser("~"))
    index, parts = _parse(memoryview(_INCOMING[0]))
    skipped: list[dict[str, str]] = []
    installed = _install(index.get("packages", []), shell, home, skipped) if packages else []
    files = _restore_files(index, parts, home, skipped)
    cwd = os.path.join(home, str(index.get("cwd", ".")))
    try:
        os.chdir(cwd)
    except OSError as exc:
        skipped.append({"name": "cwd", "reason": f"cannot change to {cwd}: {exc}"})
    restored = []
    for entry in index.get("names", []):
        name = str(entry.get("name"))
        try:
            shell.user_ns[name] = _load_name(entry, parts)
        except Exception as exc:  # one name's failure costs only that name
            reason = (f"module not importable here: {exc}" if entry.get("kind") == "module"
                      else f"cannot be loaded: {type(exc).__name__}: {exc}")
            skipped.append({"name": name, "reason": reason})
            continue
        restored.append(name)
    _drop()  # the arrays keep the buffers they use alive; the rest of the payload goes
    return {"restored": restored, "skipped": skipped, "packages": installed, "files": files,
            "cwd": os.getcwd()}


_OPS: dict[str, Callable[..., dict[str, Any]]] = {
    "take": _take, "read": _read, "drop": _drop, "begin": _begin, "write": _write, "load": _load}
