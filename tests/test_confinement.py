"""Confinement beyond seccomp: environment, Landlock, scratch, limits, timeout, output cap."""

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.confine import scratch
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import evaluate, ok, wait_until_ready

OUTPUT_CAP = 1000
SCRATCH_SIZE = 32 * 2**20


@pytest.fixture(scope="module")
def grants(tmp_path_factory):
    """A read-only and a read-write directory to grant, and a secret in the real HOME."""
    base = tmp_path_factory.mktemp("grants")
    (base / "ro").mkdir()
    (base / "ro" / "data.txt").write_text("readable")
    (base / "rw").mkdir()
    (base / "rw").chmod(0o777)  # started as root, user code runs as a uid of its own
    secret = Path(os.environ["HOME"]) / "secret.txt"
    secret.write_text("do not read")
    return base


@pytest.fixture(scope="module")
def confined(grants):
    """A kernel with grants, a passed and a set variable, and a small output cap and memory."""
    os.environ["SECRET_TOKEN"] = "s3cret-from-the-server"
    os.environ["PASSED_TOKEN"] = "passed-on-purpose"
    policy = SandboxPolicy(read_paths=[str(grants / "ro")], write_paths=[str(grants / "rw")],
                           pass_env=["PASSED_TOKEN"], env={"SET_BY_POLICY": "yes"},
                           max_output_bytes=OUTPUT_CAP, memory_limit=512 * 2**20,
                           scratch_size=SCRATCH_SIZE)
    try:
        with Sandbox(None, policy=policy) as sb:
            yield sb
    finally:
        del os.environ["SECRET_TOKEN"], os.environ["PASSED_TOKEN"]


def errno_of(sandbox, code):
    """The errno of the OSError that code raises in the kernel (None when it raises nothing)."""
    wrapped = f"try:\n{textwrap.indent(code, '    ')}\n    _e = None\n" \
              "except OSError as exc:\n    _e = exc.errno\n_e"
    return evaluate(sandbox, wrapped)


def test_launching_environment_does_not_leak(confined):
    code = ("import os\nraw = open('/proc/self/environ', 'rb').read()\n"
            "('SECRET_TOKEN' in os.environ, b'SECRET_TOKEN' in raw, b's3cret' in raw,"
            " os.environ.get('PASSED_TOKEN'), os.environ.get('SET_BY_POLICY'),"
            " os.environ['HOME'] == os.getcwd())")
    assert evaluate(confined, code) == (False, False, False, "passed-on-purpose", "yes", True)


@pytest.mark.parametrize("code", [
    "open(os.path.join(os.environ.get('REAL_HOME', '{home}'), 'secret.txt')).read()",
    "os.listdir('{runtime}')",
    "open('{other_connection_file}').read()",
    "open('/tmp/written-by-sandbox', 'w')",
    "open('/etc/shadow').read()",
    "open('/proc/{parent}/environ').read()",
    "open('/proc/1/cmdline').read()",
    "os.listdir('/sys/fs/cgroup')",
    "open('{site_packages}/sitecustomize.py', 'w')",
    "open('{grants}/ro/new.txt', 'w')",
    "os.truncate('{grants}/ro/data.txt', 0)",
    "os.rename('{grants}/rw/moved.txt', '{grants}/ro/moved.txt')",
])
def test_file_system_outside_the_grants_is_denied(confined, sandbox, grants, code):
    import sysconfig

    ok(confined.run(f"import os\nopen('{grants}/rw/moved.txt', 'w').close()"))
    code = code.format(home=os.environ["HOME"], runtime=os.environ["JUPYTER_RUNTIME_DIR"],
                       other_connection_file=sandbox.manager.connection_file,
                       parent=os.getpid(), site_packages=sysconfig.get_paths()["purelib"],
                       grants=grants)
    # Started as root, the kernel sees each grant as a bind mount of its own: moving a file from
    # one grant to another then fails with EXDEV before Landlock's EACCES.
    expected = (errno.EACCES, errno.EXDEV) if code.startswith("os.rename") else (errno.EACCES,)
    assert errno_of(confined, "import os\n" + code) in expected
    assert not Path("/tmp/written-by-sandbox").exists()
    assert (grants / "ro" / "data.txt").read_text() == "readable"


def test_scratch_and_grants_work(confined, grants):
    code = f"""
import os, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
open("notes.txt", "w").write("in scratch")
open("{grants}/rw/out.txt", "w").write("granted")
fig, ax = plt.subplots(); ax.plot([1, 3, 2]); fig.savefig("chart.png"); plt.close(fig)
(open("{grants}/ro/data.txt").read(), open("notes.txt").read(), open("chart.png", "rb").read(8),
 os.path.dirname(os.path.abspath("notes.txt")) == os.environ["SANDBOX_KERNEL_SCRATCH"])
"""
    assert evaluate(confined, code) == ("readable", "in scratch", b"\x89PNG\r\n\x1a\n", True)
    assert (grants / "rw" / "out.txt").read_text() == "granted"


