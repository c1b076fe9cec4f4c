"""Fork-served kernels: as fresh and private as cold ones; the server is expendable."""

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.launch import forkserver

from .helpers import evaluate, ok

PROBE = ("import os, random, tempfile, numpy\n"
         "(os.getpid(), os.getppid(), os.getuid(), os.getcwd(), tempfile.gettempdir(), "
         "random.random(), float(numpy.random.random()), os.environ['HOME'])")


def _server_pid(preload=()):
    return forkserver.ForkServerClient(preload=preload).server_pid()


def _kernel_pid(sb):
    return sb.manager.provisioner.process.pid


@pytest.fixture
def numpy_pair():
    """Two kernels forked from one server that preloaded numpy."""
    with Sandbox(None, preload=["numpy"]) as first, Sandbox(None, preload=["numpy"]) as second:
        yield first, second


def test_kernels_are_fork_served_by_default(numpy_pair):
    first, _ = numpy_pair
    assert first.manager.provisioner.fork_served
    pid, ppid, *_ = evaluate(first, PROBE)
    assert pid == _kernel_pid(first)
    assert ppid == _server_pid(["numpy"])  # forked, not exec'd by jupyter_client


def test_two_kernels_differ_and_see_nothing_of_each_other(numpy_pair):
    first, second = numpy_pair
    a, b = evaluate(first, PROBE), evaluate(second, PROBE)
    assert a[1] == b[1]  # one server
    assert a[0] != b[0]
    assert a[3] != b[3] and a[4] == a[3] and b[4] == b[3] and a[7] == a[3]  # own scratch
    assert a[5] != b[5] and a[6] != b[6]  # random and numpy random reseeded per kernel
    ok(first.run("open('secret.txt', 'w').write('from the first kernel')"))
    seen = evaluate(second, textwrap.dedent(f"""
        import errno
        outcomes = []
        for probe in (lambda: open({a[3] + '/secret.txt'!r}).read(),
                      lambda: os.listdir({a[3]!r}),
                      lambda: open('/proc/{a[0]}/environ').read()):
            try:
                outcomes.append(('read', probe()))
            except OSError as exc:
                outcomes.append((type(exc).__name__, errno.errorcode[exc.errno]))
        outcomes
        """))
    # Landlock refuses, or the first kernel's private tmpfs is not even there to be seen.
    hidden = {("PermissionError", "EACCES"), ("FileNotFoundError", "ENOENT")}
    assert set(seen) <= hidden, seen


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid of its own per kernel needs root")
def test_two_kernels_run_as_different_users(numpy_pair):
    first, second = numpy_pair
    a, b = evaluate(first, PROBE), evaluate(second, PROBE)
    assert a[2] != 0 and b[2] != 0 and a[2] != b[2]


def test_a_kernel_carries_nothing_of_an_earlier_kernels_code():
    with Sandbox(None) as first:
        ok(first.run("import json, random, builtins, sys, tempfile\n"
                     "json.PLANTED = 1; builtins.PLANTED = 1; random.seed(42)\n"
                     "sys.modules['planted'] = json; tempfile.tempdir = '/tmp'\n"
                     "open('left-behind', 'w').write('x')"))
        seeded = evaluate(first, "random.random()")
        with Sandbox(None) as second:
            state = evaluate(second, textwrap.dedent("""
                import json, random, builtins, sys, tempfile, os
                (hasattr(json, 'PLANTED'), hasattr(builtins, 'PLANTED'), 'planted' in sys.modules,
                 tempfile.gettempdir() == os.getcwd(), os.listdir('.'), random.random())
                """))
    assert state[:4] == (False, False, False, True)
    # IPython's own, new, and matplotlib's font list copied from the server (launch/fontcache)
    assert set(state[4]) <= {".ipython", ".config"} and ".ipython" in state[4]
    assert state[5] != seeded  # not the sequence the earlier kernel seeded


