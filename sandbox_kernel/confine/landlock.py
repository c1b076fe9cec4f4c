"""Minimal ctypes binding for Linux Landlock: file-system, TCP-port and IPC-scope restrictions.

Call apply() while the process is still single-threaded: Landlock restricts only the calling
thread and the threads and processes it creates afterwards.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ConfinementError, waiver

__all__ = ["LandlockError", "LandlockRules", "abi_version", "apply", "existing", "supported"]

# Syscall numbers come from the generic table, so they are the same on every architecture.
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446

_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_RULE_NET_PORT = 2
_PR_SET_NO_NEW_PRIVS = 38

# File-system access rights (include/uapi/linux/landlock.h).
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5

# Network access rights (ABI 4) and IPC scopes (ABI 6).
NET_BIND_TCP = 1 << 0
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1

# (report name, bit, first ABI offering it). ABI 7 only added logging flags, and any newer ABI
# gets exactly these rights, because a right is handled as soon as abi >= its first ABI.
_Table = tuple[tuple[str, int, int], ...]
_FS_RIGHTS: _Table = (
    ("execute", FS_EXECUTE, 1),
    ("write_file", FS_WRITE_FILE, 1),
    ("read_file", FS_READ_FILE, 1),
    ("read_dir", FS_READ_DIR, 1),
    ("remove_dir", FS_REMOVE_DIR, 1),
    ("remove_file", FS_REMOVE_FILE, 1),
    ("make_char", FS_MAKE_CHAR, 1),
    ("make_dir", FS_MAKE_DIR, 1),
    ("make_reg", FS_MAKE_REG, 1),
    ("make_sock", FS_MAKE_SOCK, 1),
    ("make_fifo", FS_MAKE_FIFO, 1),
    ("make_block", FS_MAKE_BLOCK, 1),
    ("make_sym", FS_MAKE_SYM, 1),
    ("refer", FS_REFER, 2),
    ("truncate", FS_TRUNCATE, 3),
    ("ioctl_dev", FS_IOCTL_DEV, 5),
)
_NET_RIGHTS: _Table = (("bind_tcp", NET_BIND_TCP, 4), ("connect_tcp", NET_CONNECT_TCP, 4))
_SCOPES: _Table = (
    ("abstract_unix_socket", SCOPE_ABSTRACT_UNIX_SOCKET, 6),
    ("signal", SCOPE_SIGNAL, 6),
)

# The kernel rejects (EINVAL) a rule on a non-directory that grants anything else.
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
# EXECUTE is needed so shared libraries under read-only dirs can be mmapped PROT_EXEC.
_READ_ONLY_RIGHTS = FS_READ_FILE | FS_READ_DIR | FS_EXECUTE

# Errnos meaning "no usable Landlock": syscall unknown, LSM disabled at boot, or a container's
# seccomp profile rejecting syscalls it does not know (Docker's default returns EPERM or ENOSYS).
_UNAVAILABLE = (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM)


class LandlockError(ConfinementError, OSError):
    """Landlock could not be applied; the message names the cause and the fix."""

    layer = "landlock"
    fix = waiver("file-system confinement", "--no-landlock")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),  # ABI 4
        ("scoped", ctypes.c_uint64),  # ABI 6
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the UAPI header: 12 bytes, not 16
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int


@dataclass(frozen=True)
class LandlockRules:
    """What the restricted process may still do; everything else Landlock handles is denied."""

    read_only: tuple[str, ...] = ()
    read_write: tuple[str, ...] = ()
    bind_tcp_ports: tuple[int, ...] = ()
    connect_tcp: bool = False
    scope_signals: bool = True
    scope_abstract_unix: bool = True
    abi_cap: int = -1  # act as if the host's ABI were at most this (see abi_version)
    # Paths (among read_only and read_write) whose rule must cover the file of that very name,
    # reached through no symbolic link: the policy's grants, checked for links before (a link
    # swapped in since would choose what is granted). The system's may be links (/lib).
    exact: tuple[str, ...] = ()


def _syscall(number: int, *args: ctypes.c_long | ctypes.c_void_p) -> int:
    """Invoke a raw syscall; return its result or -errno."""
    # glibc's syscall() reads every variadic argument as a long, so the caller passes c_long /
    # c_void_p: a bare Python int would go out as a 32-bit C int with undefined upper bits.
    ctypes.set_errno(0)
    result = int(_libc.syscall(ctypes.c_long(number), *args))
    return -ctypes.get_errno() if result == -1 else result


def _fail(err: int, what: str, fix: str) -> LandlockError:
    """Build a LandlockError for a failed call, with its errno, cause and fix."""
    return LandlockError(err, f"{what} failed ({os.strerror(err)}): {fix}")


def abi_version(cap: int = -1) -> int:
    """Landlock ABI the running kernel offers; 0 when Landlock is unsupported or disabled.

    A cap >= 0 makes the kernel look older than it is (never newer): min(host ABI, cap). It lets
    tests and operators see how the sandbox behaves on hosts with an older Landlock.
    """
    host = _host_abi()
    return host if cap < 0 else min(host, cap)


def _host_abi() -> int:
    result = _syscall(
        _SYS_LANDLOCK_CREATE_RULESET,
        ctypes.c_void_p(None),
        ctypes.c_long(0),
        ctypes.c_long(_CREATE_RULESET_VERSION),
    )
    if result >= 0:
        return result
    if -result in _UNAVAILABLE:
        return 0
    raise _fail(-result, "landlock_create_ruleset(VERSION)", "unexpected kernel answer")


def existing(paths: Iterable[str]) -> tuple[str, ...]:
    """Keep only the paths that exist (for optional system paths such as /lib64)."""
    return tuple(path for path in paths if os.path.exists(path))


def _mask(table: _Table, abi: int) -> int:
    """All bits of a table that the given ABI offers."""
    bits = 0
    for _name, bit, first_abi in table:
        if abi >= first_abi:
            bits |= bit
    return bits


def _names(table: _Table, bits: int) -> list[str]:
    """Report names of the set bits, in bit order."""
    return [name for name, bit, _first_abi in table if bits & bit]


def _require_single_thread() -> None:
    """Refuse to run when other threads exist, since they would stay unrestricted."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError as exc:
        raise LandlockError(
            exc.errno,
            "cannot count threads via /proc/self/task: mount /proc before applying Landlock",
        ) from None
    if threads != 1:
        raise LandlockError(
            f"refusing to apply Landlock: the process has {threads} threads, but Landlock only "
            "restricts the calling thread and its future children, so the other threads would "
            "escape the sandbox; call apply() before starting any thread"
        )


