"""The seccomp policy, tried from inside a real sandboxed kernel: exact errnos, kernel alive."""

import dataclasses
import errno
import os
import signal
import subprocess
import sys
import textwrap

import pyseccomp
import pytest

from sandbox_kernel.confine import seccomp
from sandbox_kernel.confine.seccomp import rules
from sandbox_kernel.confine.seccomp.rules import Rule
from sandbox_kernel.launch import forkserver
from tests.helpers import RAW_SYSCALL, evaluate, ok

NR = {name: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) for name in (
    "getpid", "fork", "vfork", "execve", "execveat", "clone", "clone3", "kill", "tgkill",
    "fchmod", "fchmodat2", "mmap", "memfd_create", "socket", "ioctl", "prlimit64",
    "personality", "chmod", "setuid", "mknod", "seccomp",
    *seccomp.NEVER)}
HIGH = 1 << 32  # a high bit the kernel drops from an int argument but seccomp would compare
CLONE_NEWUSER = 0x10000000
THREAD_FLAGS = 0x10000 | 0x100 | 0x800  # CLONE_THREAD | CLONE_VM | CLONE_SIGHAND

pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64",
                                reason="raw syscall numbers and ABI checks are written for x86-64")


def denied_with(sandbox, call):
    """The (return, errno) of a raw syscall expression evaluated in the kernel."""
    ok(sandbox.run(RAW_SYSCALL))
    return tuple(evaluate(sandbox, call))


def assert_blocked(execution, phrase):
    assert execution.error is not None, "the call was not blocked"
    assert execution.error.name == "PermissionError"
    assert execution.error.value.startswith(
        "[Errno 1] Operation not permitted: the sandbox blocked")
    assert phrase in execution.error.value


def test_allowlist_and_never_list_do_not_overlap():
    assert not set(seccomp.ALLOWED) & set(seccomp.NEVER)
    rules = seccomp.allowlist_rules(1234, allow_network=True)
    assert not {r.syscall for r in rules} & set(seccomp.NEVER)


def _changed(filt, drop=lambda rule: False, allow=()):
    """filt with the rules drop selects removed (from both filters) and allow rules added."""
    return dataclasses.replace(filt, allow=tuple(r for r in filt.allow if not drop(r)) + allow,
                               deny=tuple(r for r in filt.deny if not drop(r)))


def _arg(arg, value, mask=0xFFFFFFFF):
    return ((arg, mask, value),)


def _is(name, *args):
    return lambda rule: rule.syscall == name and (not args or rule.args == args[0])


MAP_SHARED_ANON, O_TRUNC_ONLY = (0x01 | 0x20, 0x0F | 0x20), (0o1000, 0o3 | 0o1000)
# For each guarantee, changes to the rules that each undo it: what the kernel claims (describe(),
# promises.py) must then stop claiming it. (name, network, mutation) -> the describe() line too.
BREAKS = {
    "processes": [
        dict(allow=(Rule("fork"),)), dict(allow=(Rule("execve"),)),
        dict(allow=(Rule("clone3"),)),
        dict(drop=_is("clone"), allow=(Rule("clone"),)),
        dict(drop=_is("clone"), allow=(Rule("clone", args=((0, 0x10000, 0x10000),)),)),
    ],
    "signals": [
        dict(allow=(Rule("kill"),)), dict(allow=(Rule("tgkill", args=_arg(0, 1)),)),
        dict(allow=(Rule("tkill"),)),
        dict(allow=(Rule("fcntl", args=_arg(1, 8) + _arg(2, 1)),)),  # F_SETOWN, pid 1
        dict(allow=(Rule("fcntl", args=_arg(1, 15)),)),  # F_SETOWN_EX
        dict(allow=(Rule("fcntl"),)),
        dict(drop=_is("ioctl", _arg(1, 0x8901))),  # FIOSETOWN no longer refused
    ],
    "servers": [dict(allow=(Rule("bind"),)), dict(allow=(Rule("listen"),))],
    "unix_sockets": [
        dict(allow=(Rule("socket", args=_arg(0, 1)),)),  # AF_UNIX
        dict(allow=(Rule("socket"),)),
        dict(drop=_is("socketpair"), allow=(Rule("socketpair"),)),
    ],
    "watches": [dict(allow=(Rule("inotify_init1"),)), dict(allow=(Rule("fanotify_mark"),))],
    "rare_interfaces": [dict(allow=(Rule("bpf"),)), dict(allow=(Rule("io_uring_setup"),))],
    "network_off": [
        dict(allow=(Rule("connect"),)), dict(allow=(Rule("socket", args=_arg(0, 2)),)),
        dict(drop=_is("sendto", _arg(3, 0x20000000, 0x20000000))),
    ],
    "memory": [
        dict(allow=(Rule("mremap"),)), dict(allow=(Rule("memfd_create"),)),
        dict(drop=_is("mmap", _arg(3, MAP_SHARED_ANON[0], MAP_SHARED_ANON[1]))),
        dict(drop=_is("mmap", _arg(3, 0x100, 0x100))),
    ],
    "truncate": [
        dict(allow=(Rule("truncate"),)), dict(allow=(Rule("openat2"),)),
        dict(drop=_is("openat", _arg(2, *O_TRUNC_ONLY))),
    ],
}
# The describe() line each guarantee stands behind, and what it must say once broken.
DESCRIBED = {"processes": ("processes", "allowed"),
             "signals": ("signals", "to other processes too"),
             "servers": ("bind_listen", "allowed"),
             "truncate": ("truncate_by_path", "Landlock decides")}


