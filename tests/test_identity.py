"""Uids per kernel: allocated atomically, never shared by two live kernels, freed at the end.

These kernels come from the suite's own interpreter; on this host it lives under /root (0700),
so each of them also exercises the private view of the interpreter.
"""

import contextlib
import fcntl
import os
import pwd
import signal
import subprocess
import sys
import time

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.confine import limits, paths, privileges
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import evaluate

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="identities are for kernels root starts")

RANGE = privileges.parse_range(privileges.DEFAULT_UID_RANGE)


def uid_of(sandbox):
    return evaluate(sandbox, "__import__('os').getuid()")


def is_locked(uid):
    """Whether some process holds the lock on uid (the reaper of a live kernel)."""
    fd = os.open(f"{privileges.LOCK_DIR}/{uid}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def released(uid, timeout=10.0):
    """Whether the uid's lock is free within timeout seconds."""
    deadline = time.monotonic() + timeout
    while is_locked(uid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not is_locked(uid)


def test_live_kernels_never_share_a_uid_and_free_it_at_the_end(sandbox):
    shared = uid_of(sandbox)
    with Sandbox("sandbox") as fresh:
        own = uid_of(fresh)
        assert shared in RANGE and own in RANGE and own != shared
        assert is_locked(own) and is_locked(shared)
        held = fresh.kernel_info()["sandbox"]["layers"]["privileges"]
        assert held["uid"] == own and held["own"] is True
    assert released(own)  # by the reaper, just after the kernel process ended
    assert is_locked(shared)


def test_threads_are_bounded_by_the_uid(kernelspecs):
    code = """
import threading
stop = threading.Event()
started, error = 0, None
try:
    for _ in range(200):
        threading.Thread(target=stop.wait, daemon=True).start()
        started += 1
except RuntimeError as exc:
    error = str(exc)
stop.set()
(started < 64, error)
"""
    with Sandbox(None, policy=SandboxPolicy(max_threads=64)) as sb:
        assert evaluate(sb, code) == (True, "can't start new thread")
        assert evaluate(sb, "1 + 1") == 2


def test_uid_zero_needs_run_as_root(tmp_path):
    code = tmp_path / "one.py"
    code.write_text("1")
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "run", "--run-as", "0",
                           str(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    # The kernel's own refusal (a one-shot kernel's, relayed from the fork server's log).
    assert ("refusing to start: --run-as 0 is uid 0: say --run-as root to keep "
            "root\n") in done.stderr


def test_range_skips_every_account():
    taken, _ = privileges.accounts_ids()
    assert 0 in taken and 65534 in taken
    with pytest.raises(privileges.PrivilegeError, match="used by an account or a live kernel"):
        privileges.allocate(range(65534, 65535))  # nobody's
    with pytest.raises(privileges.PrivilegeError, match="FIRST-LAST"):
        privileges.parse_range("0-10")


# A uid whose lock is free but which still has a process: what a kernel whose reaper was
# killed leaves behind. The top of the default range, which kernels reach last.
STRAY, NEXT = RANGE.stop - 2, RANGE.stop - 1


@contextlib.contextmanager
def process_as(uid, effective):
    """A process whose real uid is uid (its effective and saved one: effective) meanwhile."""
    ready_read, ready_write = os.pipe()
    stop_read, stop_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_read)
            os.close(stop_write)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, effective, effective)
            os.write(ready_write, b"x")
            os.read(stop_read, 1)
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(stop_read)
    try:
        assert os.read(ready_read, 1) == b"x"
        yield pid
    finally:
        os.close(stop_write)
        os.close(ready_read)
        os.waitpid(pid, 0)


# The real uid is what RLIMIT_NPROC counts: a process that has it (even one running a
# set-user-ID program, which /proc shows as its owner's) takes threads from the kernel's bound.
@pytest.mark.parametrize("effective", ["same", 0], ids=["as-uid", "real-uid-only"])
def test_a_uid_with_a_live_process_is_skipped_even_without_its_lock(effective):
    with process_as(STRAY, STRAY if effective == "same" else effective):
        assert limits.has_tasks(STRAY)
        uid, lock = privileges.allocate(range(STRAY, NEXT + 1))
        os.close(lock)
        assert uid == NEXT
    assert not limits.has_tasks(STRAY) and limits.tasks_of(STRAY) == 0
    uid, lock = privileges.allocate(range(STRAY, NEXT + 1))  # gone: the uid is free again
    os.close(lock)
    assert uid == STRAY


@pytest.fixture
def account_files(tmp_path, monkeypatch):
    """The account tables privileges reads, as files of this test's own (and a fresh cache)."""
    files = {name: tmp_path / name for name in ("nsswitch.conf", "subuid", "userdb")}
    files["nsswitch.conf"].write_text("passwd: files systemd\ngroup: files\n")
    files["subuid"].write_text("someone:300000:10\n")
    for path in files.values():
        if path.exists():
            settle(path)
    monkeypatch.setattr(privileges, "NSSWITCH", str(files["nsswitch.conf"]))
    monkeypatch.setattr(privileges, "SUBORDINATE_TABLES", (str(files["subuid"]),))
    monkeypatch.setattr(privileges, "SYSTEMD_USER_DIRS", (str(files["userdb"]),))
    monkeypatch.setattr(privileges, "_accounts", None)
    reads = []
    getpwall = pwd.getpwall
    monkeypatch.setattr(pwd, "getpwall", lambda: reads.append(1) or getpwall())
    files["reads"] = reads
    return files


def settle(path):
    """Date path an hour back, as a file nobody has written to lately."""
    old = time.time() - 3600
    os.utime(path, (old, old))


def test_account_ids_are_read_again_exactly_when_a_table_changed(account_files):
    subuid, reads = account_files["subuid"], account_files["reads"]
    taken, ranges = privileges.accounts_ids()
    assert ranges == [range(300000, 300010)] and 0 in taken
    assert privileges.accounts_ids() == (taken, ranges) and len(reads) == 1  # unchanged
    subuid.write_text("someone:300100:10\n")  # same size, same inode
    assert privileges.accounts_ids()[1] == [range(300100, 300110)] and len(reads) == 2
    # Written just now: the same mtime could still hide another write, so read every time.
    privileges.accounts_ids()
    assert len(reads) == 3
    settle(subuid)
    privileges.accounts_ids()
    privileges.accounts_ids()
    assert len(reads) == 4
    subuid.unlink()
    assert privileges.accounts_ids()[1] == [] and len(reads) == 5


@pytest.mark.parametrize("sources", ["passwd: files ldap\ngroup: files\n",
                                     "passwd: files\ngroup: sss files\n",
                                     "passwd: compat\ngroup: compat\n",
                                     "group: files\n", "userdb"])
def test_account_ids_are_read_every_time_when_no_file_tells_a_change(account_files, sources):
    if sources == "userdb":  # nss-systemd then serves users that no file of ours shows
        account_files["userdb"].mkdir()
        settle(account_files["userdb"])
    else:
        account_files["nsswitch.conf"].write_text(sources)
        settle(account_files["nsswitch.conf"])
    for _ in range(3):
        privileges.accounts_ids()
    assert len(account_files["reads"]) == 3


def test_interpreter_needs_are_the_real_paths_worked_out_afresh():
    needs = privileges.interpreter_needs()
    fresh = [*paths.interpreter_paths(), os.path.dirname(sys.executable),
             sys.executable, os.path.dirname(os.__file__),
             *[entry for entry in sys.path if entry and os.path.isdir(entry)]]
    assert needs == list(dict.fromkeys(os.path.realpath(path) for path in fresh))
    assert privileges._needed_paths() == [sys.executable, os.path.dirname(os.__file__),
                                          *[p for p in sys.path if p and os.path.isdir(p)]]


def test_the_uid_of_a_kernel_whose_reaper_was_killed_is_not_handed_out():
    with Sandbox("sandbox") as orphan:
        uid = uid_of(orphan)
        kernel = orphan.manager.provisioner.process.pid
        (reaper,) = (int(pid) for pid in
                     open(f"/proc/{kernel}/task/{kernel}/children").read().split())
        os.kill(reaper, signal.SIGKILL)
        assert released(uid, timeout=30)  # nothing holds the uid now but its live kernel
        with pytest.raises(privileges.PrivilegeError, match="used by an account or a live kernel"):
            privileges.allocate(range(uid, uid + 1))
        assert uid_of(orphan) == uid  # and that kernel still runs as it


# Two uids near the top of the default range, for kernels that leave files behind (#20 item 3).
LEFT, AFTER = RANGE.stop - 4, RANGE.stop - 3
TRY_FILE = """
import os
path = {path!r}
def attempt(action):
    try:
        action()
        return 'done'
    except OSError as exc:
        return type(exc).__name__
(os.getuid(), attempt(lambda: open(path).read()), attempt(lambda: open(path, 'a').write('x')),
 attempt(lambda: os.unlink(path)))
"""


def test_a_recycled_uid_does_not_inherit_files_left_in_a_shared_grant(tmp_path):
    """A kernel leaves a 0600 file in a shared --write-path (mode 1777); a later kernel never gets
    its uid while the file is there, so it can neither read, overwrite nor delete it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: only a file's owner may delete it
    left = shared / "private.txt"
    first = SandboxPolicy(write_paths=[str(shared)], uid_range=f"{LEFT}-{LEFT}")
    with Sandbox(None, policy=first) as sb:
        assert evaluate(sb, f"import os\nfd = os.open({str(left)!r}, os.O_CREAT | os.O_WRONLY, "
                            "0o600)\nos.write(fd, b'tenant A'); os.close(fd)\nos.getuid()") == LEFT
    assert released(LEFT)
    assert (left.stat().st_uid, left.stat().st_mode & 0o777) == (LEFT, 0o600)
    later = SandboxPolicy(write_paths=[str(shared)], uid_range=f"{LEFT}-{AFTER}")
    for _ in range(2):  # the second time from what the first look remembered
        with Sandbox(None, policy=later) as sb:
            assert evaluate(sb, TRY_FILE.format(path=str(left))) == (
                AFTER, "PermissionError", "PermissionError", "PermissionError")
        assert released(AFTER)
    assert left.read_text() == "tenant A"
    # Alone in its range, the tainted uid is refused with the reason, not handed out.
    with pytest.raises(privileges.PrivilegeError, match="still owns files an earlier kernel"):
        os.close(privileges.allocate(range(LEFT, LEFT + 1))[1])
    left.unlink()  # once nothing of it remains, the uid is free again
    uid, lock = privileges.allocate(range(LEFT, AFTER + 1))
    os.close(lock)
    assert uid == LEFT