@pytest.mark.parametrize("schedule", [
    "get_ipython().kernel.iopub_thread.io_loop.add_callback(attempt)",
    "get_ipython().kernel.control_thread.io_loop.add_callback(attempt)",
    "threading.Thread(target=attempt).start()",
])
def test_other_kernel_threads_are_confined_too(confined, schedule):
    code = f"""
import threading, os
done = threading.Event(); outcome = {{}}
def attempt():
    try:
        open(os.path.join('{os.environ["HOME"]}', 'secret.txt')).read(); outcome['r'] = 'read'
    except OSError as exc:
        outcome['r'] = (exc.errno, threading.current_thread() is threading.main_thread())
    done.set()
{schedule}
done.wait(10)
outcome['r']
"""
    assert evaluate(confined, code) == (errno.EACCES, False)


def test_memory_limit_gives_memory_error(confined):
    for bomb in ("bytearray(700 * 2**20)", "import numpy; numpy.ones(100_000_000)",
                 "[bytes(2**20) for _ in range(800)]"):
        ex = confined.run(bomb)
        assert ex.error is not None and ex.error.name == "MemoryError", bomb
    assert evaluate(confined, "len(bytearray(100 * 2**20))") == 100 * 2**20  # under the limit


def test_shared_memory_cannot_sidestep_the_limit(confined):
    assert errno_of(confined, "import mmap\nmmap.mmap(-1, 2**30)") == errno.EPERM
    assert errno_of(confined, "import os\nos.memfd_create('x')") == errno.EPERM


@pytest.mark.skipif(os.geteuid() != 0, reason="the scratch tmpfs needs root")
def test_scratch_quota_bounds_all_files_together(confined):
    code = """
import errno, os
written = 0
try:
    for i in range(10):
        with open(f"fill-{i}.bin", "wb") as f:
            f.write(bytes(8 * 2**20))
        written += 1
    outcome = None
except OSError as exc:
    outcome = exc.errno
for i in range(10):
    if os.path.exists(f"fill-{i}.bin"):
        os.unlink(f"fill-{i}.bin")
(written, outcome)
"""
    written, outcome = evaluate(confined, code)
    assert outcome == errno.ENOSPC and written == 3  # 32 MiB hold three 8 MiB files, not four
    layers = confined.kernel_info()["sandbox"]["layers"]
    assert layers["scratch"]["quota"] == SCRATCH_SIZE


LIST_OPEN_FILES = """
import os
targets = []
for fd in os.listdir('/proc/self/fd'):
    try:
        targets.append(os.readlink(f'/proc/self/fd/{fd}'))
    except OSError:  # the descriptor listdir itself used
        pass
print(sorted(targets))
"""


def test_inherited_descriptors_are_closed(tmp_path):
    from jupyter_client.connect import write_connection_file

    secret = tmp_path / "inherited-secret.txt"
    secret.write_text("launcher's file")
    connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"))
    argv = [sys.executable, "-I", "-m", "sandbox_kernel", "-f", connection_file]
    with open(secret) as leaked, \
            kernel_process(connection_file, argv, pass_fds=[leaked.fileno()]) as (client, process):
        seen = []
        client.execute_interactive(LIST_OPEN_FILES, timeout=30,
                                   output_hook=lambda m: seen.append(m["content"].get("text", "")))
        assert "[" in "".join(seen)
        assert str(secret) not in "".join(seen)
        client.shutdown()
        process.wait(timeout=30)


def test_output_cap_drops_with_one_marker(confined):
    # Output written to file descriptor 1 reaches the kernel through a pipe thread; the short
    # sleep keeps it inside this execution, as it would be for any C library printing mid-cell.
    ex = ok(confined.run("print('x' * 5000)\nimport os, sys, time\nsys.stdout.flush()\n"
                         "os.write(1, b'y' * 3000)\ntime.sleep(0.3)"))
    assert ex.stdout == "x" * OUTPUT_CAP
    assert ex.stderr.count("output limit of 1,000 bytes per execution reached") == 1
    assert "7,001 more bytes were dropped" in ex.stderr
    # the next execution has its own budget
    assert ok(confined.run("print('fresh')")).stdout == "fresh\n"


