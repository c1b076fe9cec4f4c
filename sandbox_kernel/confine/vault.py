"""The vault: what only a kernel's companion may hold, sealed by the launcher, read there alone.

A secret's value (egress/secret.py) and the upstream proxy's credentials are used by the egress
proxy, which runs in the kernel's unconfined companion; the kernel itself must never hold them,
not even for a moment before it confines itself (its memory is user code's from then on, and a
fork-served kernel's is a copy of its server's). So the launcher writes them into a memfd,
seals it (no writes, no resizing: what the companion reads is what the launcher wrote) and hands
the descriptor down: to a cold kernel by inheritance, to a fork-served one with its request
(SCM_RIGHTS). Every process on the way (the fork server's child, the kernel before its
re-exec) passes the descriptor on unread, and closes its copy; only the companion (reaper.py)
reads it.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from .egress.secret import Secret

VAULT_VAR = "SANDBOX_KERNEL_VAULT"  # the fd of the launcher's sealed vault, until handed on
MAX_VAULT = 1 << 20  # bytes: more than any set of credentials, less than a memory problem
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def seal(contents: Mapping[str, Any]) -> int:
    """Launcher side: a sealed memfd holding contents (JSON); an inheritable fd for the kernel.

    contents: {"secrets": [{name, value, hosts, placeholder}...], "upstream_proxy": URL}.
    """
    data = json.dumps(contents).encode()
    if len(data) > MAX_VAULT:
        raise ValueError(f"the secrets take {len(data)} bytes, more than {MAX_VAULT}")
    fd = os.memfd_create("sandbox-vault", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, data)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sealed(fd: int) -> bool:
    """Whether fd is a vault the launcher sealed: looked at, never read (kernel side)."""
    try:
        return (stat.S_ISREG(os.fstat(fd).st_mode)
                and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS)
    except OSError:
        return False


def inherited(current: Mapping[str, str]) -> int | None:
    """Kernel side: the vault the launcher named in VAULT_VAR, if it is one (never read here)."""
    text = current.get(VAULT_VAR, "")
    return int(text) if text.isdigit() and int(text) > 2 and sealed(int(text)) else None


def open_vault(fd: int) -> dict[str, Any]:
    """Companion side: the vault's contents; the descriptor is closed. {} when it is no vault."""
    try:
        if not sealed(fd):
            return {}
        data = os.pread(fd, MAX_VAULT + 1, 0)
    finally:
        os.close(fd)
    try:
        contents = json.loads(data)
    except ValueError:
        return {}
    return contents if isinstance(contents, dict) else {}


def secrets_of(contents: Mapping[str, Any]) -> tuple[Secret, ...]:
    """The secrets a vault holds (entries that are not well formed are left out)."""
    found = []
    for entry in contents.get("secrets") or ():
        try:
            found.append(Secret(str(entry["name"]), str(entry["value"]),
                                tuple(str(host) for host in entry["hosts"]),
                                str(entry["placeholder"])))
        except (KeyError, TypeError):
            continue
    return tuple(found)
