"""One-shot kernels: the same executions and the same confinement as a ZMQ kernel, one run each.

The differential tests run one corpus through a one-shot kernel (kernel/oneshot.py, from the
fork server's pool) and through a fresh ZMQ kernel of the same policy, and compare what a caller
gets: result, stdout, stderr (as runs of one stream), displays, error name, value and
traceback. The layer test reads every layer from inside user code on both.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import socket
import time

import pytest

from sandbox_kernel.client import Sandbox, oneshot
from sandbox_kernel.kernel import oneshot_wire as wire
from sandbox_kernel.launch.oneshot import OneShotPool
from sandbox_kernel.policy import SandboxPolicy

POLICY = dict(max_output_bytes=10_000)


@pytest.fixture(scope="module")
def pool():
    return OneShotPool(SandboxPolicy(**POLICY), size=2)


def one_shot(pool, code, inputs=None, timeout=10.0):
    return asyncio.run(oneshot.run(pool, code, inputs, timeout))


def zmq_run(code, inputs=None, timeout=10.0, policy=None):
    with Sandbox(None, policy=policy or SandboxPolicy(**POLICY)) as sb:
        return sb.run(code, inputs, timeout=timeout)


def _runs(logs):
    """The stream output as runs of one stream: chunking is the transport's, order is not."""
    runs: list[list[str]] = []
    for chunk in logs:
        if runs and runs[-1][0] == chunk["name"]:
            runs[-1][1] += chunk["text"]
        else:
            runs.append([chunk["name"], chunk["text"]])
    return runs


def _seen(execution):
    error = execution.error
    return {"result": execution.result, "text": execution.text, "streams": _runs(execution.logs),
            "displays": execution.displays,
            "error": None if error is None else (error.name, error.value, error.traceback)}