def _check_ports(ports: Sequence[int]) -> list[int]:
    """Validate TCP port numbers and return them sorted without duplicates."""
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise LandlockError(
                errno.EINVAL, f"invalid TCP port {port!r} in bind_tcp_ports: use integers 0-65535"
            )
    return sorted(set(ports))


def _create_ruleset(abi: int, fs: int, net: int, scoped: int) -> int:
    """Create a ruleset handling these rights and return its fd."""
    attr = _RulesetAttr(fs, net, scoped)
    # Pass only the fields this ABI knows, so older kernels never see a struct they reject.
    size = 8 if abi < 4 else 16 if abi < 6 else ctypes.sizeof(attr)
    fd = _syscall(
        _SYS_LANDLOCK_CREATE_RULESET,
        ctypes.c_void_p(ctypes.addressof(attr)),
        ctypes.c_long(size),
        ctypes.c_long(0),
    )
    if fd < 0:
        raise _fail(-fd, "landlock_create_ruleset", "the kernel rejected the handled rights")
    return fd


def _add_rule(ruleset_fd: int, rule_type: int, attr: ctypes.Structure, what: str) -> None:
    """Add one rule (path-beneath or net-port) to the ruleset."""
    result = _syscall(
        _SYS_LANDLOCK_ADD_RULE,
        ctypes.c_long(ruleset_fd),
        ctypes.c_long(rule_type),
        ctypes.c_void_p(ctypes.addressof(attr)),
        ctypes.c_long(0),
    )
    if result < 0:
        raise _fail(-result, f"landlock_add_rule({what})", "check the rule's path and rights")


