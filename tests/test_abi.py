"""Every promise at every Landlock ABI: kernels run as if the host's ABI were 1 through 7.

`--landlock-abi N` builds the Landlock ruleset exactly as on a host whose kernel offers ABI N
(the running kernel accepts rulesets of any older ABI), so the attacks that only work where
Landlock lacks a right (signals through a descriptor's owner before ABI 6, reconnecting one of
the kernel's own TCP sockets before ABI 4, truncation before ABI 3) are tried at each ABI, against
one shared kernel per ABI. The seccomp rules that stand in for the missing rights must stop them.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.confine.landlock import abi_version
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import evaluate, ok
from tests.test_hostile import CANARY_TEXT, HIGH, HOSTILE_POLICY, PRELUDE, nr

HOST_ABI = abi_version()
ABIS = [abi for abi in range(1, 8) if abi <= HOST_ABI]
EPERM = (-1, errno.EPERM)
DENIED = ("PermissionError", errno.EPERM)
EACCES = ("PermissionError", errno.EACCES)

pytestmark = [
    pytest.mark.skipif(not ABIS, reason="Landlock is not available on this host"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="raw syscalls written for x86-64"),
]

F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902
MSG_FASTOPEN = 0x20000000


@pytest.fixture(scope="module")
def read_grant():
    """A directory user code may read (and reach by its permissions), but not write."""
    grant = Path(tempfile.mkdtemp(prefix="sandbox-kernel-grant-", dir="/tmp"))
    grant.chmod(0o755)
    yield grant
    shutil.rmtree(grant)


@pytest.fixture(scope="module", params=ABIS, ids=[f"abi{abi}" for abi in ABIS])
def at_abi(request, read_grant):
    """A hostile kernel that sees Landlock as ABI N, and the uid its user code runs as."""
    abi = request.param
    policy = SandboxPolicy(landlock_abi=abi, read_paths=[str(read_grant)], **HOSTILE_POLICY)
    with Sandbox(None, policy=policy) as sb:
        ok(sb.run(PRELUDE + CSTR_BYTES))
        layers = sb.kernel_info()["sandbox"]["layers"]
        assert layers["landlock"]["abi"] == abi
        yield abi, sb, layers["privileges"]["uid"]


@pytest.fixture
def victim_process(at_abi):
    """A process of the same uid as user code: a signal from the sandbox would be delivered."""
    _, _, uid = at_abi
    process = subprocess.Popen(["sleep", "60"], user=uid)
    yield process.pid
    time.sleep(0.2)  # a SIGIO is delivered asynchronously
    assert process.poll() is None, "the sandbox signalled a process outside it"
    process.kill()
    process.wait()


# Finding 1: the owner of a descriptor is signalled by SIGIO/F_SETSIG; Landlock's signal scope
# only exists from ABI 6, so seccomp refuses to name another process as owner on every ABI.
SIGIO_ATTACK = """
import fcntl, socket, signal
a, b = socket.socketpair()
verdict = trap(lambda: fcntl.fcntl(a, fcntl.F_SETOWN, {victim}))
fcntl.fcntl(a, {F_SETSIG}, signal.SIGTERM)
fcntl.fcntl(a, fcntl.F_SETFL, fcntl.fcntl(a, fcntl.F_GETFL) | os.O_ASYNC)
b.send(b'x'); a.recv(1); b.close(); a.close()
verdict
"""


def test_sigio_to_another_process(at_abi, victim_process):
    _, sb, _ = at_abi
    code = SIGIO_ATTACK.format(victim=victim_process, F_SETSIG=F_SETSIG)
    assert tuple(evaluate(sb, code)) == DENIED


@pytest.mark.parametrize("attack", [
    "raw({fcntl}, a.fileno(), {F_SETOWN}, {victim} | {HIGH})",  # high bits the kernel drops
    "raw({fcntl}, a.fileno(), {F_SETOWN}, 2**64 - {victim})",  # the victim's process group
    "raw({fcntl}, a.fileno(), {F_SETOWN_EX}, cstr_bytes((1).to_bytes(4, 'little')"
    " + ({victim}).to_bytes(4, 'little')))",  # struct f_owner_ex {F_OWNER_PID, victim}
    "raw({ioctl}, a.fileno(), {FIOSETOWN}, ctypes.addressof(ctypes.c_int({victim})))",
    "raw({ioctl}, a.fileno(), {SIOCSPGRP}, ctypes.addressof(ctypes.c_int({victim})))",
    "raw({fcntl}, a.fileno(), {F_SETOWN} | {HIGH}, {victim})",  # high bits in the command
    "tuple(in_thread(lambda: __import__('fcntl').fcntl(a, 8, {victim})))",
], ids=["high-bits", "process-group", "F_SETOWN_EX", "FIOSETOWN", "SIOCSPGRP", "command-high-bits",
        "thread"])
def test_other_ways_to_own_a_descriptor(at_abi, victim_process, attack):
    _, sb, _ = at_abi
    code = ("a, b = socket.socketpair()\n" + attack.format(
        fcntl=nr("fcntl"), ioctl=nr("ioctl"), victim=victim_process, HIGH=HIGH,
        F_SETOWN=F_SETOWN, F_SETOWN_EX=F_SETOWN_EX, FIOSETOWN=FIOSETOWN, SIOCSPGRP=SIOCSPGRP))
    outcome = tuple(evaluate(sb, code))
    assert outcome in (EPERM, DENIED), outcome


def test_owning_a_descriptor_itself_still_works(at_abi):
    _, sb, _ = at_abi
    code = ("import fcntl\na, b = socket.socketpair()\n"
            "fcntl.fcntl(a, fcntl.F_SETOWN, os.getpid()), fcntl.fcntl(a, fcntl.F_GETOWN)")
    assert evaluate(sb, code)[1] == evaluate(sb, "os.getpid()")


# Finding 2: connect(AF_UNSPEC) drops a connected TCP socket's peer, then connect() goes
# anywhere; Landlock handles TCP connect only from ABI 4. Without the network the kernel needs
# no connect() at all. MSG_FASTOPEN connects inside sendto().
RECONNECT = """
fds = kernel_tcp_fds()
unspec = bytes(16)  # sockaddr with sa_family AF_UNSPEC
there = socket.inet_aton('127.0.0.1')
addr = (2).to_bytes(2, 'little') + (9).to_bytes(2, 'big') + there + bytes(8)
out = set()
for fd in fds:
    dup = os.dup(fd)
    out.add(raw({connect}, dup, cstr_bytes(unspec), 16))
    out.add(raw({connect}, dup, cstr_bytes(addr), 16))
    out.add(raw({sendto}, dup, cstr_bytes(b'x'), 1, {MSG_FASTOPEN}, cstr_bytes(addr), 16))
    out.add(raw({sendto}, dup, cstr_bytes(b'x'), 1, {MSG_FASTOPEN} | {HIGH}, cstr_bytes(addr), 16))
    os.close(dup)
