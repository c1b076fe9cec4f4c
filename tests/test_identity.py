"""Uids per kernel: allocated atomically, never shared by two live kernels, freed at the end.

These kernels come from the suite's own interpreter; on this host it lives under /root (0700),
so each of them also exercises the private view of the interpreter.
"""

import fcntl
import os
import subprocess
import sys

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.confine import privileges
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


def test_live_kernels_never_share_a_uid_and_free_it_at_the_end(sandbox):
    shared = uid_of(sandbox)
    with Sandbox("sandbox") as fresh:
        own = uid_of(fresh)
        assert shared in RANGE and own in RANGE and own != shared
        assert is_locked(own) and is_locked(shared)
        held = fresh.kernel_info()["sandbox"]["layers"]["privileges"]
        assert held["uid"] == own and held["own"] is True
    assert not is_locked(own)
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
    assert ("sandbox-kernel: refusing to start: --run-as 0 is uid 0: say --run-as root to keep "
            "root\n") in done.stderr


def test_range_skips_every_account():
    taken, _ = privileges.accounts_ids()
    assert 0 in taken and 65534 in taken
    with pytest.raises(privileges.PrivilegeError, match="used by an account or a live kernel"):
        privileges.allocate(range(65534, 65535))  # nobody's
    with pytest.raises(privileges.PrivilegeError, match="FIRST-LAST"):
        privileges.parse_range("0-10")
