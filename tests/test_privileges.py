"""Started as root with a Python under a 0700 directory, user code never runs as root.

This host's interpreter lives under /root (mode 0700), and so may an operator's. Here the
situation is built on purpose, wherever the suite runs: a virtualenv inside a private directory
next to a secret (it reuses this interpreter's packages through a .pth file, so it takes a
second to build). Each kernel started from it must run as a uid of its own, reach its
interpreter through its private mount namespace, and see nothing else there.
"""

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from sandbox_kernel.client import Sandbox
from sandbox_kernel.confine import privileges
from tests.helpers import evaluate, wait_until_ready

RANGE = privileges.parse_range(privileges.DEFAULT_UID_RANGE)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="identities are for kernels root starts")

IDENTITY = ("import os\n(os.getuid(), os.geteuid(), os.getgid(), os.getgroups(),"
            " os.stat(os.getcwd()).st_uid, [l.split()[1] for l in open('/proc/self/status')"
            " if l.startswith(('CapEff', 'CapPrm'))])")


@pytest.fixture(scope="module")
def private_dir():
    """A 0700 directory holding a virtualenv with this package, a kernelspec and a secret."""
    # Not pytest's tmp_path: the point is a directory only its owner can enter, made here.
    base = Path("/tmp") / f"sandbox-kernel-privileges-{os.getpid()}"
    venv, prefix = base / "venv", base / "prefix"
    base.mkdir(mode=0o700)
    try:
        base.chmod(0o700)
        (base / "secret.txt").write_text("root's own")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        where = "import sysconfig; print(sysconfig.get_path('purelib'))"
        venv_site = subprocess.run([str(venv / "bin/python"), "-c", where],
                                   check=True, capture_output=True, text=True).stdout.strip()
        packages = sysconfig.get_path("purelib")
        Path(venv_site, "packages.pth").write_text(f"import site; site.addsitedir({packages!r})\n")
        root = ["--run-as", "root", "--max-threads", "0"]  # uid 0 is exempt from RLIMIT_NPROC
        for name, extra in (("private", []), ("private-root", root),
                            ("private-cold", ["--cold-start"])):
            subprocess.run([str(venv / "bin/python"), "-m", "sandbox_kernel", "install",
                            "--prefix", str(prefix), "--name", name, *extra],
                           check=True, capture_output=True)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def start(private_dir, name):
    specs = KernelSpecManager(kernel_dirs=[str(private_dir / "prefix/share/jupyter/kernels")])
    sb = Sandbox(name)
    sb.manager.kernel_spec_manager = specs
    sb.start()
    return sb


@pytest.fixture(scope="module")
def two_kernels(private_dir):
    first, second = start(private_dir, "private"), start(private_dir, "private")
    yield first, second
    first.close()
    second.close()


def test_each_kernel_has_a_uid_of_its_own(two_kernels):
    uids = []
    for sandbox in two_kernels:
        uid, euid, gid, groups, scratch_owner, caps = evaluate(sandbox, IDENTITY)
        assert uid in RANGE and uid != 0
        assert (euid, gid, groups, scratch_owner, caps) == (uid, uid, [], uid,
                                                           ["0000000000000000"] * 2)
        uids.append(uid)
    assert uids[0] != uids[1]


def test_only_the_interpreter_shows_in_the_private_directory(two_kernels, private_dir):
    sandbox = two_kernels[0]
    code = f"""
import errno, os, sys
def outcome(fn):
    try:
        return fn()
    except OSError as exc:
        return errno.errorcode[exc.errno]
(sys.prefix, outcome(lambda: os.listdir({str(private_dir)!r})),
 os.path.exists({str(private_dir / 'secret.txt')!r}),
 outcome(lambda: open({str(private_dir / 'secret.txt')!r}).read()),
 os.path.exists({str(private_dir / 'prefix')!r}))
"""
    assert evaluate(sandbox, code) == (str(private_dir / "venv"), "EACCES", False, "ENOENT",
                                       False)
    layers = sandbox.kernel_info()["sandbox"]["layers"]["privileges"]
    assert str(private_dir) in layers["covered"]
    assert layers["own"] is True
    # The host's view is untouched: the secret is still there, the directory still private.
    assert (private_dir / "secret.txt").read_text() == "root's own"
    assert oct(private_dir.stat().st_mode & 0o777) == "0o700"


