"""What the fork server and its clients share: where servers live, their key, the framing.

Protocol, on a Unix socket in an owner-only runtime directory, peers checked with SO_PEERCRED: the
client sends one length-prefixed JSON request `{"argv": [...], "env": {...}, "cwd": ...}` with its
stdin, stdout and stderr attached (SCM_RIGHTS); the server answers `{"pid": N}` with a pidfd of the
child attached (or `{"error": why}`), and, when the child has ended, `{"exit": returncode}`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_MAX_FORKS = 200
DEFAULT_MAX_AGE = 600.0
DEFAULT_IDLE = 300.0
REQUEST_TIMEOUT = 5.0  # seconds a client may take to send its request
_HEADER = struct.Struct("!I")
_MAX_REQUEST = 8 * 2**20
_PACKAGE = Path(__file__).resolve().parent.parent.parent  # sandbox_kernel/


class ForkServerError(RuntimeError):
    """The fork server cannot give a kernel; the caller starts one cold instead."""


def runtime_path() -> Path:
    """Where the servers' sockets, locks and logs live (JUPYTER_RUNTIME_DIR/sandbox-kernel)."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "sandbox-kernel"


def runtime_dir() -> Path:
    """The owner-only directory holding the servers' sockets, locks and logs, made if need be.

    A directory that cannot be made (a read-only root, say) is a ForkServerError like any
    other: the launcher starts its kernels cold instead.
    """
    path = runtime_path()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise ForkServerError(f"cannot use {path}: {exc.strerror}; set JUPYTER_RUNTIME_DIR "
                              "to a writable directory") from exc
    if not path.is_dir() or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise ForkServerError(f"{path} must be a directory owned by uid {os.geteuid()} with "
                              "mode 0700; remove it to let the fork server recreate it")
    return path


def server_key(python: str, preload: Sequence[str]) -> str:
    """One server per interpreter, preload set and version of this package's code.

    The path as given, not only what it resolves to: every virtualenv's python links to the
    same binary, yet each has its own site-packages. And what the path runs now: a venv rebuilt
    at the same path (on another base Python, or afresh) or a base Python upgraded in place
    must get a new server at once, not kernels forked from the old interpreter until the old
    server retires. A server imported the kernel's code when it started: after an upgrade (or
    an edit of an editable install) it would go on forking kernels that run the old
    confinement code, so the code's fingerprint is part of the key too.
    """
    text = json.dumps([os.path.abspath(python), _interpreter_identity(python),
                       sorted(set(preload)), _code_fingerprint()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _interpreter_identity(python: str) -> list[tuple[str, int, int, int]]:
    """The binary python resolves to and its venv's pyvenv.cfg, each by path, device, inode and
    mtime: all change when the venv is rebuilt or the binary replaced (never cached for that)."""
    path = Path(os.path.abspath(python))
    found = []
    for candidate in (path.resolve(), path.parent / "pyvenv.cfg",
                      path.parent.parent / "pyvenv.cfg"):
        try:
            info = candidate.stat()
        except OSError:
            continue
        found.append((str(candidate), info.st_dev, info.st_ino, info.st_mtime_ns))
    return found


@functools.cache
def _code_fingerprint() -> list[tuple[str, int, int]]:
    """Path, size and mtime of each module of this package, as this process imported it."""
    found = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        info = path.stat()
        found.append((str(path.relative_to(_PACKAGE)), info.st_size, info.st_mtime_ns))
    return found


def main_module() -> str:
    """The path of `python -m sandbox_kernel`'s module: a forked kernel's sys.argv[0]."""
    return str(_PACKAGE / "__main__.py")


def thread_count() -> int:
    """Threads of this process, from the kernel's point of view (Python's may not know)."""
    return len(os.listdir("/proc/self/task"))


def split_names(names: str | Sequence[str]) -> tuple[str, ...]:
    """A preload set, sorted and without blanks, from 'a,b' or a list."""
    items = names.split(",") if isinstance(names, str) else names
    return tuple(sorted({name.strip() for name in items if name.strip()}))


def peer_pid_uid(conn: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def frame(message: dict[str, Any]) -> bytes:
    """One message as it goes on the socket: a 4-byte length, then JSON."""
    data = json.dumps(message).encode()
    return _HEADER.pack(len(data)) + data


def _read_exactly(sock: socket.socket, size: int, start: bytes = b"") -> bytes:
    data = bytearray(start)
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer hung up mid-message")
        data += chunk
    return bytes(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One framed message and the descriptors that came with its first bytes."""
    # At most stdio, a ready pipe and a vault (a kernel's request): more are cut off, and the
    # request is refused for not bringing what it says.
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 5)
    if not data:
        raise ConnectionError("the peer hung up")
    data = _read_exactly(sock, _HEADER.size, data)
    (size,) = _HEADER.unpack_from(data)
    if size > _MAX_REQUEST:
        raise ValueError(f"a {size}-byte message is too large")
    body = _read_exactly(sock, _HEADER.size + size, data)[_HEADER.size:]
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("a message is a JSON object")
    return message, fds


def pools_path(server_socket: str) -> str:
    """Where launchers ask a server for pools of one-shot kernels (beside its socket; short,
    as a unix socket's path has at most 107 bytes)."""
    return server_socket.removesuffix(".sock") + ".p.sock"
