"""Show a kernel's uid the interpreter it needs, and nothing else of a directory it cannot enter.

A Python under /root (mode 0700), as pyenv installs it for root, is out of reach of any other
uid. Rather than widen /root, the kernel covers it in its own mount namespace with a small
tmpfs (mode 0711: enterable, not listable) that holds only bind mounts of the paths the kernel
needs: its /root then shows the interpreter and nothing else of root's home. The host's mount
table is untouched. Must run as root, single-threaded (unshare), before Landlock (which forbids
changing mounts).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

from .errors import ConfinementError
from .libc import libc as _libc

_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
COVER_OPTIONS = b"mode=0711,size=1m"


class ViewError(ConfinementError):
    """The paths cannot be made visible to the kernel's uid."""

    layer = "view"


@contextmanager
def as_user(uid: int, gid: int) -> Iterator[None]:
    """Check permissions with uid:gid's effective ids (root again afterwards)."""
    groups = os.getgroups()
    os.setgroups([])
    os.setegid(gid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


def ancestors(path: str) -> list[str]:
    """The directories above an absolute path, outermost first, without '/'."""
    parts = path.split(os.sep)[1:-1]
    return [os.sep + os.sep.join(parts[:depth]) for depth in range(1, len(parts) + 1)]


def outermost(paths: Iterable[str]) -> list[str]:
    """The paths that have no ancestor among the others."""
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not any(is_within(path, outer) for outer in kept):
            kept.append(path)
    return kept


def is_within(path: str, directory: str) -> bool:
    """Whether path is directory or lies under it."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def covers_for(needed: Iterable[str], uid: int, gid: int) -> list[str]:
    """The outermost directories above the needed real paths that uid:gid cannot enter.

    Covering those makes every needed path reachable. The paths share most of their
    ancestors (one prefix, one site-packages): each directory is checked once, outermost
    first, and nothing under a blocked one is checked at all. A directory a zygote remembered
    is answered from its mode bits (see remember); any other is asked of the kernel as uid:gid.
    """
    paths = tuple(needed)
    answer = _answer_for_others(paths)
    if answer is not None and uid != 0 and uid not in answer[1] and gid not in answer[2]:
        return list(answer[0])
    above = {directory for path in paths for directory in ancestors(path)}
    blocked: list[str] = []
    switched = False
    with ExitStack() as as_them:
        for directory in sorted(above, key=lambda path: (path.count(os.sep), path)):
            if any(is_within(directory, cover) for cover in blocked):
                continue
            enterable = _remembered(directory, uid, gid)
            if enterable is None:
                if not switched:  # the ids switched once, for the first directory asked
                    as_them.enter_context(as_user(uid, gid))
                    switched = True
                enterable = os.access(directory, os.X_OK, effective_ids=True)
            if not enterable:
                blocked.append(directory)
    return blocked


# Directories a zygote looked at before forking (remember): path -> (owner, group, whether
# the mode lets others search it).
_searchable_by_others: dict[str, tuple[int, int, bool]] = {}


@functools.lru_cache(maxsize=8)
def _answer_for_others(needed: tuple[str, ...]) -> tuple[tuple[str, ...], frozenset[int],
                                                         frozenset[int]] | None:
    """covers_for's answer for a uid and gid that own none of the directories above needed,
    from remembered facts alone, with those directories' owners and groups; None unless every
    one was remembered. Worked out once per list (the interpreter's: in the zygote)."""
    above = {directory for path in needed for directory in ancestors(path)}
    facts = [_searchable_by_others.get(directory) for directory in above]
    if None in facts:
        return None
    blocked: list[str] = []
    for directory in sorted(above, key=lambda path: (path.count(os.sep), path)):
        if not any(is_within(directory, cover) for cover in blocked) \
                and not _searchable_by_others[directory][2]:
            blocked.append(directory)
    known = [fact for fact in facts if fact is not None]
    return (tuple(blocked), frozenset(fact[0] for fact in known),
            frozenset(fact[1] for fact in known))


def forget() -> None:
    """Drop what remember noted (tests; a zygote never needs to)."""
    _searchable_by_others.clear()
    _answer_for_others.cache_clear()


def remember(directories: Iterable[str], needed: Sequence[str] = ()) -> None:
    """In a zygote: note whether a uid of neither a directory's owner nor its group may enter
    it, for covers_for in every process it forks (their uids differ; this answer does not).

    Only where the mode bits alone decide: a directory with an ACL (or any system xattr, such
    as an NFSv4 ACL) is left to the live check, as is one the uid or gid owns. A directory
    changed since is answered as it was: at worst a cover made that the change made needless
    (it shows only the needed paths), or none where one is now needed, which can_run_as's live
    check then refuses, naming the path (privileges.py). needed: the paths every process
    forked asks about alike (the interpreter's), whose answer is worked out here once.
    """
    for directory in directories:
        try:
            info = os.stat(directory)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and not _has_acl(directory):
            _searchable_by_others[directory] = (info.st_uid, info.st_gid,
                                                bool(info.st_mode & stat.S_IXOTH))
    _answer_for_others.cache_clear()
    _answer_for_others(tuple(needed))  # needed: the paths every process asks covers_for about


def _has_acl(directory: str) -> bool:
    try:
        names = os.listxattr(directory)
    except OSError as exc:
        return exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP)  # no xattrs: no ACL
    return any(name.startswith("system.") for name in names)


def _remembered(directory: str, uid: int, gid: int) -> bool | None:
    """Whether uid:gid may enter directory, as remembered; None when that does not tell."""
    known = _searchable_by_others.get(directory)
    if known is None or uid == 0 or uid == known[0] or gid == known[1]:
        return None
    return known[2]


def _check(result: int, what: str) -> None:
    if result != 0:
        raise ViewError(f"{what}: {os.strerror(ctypes.get_errno())}")


_namespace_of: int | None = None  # the process that made the mount namespace it is in


def private_namespace() -> None:
    """A mount namespace of this process's own, whose changes never reach the host.

    Made once per process: the scratch's tmpfs (scratch.mount_quota) and the view both need
    one, and a second unshare would copy the mount table again for nothing. A forked child
    shares its parent's namespace (another pid), so it makes its own.
    """
    global _namespace_of
    if _namespace_of == os.getpid():
        return
    libc = _libc()
    _check(libc.unshare(_CLONE_NEWNS), "no private mount namespace (unshare)")
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None),
           "cannot make the mount namespace private")
    _namespace_of = os.getpid()