(len(fds) > 0, sorted(out))
"""
CSTR_BYTES = """
def cstr_bytes(data):
    buf = ctypes.create_string_buffer(data, len(data))
    _keep.append(buf)
    return ctypes.addressof(buf)
"""


def test_reconnecting_a_kernel_socket(at_abi):
    _, sb, _ = at_abi
    code = RECONNECT.format(connect=nr("connect"), sendto=nr("sendto"),
                            MSG_FASTOPEN=MSG_FASTOPEN, HIGH=HIGH)
    found, outcomes = evaluate(sb, code)
    assert found, "the kernel has TCP sockets to try"
    assert [tuple(o) for o in outcomes] == [EPERM]
    assert evaluate(sb, "'alive'") == "alive"  # its own connections survived
    from_thread = evaluate(sb, "in_thread(lambda: socket.socket(fileno=os.dup(kernel_tcp_fds()[0]))"
                               ".connect(('127.0.0.1', 9)))")
    assert tuple(from_thread) == DENIED


# Finding 3: truncation by path (and by open(O_RDONLY|O_TRUNC)) of a file the kernel's uid
# owns; Landlock handles truncation only from ABI 3.
@pytest.fixture
def owned_canary(at_abi, read_grant):
    """A file granted read-only that user code's uid owns (as root owns the interpreter's)."""
    _, _, uid = at_abi
    canary = read_grant / "owned.txt"
    canary.write_text(CANARY_TEXT)
    os.chown(canary, uid, -1)
    yield str(canary)
    assert canary.read_text() == CANARY_TEXT
    canary.unlink()


@pytest.mark.parametrize("attack", [
    "trap(lambda: os.truncate('{path}', 0))",
    "trap(lambda: os.open('{path}', os.O_RDONLY | os.O_TRUNC))",
    "raw({openat}, -100, cstr('{path}'), os.O_RDONLY | os.O_TRUNC | {HIGH}, 0)",
    "raw({open}, cstr('{path}'), os.O_RDONLY | os.O_TRUNC, 0)",
    "raw({openat2}, -100, cstr('{path}'), cstr_bytes((0o1000).to_bytes(8, 'little')"
    " + bytes(16)), 24)",
    "in_thread(lambda: os.truncate('{path}', 0))",
], ids=["truncate", "O_TRUNC", "openat-high-bits", "open", "openat2", "thread"])
def test_truncating_a_host_file_the_uid_owns(at_abi, owned_canary, attack):
    abi, sb, _ = at_abi
    code = attack.format(path=owned_canary, openat=nr("openat"), open=nr("open"),
                         openat2=nr("openat2"), HIGH=HIGH)
    outcome = tuple(evaluate(sb, code))
    if "openat2" in attack:
        # Before ABI 3 openat2 says ENOSYS (callers fall back to openat); then Landlock decides.
        assert outcome == ((-1, errno.ENOSYS) if abi < 3 else (-1, errno.EACCES))
    elif "truncate" in attack and abi >= 3:
        assert outcome == EACCES  # Landlock's truncate right
    else:
        assert outcome in (EPERM, DENIED)  # seccomp


def test_truncation_inside_scratch(at_abi):
    abi, sb, _ = at_abi
    ok(sb.run("open('mine.txt', 'w').write('0123456789')\n"
              "with open('mine.txt', 'r+') as f:\n    f.truncate(4)"))
    assert evaluate(sb, "open('mine.txt').read()") == "0123"
    by_path = evaluate(sb, "trap(lambda: os.truncate('mine.txt', 2))")
    assert by_path == ("ok" if abi >= 3 else DENIED)
    if abi < 3:
        ex = sb.run("os.truncate('mine.txt', 2)")
        assert "truncating a file by its path" in ex.error.value
        assert "f.truncate()" in ex.error.value


def test_files_outside_the_grants_at_every_abi(at_abi):
    _, sb, _ = at_abi
    assert tuple(evaluate(sb, "trap(lambda: open('/etc/shadow').read())")) == EACCES
    assert tuple(evaluate(sb, "trap(lambda: open('/etc/hostname', 'a'))")) == EACCES


WORKLOAD = """
import asyncio, sqlite3, threading, io
import numpy, pandas
import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt
async def twice(x):
    await asyncio.sleep(0)
    return 2 * x