def test_every_guarantee_holds_for_the_rules_a_kernel_loads():
    for allow_network in (False, True):
        for abi in (0, 7):
            kept = {key for key in rules.GUARANTEES
                    if rules.keeps(key, allow_network, landlock_abi=abi)}
            expected = set(rules.GUARANTEES) - ({"network_off"} if allow_network else set()) \
                - ({"truncate"} if abi >= 3 else set())
            assert kept == expected, (allow_network, abi)


@pytest.mark.parametrize(("key", "index"), [(key, index) for key, changes in BREAKS.items()
                                            for index in range(len(changes))])
def test_each_claim_is_read_from_its_rule(key, index):
    filt = rules.described(False, 0)
    guarantee = rules.GUARANTEES[key]
    assert guarantee.holds(filt)
    broken = _changed(filt, **BREAKS[key][index])
    assert not guarantee.holds(broken)
    if key in DESCRIBED:
        line, now = DESCRIBED[key]
        assert rules.summarize(filt)[line] != now
        assert rules.summarize(broken)[line] == now


def test_described_sockets_connect_and_never_list_follow_the_rules():
    off, on = rules.described(False), rules.described(True)
    assert rules.summarize(off)["sockets"] == "none (unix stream socketpair only)"
    assert rules.summarize(on)["sockets"] == "inet/inet6 stream+dgram, unix stream socketpair"
    assert (rules.summarize(off)["connect"], rules.summarize(on)["connect"]) == ("denied",
                                                                                 "allowed")
    leaky = _changed(off, allow=(Rule("socket", args=_arg(0, 1)), Rule("ptrace")))
    assert rules.summarize(leaky)["sockets"] == "any any, any socketpair"
    assert "ptrace" not in rules.summarize(leaky)["never"]
    assert rules.summarize(off)["never"] == list(seccomp.NEVER)


def test_a_promise_whose_rule_is_gone_is_no_longer_claimed(monkeypatch):
    from sandbox_kernel.confine import promises

    host = promises.Host(landlock_abi=7, landlock_on=True, seccomp_reason=None, seccomp_on=True,
                         allow_network=False, max_threads=0, memory_limit=0, uid=1234)
    servers = "servers: listen on no address or port"
    before = {p.name: p for p in promises.evaluate(host)}[servers]
    assert before.enforced_by == ["seccomp: " + rules.GUARANTEES["servers"].text]
    real = rules._described
    monkeypatch.setattr(rules, "_described", lambda network, abi: _changed(
        real(network, abi), allow=(Rule("listen"),)))
    rules._kept.cache_clear()  # read again, from the changed rules
    try:
        after = {p.name: p for p in promises.evaluate(host)}[servers]
    finally:
        monkeypatch.undo()
        rules._kept.cache_clear()
    assert after.enforced_by == [] and after.missing
    assert "its rules here do not keep it" in promises.refusal([after])


