"""A tamper-proof record of denials: the reaper answers and records every refused call.

Refused calls wait on the filter's listener, which only the reaper holds; it answers EPERM and
appends one JSON line per denial to --audit-log. User code can neither write that file nor stop
the reaper, and without the reaper refused calls still fail (ENOSYS).
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import RAW_SYSCALL, evaluate

SYS_ACCT = 163  # refused by the allowlist; a marker argument finds it in the record
MARKER = 0x5EED0ACC7

# User code's helper: the errno name a call fails with, or 'done'.
OUTCOME = """
import errno
def outcome(fn):
    try:
        fn()
        return 'done'
    except OSError as exc:
        return errno.errorcode[exc.errno]
"""

ATTACKS = RAW_SYSCALL + OUTCOME + f"""
import errno, os, socket
(outcome(os.fork), outcome(lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)),
 errno.errorcode[raw({SYS_ACCT}, {MARKER})[1]])
"""


def reaper_of(sandbox):
    """The pid of the kernel's reaper: the kernel's only child."""
    kernel = sandbox.manager.provisioner.pid
    children = Path(f"/proc/{kernel}/task/{kernel}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def kernel_id(sandbox):
    name = Path(sandbox.manager.connection_file).stem
    return name.removeprefix("kernel-")


def records(path, timeout=10.0, at_least=0):
    """The audit file's records (waiting a little for the reaper to write them)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= at_least or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.1)


