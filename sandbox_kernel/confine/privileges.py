"""Dropping root: an identity of the kernel's own, or a named user, or root without capabilities.

Started as root, each kernel takes a uid (and the same gid) from --uid-range that no account
and no other live kernel uses: kernels then share no per-user limit, no file ownership, and
RLIMIT_NPROC bounds the threads of exactly one kernel. A lock file per uid, locked and handed
to the reaper until the kernel is gone, makes the choice atomic across processes.

Same uid must not mean same tenant: a kernel can leave files (mode 0600, say) in a shared
--write-path, and a later kernel with its uid could read, overwrite and delete them. So a uid is
kept out of use until nothing it owns remains in any write grant a kernel with that uid had: each
allocation records the kernel's write grants next to the uid's lock, and the next allocation of
that uid first looks through them (remembering the file it found, so that a uid still tainted
costs one lstat next time).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import grp
import json
import os
import pwd
import stat
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from . import libc, limits, paths, view
from .errors import ConfinementError
from .libc import libc as _libc

NOBODY = 65534
DEFAULT_UID_RANGE = "200000-265535"
LOCK_DIR = "/run/sandbox-kernel/uids"
# Where the locks go when /run cannot hold them (a container's read-only root without a /run
# tmpfs): the one other place such a root keeps writable. Root-only like the first (checked).
FALLBACK_LOCK_DIR = "/tmp/sandbox-kernel-uids"  # noqa: S108 - root-only, checked in lock_dir
SUBORDINATE_TABLES = ("/etc/subuid", "/etc/subgid")
NSSWITCH = "/etc/nsswitch.conf"
# What the account database is read from, per nsswitch source whose state lives in files only:
# "files" reads these two; nss-systemd adds root and nobody (fixed ids) and, only where any of
# these directories exists, dynamic users and userdb records (which may change in place).
ACCOUNT_FILES = ("/etc/passwd", "/etc/group")
SYSTEMD_USER_DIRS = ("/run/systemd/userdb", "/run/systemd/dynamic-uid", "/etc/userdb",
                     "/run/userdb", "/run/host/userdb", "/usr/local/lib/userdb", "/usr/lib/userdb")
_RACY_SECONDS = 2  # a file changed this recently may change again with the same mtime
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_READ = 23
_PR_CAPBSET_DROP = 24
_CAP_VERSION_3 = 0x20080522
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}


class PrivilegeError(ConfinementError):
    """The requested user cannot be switched to or cannot run the kernel."""

    layer = "privileges"  # no flag waives it: each reason names the --run-as that works


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
    """What the kernel's uid must be able to read to run: interpreter, stdlib, import path."""
    return list(_needed_paths_of(sys.executable, tuple(sys.path)))


@functools.cache
def _needed_paths_of(executable: str, search_path: tuple[str, ...]) -> tuple[str, ...]:
    # Keyed by the import path: a fork server works this out once for all its kernels, which
    # inherit its sys.path as it is (see paths.interpreter_paths).
    stdlib = Path(os.__file__).parent
    return (executable, str(stdlib), *[p for p in search_path if p and os.path.isdir(p)])


@functools.cache
def _each_once(paths: tuple[str, ...]) -> tuple[str, ...]:
    # The stdlib and the working directory come twice in _needed_paths: one access() each.
    return tuple(dict.fromkeys(paths))


def interpreter_needs() -> list[str]:
    """Real paths the kernel's uid must reach: interpreter paths and what _needed_paths lists."""
    return list(_interpreter_needs(sys.executable, tuple(sys.path)))


@functools.cache
def _interpreter_needs(executable: str, search_path: tuple[str, ...]) -> tuple[str, ...]:
    # Keyed like _needed_paths_of (search_path is what _needed_paths reads from sys.path).
    needed = [*paths.interpreter_paths(), os.path.dirname(executable),
              *_needed_paths_of(executable, search_path)]
    return tuple(dict.fromkeys(os.path.realpath(path) for path in needed))


def remember_reachable(paths: Iterable[str] = ()) -> None:
    """In a pool's zygote: the directories above the interpreter's paths and the given ones
    (the scratch's, the grants'), noted for the view's check in each process it forks (see
    view.remember: whether any uid of --uid-range may enter each, from its mode bits)."""
    interpreter = _interpreter_needs(sys.executable, tuple(sys.path))
    needed = [*interpreter, *(os.path.realpath(path) for path in paths)]
    view.remember({directory for path in needed for directory in view.ancestors(path)},
                  interpreter)


def prepare() -> None:
    """In a fork server: work out once what every kernel it forks would work out alike."""
    interpreter_needs()
    _each_once(_needed_paths_of(sys.executable, tuple(sys.path)))
    accounts_ids()
    libc.prepare()
    _last_capability()


