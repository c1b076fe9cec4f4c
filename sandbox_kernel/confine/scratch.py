"""The kernel's private scratch directory: its cwd and HOME, gone when the kernel is."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

from . import view
from .errors import ConfinementError
from .libc import libc as _libc

DEFAULT_SCRATCH_SIZE = 2**30  # at most; by default a quarter of the memory limit (planned_size)
AUTO_SIZE = -1  # --scratch-size's default: planned_size chooses
DEFAULT_SCRATCH_FILES = 32768  # inodes: each costs the host ~1 KiB of kernel memory
_MS_NOSUID, _MS_NODEV = 0x2, 0x4


class ScratchError(ConfinementError):
    """The scratch directory is missing, foreign or unsafe."""

    layer = "scratch"  # no flag waives it: every kernel has one


def root() -> Path:
    """Where every scratch directory of this user lives (one per kernel)."""
    return Path(_root_path())


def _root_path() -> str:
    return os.path.join(tempfile.gettempdir(), _root_name())


def _root_name() -> str:
    return f"sandbox-kernel-{os.geteuid()}"


def _safe_root() -> str:
    base = _root_path()
    try:
        info = os.lstat(base)  # there already, but for the first kernel of this user
    except FileNotFoundError:
        try:
            os.mkdir(base, 0o711)
        except FileExistsError:
            pass
        info = os.lstat(base)
    # Someone else could have planted the directory (or a link) in the shared /tmp.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise ScratchError(f"{base} is not a directory owned by uid {os.geteuid()} and "
                           "writable only by it; remove it and start the kernel again")
    if stat.S_IMODE(info.st_mode) != 0o711:
        os.chmod(base, 0o711)  # others may reach their own scratch after a privilege drop, not list
    return base


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(base: Path | str) -> list[str]:
    """Remove the scratch directories of kernels that are no longer running."""
    removed = []
    for name in os.listdir(base):
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == "kernel" and parts[1].isdigit():
            if not _alive(int(parts[1])):
                entry = os.path.join(base, name)
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def create() -> str:
    """A new scratch directory for this process, after sweeping away stale ones."""
    base = _safe_root()
    remove_stale(base)
    return _make_own(base)


def _make_own(base: str) -> str:
    """A new folder `kernel-<pid>-<8 random hex digits>` of base, mode 0700, as
    tempfile.mkdtemp makes one: a random name, taken only if it did not exist (tempfile's
    names need a random.Random seeded anew in each forked process; os.urandom does not)."""
    prefix = os.path.join(base, f"kernel-{os.getpid()}-")
    for _ in range(tempfile.TMP_MAX):
        path = prefix + os.urandom(4).hex()
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, "no usable scratch directory name found")


def is_own(path: str) -> bool:
    """True when path is a scratch directory this very process created before re-executing."""
    # After the re-exec TMPDIR is the scratch itself, so the parent is checked by name and owner
    # (by name alone: tempfile would probe the scratch, writing a file, to find its own dir).
    candidate = Path(path)
    try:
        info, parent = candidate.lstat(), candidate.parent.lstat()
    except OSError:
        return False
    return (candidate.parent.name == _root_name() and parent.st_uid == os.geteuid()
            and not parent.st_mode & 0o022 and stat.S_ISDIR(info.st_mode)
            and info.st_uid == os.geteuid()
            and candidate.name.startswith(f"kernel-{os.getpid()}-"))


def planned_size(scratch_size: int, memory_limit: int) -> int:
    """The scratch tmpfs's size: as given, or (AUTO_SIZE) a quarter of the memory limit, which
    counts the scratch too, and at most DEFAULT_SCRATCH_SIZE."""
    if scratch_size != AUTO_SIZE:
        return scratch_size
    return min(DEFAULT_SCRATCH_SIZE, memory_limit // 4) if memory_limit else DEFAULT_SCRATCH_SIZE


def mount_quota(path: str, size: int, files: int = DEFAULT_SCRATCH_FILES) -> bool:
    """Make path a private tmpfs of at most size bytes and files inodes (root only); False
    when not possible.

    RLIMIT_FSIZE bounds one file, not how many there are. A tmpfs in the kernel's own mount
    namespace bounds them all, and vanishes with the kernel. Its size bounds the data, not the
    inodes, which the host's kernel allocates outside it: nr_inodes bounds those (300,000 empty
    files cost ~240 MiB of unreclaimable memory otherwise).
    """
    if not size or os.geteuid() != 0:
        return False
    try:
        view.private_namespace()
    except view.ViewError as exc:
        raise ScratchError(f"could not mount a {size}-byte tmpfs on {path}: {exc}") from None
    options = f"size={size},nr_inodes={files or 0},mode=0700".encode()
    if _libc().mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options):
        raise ScratchError(f"could not mount a {size}-byte tmpfs on {path}: "
                           f"{os.strerror(ctypes.get_errno())}")
    return True


def quota(path: str) -> int | None:
    """The size of the tmpfs on path, or None when path is on an ordinary file system."""
    return quotas(path)[0]


def quotas(path: str) -> tuple[int | None, int | None]:
    """The size and the most files (inodes) of the tmpfs on path; (None, None) when path is
    on an ordinary file system."""
    stats = _tmpfs_stats(path)
    return (None, None) if stats is None else (stats.f_blocks * stats.f_frsize, stats.f_files)


def _tmpfs_stats(path: str) -> os.statvfs_result | None:
    with open("/proc/self/mounts") as mounts:  # as Path.read_text reads it
        table = mounts.read()
    for line in table.splitlines():
        _, mount_point, fs_type, *_ = line.split()
        if mount_point == path and fs_type == "tmpfs":
            return os.statvfs(path)
    return None