@pytest.mark.parametrize("code, phrase", [
    ("import subprocess; subprocess.run(['true'])", "creating processes is not allowed"),
    ("import os; os.system('true')", "os.system()"),
    ("import os; os.fork()", "os.fork()"),
    ("!ls", "os.forkpty()"),
    ("import os; os.execv('/bin/true', ['true'])", "os.execv()"),
    ("import os; os.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn()"),
    ("import multiprocessing as mp; mp.get_context('spawn').Process(target=print).start()",
     "creating processes is not allowed"),
    ("import socket; socket.socket()", "--network hosts --allow-host NAME"),
    ("import os; os.chmod(os.getcwd(), 0o700)", "changing file permissions is not allowed"),
    ("import fcntl, socket; fcntl.fcntl(socket.socketpair()[0], fcntl.F_SETOWN, 1)",
     "a descriptor's owner may only be the kernel's own process"),
    ("import socket; socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)",
     "only allows stream socketpairs"),
    ("import socket; socket.socketpair()[0].bind('server')", "listening for connections"),
    ("import socket; socket.socketpair()[0].listen()", "listening for connections"),
    ("import socket; socket.socketpair()[0].connect('/dev/log')",
     "--network hosts --allow-host NAME"),
])
def test_blocked_calls_say_why_and_the_kernel_lives(sandbox, code, phrase):
    assert_blocked(sandbox.run(code), phrase)
    assert evaluate(sandbox, "'still here'") == "still here"


def test_libraries_pass_the_reason_on(sandbox):
    ex = sandbox.run("import urllib.request; urllib.request.urlopen('http://127.0.0.1:9/')")
    assert ex.error.name == "URLError"  # urllib wraps the PermissionError, message and all
    assert "the sandbox blocked creating a socket" in ex.error.value


def test_raw_process_creation_is_denied(sandbox):
    for call, expected in [
        (f"raw({NR['fork']})", errno.EPERM),
        (f"raw({NR['vfork']})", errno.EPERM),
        (f"raw({NR['execve']}, 0, 0, 0)", errno.EPERM),
        (f"raw({NR['execveat']}, -100, 0, 0, 0, 0)", errno.EPERM),
        (f"raw({NR['clone']}, {signal.SIGCHLD}, 0, 0, 0, 0)", errno.EPERM),
        # a "thread" that also asks for a new user namespace
        (f"raw({NR['clone']}, {THREAD_FLAGS | CLONE_NEWUSER}, 0, 0, 0, 0)", errno.EPERM),
        (f"raw({NR['clone3']}, 0, 0)", errno.ENOSYS),  # glibc then falls back to clone
    ]:
        assert denied_with(sandbox, call) == (-1, expected), call


def test_socket_families_without_network(sandbox):
    import socket

    for family, kind in [(socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, 2),
                         (socket.AF_UNIX, 1), (socket.AF_NETLINK, 3), (socket.AF_PACKET, 3),
                         (socket.AF_INET | HIGH, socket.SOCK_STREAM)]:
        call = f"raw({NR['socket']}, {family}, {kind}, 0)"
        assert denied_with(sandbox, call) == (-1, errno.EPERM), call
    # socketpair stays: asyncio needs it for its self-pipe
    assert evaluate(sandbox, "import socket; len(socket.socketpair())") == 2


def test_socket_families_with_network(net_sandbox):
    import socket

    code = "import socket; s = socket.socket(); s.close(); s.family.name"
    assert evaluate(net_sandbox, code) == "AF_INET"
    for family, kind, expected in [
        (socket.AF_INET | HIGH, socket.SOCK_DGRAM, 0),  # the kernel sees AF_INET: allowed
        (socket.AF_INET, socket.SOCK_RAW, errno.EPERM),
        (socket.AF_UNIX, socket.SOCK_STREAM, errno.EPERM),
        (socket.AF_NETLINK, socket.SOCK_RAW, errno.EPERM),
        (socket.AF_PACKET, socket.SOCK_RAW, errno.EPERM),
        (socket.AF_VSOCK, socket.SOCK_STREAM, errno.EPERM),
        (socket.AF_ALG, socket.SOCK_SEQPACKET, errno.EPERM),
    ]:
        ret, err = denied_with(net_sandbox, f"raw({NR['socket']}, {family}, {kind}, 0)")
        assert err == expected, (family, kind)
        if expected == 0:
            ok(net_sandbox.run(f"import os; os.close({ret})"))
    assert_blocked(net_sandbox.run("import socket; socket.socket(socket.AF_UNIX)"),
                   "only allows AF_INET/AF_INET6")


