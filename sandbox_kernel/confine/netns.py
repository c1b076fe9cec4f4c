"""A network namespace of the kernel's own: user code's sockets never touch the host's network.

A network namespace belongs to each thread: unshare(CLONE_NEWNET) moves the calling thread,
threads made later inherit it, threads that already exist keep theirs. So the kernel moves
while it is the only thread (before ipykernel starts any, and before libzmq's I/O threads
exist), and every thread user code can reach lives in the private namespace: there is no
thread left in the launcher's. What stays in the launcher's namespace are the five listening
sockets of the kernel's channels, bound here before the move and handed to libzmq with
ZMQ_USE_FD: a listening socket keeps the namespace it was made in, and so do the connections
it accepts, so frontends connect as before while user code (even from libzmq's own I/O
threads, which do the connect() of sockets user code makes) cannot reach them or anything
else on the host's loopback.

As root the move needs nothing; otherwise it needs an unprivileged user namespace to own the
network namespace (the kernel keeps its uid and gid mapped to themselves, and drops the
capabilities the new user namespace gave it).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
from typing import Any

from .errors import ConfinementError
from .libc import libc as _libc

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_CAP_VERSION_3 = 0x20080522
_PR_SET_DUMPABLE = 4


class NamespaceError(OSError):
    """A private network namespace cannot be made here."""


# What makes a namespace possible where enter() finds none: said by `check` and by a kernel
# that refuses to start for want of one.
NAMESPACE_FIX = (
    "run as root or where unprivileged user namespaces are enabled (in a container or a pod: "
    "its seccomp profile must allow unshare(CLONE_NEWUSER|CLONE_NEWNET), "
    "deploy/service/seccomp.json, a pod's Localhost profile as deploy/enterprise-gateway/"
    "README.md installs it), or use --network off")


def current() -> str:
    """The calling thread's network namespace, as /proc names it ('net:[4026531833]')."""
    return os.readlink(f"/proc/self/task/{_gettid()}/ns/net")


def _gettid() -> int:
    return int(_libc().syscall(186 if os.uname().machine == "x86_64" else 178))


def prebind(ip: str, ports: dict[str, int]) -> dict[str, socket.socket]:
    """Listening TCP sockets for the kernel's channels, in the launcher's namespace.

    ports maps a channel name to its port (0: any free one). Call before `enter`.
    """
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    listeners: dict[str, socket.socket] = {}
    try:
        for name, port in ports.items():
            listener = socket.socket(family, socket.SOCK_STREAM)
            listeners[name] = listener
            # What libzmq sets on the listeners it makes itself.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((ip, port))
            listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        for listener in listeners.values():
            listener.close()
        raise NamespaceError(exc.errno, f"cannot bind the kernel's {name} port {ip}:{port}: "
                                        f"{exc.strerror}") from None
    return listeners


def enter() -> dict[str, Any]:
    """Move this (single-threaded) process into a new network namespace, with loopback down.

    Raises NamespaceError when the host allows neither a network namespace nor a user namespace
    to own one.
    """
    libc = _libc()
    before = current()
    if libc.unshare(CLONE_NEWNET) == 0:
        return {"active": True, "owner": "root", "namespace": current(), "launcher": before}
    first = ctypes.get_errno()
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        # uid 0 without CAP_SYS_ADMIN (--run-as root drops every capability): a user namespace
        # could not map uid 0 (that needs CAP_SETFCAP), and an unmapped process cannot even
        # create its files, so there is no namespace to be had.
        raise NamespaceError(first, "no network namespace: unshare(CLONE_NEWNET) failed with "
                                    f"{errno.errorcode.get(first, first)} and uid 0 without "
                                    "capabilities cannot map itself into a user namespace")
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        second = ctypes.get_errno()
        raise NamespaceError(second, f"no network namespace: unshare(CLONE_NEWNET) failed with "
                                     f"{errno.errorcode.get(first, first)} and with a user "
                                     f"namespace {errno.errorcode.get(second, second)}")
    try:
        _map_ids(uid, gid)
    except OSError as exc:  # already inside: an unmapped process must not go on
        raise ConfinementError(f"entering a user namespace failed half-way (mapping uid {uid}: "
                               f"{exc.strerror}); the kernel cannot go on unmapped",
                               layer="network") from exc
    return {"active": True, "owner": "user namespace", "namespace": current(),
            "launcher": before}


def _map_ids(uid: int, gid: int) -> None:
    """Keep our uid and gid inside the new user namespace (setgroups off, as it must be)."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def _try_enter(switch_to: tuple[int, int] | None) -> str:
    try:
        return str(enter()["owner"])
    except NamespaceError:
        if switch_to is None or os.geteuid() != 0:
            raise
    os.setgroups([])
    os.setgid(switch_to[1])
    os.setuid(switch_to[0])
    # As privileges.switch does for a uid of the kernel's own: /proc/self is ours again, and
    # with it the user namespace's uid_map.
    _libc().prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    return f"{enter()['owner']} of uid {switch_to[0]}"


def drop_capabilities() -> None:
    """Drop every capability (a new user namespace grants them all inside it)."""
    header = struct.pack("=Ii", _CAP_VERSION_3, 0)
    data = bytes(24)  # two __user_cap_data_struct: effective, permitted, inheritable = 0
    if _libc().syscall(126 if os.uname().machine == "x86_64" else 91,
                       ctypes.c_char_p(header), ctypes.c_char_p(data)) != 0:
        err = ctypes.get_errno()
        raise NamespaceError(err, f"capset: {os.strerror(err)}")


def loopback_up() -> None:
    """Bring up the namespace's own loopback (where the egress listener lives)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def egress_listener(port: int) -> socket.socket:
    """The egress proxy's listening socket on this namespace's 127.0.0.1."""
    listener = socket.create_server(("127.0.0.1", port), backlog=socket.SOMAXCONN)
    os.set_inheritable(listener.fileno(), False)
    return listener


def available(switch_to: tuple[int, int] | None = None) -> dict[str, Any]:
    """Whether a kernel can have a network namespace here, and what owns it (tried in a child).

    switch_to: the (uid, gid) a root kernel drops to; where root cannot make the namespace,
    the kernel tries again as that uid, in a user namespace (kernel/app.py), and so does this.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        try:
            message = "ok " + _try_enter(switch_to)
        except OSError as exc:
            message = str(exc.strerror or exc)
        except Exception as exc:  # ConfinementError: the user namespace failed half-way
            message = str(exc)
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    if said.startswith("ok "):
        return {"available": True, "owner": said[3:]}
    return {"available": False, "reason": said or "the probe ended without an answer"}
