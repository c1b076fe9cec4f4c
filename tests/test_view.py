"""Which directories the kernel's uid gets covered, and the one mount namespace per process."""

import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest

from sandbox_kernel.confine import scratch, view

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the view is made by root")

UID = GID = 265533  # no account's, checked by a uid that has no process


def blocked_ancestor_by_walking(path):
    """The outermost directory above path the effective uid cannot enter (the plain walk)."""
    current = "/"
    for part in os.path.realpath(path).split(os.sep)[1:-1]:
        current = os.path.join(current, part)
        if not os.access(current, os.X_OK, effective_ids=True):
            return current
    return None


def covers_by_walking(needed, uid, gid):
    """What covers_for must return: every path walked on its own, then the outermost."""
    with view.as_user(uid, gid):
        blocked = [blocked_ancestor_by_walking(path) for path in needed]
    return view.outermost(path for path in blocked if path)


@pytest.fixture
def tree():
    """Directories a uid can or cannot enter: by mode, by group, or nested in a closed one."""
    top = Path(tempfile.mkdtemp(prefix="sandbox-kernel-view-", dir="/tmp"))
    layout = {  # directory: (mode, group)
        "open": (0o755, 0), "open/deep": (0o755, 0), "open/deep/closed": (0o700, 0),
        "closed": (0o700, 0), "closed/open": (0o755, 0), "closed/open/closed": (0o700, 0),
        "passable": (0o711, 0), "passable/closed": (0o700, 0),
        "group": (0o710, GID), "group/open": (0o755, 0),
        "other-group": (0o710, GID + 1), "other-group/open": (0o755, 0),
    }
    try:
        top.chmod(0o755)
        for name, (mode, group) in layout.items():
            (top / name).mkdir()
            os.chown(top / name, 0, group)
            (top / name).chmod(mode)
            (top / name / "file").write_text(name)
        yield top
    finally:
        for directory, _, _ in os.walk(top):
            os.chmod(directory, 0o755)
        shutil.rmtree(top)


def needed_in(tree):
    files = [str(path / "file") for path in sorted(tree.rglob("*")) if path.is_dir()]
    return [*files, str(tree / "open/deep"), str(tree / "closed/open/closed")]


@pytest.fixture(params=["asked", "remembered"])
def answers(request, tree):
    """covers_for asking the kernel as the uid, or answering from what a zygote remembered
    (view.remember: the mode bits; the directories owned by the uid's group still asked)."""
    if request.param == "remembered":
        directories = [*view.ancestors(str(tree / "x")),
                       *(str(path) for path in tree.rglob("*") if path.is_dir())]
        view.remember(directories, needed_in(tree))
        assert str(tree / "closed") in view._searchable_by_others
        assert view._answer_for_others(tuple(needed_in(tree))) is not None  # worked out once
    yield request.param
    view.forget()


@pytest.mark.parametrize(("uid", "gid"), [(UID, GID), (UID, GID + 1), (UID, GID + 2)])
def test_covers_are_those_of_walking_each_path(tree, answers, uid, gid):
    needed = needed_in(tree)
    covers = view.covers_for(needed, uid, gid)
    assert sorted(covers) == sorted(covers_by_walking(needed, uid, gid))
    assert str(tree / "closed") in covers and str(tree / "closed/open/closed") not in covers
    assert (str(tree / "group") in covers) == (gid != GID)
    assert (str(tree / "other-group") in covers) == (gid != GID + 1)
    for subset in (needed[:1], needed[3:7], needed[::2], []):
        assert sorted(view.covers_for(subset, uid, gid)) == \
            sorted(covers_by_walking(subset, uid, gid))


@pytest.mark.parametrize("remembered", [False, True])
def test_the_interpreter_is_covered_as_by_walking(remembered):
    from sandbox_kernel.confine import privileges

    needed = privileges.interpreter_needs()
    if remembered:
        privileges.remember_reachable()
    try:
        assert sorted(view.covers_for(needed, UID, GID)) == \
            sorted(covers_by_walking(needed, UID, GID))
    finally:
        view.forget()


def acl_letting_in(uid):
    """A POSIX access ACL (version 2): owner rwx, uid x, group and others nothing."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, 7, undefined), (0x02, 1, uid), (0x04, 0, undefined),
               (0x10, 1, undefined), (0x20, 0, undefined)]  # user_obj, user, group_obj, mask, other
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


def test_a_directory_with_an_acl_is_asked_not_remembered(tree):
    """An ACL can let one uid in where the mode bits keep others out: never remembered."""
    closed = tree / "closed"
    try:  # setfacl -m u:UID:x closed, as the kernel stores it (mode 0700 kept otherwise)
        os.setxattr(closed, "system.posix_acl_access", acl_letting_in(UID))
    except OSError:
        pytest.skip("this file system keeps no ACLs")
    view.remember([str(tree), str(closed), str(tree / "closed/open")])
    try:
        assert str(closed) not in view._searchable_by_others
        needed = [str(tree / "closed/open/file")]
        assert view.covers_for(needed, UID, GID) == covers_by_walking(needed, UID, GID) == []
        assert view.covers_for(needed, UID + 1, GID + 2) == [str(closed)]
    finally:
        view.forget()


def in_child(check):
    """Run check() in a forked child (namespaces and mounts stay there); its exit code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if check() else 2
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def namespace():
    return os.stat("/proc/self/ns/mnt").st_ino


def test_one_private_namespace_per_process():
    def check():
        host = namespace()
        view.private_namespace()
        own = namespace()
        view.private_namespace()  # already its own: the same one
        if not host != own == namespace():
            return False
        # A forked child shares its parent's namespace: it makes one of its own.
        return in_child(lambda: (view.private_namespace(), namespace())[1] not in (own, host)) \
            == 0

    assert in_child(check) == 0


def test_the_scratch_quota_and_the_view_share_one_namespace(tmp_path):
    def check():
        host = namespace()
        assert scratch.mount_quota(str(tmp_path), 2**20)
        own = namespace()
        view.private_namespace()
        return host != own == namespace() and scratch.quota(str(tmp_path)) == 2**20

    assert in_child(check) == 0
    assert scratch.quota(str(tmp_path)) is None  # the host never saw the tmpfs