def test_fork_served_and_cold_kernels_are_shown_the_same(two_kernels, private_dir):
    """The fork server resolves the interpreter's paths once; a cold kernel does it itself."""
    cold = start(private_dir, "private-cold")
    try:
        assert two_kernels[0].manager.provisioner.fork_served
        assert not cold.manager.provisioner.fork_served
        forked, alone = (sandbox.kernel_info()["sandbox"]["layers"]["privileges"]
                         for sandbox in (two_kernels[0], cold))
        assert forked["covered"] == alone["covered"] and str(private_dir) in alone["covered"]
        assert forked.keys() == alone.keys() and alone["own"] is True
        taken, _ = privileges.accounts_ids()
        for layer in (forked, alone):  # the same rules: a uid of the range no account has
            assert layer["uid"] in RANGE and layer["uid"] not in taken
        assert forked["uid"] != alone["uid"]
        probe = (f"import os\n[os.path.exists(os.path.join({str(private_dir)!r}, name))"
                 " for name in ('venv', 'secret.txt', 'prefix')]")
        shown = [evaluate(sandbox, probe) for sandbox in (two_kernels[0], cold)]
        assert shown == [[True, False, False]] * 2
    finally:
        cold.close()


def test_user_code_cannot_become_root_again(two_kernels):
    code = """
import os, errno
def attempt(fn):
    try:
        fn()
        return 'done'
    except OSError as exc:
        return errno.errorcode[exc.errno]
(attempt(lambda: os.setuid(0)), attempt(lambda: os.seteuid(0)),
 attempt(lambda: open('/root/.profile')))
"""
    setuid, seteuid, profile = evaluate(two_kernels[0], code)
    # /root/.profile: hidden (ENOENT) where /root is covered to show the interpreter, else EACCES.
    assert (setuid, seteuid) == ("EPERM", "EPERM") and profile in ("ENOENT", "EACCES")


def test_root_only_when_asked_for(private_dir):
    sandbox = start(private_dir, "private-root")
    try:
        uid, euid, *_, caps = evaluate(sandbox, IDENTITY)
        assert (uid, euid, caps) == (0, 0, ["0000000000000000"] * 2)
        layers = sandbox.kernel_info()["sandbox"]["layers"]["privileges"]
        assert layers["reason"] == "--run-as root"
    finally:
        sandbox.close()


# A launcher without CAP_SYS_ADMIN, as in a container that grants root no mount namespace.
NO_MOUNTS_LAUNCHER = """
import ctypes, os, sys
assert ctypes.CDLL(None).prctl(24, 21, 0, 0, 0) == 0  # PR_CAPBSET_DROP, CAP_SYS_ADMIN
os.execv(sys.executable, [sys.executable, "-I", *sys.argv[1:]])
"""