CORPUS = {
    "prints": ("print('a')\nimport sys\nprint('b', file=sys.stderr)\nprint('c')\n", None),
    "last value": ("x = 20\nx + 22", None),
    "json types": ("def main():\n    return {'s': 'x', 'i': 1, 'f': 1.5, 'b': True, 'n': None,"
                   " 'l': [1, 'a', [2]], 'd': {'k': {}}}", {}),
    "main inputs": ("def main(a, b=2):\n    print('adding')\n    return {'sum': a + b}",
                    {"a": 40}),
    "unicode": ("def main(t):\n    print('héllo ✓ 日本 😀')\n    return {'t': t * 2}",
                {"t": "ü✓"}),
    "big output": ("print('x' * 25_000)\nprint('after')", None),
    "exception": ("def f(n):\n    raise ValueError(f'bad {n}')\n\nf(3)", None),
    "main raises": ("def main():\n    {}['missing']", {}),
    "no main": ("x = 1", {}),
    "bad result": ("def main():\n    return [1]", {}),
    "syntax error": ("def (:\n    pass", None),
    "displays": ("from IPython.display import display, HTML, Markdown\n"
                 "display(HTML('<b>bold</b>'))\nprint('between')\n"
                 "display({'text/plain': 'p', 'text/html': '<i>h</i>',"
                 " 'application/json': {'a': 1}}, raw=True)\ndisplay(Markdown('# t'))", None),
    "refused fork": ("import os\nos.fork()", None),
    "refused socket": ("import socket\nsocket.socket(socket.AF_INET).connect(('1.1.1.1', 80))",
                       None),
    "magics": ("%env SANDBOX_X=1\nimport os\nprint(os.environ['SANDBOX_X'])\n"
               "r = %who_ls\nprint(r)", None),
    "stdin": ("input('name? ')", None),
    "system exit": ("import sys\nsys.exit(3)", None),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_same_execution_as_a_zmq_kernel(pool, name):
    code, inputs = CORPUS[name]
    ours, theirs = one_shot(pool, code, inputs), zmq_run(code, inputs)
    assert _seen(ours) == _seen(theirs)


def test_a_timeout_reads_the_same(pool):
    code = "import time\nprint('start')\nwhile True:\n    time.sleep(0.01)"
    ours, theirs = one_shot(pool, code, timeout=1.0), zmq_run(code, timeout=1.0)
    assert ours.error.name == theirs.error.name == "ExecutionTimeout"
    assert ours.error.value == theirs.error.value
    assert ours.stdout == theirs.stdout == "start\n"


def test_a_run_that_never_yields_is_killed_and_says_so(pool):
    # The kernel's own deadline switched off (its signal ignored): only a kill ends it.
    code = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass"
    started = time.monotonic()
    ex = asyncio.run(oneshot.run(pool, code, None, 0.5, grace=1.0))
    assert time.monotonic() - started < 10
    assert ex.error.name == "ExecutionTimeout"
    assert "its one-shot kernel was killed" in ex.error.value
    assert ex.state_lost


def test_fd_level_output_counts(pool):
    ex = one_shot(pool, "import os\nos.write(1, b'raw out\\n')\nprint('py')\n"
                        "os.write(2, 'raw ✓ err\\n'.encode())")
    assert ex.stdout == "raw out\npy\n"
    assert ex.stderr == "raw ✓ err\n"


def test_fd_level_output_is_capped(pool):
    ex = one_shot(pool, "import os\nos.write(1, b'y' * 30_000)")
    assert ex.stdout == "y" * 10_000
    assert "output limit of 10,000 bytes" in ex.stderr


LAYERS = r"""
import errno, json, os, resource, socket
def outcome(call):
    try:
        call()
        return "allowed"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines()
              if ":\t" in line)
mounts = [line.split(" - ")[1].split()[0] for line in open("/proc/self/mountinfo")
          if line.split()[4] == os.getcwd()]
def bind_any():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
layers = {
    "seccomp": status["Seccomp"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
    "cap_eff": status["CapEff"].strip(), "cap_bnd": status["CapBnd"].strip(),
    "uid_is_own": os.getuid() not in (0, 65534) and os.getuid() == os.getgid(),
    "groups": os.getgroups(),
    "rlimits": {name: resource.getrlimit(getattr(resource, name))
                for name in ("RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_FSIZE", "RLIMIT_NOFILE",
                             "RLIMIT_CPU", "RLIMIT_NPROC")},
    "read /etc/shadow": outcome(lambda: open("/etc/shadow").read()),
    "write /tmp": outcome(lambda: open("/tmp/sandbox-layer-probe", "w")),
    "write scratch": outcome(lambda: open("probe", "w").close()),
    "list /root": outcome(lambda: os.listdir("/root")),
    "bind a port": outcome(bind_any),
    "fork": outcome(os.fork),
    "interfaces": outcome(lambda: socket.if_nameindex()),
    "loopback connect": outcome(lambda: socket.create_connection(("127.0.0.1", 22), 1)),
    "scratch mount": mounts[-1:],
    "home is cwd": os.environ["HOME"] == os.getcwd(),
    "net ns is not the host's": os.stat("/proc/self/ns/net").st_ino != HOST_NET,
}
print(json.dumps(layers, sort_keys=True))
"""


@pytest.mark.parametrize("network", [False, True], ids=["offline", "network"])
def test_every_layer_is_the_kernels(network):
    if os.geteuid() != 0:
        pytest.skip("a uid of its own needs root")
    policy = SandboxPolicy(allow_network=network, **POLICY)
    code = f"HOST_NET = {os.stat('/proc/self/ns/net').st_ino}\n" + LAYERS
    ours = one_shot(OneShotPool(policy, size=1), code)
    theirs = zmq_run(code, policy=policy)
    assert ours.error is None and theirs.error is None, (ours.error, theirs.error)
    ours_layers, theirs_layers = json.loads(ours.stdout), json.loads(theirs.stdout)
    assert ours_layers["seccomp"] == "2" and ours_layers["scratch mount"] == ["tmpfs"]
    assert ours_layers["net ns is not the host's"] and ours_layers["uid_is_own"]
    # The one difference on purpose: a ZMQ kernel may bind its five channel ports (any other
    # port is refused), a one-shot kernel has none and binds no port at all.
    assert ours_layers.pop("bind a port") in ("EACCES", "EPERM")
    theirs_layers.pop("bind a port")
    assert ours_layers == theirs_layers


PROBE = ("import os, time\ntime.sleep(1.0)\n"
         "print(os.getpid(), os.getuid(), os.getcwd(), os.stat('/proc/self/ns/net').st_ino,"
         " os.stat('/proc/self/ns/mnt').st_ino)")


def test_two_runs_share_no_process_uid_scratch_or_namespace(pool):
    async def both():
        return await asyncio.gather(*(oneshot.run(pool, PROBE, None, 10.0) for _ in range(3)))

    seen = [ex.stdout.split() for ex in asyncio.run(both())]
    assert all(len(fields) == 5 for fields in seen), seen
    for column in range(5):  # pid, uid, scratch, network and mount namespace
        assert len({fields[column] for fields in seen}) == 3, seen


def _record(conn):
    records = wire.Records()
    data, fds, _, _ = socket.recv_fds(conn, 64, 1)
    for fd in fds:
        os.close(fd)
    return list(records.feed(data))


def test_a_pooled_process_takes_exactly_one_request(pool):
    pool.path = pool.path or pool.ask()
    first = socket.socket(socket.AF_UNIX)
    first.connect(pool.path)
    [(kind, pid)] = _record(first)
    assert kind == wire.PID
    request = oneshot.request("print('one')", None, 5.0)
    payload = wire.pack_frames(oneshot._SESSION.serialize(request))
    first.sendall(wire.record(wire.REQUEST, payload) * 2)  # a second request on the same line
    received = b""
    while chunk := first.recv(65536):
        received += chunk
    kinds = [kind for kind, _ in wire.Records().feed(received)]
    assert kinds[-1] == wire.DONE and kinds.count(wire.DONE) == 1  # then it hung up, gone
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{int(pid)}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{int(pid)}")
    # The next connection is another process's.
    second = socket.socket(socket.AF_UNIX)
    second.connect(pool.path)
    [(_, other)] = _record(second)
    second.close()
    assert other != pid


def test_the_server_never_holds_the_request(pool):
    """The code of a run never reaches the fork server's memory (only the process's)."""
    marker = "sandbox-oneshot-marker-" + os.urandom(8).hex()
    assert one_shot(pool, f"print('{marker}')").stdout == marker + "\n"
    server = pool.server.server_pid()
    assert server is not None
    with open(f"/proc/{server}/maps") as maps, open(f"/proc/{server}/mem", "rb") as mem:
        for line in maps:
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            if "rw" not in line.split()[1] or end - start > 1 << 30:
                continue
            try:
                mem.seek(start)
                assert marker.encode() not in mem.read(end - start)
            except OSError:
                continue


def test_a_refused_request_is_said(pool):
    pool.path = pool.path or pool.ask()
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(pool.path)
    _record(conn)
    conn.sendall(wire.record(ord("z"), b"nonsense"))
    received = b""
    while chunk := conn.recv(65536):
        received += chunk
    [(kind, reason)] = list(wire.Records().feed(received))
    assert kind == wire.REFUSED and b"expected a request record" in reason


def test_traceback_frames_are_the_users(pool):
    ex = one_shot(pool, "def f():\n    1 / 0\nf()")
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(ex.error.traceback))
    assert "Cell In[1], line 3" in text and "ZeroDivisionError" in text
    assert "oneshot" not in text


def test_refused_calls_are_answered_and_recorded_by_the_companion(tmp_path):
    from tests.test_audit import ATTACKS, MARKER, records

    path = tmp_path / "audit.jsonl"
    code = ATTACKS.replace("(outcome(os.fork)", "outcomes = (outcome(os.fork)")
    ex = one_shot(OneShotPool(SandboxPolicy(audit_log=str(path), **POLICY), size=1),
                  code + "\n(outcomes, os.getpid(), os.getuid())")
    assert ex.error is None, ex.error
    outcomes, pid, uid = ast.literal_eval(ex.text)
    assert outcomes == ("EPERM", "EPERM", "EPERM")
    assert ex.usage.refused_syscalls == 3  # the companion's count, read by the kernel
    found = records(path, at_least=3)
    raws = [r for r in found if r["syscall"] == "acct" and r["args"][0] == hex(MARKER)]
    assert len(raws) == 1, found
    assert raws[0]["kernel"] == f"one-shot-{pid}" and raws[0]["uid"] == uid
    assert raws[0]["errno"] == "EPERM"