def _records_until(path, wanted, timeout=10.0):
    """The audit file's records once wanted(records) holds, or when the time is up."""
    deadline = time.monotonic() + timeout
    while not wanted(found := records(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """A kernel recording its denials into a file of the test's."""
    path = tmp_path_factory.mktemp("audit") / "denials.jsonl"
    with Sandbox(None, policy=SandboxPolicy(audit_log=str(path))) as sb:
        yield sb, path


def test_each_refused_call_is_recorded_once_with_the_kernel_id(audited):
    sandbox, path = audited
    assert evaluate(sandbox, ATTACKS) == ("EPERM", "EPERM", "EPERM")
    found = records(path, at_least=3)
    forks = [r for r in found if r.get("syscall") == "clone" and int(r["args"][0], 16) & 0xFF
             == signal.SIGCHLD]
    sockets = [r for r in found
               if r.get("syscall") == "socket" and r["args"][:2] == ["0xa", "0x80002"]]
    raws = [r for r in found if r.get("syscall") == "acct" and r["args"][0] == hex(MARKER)]
    assert (len(forks), len(sockets), len(raws)) == (1, 1, 1), found
    for entry in (forks[0], sockets[0], raws[0]):
        assert entry["kernel"] == kernel_id(sandbox)
        assert entry["errno"] == "EPERM"
        assert entry["uid"] == evaluate(sandbox, "__import__('os').getuid()")
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_user_code_cannot_write_or_find_the_audit_file(audited):
    sandbox, path = audited
    before = path.read_bytes()
    code = OUTCOME + f"""
import errno, os
held = [os.readlink(f'/proc/self/fd/{{fd}}') for fd in os.listdir('/proc/self/fd')
        if os.path.exists(f'/proc/self/fd/{{fd}}')]
(outcome(lambda: open({str(path)!r}, 'a').write('{{"forged": 1}}\\n')),
 outcome(lambda: os.truncate({str(path)!r}, 0)), outcome(lambda: os.unlink({str(path)!r})),
 {str(path)!r} in held, any('seccomp' in target for target in held))
"""
    assert evaluate(sandbox, code) == ("EACCES", "EACCES", "EACCES", False, False)
    assert path.read_bytes().startswith(before)
    assert b"forged" not in path.read_bytes()


def test_user_code_cannot_signal_trace_or_stop_the_reaper(audited):
    sandbox, _ = audited
    pid = reaper_of(sandbox)
    code = RAW_SYSCALL + OUTCOME + f"""
import errno, os, signal
PTRACE_ATTACH, PTRACE_SEIZE, SYS_ptrace, SYS_pidfd_open = 16, 0x4206, 101, 434
(outcome(lambda: os.kill({pid}, signal.SIGKILL)), outcome(lambda: os.kill({pid}, signal.SIGSTOP)),
 outcome(lambda: os.killpg({pid}, signal.SIGKILL)),
 errno.errorcode[raw(SYS_ptrace, PTRACE_ATTACH, {pid}, 0, 0)[1]],
 errno.errorcode[raw(SYS_ptrace, PTRACE_SEIZE, {pid}, 0, 0)[1]],
 errno.errorcode[raw(SYS_pidfd_open, {pid}, 0)[1]],
 outcome(lambda: open('/proc/{pid}/mem', 'rb')))
"""
    assert evaluate(sandbox, code) == ("EPERM", "EPERM", "EPERM", "EPERM", "EPERM", "EPERM",
                                       "EACCES")
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state == "S"  # alive, not stopped or traced
    assert evaluate(sandbox, ATTACKS) == ("EPERM", "EPERM", "EPERM")  # and still answering


def test_user_code_cannot_make_the_reaper_fault_through_the_shared_count(fresh_sandbox):
    """The count of refused calls is a memfd the reaper maps writable: shrinking it under the
    reaper's mapping would kill the reaper (SIGBUS) at the next refusal. It is sealed."""
    pid = reaper_of(fresh_sandbox)
    code = OUTCOME + """
import os
fds = [int(fd) for fd in os.listdir('/proc/self/fd') if os.path.exists(f'/proc/self/fd/{fd}')
       and os.readlink(f'/proc/self/fd/{fd}').startswith('/memfd:sandbox-kernel-tally')]
(len(fds), [outcome(lambda: os.ftruncate(fd, 0)) for fd in fds],
 [outcome(lambda: os.ftruncate(fd, 1 << 20)) for fd in fds])
"""
    count, shrink, grow = evaluate(fresh_sandbox, code)
    assert (count, shrink, grow) == (1, ["EPERM"], ["EPERM"])
    assert evaluate(fresh_sandbox, ATTACKS) == ("EPERM", "EPERM", "EPERM")  # answered, counted
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state == "S"  # the reaper is alive
    execution = fresh_sandbox.run(ATTACKS)
    assert execution.error is None and execution.usage.refused_syscalls == 3


def test_refused_calls_still_fail_without_the_reaper(tmp_path):
    path = tmp_path / "denials.jsonl"
    with Sandbox(None, policy=SandboxPolicy(audit_log=str(path))) as sb:
        pid = reaper_of(sb)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # With the listener gone, the filter answers ENOSYS: still a refusal, and no process.
        assert evaluate(sb, ATTACKS) == ("ENOSYS", "ENOSYS", "ENOSYS")
        assert evaluate(sb, "import threading\nt = threading.Thread(target=int)\nt.start()\n"
                            "t.join()\n2 + 2") == 4


def test_rate_limit_counts_what_it_does_not_record(tmp_path):
    path = tmp_path / "denials.jsonl"
    # Each call after some work of the kernel's own: its CPU pays for the answers (share.py).
    flood = RAW_SYSCALL + f"set((raw({SYS_ACCT}, {MARKER}), sum(range(20_000)))[0] " \
                          "for _ in range(1000))"
    with Sandbox(None, policy=SandboxPolicy(audit_log=str(path))) as sb:
        assert evaluate(sb, flood) == {(-1, 1)}
        assert evaluate(sb, RAW_SYSCALL + f"raw({SYS_ACCT}, 1)") == (-1, 1)
        # The count of what was left out is written within a second, while the kernel runs
        # and no later record comes.
        assert any("suppressed" in r for r in _records_until(
            path, lambda found: any("suppressed" in r for r in found)))
    deadline = time.monotonic() + 30  # the reaper writes the last count when the kernel ends
    while True:
        found = records(path)
        recorded = [r for r in found if r.get("syscall") == "acct"]
        suppressed = sum(r.get("suppressed", 0) for r in found)
        if len(recorded) + suppressed >= 1001 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(recorded) < 200
    assert len(recorded) + suppressed == 1001, (len(recorded), suppressed)


def test_without_audit_log_the_record_goes_to_the_default_file_that_check_names(fresh_sandbox):
    """No --audit-log: the record is still kept, in the default audit file, and the launcher's
    `sandbox-kernel check` names that file."""
    import random
    import subprocess
    import sys

    from sandbox_kernel.confine import audit

    marker = random.getrandbits(48)
    assert evaluate(fresh_sandbox, RAW_SYSCALL + f"raw({SYS_ACCT}, {marker})") == (-1, 1)
    path = Path(audit.default_path())
    assert str(path) == ("/var/log/sandbox-kernel/audit.jsonl" if os.getuid() == 0 else
                         os.path.expanduser("~/.local/state/sandbox-kernel/audit.jsonl"))
    deadline = time.monotonic() + 10
    while not (path.exists() and hex(marker).encode() in path.read_bytes()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    [entry] = [json.loads(line) for line in path.read_text().splitlines() if hex(marker) in line]
    assert (entry["kernel"], entry["syscall"]) == (kernel_id(fresh_sandbox), "acct")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    said = subprocess.run([sys.executable, "-m", "sandbox_kernel", "check"], capture_output=True,
                          text=True, timeout=60).stdout
    assert (f"  audit record (refused calls, egress connections): {path} (the default; "
            "--audit-log PATH chooses another)") in said.splitlines()


def test_a_connection_open_when_the_kernel_dies_is_recorded(tmp_path):
    """An allowed tunnel still open when the kernel is killed: its record at open is there at
    once, and the reaper writes its end when it sees the kernel's."""
    from tests.network_servers import Catcher

    path = tmp_path / "audit.jsonl"
    catcher = Catcher()  # keeps the connection open: only the kernel's end ends it
    policy = SandboxPolicy(network="on", allow_addresses=[f"127.0.0.1:{catcher.port}"],
                           audit_log=str(path))
    code = f"""
import socket
held = socket.create_connection(("127.0.0.1", 3128), timeout=10)
held.sendall(b"CONNECT 127.0.0.1:{catcher.port} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\nstill open")
held.recv(4096).split(b"\\r\\n")[0].decode()
"""
    try:
        with Sandbox(None, policy=policy) as sb:
            assert evaluate(sb, code) == "HTTP/1.1 200 Connection established"
            opened = [r for r in records(path, at_least=1) if r.get("event") == "egress-open"]
            assert [(r["host"], r["port"], r["allowed"]) for r in opened] == [
                ("127.0.0.1", catcher.port, True)]
            os.kill(sb.manager.provisioner.pid, signal.SIGKILL)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not any(
                    r.get("event") == "egress" for r in records(path, timeout=0)):
                time.sleep(0.1)
    finally:
        catcher.close()
    [ended] = [r for r in records(path) if r.get("event") == "egress"]
    assert (ended["host"], ended["port"], ended["allowed"], ended["sent"]) == (
        "127.0.0.1", catcher.port, True, len("still open"))
    # Either the reaper cut it at the kernel's end, or the proxy saw the dead kernel's socket
    # close first: both are recorded, neither is lost with the kernel.
    assert ended.get("reason") in (None, "cut when the kernel ended"), ended
