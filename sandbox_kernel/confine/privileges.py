"""Dropping root: switch to an unprivileged user, or at least shed every capability."""

from __future__ import annotations

import ctypes
import os
import pwd
import sys
from pathlib import Path
from typing import Any

NOBODY = 65534
_PR_CAPBSET_DROP = 24
_CAP_VERSION_3 = 0x20080522
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}


class PrivilegeError(RuntimeError):
    """The requested user cannot be switched to or cannot run the kernel."""


def resolve(run_as: str) -> tuple[int, int]:
    """(uid, gid) for 'nobody', a user name or UID[:GID]."""
    name, _, group = run_as.partition(":")
    if name.isdigit():
        uid = int(name)
        gid = int(group) if group.isdigit() else uid
        return uid, gid
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise PrivilegeError(f"no such user {name!r} for --run-as") from None
    return entry.pw_uid, int(group) if group.isdigit() else entry.pw_gid


def _needed_paths() -> list[str]:
    stdlib = Path(os.__file__).parent
    return [sys.executable, str(stdlib), *[p for p in sys.path if p and os.path.isdir(p)]]


def can_run_as(uid: int, gid: int) -> str | None:
    """None when uid:gid can read the interpreter and its libraries; otherwise the first miss."""
    os.setegid(gid)
    os.seteuid(uid)
    try:
        for path in _needed_paths():
            if not os.access(path, os.R_OK | os.X_OK, effective_ids=True):
                return path
        return None
    finally:
        os.seteuid(0)
        os.setegid(0)


def _chown_tree(top: str, uid: int, gid: int) -> None:
    for directory, _, files in os.walk(top):
        os.chown(directory, uid, gid)
        for name in files:
            os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)


def _drop_capabilities() -> None:
    """Empty the bounding, permitted, effective and inheritable sets of this thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            why = os.strerror(ctypes.get_errno())
            raise PrivilegeError(f"could not drop capability {cap}: {why}")
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two empty __user_cap_data_struct
    number = _SYS_CAPSET.get(os.uname().machine)
    if number is None or libc.syscall(number, header, data) != 0:
        raise PrivilegeError("could not clear the capability sets")


def plan(run_as: str) -> dict[str, Any]:
    """Decide whom the kernel runs as; if it stays root, shed every capability now.

    Call while single-threaded: capabilities belong to each thread, and threads started later
    inherit the empty sets.
    """
    if os.geteuid() != 0:
        return {"uid": os.geteuid(), "gid": os.getegid(), "dropped": False,
                "reason": "not started as root"}
    uid, gid = resolve("65534" if run_as == "auto" else run_as)
    missing = can_run_as(uid, gid)
    if missing and run_as != "auto":
        raise PrivilegeError(f"uid {uid} cannot read {missing}, which the kernel needs; "
                             "choose another --run-as user or make the interpreter readable")
    if missing:
        _drop_capabilities()
        return {"uid": 0, "gid": os.getegid(), "dropped": False, "capabilities": "none",
                "reason": f"uid {uid} cannot read {missing}; stayed root without capabilities"}
    return {"uid": uid, "gid": gid, "dropped": True}


def switch(planned: dict[str, Any], scratch_dir: str) -> None:
    """Become the planned user, owning the scratch (glibc applies it to every thread)."""
    if not planned["dropped"]:
        return
    uid, gid = planned["uid"], planned["gid"]
    _chown_tree(scratch_dir, uid, gid)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