def test_timeout_from_metadata_keeps_the_kernel_and_its_state(confined):
    ok(confined.run("kept = 'state'"))
    ex = confined.run("while True:\n    pass", timeout=1)
    assert ex.error.name == "ExecutionTimeout"
    assert "longer than its 1 s limit (set by Sandbox.run(timeout=))" in ex.error.value
    # swallowing exceptions does not help: the limit is a BaseException, and it repeats
    ex = confined.run("while True:\n    try:\n        sum(range(1000))\n"
                      "    except Exception:\n        pass", timeout=1)
    assert ex.error.name == "ExecutionTimeout"
    assert evaluate(confined, "kept") == "state"


@pytest.mark.parametrize("code, inputs", [
    ("import asyncio\nawait asyncio.sleep(60)", None),
    ("async def main():\n    import asyncio\n    await asyncio.sleep(60)", {}),
    ("def main():\n    while True:\n        pass", {}),
], ids=["async-cell", "async-main", "main"])
def test_timeout_reaches_async_cells_and_main(confined, code, inputs):
    # An async cell waits in the event loop, where no exception can be raised into it: the
    # kernel cancels the execution instead, and still reports the limit.
    ok(confined.run("kept_too = 'yes'"))
    ex = confined.run(code, inputs=inputs, timeout=1)
    assert ex.error.name == "ExecutionTimeout" and not ex.state_lost
    assert ex.error.traceback[-1].startswith("ExecutionTimeout: the execution ran longer than")
    assert evaluate(confined, "kept_too") == "yes"
    assert evaluate(confined, "import asyncio\nawait asyncio.sleep(0.01)\n'loop fine'") == \
        "loop fine"


def test_policy_timeout_applies_without_metadata():
    with Sandbox(None, policy=SandboxPolicy(timeout=1)) as sb:
        ex = sb.run("import time\ntime.sleep(30)")
        assert ex.error.name == "ExecutionTimeout"
        assert "(set by the kernel's --timeout policy default)" in ex.error.value
        assert evaluate(sb, "1 + 1") == 2


def test_cpu_budget_ends_the_kernel_cleanly():
    # RLIMIT_CPU covers the kernel's whole life: once spent, SIGXCPU ends the process and the
    # client reports it (a per-execution limit is --timeout).
    with Sandbox(None, policy=SandboxPolicy(cpu_limit=2)) as sb:
        ex = sb.run("while True:\n    pass")
        assert ex.error.name == "KernelDied" and ex.state_lost
        assert "SIGXCPU" in ex.error.value
        assert evaluate(sb, "'replaced'") == "replaced"


def test_planted_startup_files_do_not_run_after_restart(fresh_sandbox):
    code = """
import os, sysconfig
ip = get_ipython()
planted = []
home_startup = os.path.expanduser('~/.ipython/profile_default/startup')
for folder in (ip.profile_dir.startup_dir, home_startup):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, '00-plant.py'), 'w') as f:
        f.write('PLANTED = True\\n')
    planted.append(folder)
try:
    open(os.path.join(sysconfig.get_paths()['purelib'], 'zz-plant.pth'), 'w')
    pth = 'written'
except PermissionError as exc:
    pth = exc.errno
(len(planted), pth)
"""
    assert evaluate(fresh_sandbox, code) == (2, errno.EACCES)
    fresh_sandbox.restart()
    assert fresh_sandbox.run("PLANTED").error.name == "NameError"


def test_scratch_is_removed_at_shutdown_and_stale_ones_are_swept(kernelspecs):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = scratch.root() / f"kernel-{dead.pid}-stale"
    stale.mkdir(parents=True)
    with Sandbox("sandbox") as sb:
        path = Path(sb.kernel_info()["sandbox"]["layers"]["scratch"]["path"])
        assert path.is_dir() and path.parent == scratch.root()
        assert not stale.exists()
    for _ in range(50):  # the reaper removes it just after the kernel process ends
        if not path.exists():
            break
        time.sleep(0.1)
    assert not path.exists()


def test_kernel_info_reports_every_layer(sandbox):
    layers = sandbox.kernel_info()["sandbox"]["layers"]
    assert layers["landlock"]["active"] is True and layers["landlock"]["abi"] >= 1
    assert layers["landlock"]["net"]["connect_tcp"] == "denied"
    assert layers["limits"]["core"] == {"soft": 0, "hard": 0}
    assert layers["limits"]["nofile"]["soft"] == 1024
    privileges = layers["privileges"]
    if os.geteuid() == 0:
        # Either switched to an unprivileged user or, where it cannot read the interpreter,
        # stayed root with every capability gone.
        if privileges["dropped"]:
            assert privileges["uid"] != 0
        else:
            assert privileges["capabilities"] == "none"
        caps = evaluate(sandbox, "[l.split()[1] for l in open('/proc/self/status')"
                                 " if l.startswith(('CapEff', 'CapPrm', 'CapBnd'))]")
        assert caps == ["0000000000000000"] * 3


