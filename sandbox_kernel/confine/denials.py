"""Clear messages for calls the sandbox refused.

The filter answers a refused call with a bare EPERM, which Python shows as "Operation not
permitted". These wrappers call the real function first and, only when the kernel really refused
it, re-raise a PermissionError that says which rule refused it and what would allow it. They are a
courtesy, not a layer: calling the unwrapped function still hits the same filter.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import pty
import socket
from collections.abc import Callable
from typing import Any

PROCESSES = ("creating processes is not allowed in the sandbox (no policy flag allows it: "
             "run external programs outside the kernel)")
NETWORK_OFF = ("the network is off in this sandbox; start the kernel with --allow-network "
               "(or install the kernelspec with --allow-network) to allow it")
NETWORK_KINDS = ("the sandbox only allows AF_INET/AF_INET6 stream and datagram sockets, even "
                 "with --allow-network")

FILE_MODES = ("changing file permissions is not allowed in the sandbox (copy files with "
              "shutil.copyfile, which keeps the default mode)")

TRUNCATE_BY_PATH = ("truncating a file by its path is refused where Landlock is older than ABI 3 "
                    "(it could not keep truncation inside the grants): open the file for "
                    "writing and use f.truncate()")
SERVERS = ("listening for connections is not allowed in the sandbox (no policy flag allows it: "
           "connect out with --allow-network instead)")

DESCRIPTOR_OWNER = ("a descriptor's owner may only be the kernel's own process in the sandbox "
                    "(its signals would reach other processes; no policy flag allows it)")
UNIX_DATAGRAMS = ("the sandbox only allows stream socketpairs (socket.socketpair()): datagram "
                  "sockets could send to the host's unix sockets")
_F_SETOWN, _F_SETOWN_EX = 8, 15

_SHELL_FAILED = 127 << 8  # what os.system returns when the shell could not be started


def _denied(what: str, why: str) -> PermissionError:
    message = f"Operation not permitted: the sandbox blocked {what}: {why}"
    exc = PermissionError(errno.EPERM, message)
    exc.sandbox_rule = why  # type: ignore[attr-defined]  # marks it as already explained
    return exc


def _unexplained(exc: PermissionError, errnos: tuple[int, ...] = (errno.EPERM,)) -> bool:
    return exc.errno in errnos and not hasattr(exc, "sandbox_rule")


def _explain(original: Callable[..., Any], what: str, why: str,
             errnos: tuple[int, ...] = (errno.EPERM,)) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except PermissionError as exc:
            if not _unexplained(exc, errnos):
                raise
            raise _denied(what, why) from None

    return wrapper


def _explain_system(original: Callable[[Any], int]) -> Callable[[Any], int]:
    @functools.wraps(original)
    def system(command: Any) -> int:
        status = original(command)
        if status == _SHELL_FAILED:
            raise _denied("os.system()", PROCESSES)
        return status

    return system


def _explain_socket(allow_network: bool) -> Callable[..., None]:
    original = socket.socket.__init__

    @functools.wraps(original)
    def __init__(self: socket.socket, family: Any = -1, type: Any = -1, *args: Any,
                 **kwargs: Any) -> None:
        try:
            original(self, family, type, *args, **kwargs)
        except PermissionError as exc:
            if not _unexplained(exc):
                raise
            why = NETWORK_KINDS if allow_network else NETWORK_OFF
            raise _denied("creating a socket", why) from None

    return __init__


def _explain_fcntl(original: Callable[..., Any]) -> Callable[..., Any]:
    explained = _explain(original, "fcntl()", DESCRIPTOR_OWNER)

    @functools.wraps(original)
    def fcntl(fd: Any, cmd: int, *args: Any) -> Any:
        # Only the owner-setting commands: other EPERMs (O_NOATIME, ...) are the host's own.
        if cmd in (_F_SETOWN, _F_SETOWN_EX):
            return explained(fd, cmd, *args)
        return original(fd, cmd, *args)

    return fcntl


def install(allow_network: bool) -> None:
    """Wrap the usual ways Python creates processes and sockets."""
    import _posixsubprocess
    import subprocess

    for name in ("fork", "posix_spawn", "posix_spawnp", "execv", "execve"):
        if hasattr(os, name):
            setattr(os, name, _explain(getattr(os, name), f"os.{name}()", PROCESSES))
    # forkpty opens /dev/ptmx (refused by Landlock) before it forks. pty.fork, and so IPython's
    # `!cmd`, would then retry by hand and report "out of pty devices": let forkpty answer.
    os.forkpty = _explain(os.forkpty, "os.forkpty()", PROCESSES, (errno.EPERM, errno.EACCES))
    pty.fork = os.forkpty
    os.system = _explain_system(os.system)  # type: ignore[assignment]
    for name in ("chmod", "fchmod", "lchmod"):
        if hasattr(os, name):
            setattr(os, name, _explain(getattr(os, name), f"os.{name}()", FILE_MODES))
    fork_exec = _explain(_posixsubprocess.fork_exec, "starting a subprocess", PROCESSES)
    _posixsubprocess.fork_exec = fork_exec  # multiprocessing looks it up here
    subprocess._fork_exec = fork_exec  # type: ignore[attr-defined]  # subprocess keeps a copy
    socket.socket.__init__ = _explain_socket(allow_network)  # type: ignore[method-assign]
    os.truncate = _explain(os.truncate, "os.truncate()", TRUNCATE_BY_PATH)
    fcntl.fcntl = _explain_fcntl(fcntl.fcntl)
    socket.socketpair = _explain(socket.socketpair, "socket.socketpair()", UNIX_DATAGRAMS)
    for name in ("bind", "listen"):
        setattr(socket.socket, name, _explain(getattr(socket.socket, name),
                                              f"socket.{name}()", SERVERS))
    if not allow_network:
        for name in ("connect",):
            setattr(socket.socket, name, _explain(getattr(socket.socket, name),
                                                  f"socket.{name}()", NETWORK_OFF))