con = sqlite3.connect('work.db'); con.execute('create table if not exists t(x)')
con.execute('insert into t values (21)'); con.commit()
box = []
def work():  # a thread of its own, with an event loop of its own (self-pipe: a socketpair)
    box.append(asyncio.run(twice(con2.execute('select x from t').fetchone()[0])))
    box.append(numpy.arange(4).sum())
con2 = sqlite3.connect('work.db', check_same_thread=False)
t = threading.Thread(target=work); t.start(); t.join()
fig, ax = plt.subplots(); ax.plot([1, 2]); png = io.BytesIO(); fig.savefig(png, format='png')
[box[0], int(box[1]),
 int(pandas.DataFrame({'a': [1, 2]}).a.sum()), png.getvalue()[:4] == b'\\x89PNG']
"""


def test_the_scientific_stack_works(at_abi):
    _, sb, _ = at_abi
    assert evaluate(sb, WORKLOAD) == [42, 6, 3, True]


def test_layers_report_the_compensations(at_abi):
    abi, sb, _ = at_abi
    layers = sb.kernel_info()["sandbox"]["layers"]
    kept = {p["promise"]: p["enforced_by"] for p in layers["promises"]}
    truncation = kept["files: truncate none outside the grants"]
    signals = kept["other processes: signal none"]
    assert any(k.startswith("Landlock truncate") for k in truncation) == (abi >= 3)
    assert any(k.startswith("seccomp") for k in truncation) == (abi < 3)
    assert any(k.startswith("Landlock signal") for k in signals) == (abi >= 6)
    assert any(k.startswith("seccomp") for k in signals)
    assert layers["seccomp"]["truncate_by_path"] == (
        "Landlock decides" if abi >= 3 else "denied (Landlock ABI < 3)")


# The kernel never claims more than the host has, and refuses without Landlock at all.
def _check(*flags):
    result = subprocess.run([sys.executable, "-m", "sandbox_kernel", "check", "--json", *flags],
                            capture_output=True, text=True, timeout=60)
    return result.returncode, json.loads(result.stdout)


def test_the_cap_never_raises_the_abi():
    _, report = _check(f"--landlock-abi={HOST_ABI + 5}")
    assert report["landlock"]["abi"] == HOST_ABI == report["landlock"]["host_abi"]


@pytest.mark.parametrize("abi", ABIS)
def test_check_names_the_layer_per_abi(abi):
    _, report = _check(f"--landlock-abi={abi}")
    truncation = next(p for p in report["promises"] if "truncate" in p["promise"])
    if abi >= 3:
        assert truncation["enforced_by"] == ["Landlock truncate"]
    else:
        assert truncation["enforced_by"] == [
            "seccomp: truncate(path), open(O_RDONLY|O_TRUNC) and openat2 refused"]


def test_without_landlock_the_kernel_refuses_naming_promise_right_and_flag(tmp_path):
    from jupyter_client.connect import write_connection_file

    connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"))
    result = subprocess.run(
        [sys.executable, "-I", "-m", "sandbox_kernel", "-f", connection_file, "--landlock-abi=0"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    line = [line.partition("] ")[2] for line in result.stderr.splitlines()  # after the mark
            if "refusing to start" in line]
    assert line == [
        "sandbox-kernel: refusing to start: cannot keep these promises on this host: files: "
        "read and write only the interpreter, scratch and grants: MISSING, needs Landlock file "
        "rights (ABI >= 1); this host: ABI 0; to run without it on purpose: --no-landlock"]
    code, report = _check("--landlock-abi=0")
    assert code == 1 and report["problems"]
    code, report = _check("--landlock-abi=0", "--no-landlock")
    assert code == 0 and report["problems"] == []