def parse_range(text: str) -> range:
    """The ids of --uid-range FIRST-LAST (inclusive)."""
    first, sep, last = text.partition("-")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()) \
            or not 0 < int(first) <= int(last) < 2**32 - 1:
        raise PrivilegeError(f"--uid-range {text!r}: expected FIRST-LAST, e.g. "
                             f"{DEFAULT_UID_RANGE}, with 0 < FIRST <= LAST")
    return range(int(first), int(last) + 1)


def _subordinate_ranges() -> list[range]:
    """Ranges /etc/subuid and /etc/subgid give to user namespaces (container files)."""
    ranges = []
    for table in SUBORDINATE_TABLES:
        try:
            lines = Path(table).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(":")
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                ranges.append(range(int(fields[1]), int(fields[1]) + int(fields[2])))
    return ranges


class _Accounts(NamedTuple):
    ids: frozenset[int]
    subordinate: tuple[range, ...]
    fingerprint: tuple[tuple[int, int, int] | None, ...]
    reusable: bool  # whether the fingerprint tells every change of what was read


_accounts: _Accounts | None = None


def accounts_ids() -> tuple[set[int], list[range]]:
    """Ids some account or group has, and the subordinate ranges; the range must avoid both.

    Read again whenever a file they come from changed (a fork server reads them once for all
    its kernels while nothing changes), and every time where nsswitch names a source whose
    changes no file shows (LDAP, sssd, systemd's userdb).
    """
    global _accounts
    fingerprint = _fingerprint()
    if _accounts is None or not _accounts.reusable or _accounts.fingerprint != fingerprint:
        _accounts = _read_accounts(fingerprint)
    return set(_accounts.ids), list(_accounts.subordinate)


def _account_state_files() -> tuple[str, ...]:
    return (NSSWITCH, *ACCOUNT_FILES, *SUBORDINATE_TABLES, *SYSTEMD_USER_DIRS)


def _fingerprint() -> tuple[tuple[int, int, int] | None, ...]:
    """(inode, mtime, size) of each file the accounts come from; None for a missing one."""
    prints: list[tuple[int, int, int] | None] = []
    for path in _account_state_files():
        try:
            info = os.stat(path)
        except OSError:
            prints.append(None)
            continue
        prints.append((info.st_ino, info.st_mtime_ns, info.st_size))
    return tuple(prints)


def _read_accounts(fingerprint: tuple[tuple[int, int, int] | None, ...]) -> _Accounts:
    read_at = time.time_ns()
    accounts = pwd.getpwall()
    ids = {entry.pw_uid for entry in accounts} | {entry.pw_gid for entry in accounts}
    ids |= {entry.gr_gid for entry in grp.getgrall()}
    return _Accounts(frozenset(ids), tuple(_subordinate_ranges()), fingerprint,
                     _reusable(fingerprint, read_at))


def _reusable(fingerprint: tuple[tuple[int, int, int] | None, ...], read_at: int) -> bool:
    """Whether the same fingerprint later proves the accounts read at read_at unchanged."""
    state = dict(zip(_account_state_files(), fingerprint, strict=True))
    # A file written within the file system's timestamp granularity of the read could be
    # written again without its mtime changing (a coarse clock ticks every few ms).
    settled = all(info is None or info[1] < read_at - _RACY_SECONDS * 10**9
                  for info in fingerprint)
    without_userdb = all(state[path] is None for path in SYSTEMD_USER_DIRS)
    return settled and without_userdb and _sources_in_files()


def _sources_in_files() -> bool:
    """Whether nsswitch takes users and groups only from sources the fingerprint covers."""
    try:
        lines = Path(NSSWITCH).read_text().splitlines()
    except OSError:
        return False  # glibc's built-in default may include NIS (compat)
    sources = {}
    for line in lines:
        database, sep, rest = line.partition("#")[0].partition(":")
        if sep:
            sources[database.strip()] = rest.split()
    return all(name in sources and sources[name]
               and set(sources[name]) <= {"files", "systemd"} for name in ("passwd", "group"))


def lock_dir(configured: str = "") -> Path:
    """The directory of the uid locks (--uid-lock-dir), made if need be; root-only, checked.

    Every kernel of a host must use the same one. By default LOCK_DIR, or FALLBACK_LOCK_DIR
    where LOCK_DIR cannot be made (a read-only /run).
    """
    directory = Path(configured or LOCK_DIR)
    if _root_only_directory(directory):  # made already (by the zygote, an earlier kernel)
        return directory
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        if configured:
            raise PrivilegeError(f"cannot make --uid-lock-dir {directory}: {exc.strerror}; "
                                 "choose a directory root can write") from None
        directory = Path(FALLBACK_LOCK_DIR)
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as second:
            raise PrivilegeError(f"cannot make {LOCK_DIR} ({exc.strerror}) nor "
                                 f"{FALLBACK_LOCK_DIR} ({second.strerror}) for the uid locks: "
                                 "give --uid-lock-dir a directory root can write") from None
    if not _root_only_directory(directory):
        raise PrivilegeError(f"{directory} must be a directory only root can use; remove it "
                             "and start the kernel again")
    return directory