@pytest.mark.parametrize("run_as", ["auto", "root"])
def test_without_a_mount_namespace_only_run_as_root_starts(private_dir, tmp_path, run_as):
    from jupyter_client.blocking import BlockingKernelClient
    from jupyter_client.connect import write_connection_file

    connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"))
    process = subprocess.Popen(
        [str(private_dir / "venv/bin/python"), "-c", NO_MOUNTS_LAUNCHER, "-m", "sandbox_kernel",
         "-f", connection_file, "--scratch-size=0", f"--run-as={run_as}",
         # uid 0 is exempt from RLIMIT_NPROC: root without a thread cap must be asked for too
         *(["--max-threads=0"] if run_as == "root" else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if run_as == "auto":
            assert process.wait(timeout=60) == 3
            refusal = process.stderr.read()
            assert "cannot read the interpreter and no private mount namespace (unshare): " \
                   "Operation not permitted; start the kernel with --run-as root" in refusal
        else:  # explicitly root: it starts, as uid 0 without capabilities
            client = BlockingKernelClient(connection_file=connection_file)
            client.load_connection_file()
            client.start_channels()
            try:
                wait_until_ready(client, process)
                layers = client.kernel_info(reply=True, timeout=30)["content"]["sandbox"]
                assert layers["layers"]["privileges"]["reason"] == "--run-as root"
                # without CAP_SYS_ADMIN there is no network namespace: said, not pretended
                assert layers["layers"]["network"]["active"] is False
            finally:
                client.stop_channels()
    finally:
        process.kill()
        process.wait(30)


def test_without_a_network_namespace_a_network_kernel_refuses_to_start(private_dir, tmp_path):
    from jupyter_client.connect import write_connection_file

    connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"))
    done = subprocess.run(
        [str(private_dir / "venv/bin/python"), "-c", NO_MOUNTS_LAUNCHER, "-m", "sandbox_kernel",
         "-f", connection_file, "--scratch-size=0", "--run-as=root", "--max-threads=0",
         "--SandboxPolicy.network=on"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "uid 0 without capabilities cannot map itself into a user namespace" in done.stderr
    assert "or use --network off" in done.stderr


# --- a policy's --env never reaches the unconfined start-up (#20 item 2) -----------------------

PRELOAD_SOURCE = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    char path[4096];
    snprintf(path, sizeof path, "%s/loaded-as-uid-%d", MARKS, (int)getuid());
    close(open(path, O_CREAT | O_WRONLY, 0644));
}
"""


@pytest.fixture
def planted_library(tmp_path):
    """A library an earlier kernel could have written into a shared --write-path, and the
    directory its constructor marks when some process loads it."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler to build the planted library")
    shared = tmp_path / "shared"
    marks = tmp_path / "marks"
    shared.mkdir(mode=0o777)
    marks.mkdir(mode=0o777)
    source = tmp_path / "planted.c"
    source.write_text(PRELOAD_SOURCE)
    library = shared / "planted.so"
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKS="{marks}"', "-o", str(library),
                    str(source)], check=True, capture_output=True)
    return library, marks


def _run_with_env(tmp_path, *flags):
    code = tmp_path / "show.py"
    code.write_text("import os\ndef main():\n"
                    "    return {'LD_PRELOAD': os.environ.get('LD_PRELOAD'), 'uid': os.getuid()}\n")
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", "run", *flags, str(code)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("start", ["--cold-start", "--preload=colorsys"])
def test_loader_variables_in_env_are_refused(tmp_path, planted_library, start):
    library, marks = planted_library
    done = _run_with_env(tmp_path, start, "--env", f"LD_PRELOAD={library}")
    assert done.returncode == 3, done
    assert ("sandbox-kernel: refusing to start: --env/--pass-env LD_PRELOAD: the dynamic loader "
            "or the interpreter acts on this variable; to set it for user code anyway, add "
            "--allow-loader-env\n") in done.stderr
    assert list(marks.iterdir()) == []  # nothing loaded it, as root or otherwise


@pytest.mark.parametrize("start", ["--cold-start", "--preload=colorsys"])
def test_allowed_loader_variable_is_set_only_once_confined(tmp_path, planted_library, start):
    """With --allow-loader-env, user code sees LD_PRELOAD; no process ever loaded the library."""
    library, marks = planted_library
    done = _run_with_env(tmp_path, start, "--allow-loader-env", "--env", f"LD_PRELOAD={library}")
    assert done.returncode == 0, done
    result = json.loads(done.stdout)
    assert result["LD_PRELOAD"] == str(library) and result["uid"] in RANGE
    assert list(marks.iterdir()) == []


def test_loader_variables_in_pass_env_are_refused(tmp_path, planted_library, monkeypatch):
    library, marks = planted_library
    monkeypatch.setenv("PYTHONSTARTUP", str(library))
    done = _run_with_env(tmp_path, "--cold-start", "--pass-env", "PYTHONSTARTUP")
    assert done.returncode == 3, done
    assert "--env/--pass-env PYTHONSTARTUP" in done.stderr and "--allow-loader-env" in done.stderr
    assert list(marks.iterdir()) == []


# The capability sets of the process this prints ("CapPrm:\t...", "CapEff:\t...").
CAPABILITY_LINES = ("CapPrm:", "CapEff:")
DAC_OVERRIDE = 1 << 1  # CAP_DAC_OVERRIDE


def _file_capability(capabilities):
    """A security.capability value (VFS_CAP_REVISION_2, effective): these permitted caps."""
    return struct.pack("<IIIII", 0x02000000 | 1, capabilities, 0, 0, 0)


def _exec_as_pooled(binary, empty_in_zygote):
    """Fork a 'zygote' (the bounding set emptied as lean_zygote.prepare does, or not), which
    forks a 'pooled process' that checks its set as plan does, takes a uid of the range and
    execs binary on its own /proc status; that status's capability lines (or the exec's errno)."""
    read, write = os.pipe()
    zygote = os.fork()
    if zygote == 0:
        code = 1
        try:
            os.close(read)
            if empty_in_zygote:
                privileges.drop_bounding_set()
            pooled = os.fork()
            if pooled == 0:
                try:
                    assert privileges.bounding_set_is_empty() == empty_in_zygote
                    os.dup2(write, 1)
                    os.setgroups([])
                    os.setresgid(RANGE[-2], RANGE[-2], RANGE[-2])
                    os.setresuid(RANGE[-2], RANGE[-2], RANGE[-2])
                    os.execv(binary, [binary, "/proc/self/status"])  # noqa: S606 - the test binary
                except OSError as exc:
                    os.write(write, f"errno {exc.errno}\n".encode())
                finally:
                    os._exit(3)
            code = os.waitstatus_to_exitcode(os.waitpid(pooled, 0)[1])
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as output:
        text = output.read()
    os.waitpid(zygote, 0)
    if text.startswith("errno"):
        return text.strip()
    return [line.split()[1] for line in text.splitlines() if line.startswith(CAPABILITY_LINES)]


@pytest.fixture
def binaries_dir():
    """A directory any uid may enter (pytest's tmp_path is under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="sandbox-kernel-exec-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_an_inherited_empty_bounding_set_grants_no_capability_on_execve(binaries_dir):
    """What a lean zygote's children inherit holds as a drop of their own would: a setuid-root
    binary and a file-capability one, exec'd with no seccomp filter, grant no capability."""
    tmp_path = binaries_dir
    setuid_root = tmp_path / "setuid-cat"
    shutil.copy("/bin/cat", setuid_root)
    os.chown(setuid_root, 0, 0)
    setuid_root.chmod(0o4755)
    with_capability = tmp_path / "cap-cat"
    shutil.copy("/bin/cat", with_capability)
    with_capability.chmod(0o755)
    try:
        os.setxattr(with_capability, "security.capability", _file_capability(DAC_OVERRIDE))
    except OSError:
        pytest.skip("this file system keeps no file capabilities")
    # Without the drop the binaries do grant capabilities here (else this proves nothing).
    gained = _exec_as_pooled(str(setuid_root), empty_in_zygote=False)
    if gained == ["0000000000000000"] * 2:
        pytest.skip("this file system ignores setuid bits (nosuid)")
    assert isinstance(gained, list) and len(gained) == 2 and int(gained[1], 16) != 0, gained
    assert _exec_as_pooled(str(with_capability), empty_in_zygote=False) == \
        [f"{DAC_OVERRIDE:016x}"] * 2
    # Inherited empty: nothing gained (the file-capability exec may also be refused outright).
    assert _exec_as_pooled(str(setuid_root), empty_in_zygote=True) == ["0000000000000000"] * 2
    assert _exec_as_pooled(str(with_capability), empty_in_zygote=True) in (
        ["0000000000000000"] * 2, f"errno {errno.EPERM}")


def test_a_bounding_set_missing_only_the_probed_capability_is_still_emptied():
    """drop_bounding_set skips the drops only when the whole set reads empty, not one bit."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            libc = privileges._libc()
            assert libc.prctl(24, 0, 0, 0, 0) == 0  # PR_CAPBSET_DROP of CAP_CHOWN alone
            assert not privileges.bounding_set_is_empty()
            privileges.drop_bounding_set()
            code = 0 if privileges.bounding_set_is_empty() else 2
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