def test_killing_the_server_loses_no_running_kernel():
    with Sandbox(None) as survivor:
        old_server = _server_pid()
        assert old_server is not None
        os.kill(old_server, signal.SIGKILL)
        assert evaluate(survivor, "6 * 7") == 42
        # Interrupt still reaches it, through its pidfd.
        timer = threading.Timer(1.0, survivor.interrupt)
        timer.start()
        execution = survivor.run("import time; time.sleep(30)")
        timer.join()
        assert execution.error is not None and execution.error.name == "KeyboardInterrupt"
        with Sandbox(None) as newcomer:
            assert newcomer.manager.provisioner.fork_served
            assert _server_pid() not in (None, old_server)
            assert evaluate(newcomer, "1 + 1") == 2
        assert evaluate(survivor, "6 * 7") == 42
        process = survivor.manager.provisioner.process
    assert process.poll() is not None  # shut down cleanly though its parent is gone


def test_interrupt_and_restart_behave_as_with_a_cold_kernel(fresh_sandbox):
    sb = fresh_sandbox
    assert sb.manager.provisioner.fork_served
    ok(sb.run("x = 1"))
    timer = threading.Timer(1.0, sb.interrupt)
    timer.start()
    execution = sb.run("import time; time.sleep(30)")
    timer.join()
    assert execution.error is not None and execution.error.name == "KeyboardInterrupt"
    assert evaluate(sb, "x") == 1
    before = _kernel_pid(sb)
    sb.restart()
    assert sb.manager.provisioner.fork_served and _kernel_pid(sb) != before
    assert evaluate(sb, "'x' in globals()") is False


def test_a_kernel_that_dies_reports_its_exit_status(fresh_sandbox):
    execution = fresh_sandbox.run("import os; os.kill(os.getpid(), 9)")
    assert execution.error is not None and execution.error.name == "KernelDied"
    assert "killed by signal SIGKILL" in execution.error.value
    assert evaluate(fresh_sandbox, "2 + 2") == 4  # restarted, fork-served again


def test_the_kernel_ends_with_its_launcher():
    script = textwrap.dedent("""
        import os, sys
        from sandbox_kernel.client import Sandbox
        sb = Sandbox(None)
        sb.start()
        print(sb.manager.provisioner.process.pid, flush=True)
        os._exit(0)  # no shutdown: the launcher just vanishes
        """)
    launcher = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120, check=True)
    pid = int(launcher.stdout.split()[-1])
    try:
        pidfd = os.pidfd_open(pid)  # it is not our child: a pidfd tells when it has ended
    except ProcessLookupError:
        return  # already gone
    try:
        ended, _, _ = select.select([pidfd], [], [], 30)
    finally:
        os.close(pidfd)
    assert ended, f"kernel {pid} outlived its launcher"


def test_without_a_server_the_kernel_starts_cold():
    with Sandbox(None, preload=["no_such_module_for_the_fork_server"]) as sb:
        assert not sb.manager.provisioner.fork_served
        assert evaluate(sb, "1 + 2") == 3
    log = (forkserver.runtime_dir().glob("*.log"))
    assert any("cannot preload no_such_module_for_the_fork_server" in path.read_text()
               for path in log)


def test_cold_start_opts_out():
    with Sandbox(None, cold_start=True) as sb:
        assert not sb.manager.provisioner.fork_served
        assert evaluate(sb, "import os; os.getppid() != os.getpid()") is True


def test_preloaded_matplotlib_uses_the_kernels_own_config_dir():
    with Sandbox(None, preload=["matplotlib", "matplotlib.pyplot"]) as sb:
        dirs = evaluate(sb, "import os, sys, matplotlib\n"
                            "('matplotlib' in sys.modules, matplotlib.get_configdir(), "
                            "matplotlib.get_cachedir(), os.getcwd())")
    assert dirs[0]
    assert dirs[1].startswith(dirs[3]) and dirs[2].startswith(dirs[3])


def test_the_server_is_single_threaded_and_recycled_after_max_forks():
    client = forkserver.ForkServerClient(preload=["numpy", "pandas"], max_forks=2)
    refused = ["--SandboxPolicy.run_as=no-such-user-here"]  # each kernel exits before serving
    first = client.spawn(refused, {}, [0, 1, 2])
    server = client.server_pid()
    with open(f"/proc/{server}/status") as status:
        assert "Threads:\t1\n" in status.read()
    second = client.spawn(refused, {}, [0, 1, 2])
    for kernel in (first, second):
        assert kernel.wait(60) == 3  # refused to start, and the server reported it
    deadline = time.monotonic() + 30
    while client.server_pid() == server and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.server_pid() is None  # retired after two forks; the next spawn starts one
    third = client.spawn(refused, {}, [0, 1, 2])
    assert client.server_pid() not in (None, server)
    third.wait(60)