def _add_path_rule(ruleset_fd: int, path: str, allowed: int, exact: bool = False) -> None:
    """Allow `allowed` beneath `path` (only the file rights when it is not a directory);
    exact: refuse when the file opened is not the one of that name (a link on the way)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        raise LandlockError(
            errno.ENOENT,
            "Landlock rule path does not exist (create it, or pass optional paths through "
            "existing())",
            path,
        ) from None
    except OSError as exc:
        raise LandlockError(
            exc.errno, f"cannot open Landlock rule path: {exc.strerror}", path
        ) from None
    try:
        if exact:
            _check_exact(fd, path)
        # fstat on the O_PATH fd checks the very inode the rule will cover.
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            allowed &= _FILE_RIGHTS
        _add_rule(ruleset_fd, _RULE_PATH_BENEATH, _PathBeneathAttr(allowed, fd), repr(path))
    finally:
        os.close(fd)


def _check_exact(fd: int, path: str) -> None:
    """Refuse unless the opened file's own path is `path`: a symbolic link anywhere on the way
    makes them differ. Checked on the open file, so no later swap can change the answer."""
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise LandlockError(exc.errno, "cannot tell which file a grant opened (is /proc "
                            f"mounted?): {exc.strerror}", path, fix="") from None
    if opened != path:
        raise LandlockError(
            errno.ELOOP, f"the grant now reaches {opened} through a symbolic link (one was "
            "put on its path after it was checked): grant a path no one else may change",
            path, fix="")


def _set_no_new_privs() -> None:
    """Set no_new_privs, which landlock_restrict_self requires without CAP_SYS_ADMIN."""
    ctypes.set_errno(0)
    one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
    if _libc.prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), one, zero, zero, zero) != 0:
        raise _fail(
            ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)", "is prctl blocked by seccomp?"
        )


def _restrict_self(ruleset_fd: int) -> None:
    """Enforce the ruleset on the calling thread and its future children."""
    result = _syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_long(ruleset_fd), ctypes.c_long(0))
    if result < 0:
        raise _fail(
            -result,
            "landlock_restrict_self",
            "no_new_privs must be set, and at most 16 Landlock layers can be stacked",
        )


def supported(abi: int) -> dict[str, list[str]]:
    """Names of the file-system rights, network rights and scopes a Landlock ABI offers."""
    return {
        "fs_rights": _names(_FS_RIGHTS, _mask(_FS_RIGHTS, abi)),
        "net_rights": _names(_NET_RIGHTS, _mask(_NET_RIGHTS, abi)),
        "scopes": _names(_SCOPES, _mask(_SCOPES, abi)),
    }


def apply(rules: LandlockRules) -> dict[str, Any]:
    """Restrict the calling thread (and its future children) with these rules; return a report."""
    _require_single_thread()
    abi = abi_version(rules.abi_cap)
    if abi == 0:
        raise LandlockError(
            "Landlock is not supported or is disabled on this kernel (or a seccomp filter blocks "
            "its syscalls): use Linux >= 5.13 built with CONFIG_SECURITY_LANDLOCK=y and "
            "'landlock' in the lsm= boot parameter"
        )
    ports = _check_ports(rules.bind_tcp_ports)
    fs = _mask(_FS_RIGHTS, abi)
    net = _mask(_NET_RIGHTS, abi)
    if rules.connect_tcp:
        net &= ~NET_CONNECT_TCP  # not handled means not restricted
    wanted_scopes = (SCOPE_SIGNAL if rules.scope_signals else 0) | (
        SCOPE_ABSTRACT_UNIX_SOCKET if rules.scope_abstract_unix else 0
    )
    scoped = wanted_scopes & _mask(_SCOPES, abi)

    ruleset_fd = _create_ruleset(abi, fs, net, scoped)
    try:
        for path in rules.read_only:
            _add_path_rule(ruleset_fd, path, _READ_ONLY_RIGHTS & fs, path in rules.exact)
        for path in rules.read_write:
            _add_path_rule(ruleset_fd, path, fs, path in rules.exact)
        if net & NET_BIND_TCP:
            for port in ports:
                _add_rule(
                    ruleset_fd, _RULE_NET_PORT, _NetPortAttr(NET_BIND_TCP, port), f"port {port}"
                )
        _set_no_new_privs()
        _restrict_self(ruleset_fd)
    finally:
        os.close(ruleset_fd)

    if abi < 4:
        connect = "unrestricted (ABI < 4)"
    else:
        connect = "denied" if net & NET_CONNECT_TCP else "allowed"
    return {
        "abi": abi,
        "fs_rights": _names(_FS_RIGHTS, fs),
        "net": {
            "bind_tcp_ports": ports,
            "bind_tcp": "restricted" if net & NET_BIND_TCP else "unrestricted (ABI < 4)",
            "connect_tcp": connect,
        },
        "scopes": _names(_SCOPES, scoped),
        "read_only": list(rules.read_only),
        "read_write": list(rules.read_write),
    }