# A launcher whose own filter hides Landlock (ENOSYS), as on a host kernel without it.
NO_LANDLOCK_LAUNCHER = textwrap.dedent("""
    import errno, os, sys
    import pyseccomp as sc
    f = sc.SyscallFilter(sc.ALLOW)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "landlock_create_ruleset")
    f.load()
    os.execv(sys.executable, [sys.executable, "-I", *sys.argv[1:]])
""")


def run_launched(tmp_path, *args, launcher=NO_LANDLOCK_LAUNCHER):
    return subprocess.run([sys.executable, "-c", launcher, *args], capture_output=True,
                          text=True, timeout=60)


def start_kernel_directly(tmp_path, *policy_args):
    from jupyter_client.connect import write_connection_file

    connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"))
    return connection_file, ["-m", "sandbox_kernel", "-f", connection_file, *policy_args]


@contextlib.contextmanager
def kernel_process(connection_file, argv, **popen):
    """A kernel started by argv (no manager) and a client of it, ready; both gone after."""
    from jupyter_client.blocking import BlockingKernelClient

    process = subprocess.Popen(argv, **popen)
    client = BlockingKernelClient(connection_file=connection_file)
    client.load_connection_file()
    client.start_channels()
    try:
        wait_until_ready(client, process)  # IOPub subscribed too, or the first output is lost
        yield client, process
    finally:
        client.stop_channels()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_refuses_to_start_without_landlock(tmp_path):
    _, args = start_kernel_directly(tmp_path)
    result = run_launched(tmp_path, *args)
    assert result.returncode == 3
    lines = [line.partition("] ")[2] for line in result.stderr.splitlines()  # after the mark
             if "refusing to start" in line]
    assert len(lines) == 1
    assert lines[0].startswith("sandbox-kernel: refusing to start: cannot keep these promises "
                               "on this host: files: read and write only")
    assert lines[0].endswith("this host: ABI 0; to run without it on purpose: --no-landlock")


def test_no_landlock_starts_on_purpose_and_says_so(tmp_path):
    connection_file, args = start_kernel_directly(tmp_path, "--no-landlock")
    argv = [sys.executable, "-c", NO_LANDLOCK_LAUNCHER, *args]
    with kernel_process(connection_file, argv) as (client, process):
        layers = client.kernel_info(reply=True, timeout=30)["content"]["sandbox"]["layers"]
        assert layers["landlock"] == {"active": False, "reason": "off by policy (--no-landlock)"}
        assert layers["seccomp"]["active"] is True
        client.shutdown()
        assert process.wait(timeout=30) == 0


def test_shutdown_does_not_wait_for_user_code(tmp_path):
    # Python's finalisation joins non-daemon threads and runs atexit callbacks: user code could
    # hold the kernel's exit forever (and finalising a big process takes seconds under load).
    connection_file, args = start_kernel_directly(tmp_path)
    argv = [sys.executable, "-I", *args]
    with kernel_process(connection_file, argv, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL) as (client, process):
        reply = client.execute_interactive(
            "import atexit, threading, time\natexit.register(time.sleep, 3600)\n"
            "threading.Thread(target=time.sleep, args=(3600,)).start()\n"
            "class Slow:\n    def __del__(self):\n        time.sleep(3600)\nkept = Slow()",
            timeout=60)
        assert reply["content"]["status"] == "ok"
        client.shutdown()
        assert process.wait(timeout=30) == 0


def test_missing_grant_refuses_to_start(tmp_path):
    _, args = start_kernel_directly(tmp_path, f"--read-path={tmp_path / 'missing'}")
    result = subprocess.run([sys.executable, "-I", *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 3
    assert f"granted path does not exist: {tmp_path / 'missing'}" in result.stderr


def test_check_reports_the_host_and_fails_when_unenforceable(tmp_path):
    result = subprocess.run(["sandbox-kernel", "check", "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["seccomp"]["available"] is True
    assert report["landlock"]["abi"] >= 1 and "truncate" in report["landlock"]["fs_rights"]
    assert report["rlimits"]["NOFILE"] and report["uid"] == os.geteuid()
    assert report["problems"] == []
    hidden = run_launched(tmp_path, "-m", "sandbox_kernel", "check", "--json")
    assert hidden.returncode == 1
    assert json.loads(hidden.stdout)["landlock"]["abi"] == 0
    assert "cannot enforce: files: read and write only" in hidden.stderr
    relaxed = run_launched(tmp_path, "-m", "sandbox_kernel", "check", "--json", "--no-landlock")
    assert relaxed.returncode == 0