# Descriptor kinds and how many of each; sockets only by kind (ZMQ's count varies with
# timing), with the paths of Unix sockets (the fork server's would have one).
FDS = ("import os, re, collections\n"
       "paths = {}\n"
       "for line in open('/proc/self/net/unix').read().splitlines()[1:]:\n"
       "    fields = line.split()\n"
       "    paths[fields[6]] = fields[7] if len(fields) > 7 else ''\n"
       "kinds = collections.Counter()\n"
       "for fd in set(os.listdir('/proc/self/fd')) - {'0'}:  # stdin: /dev/null, not a pipe\n"
       "    try:\n"
       "        target = os.readlink(f'/proc/self/fd/{fd}')\n"
       "    except OSError:\n"
       "        continue\n"
       "    if target.startswith('socket:'):\n"
       "        kinds['unix ' + paths[target[8:-1]] if target[8:-1] in paths else 'socket'] = 1\n"
       "    elif target.startswith(os.environ['SANDBOX_KERNEL_SCRATCH'] + '/'):\n"
       "        kinds['a file in its scratch'] = 1  # sqlite's journal comes and goes\n"
       "    elif target.startswith('/'):\n"
       "        kinds[target] += 1  # any other file by name: a server's file would show here\n"
       "    else:\n"
       "        kinds[re.sub(r'\\[\\d+\\]|/.*', '', target)] += 1\n"
       "dict(kinds)")


def test_a_fork_served_kernel_holds_no_descriptor_a_cold_one_does_not():
    with Sandbox(None) as forked, Sandbox(None, cold_start=True) as cold:
        assert forked.manager.provisioner.fork_served
        fork_fds, cold_fds = evaluate(forked, FDS), evaluate(cold, FDS)
    assert "anon_inode:[pidfd]" not in fork_fds and "anon_inode:pidfd" not in fork_fds
    assert [kind for kind in fork_fds if kind.startswith("unix /")] == []
    assert fork_fds == cold_fds


def test_user_code_cannot_reach_the_fork_server(fresh_sandbox):
    """A kernel that could ask the server for kernels could run code outside its own limits."""
    path = forkserver.ForkServerClient().socket_path
    outcome = evaluate(fresh_sandbox, textwrap.dedent(f"""
        import socket, errno
        outcomes = []
        for attempt in (lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM),
                        lambda: open({path!r}, 'rb'),
                        lambda: __import__('os').listdir({str(Path(path).parent)!r})):
            try:
                attempt()
                outcomes.append('done')
            except OSError as exc:
                outcomes.append(errno.errorcode[exc.errno])
        outcomes
        """))
    assert outcome[0] == "EPERM"  # seccomp: no AF_UNIX sockets but socketpairs
    assert outcome[1] in ("EACCES", "ENXIO") and outcome[2] == "EACCES"  # Landlock, mode 0700


def test_each_virtualenv_gets_its_own_server(tmp_path):
    for env in ("a", "b"):
        (tmp_path / env).mkdir()
        (tmp_path / env / "python").symlink_to(sys.executable)
    keys = {forkserver.server_key(str(tmp_path / env / "python"), ()) for env in ("a", "b")}
    assert len(keys) == 2
    assert forkserver.server_key(sys.executable, ["pandas", "numpy"]) == \
        forkserver.server_key(sys.executable, ["numpy", "pandas"])