def test_signals_only_reach_this_process(sandbox):
    # Its parent: the test process (cold start) or the fork server (or init, if that is gone).
    parent = evaluate(sandbox, "import os; os.getppid()")
    assert parent in (os.getpid(), forkserver.ForkServerClient().server_pid(), 1)
    own = evaluate(sandbox, "os.getpid()")
    cases = [
        (f"raw({NR['kill']}, {own}, 0)", (0, 0)),
        (f"raw({NR['kill']}, {own | HIGH}, 0)", (0, 0)),  # the kernel truncates to own pid
        (f"raw({NR['kill']}, {parent}, 0)", (-1, errno.EPERM)),
        (f"raw({NR['kill']}, {parent | HIGH}, 0)", (-1, errno.EPERM)),
        (f"raw({NR['kill']}, 0, 0)", (-1, errno.EPERM)),  # own process group
        (f"raw({NR['kill']}, {2**64 - 1}, 0)", (-1, errno.EPERM)),  # -1: every process
        (f"raw({NR['tgkill']}, {parent}, {parent}, 0)", (-1, errno.EPERM)),
        (f"raw({NR['prlimit64']}, {parent}, 7, 0, 0)", (-1, errno.EPERM)),
        (f"raw({NR['kill']}, {os.getpid()}, 0)", (-1, errno.EPERM)),  # the launcher
    ]
    for call, expected in cases:
        assert denied_with(sandbox, call) == expected, call


def test_limits_can_be_read_not_raised(sandbox):
    code = ("import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "try:\n    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))\n"
            "    r = 'changed'\nexcept (ValueError, OSError) as e:\n    r = str(e)\nr")
    assert evaluate(sandbox, code) == "not allowed to raise maximum limit"


@pytest.mark.parametrize("name", ["io_uring_setup", "bpf", "userfaultfd", "perf_event_open",
                                  "keyctl", "add_key", "mount", "umount2", "unshare", "setns",
                                  "ptrace", "process_vm_readv", "process_vm_writev", "kexec_load",
                                  "init_module", "finit_module", "open_by_handle_at", "seccomp",
                                  "setuid", "mknod", "pidfd_getfd", "chroot", "pivot_root"])
def test_never_list_returns_eperm(sandbox, name):
    assert denied_with(sandbox, f"raw({NR[name]}, 0, 0, 0, 0, 0)") == (-1, errno.EPERM)


def test_argument_rules(sandbox):
    import termios

    ok(sandbox.run(RAW_SYSCALL + "import os, tempfile\nr, w = os.pipe()\n"
                   "fd, path = tempfile.mkstemp()\n"
                   "buffers = [_ct.create_string_buffer(path.encode()), _ct.c_int()]\n"
                   "c_path, c_int = map(_ct.addressof, buffers)\n"))
    cases = [
        (f"raw({NR['personality']}, 0xffffffff)", (0, 0)),  # query: allowed (PER_LINUX is 0)
        (f"raw({NR['personality']}, 0x0040000)", (-1, errno.EPERM)),  # ADDR_NO_RANDOMIZE
        (f"raw({NR['ioctl']}, r, {termios.TIOCSTI}, 0)", (-1, errno.EPERM)),
        (f"raw({NR['ioctl']}, r, {termios.TIOCSTI | HIGH}, 0)", (-1, errno.EPERM)),
        (f"raw({NR['ioctl']}, r, 0x541C, 0)", (-1, errno.EPERM)),  # TIOCLINUX
        (f"raw({NR['ioctl']}, r, {termios.FIONREAD}, c_int)", (0, 0)),  # other ioctls work
        # file modes cannot change at all (Landlock does not cover chmod on paths)
        (f"raw({NR['chmod']}, c_path, 0o4755)", (-1, errno.EPERM)),
        (f"raw({NR['chmod']}, c_path, 0o600)", (-1, errno.EPERM)),
        (f"raw({NR['fchmod']}, fd, 0o777)", (-1, errno.EPERM)),
        (f"raw({NR['fchmodat2']}, -100, c_path, 0o777, 0)", (-1, errno.EPERM)),
        # shared anonymous memory would escape the memory limit; private mappings are fine
        (f"raw({NR['mmap']}, 0, 4096, 3, 0x21, -1, 0)", (-1, errno.EPERM)),
        (f"raw({NR['mmap']}, 0, 4096, 3, 0x23 | {HIGH}, -1, 0)", (-1, errno.EPERM)),
        (f"raw({NR['memfd_create']}, c_path, 0)", (-1, errno.EPERM)),
        ("raw(1000)", (-1, errno.EPERM)),  # unknown syscall numbers: EPERM, not ENOSYS
    ]
    for call, expected in cases:
        assert tuple(evaluate(sandbox, call)) == expected, call
    ok(sandbox.run("os.close(r); os.close(w); os.close(fd); os.unlink(path)"))