def expose(needed: Sequence[str], also_visible: Iterable[str], uid: int, gid: int,
           also_needed: Sequence[str] = ()) -> list[str]:
    """Cover what keeps uid:gid from the needed paths; return the covered directories.

    needed: real paths (the caller resolves them, a fork server once for all its kernels);
    also_needed: more real paths, per process (the scratch, the grants): asked about apart, as
    the same needed list's answer is worked out once (covers_for; a directory's answer depends
    only on it and those above it, so the covers of both lists are those of either).
    Under each cover only the needed and also_visible paths (the connection file, grants)
    appear, bind-mounted from the host, with their own permissions.
    """
    covers = covers_for(needed, uid, gid)
    if also_needed:
        covers = outermost([*covers, *covers_for(also_needed, uid, gid)])
    if not covers:
        return []
    private_namespace()
    visible = [*needed, *also_needed, *(os.path.realpath(path) for path in also_visible)]
    for cover in covers:
        _cover(cover, outermost(p for p in visible if is_within(p, cover) and p != cover
                                and os.path.exists(p)))
    return covers


def _cover(directory: str, shown: list[str]) -> None:
    libc = _libc()
    # Take hold of each source before the tmpfs hides it, then bind it back from its fd.
    handles = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in shown}
    try:
        _check(libc.mount(b"tmpfs", directory.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                          COVER_OPTIONS), f"cannot cover {directory} with a tmpfs")
        for path, handle in handles.items():
            _make_mount_point(directory, path, os.path.isdir(f"/proc/self/fd/{handle}"))
            _check(libc.mount(f"/proc/self/fd/{handle}".encode(), path.encode(), None,
                              _MS_BIND | _MS_REC, None), f"cannot show {path} under {directory}")
    finally:
        for handle in handles.values():
            os.close(handle)


def _make_mount_point(cover: str, path: str, is_dir: bool) -> None:
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o711)
    if is_dir:
        os.mkdir(path, 0o711)
    else:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
    if not is_within(path, cover):  # a check, not an assert: python -O would drop it
        raise ViewError(f"{path} is not under {cover}, so it cannot be shown there")