def _venv_on(base, venv):
    """A venv at venv on the interpreter binary base, seeing this environment's packages."""
    subprocess.run([str(base), "-m", "venv", "--clear", "--without-pip", str(venv)], check=True,
                   timeout=120)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    Path(purelib.strip(), "host.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    return venv / "bin" / "python"


def test_a_venv_rebuilt_at_the_same_path_gets_a_new_server_at_once(tmp_path):
    """The key once held the path only: kernels kept the old interpreter until the old server
    retired (#32 item 6). Two base binaries (copies, as two Python installs are) in turn."""
    bases = []
    for name in ("one", "two"):
        bases.append(tmp_path / name / "bin" / "python3")
        bases[-1].parent.mkdir(parents=True)
        shutil.copy2(os.path.realpath(sys.executable), bases[-1])
    clients, served_by = [], []
    try:
        for base in bases:
            python = _venv_on(base, tmp_path / "venv")
            clients.append(forkserver.ForkServerClient(python=str(python)))
            clients[-1].connect().close()
            served_by.append(os.readlink(f"/proc/{clients[-1].server_pid()}/exe"))
    finally:
        for client in clients:
            client.stop_server()
    assert served_by == [str(base) for base in bases]


def test_a_malformed_request_is_refused_and_the_server_goes_on():
    """The child forked for a request reads it; a bad one is refused with why, nothing runs."""
    from sandbox_kernel.launch.forkserver import protocol

    client = forkserver.ForkServerClient()
    with Sandbox(None):  # the server runs
        pass
    server = client.server_pid()
    for request, fds in (({"argv": "not a list", "env": {}}, 3), ({"argv": [], "env": {}}, 1),
                         ({"argv": [], "env": {"A": 1}}, 3)):
        conn = client.connect()
        stdio = [os.open(os.devnull, os.O_RDWR) for _ in range(fds)]
        try:
            socket.send_fds(conn, [protocol.frame(request)], stdio)
            conn.settimeout(30)
            reply, got = protocol.receive(conn)
        finally:
            conn.close()
            for fd in stdio:
                os.close(fd)
        assert got == [] and "three descriptors" in reply["error"], reply
    with Sandbox(None) as sb:  # the same server still forks kernels
        assert sb.manager.provisioner.fork_served
        assert evaluate(sb, "6 * 7") == 42
    assert client.server_pid() == server


def test_modules_laid_out_again_still_find_every_module_and_file_in_its_place():
    """sharing.compact_modules (the server's and each zygote's): new key and __file__ objects,
    equal names and paths, the same modules in the same order; imports still find what is
    loaded, and a module's source is still found from its file."""
    check = textwrap.dedent("""
        import importlib, inspect, linecache, sys
        import IPython, IPython.core.interactiveshell
        from sandbox_kernel.launch.forkserver import sharing
        before = list(sys.modules.items())
        files = {name: getattr(module, "__file__", None) for name, module in before}
        loaded = sys.modules["IPython.core.interactiveshell"]
        sharing.compact_modules()
        after = list(sys.modules.items())
        assert after == before, "names, modules or order changed"
        assert all(new is not old for (old, _), (new, _) in zip(before, after))
        now = {name: getattr(module, "__file__", None) for name, module in after}
        assert now == files, "a module's file changed"
        assert all(now[name] is not path for name, path in files.items()
                   if type(path) is str), "a __file__ was kept, not laid out again"
        assert importlib.import_module("IPython.core.interactiveshell") is loaded
        import IPython as again
        assert again is IPython and again.__name__ == "IPython"
        assert inspect.getsourcefile(loaded) == files["IPython.core.interactiveshell"]
        assert "class InteractiveShell" in inspect.getsource(loaded)
    """)
    done = subprocess.run([sys.executable, "-I", "-c", check], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr


def test_a_caller_holding_more_than_1024_descriptors_starts_runs_and_stops_kernels():
    """A service with ~100 sessions holds over 1024 descriptors: select() refused those
    ("filedescriptor out of range in select()") and the sessions' executes answered 500."""
    script = textwrap.dedent("""
        import os, resource
        from sandbox_kernel.client import Sandbox
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
        held = [os.dup(0) for _ in range(1100)]
        with Sandbox(None) as sandbox:
            assert sandbox.run("6 * 7").text == "42"
            process = sandbox.manager.provisioner.process
            assert process.pid > 0
        assert process.wait(timeout=30) is not None
        print("ok", max(held) > 1024)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok True\n"
