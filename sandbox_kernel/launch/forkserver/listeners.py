"""The fork server's unix listeners: bound for its user alone, unlinked only while still its own.

A server (server.py) listens at its socket and at its pools' request socket, and each pool of
one-shot kernels (pools.py) at a socket of its own. A retiring server's successor has the same
key, so the same paths: a retiring server unlinks a path only if the socket there is the one it
bound (its inode), never a successor's.
"""

from __future__ import annotations

import contextlib
import os
import socket


def listen(path: str) -> tuple[socket.socket, int]:
    """A unix listener at path that only this server's user may connect to, and the inode
    of its socket file (replacing a dead server's)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(path)
    except OSError as exc:  # "AF_UNIX path too long" has no errno: say what to change
        listener.close()
        raise OSError(f"cannot listen at {path}: {exc}; set JUPYTER_RUNTIME_DIR to a "
                      "directory with a shorter path") from exc
    finally:
        os.umask(old_umask)
    listener.listen(64)
    return listener, os.stat(path).st_ino


def unlink_own(path: str, inode: int) -> None:
    """Unlink the socket file this server bound at path, if it still is that one (inode 0:
    unlinked already). A successor has the same key, so the same paths: its sockets stay."""
    with contextlib.suppress(FileNotFoundError):
        if inode and os.stat(path).st_ino == inode:
            os.unlink(path)