def _root_only_directory(directory: Path) -> bool:
    try:
        info = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and not info.st_mode & 0o077


def allocate(id_range: range, writable: Sequence[str] = (),
             locks: str = "") -> tuple[int, int]:
    """A uid of id_range no account uses, no live kernel holds and no earlier kernel left files
    of in a write grant; and the fd of its lock. writable: the new kernel's write grants;
    locks: --uid-lock-dir (see lock_dir).

    Whoever holds the fd (the reaper, until the kernel is gone) owns the uid.
    """
    directory = lock_dir(locks)
    taken, subordinate = accounts_ids()
    for uid in id_range:
        if uid in taken or any(uid in ranges for ranges in subordinate):
            continue
        fd = os.open(directory / f"{uid}.lock",
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        # A free lock with a live process of uid: a kernel whose reaper was killed, say.
        if limits.has_tasks(uid):
            os.close(fd)
            continue
        recorded = _read_record(directory, uid)
        if _leftover(directory, uid, recorded):
            os.close(fd)
            continue
        _record_grants(directory, uid, writable, recorded)
        return uid, fd
    raise PrivilegeError(f"every uid of --uid-range {id_range.start}-{id_range.stop - 1} is "
                         "used by an account or a live kernel, or still owns files an earlier "
                         "kernel left in a --write-path: give a wider range, or remove those "
                         "files")


def _grants_record(directory: Path, uid: int) -> Path:
    return directory / f"{uid}.grants"


def _read_record(directory: Path, uid: int) -> bytes | None:
    """The uid's grants record as it is on disk; None when there is none."""
    try:
        fd = os.open(_grants_record(directory, uid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks)


def _record_grants(directory: Path, uid: int, writable: Sequence[str],
                   recorded: bytes | None = None) -> None:
    """Remember where a kernel with uid may leave files (call holding the uid's lock).

    recorded: the record as read under this lock; the same bytes again are not rewritten (a
    pool's processes take the same uids with the same grants: a write each would cost more
    than the rest of the allocation).
    """
    record = {"grants": sorted({os.path.realpath(path) for path in writable}), "owned": None}
    if _encoded(record) != recorded:
        _write_record(_grants_record(directory, uid), record)


def _encoded(record: dict[str, Any]) -> bytes:
    return json.dumps(record).encode()


def _write_record(path: Path, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with open(fd, "wb", buffering=0) as handle:
        handle.write(_encoded(record))


def _leftover(directory: Path, uid: int, recorded: bytes | None) -> bool:
    """Whether uid still owns something in a write grant an earlier kernel with it had
    (recorded: its grants record, as _read_record read it)."""
    try:
        record = json.loads(recorded or b"")
        grants, owned = list(record["grants"]), record.get("owned")
    except (ValueError, KeyError, TypeError):
        return False  # no kernel with write grants had this uid (or a record from before)
    if not grants and not owned:
        return False
    if owned and _owned_by(owned, uid):
        return True
    found = next((found for grant in grants if (found := _first_owned(grant, uid))), None)
    if found is not None:
        _write_record(_grants_record(directory, uid), {"grants": grants, "owned": found})
    return found is not None


def _owned_by(path: str, uid: int) -> bool:
    try:
        return os.lstat(path).st_uid == uid
    except OSError:
        return False


def _first_owned(top: str, uid: int) -> str | None:
    """The first entry under top (top included, links not followed) that uid owns."""
    if _owned_by(top, uid):
        return top
    for directory, subdirectories, files in os.walk(top, onerror=lambda _: None):
        for name in (*subdirectories, *files):
            candidate = os.path.join(directory, name)
            if _owned_by(candidate, uid):
                return candidate
    return None


def can_run_as(uid: int, gid: int) -> str | None:
    """None when uid:gid can read the interpreter and its libraries; otherwise the first miss."""
    with view.as_user(uid, gid):
        for path in _each_once(_needed_paths_of(sys.executable, tuple(sys.path))):
            if not os.access(path, os.R_OK | os.X_OK, effective_ids=True):
                return path
        return None


def _chown_tree(top: str, uid: int, gid: int) -> None:
    for directory, _, files in os.walk(top):
        os.chown(directory, uid, gid)
        for name in files:
            os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)


@functools.cache
def _last_capability() -> int:
    # Fixed by the running Linux kernel: a fork server reads it once for all its kernels.
    return int(Path("/proc/sys/kernel/cap_last_cap").read_text())


def bounding_set_is_empty() -> bool:
    """Whether this thread's whole bounding set is empty: its CapBnd line, one read."""
    try:
        fd = os.open("/proc/thread-self/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        status = os.read(fd, 1 << 14)
    finally:
        os.close(fd)
    _, found, rest = status.partition(b"\nCapBnd:\t")
    try:
        return bool(found) and int(rest.split(b"\n", 1)[0], 16) == 0
    except ValueError:
        return False


def drop_bounding_set() -> None:
    """Empty this thread's bounding set: no execve can ever grant a capability again.

    A lean zygote empties its own once (launch/forkserver/lean_zygote.py) and its children
    inherit the empty set (fork copies it; nothing can add to it again): they find it empty
    here in one read, rather than dropping each capability once more.
    """
    libc = _libc()
    # CAP_CHOWN still in the set: not emptied (a kernel's start, the kernel-based zygote's
    # children), dropped at once as before; else the whole set is read, never the one bit.
    if libc.prctl(_PR_CAPBSET_READ, 0, 0, 0, 0) != 1 and bounding_set_is_empty():
        return
    for cap in range(_last_capability() + 1):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            why = os.strerror(ctypes.get_errno())
            raise PrivilegeError(f"could not drop capability {cap}: {why}")


def _drop_capabilities() -> None:
    """Empty the bounding, permitted, effective and inheritable sets of this thread."""
    drop_bounding_set()
    libc = _libc()
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two empty __user_cap_data_struct
    number = _SYS_CAPSET.get(os.uname().machine)
    if number is None or libc.syscall(number, header, data) != 0:
        raise PrivilegeError("could not clear the capability sets")


def plan(run_as: str, uid_range: str, grants: list[str], visible: list[str],
         writable: Sequence[str] = (), locks: str = "") -> tuple[dict[str, Any], int | None]:
    """Decide whom the kernel runs as; return that and the uid lock to hand to the reaper.

    'auto' takes a uid of its own; 'root' stays uid 0 without capabilities; a user name or
    UID[:GID] is taken as given. When the uid cannot reach the interpreter, the kernel's mount
    namespace shows it the paths it needs: the interpreter and the grants (and `visible`, the
    connection file root reads once more); writable: the write grants, locks: --uid-lock-dir
    (see allocate).
    Call as root, while single-threaded and before Landlock.
    """
    if os.geteuid() != 0:
        return {"uid": os.geteuid(), "gid": os.getegid(), "dropped": False,
                "reason": "not started as root"}, None
    if run_as == "root":
        _drop_capabilities()
        return {"uid": 0, "gid": os.getegid(), "dropped": False, "capabilities": "none",
                "reason": "--run-as root"}, None
    lock = None
    if run_as == "auto":
        uid, lock = allocate(parse_range(uid_range), writable, locks)
        gid = uid
    else:
        uid, gid = resolve(run_as)
        if uid == 0:
            raise PrivilegeError(f"--run-as {run_as} is uid 0: say --run-as root to keep root")
    try:
        covered = _make_reachable(uid, gid, grants, visible)
    except BaseException:
        if lock is not None:
            os.close(lock)
        raise
    drop_bounding_set()  # threads started from here on inherit the empty set
    planned: dict[str, Any] = {"uid": uid, "gid": gid, "dropped": True,
                               "own": lock is not None}
    if covered:
        planned["covered"] = covered
    return planned, lock


def _make_reachable(uid: int, gid: int, grants: list[str], visible: list[str]) -> list[str]:
    interpreter = _interpreter_needs(sys.executable, tuple(sys.path))  # the zygote's, cached
    granted = [*dict.fromkeys(os.path.realpath(path) for path in grants)]
    try:
        covered = view.expose(interpreter, visible, uid, gid, granted)
    except view.ViewError as exc:
        raise PrivilegeError(f"uid {uid} cannot read the interpreter and {exc}; start the "
                             "kernel with --run-as root to run as root without capabilities, "
                             "or install Python where every user can read it") from None
    missing = can_run_as(uid, gid)
    if missing:
        raise PrivilegeError(f"uid {uid} cannot read {missing}, which the kernel needs; make "
                             "it readable, or start the kernel with --run-as root")
    return covered


def switch(planned: dict[str, Any], scratch_dir: str) -> None:
    """Become the planned user, owning the scratch (glibc applies it to every thread).

    A uid of its own may read its own /proc/self again: no other process has that uid. (Its
    RLIMIT_NPROC, set by limits.apply, then counts this kernel's threads alone.)
    """
    if not planned["dropped"]:
        return
    uid, gid = planned["uid"], planned["gid"]
    _chown_tree(scratch_dir, uid, gid)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if planned.get("own"):
        _libc().prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
