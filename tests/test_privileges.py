"""Started as root, the kernel becomes nobody when nobody can run it.

This host's interpreter lives under /root (mode 0700), so the shared kernels stay root without
capabilities. Here the system's own Python, which anyone can read, gets a virtualenv with this
package in it, and the kernel started from it must really switch user.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from sandbox_kernel.client import Sandbox
from tests.helpers import evaluate

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/usr/local/bin")
REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or SYSTEM_PYTHON is None,
    reason="needs root and a system Python that unprivileged users can read")


@pytest.fixture(scope="module")
def nobody_kernel():
    """A kernel started as root from a world-readable virtualenv."""
    # Not pytest's tmp_path: it is private to root, and nobody must read the virtualenv.
    base = Path("/tmp") / f"sandbox-kernel-privileges-{os.getpid()}"
    venv, prefix = base / "venv", base / "prefix"
    try:
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin/pip"), "install", "-q", str(REPO)], check=True)
        subprocess.run([str(venv / "bin/python"), "-m", "sandbox_kernel", "install", "--prefix",
                        str(prefix), "--name", "nobody"], check=True, capture_output=True)
        specs = KernelSpecManager(kernel_dirs=[str(prefix / "share/jupyter/kernels")])
        sb = Sandbox("nobody")
        sb.manager.kernel_spec_manager = specs
        sb.start()
        yield sb
        sb.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_kernel_runs_as_nobody_and_owns_its_scratch(nobody_kernel):
    code = ("import os\n(os.getuid(), os.geteuid(), os.getgid(), os.getgroups(),"
            " os.stat(os.getcwd()).st_uid, [l.split()[1] for l in open('/proc/self/status')"
            " if l.startswith(('CapEff', 'CapPrm'))])")
    assert evaluate(nobody_kernel, code) == (65534, 65534, 65534, [], 65534,
                                             ["0000000000000000"] * 2)
    layers = nobody_kernel.kernel_info()["sandbox"]["layers"]
    assert layers["privileges"] == {"uid": 65534, "gid": 65534, "dropped": True}


def test_nobody_can_work_in_scratch_and_cannot_regain_root(nobody_kernel):
    code = """
import os, errno
open('notes.txt', 'w').write('ok')
def attempt(fn):
    try:
        fn()
        return 'done'
    except OSError as exc:
        return errno.errorcode[exc.errno]
(open('notes.txt').read(), attempt(lambda: os.setuid(0)), attempt(lambda: os.seteuid(0)),
 attempt(lambda: open('/root/.profile')))
"""
    assert evaluate(nobody_kernel, code) == ("ok", "EPERM", "EPERM", "EACCES")