def test_every_thread_is_filtered_including_late_ones(sandbox):
    code = """
import threading, pathlib
def status(task):
    try:
        return (task / 'status').read_text()
    except FileNotFoundError:  # a thread that ended after the listing (one just joined)
        return ''
def modes():
    return sorted({line.split()[1] for task in pathlib.Path('/proc/self/task').iterdir()
                   for line in status(task).splitlines()
                   if line.startswith(('Seccomp:', 'NoNewPrivs:'))})
late = {}
def record():
    late['status'] = pathlib.Path('/proc/thread-self/status').read_text()
t = threading.Thread(target=record)
t.start(); t.join()
(len(list(pathlib.Path('/proc/self/task').iterdir())) > 3, modes(),
 'Seccomp:\\t2' in late['status'], 'Seccomp_filters:\\t2' in late['status'])
"""
    assert evaluate(sandbox, code) == (True, ["1", "2"], True, True)


def test_thread_modes_reads_every_threads_filter_state():
    # The check install() makes after loading: one mode per thread, 0 before and 2 after.
    code = """
import os, threading
from sandbox_kernel.confine.seccomp import denylist, load, thread_modes
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(3)]
for thread in threads:
    thread.start()
tids = {os.getpid(), *(thread.native_id for thread in threads)}
before = thread_modes()
load(denylist(False), listener=False)
after = thread_modes()
stop.set()
print(set(before) == set(after) == tids, sorted(set(before.values())), sorted(set(after.values())))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "True [0] [2]"


def test_subshell_threads_are_filtered(fresh_sandbox):
    client = fresh_sandbox.client
    if "kernel subshells" not in fresh_sandbox.kernel_info()["supported_features"]:
        pytest.skip("this ipykernel has no subshells")
    client.control_channel.send(client.session.msg("create_subshell_request", {}))
    subshell_id = client.control_channel.get_msg(timeout=10)["content"]["subshell_id"]
    msg = client.session.msg("execute_request", {
        "code": "import os, threading\n"
                "try:\n    os.fork(); r = 'forked'\nexcept PermissionError as e:\n    r = e.errno\n"
                "(r, threading.current_thread() is threading.main_thread(),"
                " open('/proc/thread-self/status').read().count('Seccomp:\\t2'))",
        "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False})
    msg["header"]["subshell_id"] = subshell_id
    client.shell_channel.send(msg)
    result = None
    while True:
        reply = client.get_iopub_msg(timeout=20)
        if reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            continue
        if reply["msg_type"] == "execute_result":
            result = reply["content"]["data"]["text/plain"]
        if reply["msg_type"] == "status" and reply["content"]["execution_state"] == "idle":
            break
    assert result == f"({errno.EPERM}, False, 1)"


@pytest.mark.parametrize("attack", [
    # x32 ABI: the same syscall number with bit 30 set
    f"raw({0x40000000} | {39})",
    # i386 entry point: `mov eax, 20 (getpid); int 0x80; ret`, run from an executable page
    "import mmap\nm = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE,\n"
    "              prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
    "m.write(b'\\xb8\\x14\\x00\\x00\\x00\\xcd\\x80\\xc3')\n"
    "_ct.CFUNCTYPE(_ct.c_long)(_ct.addressof(_ct.c_char.from_buffer(m)))()",
])
def test_foreign_abis_kill_the_process(fresh_sandbox, attack):
    process = fresh_sandbox.manager.provisioner.process
    ex = fresh_sandbox.run(RAW_SYSCALL + attack)
    assert process.wait(timeout=10) == -signal.SIGSYS
    assert ex.error.name == "KernelDied" and ex.state_lost
    assert evaluate(fresh_sandbox, "'fresh kernel answers'") == "fresh kernel answers"


# A launcher whose own filter makes seccomp() unusable, as on a host kernel without it.
NO_SECCOMP_LAUNCHER = textwrap.dedent("""
    import errno, os, sys
    import pyseccomp as sc
    f = sc.SyscallFilter(sc.ALLOW)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "seccomp")
    f.add_rule(sc.ERRNO(errno.EINVAL), "prctl", sc.Arg(0, sc.EQ, 22))  # PR_SET_SECCOMP
    f.load()
    os.execv(sys.executable, [sys.executable, "-I", "-m", "sandbox_kernel", "-f", sys.argv[1]])
""")


def test_fails_closed_when_seccomp_cannot_be_loaded(tmp_path):
    from jupyter_client.connect import write_connection_file

    connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"))
    result = subprocess.run([sys.executable, "-c", NO_SECCOMP_LAUNCHER, connection_file],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    lines = [line.partition("] ")[2] for line in result.stderr.splitlines()  # after the mark
             if "refusing to start" in line]
    assert len(lines) == 1
    assert lines[0].startswith("sandbox-kernel: refusing to start: seccomp: loading")
    assert "--no-seccomp" in lines[0]
