"""The hostile-code suite through one-shot kernels: every case that applies, the same outcome.

Each case runs as one stateless run (the suite's prelude and the case's code in one request) on
a one-shot kernel of the suite's policy, network off or on, and must end exactly as it does in
the suite's ZMQ kernels (tests/test_hostile.py). Cases that are about the ZMQ transport itself
are listed in ZMQ_ONLY with the reason.
"""

from __future__ import annotations

import ast
import asyncio
import errno
import time
from collections import Counter

import pytest

from sandbox_kernel.client import oneshot
from sandbox_kernel.launch.oneshot import OneShotPool
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import RAW_SYSCALL
from tests.test_hostile import CASES, HOSTILE_POLICY, PRELUDE, _applies, world  # noqa: F401

# What the one-shot path answers differently, by design (none of these is a weaker outcome).
ZMQ_ONLY = {
    "N17": "connects through the kernel's own TCP sockets: a one-shot kernel has none",
    "N18": "listens on the kernel's own channel port: a one-shot kernel has no port",
    "N20": "listen() on a dup of the kernel's TCP listener: a one-shot kernel has none",
    "X21": "signals the kernel's reaper child: a one-shot kernel has no child (its companion "
           "is not its child; X-cases on PPID and other pids cover it)",
}


@pytest.fixture(scope="module", params=["shell", "kernel"])
def process(request):
    """Every hostile case on both one-shot processes: the lean one and the ipykernel one."""
    return request.param


@pytest.fixture(scope="module")
def pools(world, process):  # noqa: F811
    return {"hostile": OneShotPool(SandboxPolicy(**HOSTILE_POLICY), size=2, process=process),
            "net": OneShotPool(SandboxPolicy(allow_network=True, **HOSTILE_POLICY), size=2,
                               process=process)}


def _outcome(pool, code):
    execution = asyncio.run(oneshot.run(pool, PRELUDE + "\n" + code, None, 30.0))
    assert execution.error is None, execution.error
    assert execution.text is not None, f"no result from {code!r}: {execution}"
    return ast.literal_eval(execution.text)


@pytest.mark.parametrize("case", [c for c in CASES if _applies(c) and c.id not in ZMQ_ONLY],
                         ids=lambda c: c.id)
def test_attack_on_a_one_shot_kernel(pools, world, case):  # noqa: F811
    code = case.code
    for name, value in world.items():
        code = code.replace("{" + name + "}", str(value))
    outcome = _outcome(pools[case.kernel], code)
    if isinstance(case.expect, tuple) and isinstance(outcome, list):
        outcome = tuple(outcome)
    assert outcome == case.expect, f"{case.id} {case.attack}: {outcome!r}"


def test_no_listener_is_left_to_take_a_second_request(pools):
    """The pool's listener was closed at the accept: nothing in the process can accept again,
    and the one connection to the pool's socket it holds is the caller's (the other unix
    sockets are the event loop's own socketpair)."""
    code = PRELUDE + """
import socket, stat
listening, connected = 0, 0
for name in os.listdir('/proc/self/fd'):
    try:
        if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
            continue
        sock = socket.socket(fileno=os.dup(int(name)))
    except OSError:
        continue
    with sock:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            listening += 1
        elif sock.family == socket.AF_UNIX and sock.getsockname():
            connected += 1
(listening, connected, trap(lambda: socket.socket(socket.AF_UNIX).connect('/tmp/x')))
"""
    assert _outcome(pools["hostile"], code) == (0, 1, ("PermissionError", 1))


# User code that writes records of its own onto the run's connection, as the files record.
FORGE_FILES = """
import sys
from sandbox_kernel.kernel import oneshot_wire as wire
kernel = get_ipython().kernel  # the lean process, or the ipykernel one's kernel (its app's)
conn = getattr(kernel, 'parent', kernel).channel.conn
for payload in FORGED:
    conn.sendall(wire.record(wire.FILES, payload))
'sent'
"""


@pytest.mark.parametrize("forged, asked, kept", [
    # Not asked for (every service run): never parsed, however many or large.
    ([b'{"forged": 0}', *[b'"' + b"x" * 1_000_000 + b'"'] * 8], None, None),
    # Asked for: one record at most is parsed (the process's own, sent after the run, when
    # user code sent none), and none larger than the budget asked for allows.
    ([b"1" * 2_000_000], {"budget": 1000}, {"files": [], "more": False, "embedded": {}}),
    ([b"not json", b'{"forged": 2}'], {"budget": 1000}, None),
    ([b'{"forged": 1}', b'{"forged": 2}'], {"budget": 1000}, {"forged": 1}),
], ids=["not-asked", "too-large", "first-only-malformed", "first-only"])
def test_files_records_user_code_forges_are_bounded_by_what_the_caller_asked(
        pools, forged, asked, kept):
    keep = None if asked is None else {"op": "keep", "path": ".", "limit": 50, "since": 0.0,
                                       "embed": 1000, **asked}
    handle = oneshot.RunHandle(keep)
    execution = asyncio.run(oneshot.run(pools["hostile"],
                                        f"FORGED = {forged!r}\n" + FORGE_FILES, None, 30.0,
                                        handle=handle))
    assert execution.error is None and execution.text == "'sent'", execution.error
    assert handle.kept == kept


# The process's own files record never sent: what the caller took is only what user code sent.
WITHOUT_OWN = ("import sys\nsys.modules['sandbox_kernel.kernel.oneshot_io']"
               ".written_files = lambda request: None\n")
OWN = {"files": [], "more": False, "embedded": {}}


@pytest.mark.parametrize("asked, without_own, kept", [
    (None, False, None), ({"budget": 1000}, False, OWN), ({"budget": 1000}, True, "dropped"),
], ids=["not-asked", "asked", "asked-none-taken"])
def test_a_files_record_past_every_message_limit_is_dropped_and_the_run_keeps_its_result(
        pools, asked, without_own, kept):
    """20 MiB, more than any message the caller takes: dropped as it arrives, never kept
    whole, and the run is not lost for it. Asked for files and given none, the caller's
    answer says why."""
    keep = None if asked is None else {"op": "keep", "path": ".", "limit": 50, "since": 0.0,
                                       "embed": 1000, **asked}
    handle = oneshot.RunHandle(keep)
    code = (WITHOUT_OWN if without_own else "") + f"FORGED = [b'1' * {20 << 20}]\n" \
        + FORGE_FILES
    execution = asyncio.run(oneshot.run(pools["hostile"], code, None, 30.0, handle=handle))
    assert execution.error is None and execution.text == "'sent'", execution.error
    if kept == "dropped":
        assert handle.kept == {"error": f"the record of the files the run wrote "
                                        f"({20 << 20:,} bytes) is larger than the "
                                        f"{handle.files_room():,} asked for: dropped"}
    else:
        assert handle.kept == kept


def test_a_record_length_user_code_never_sends_ends_the_run_saying_so(pools):
    """A files header claiming 4 GiB, then nothing: what the process sends after it is read as
    that record's bytes (reply included). The caller says so, not that the kernel died."""
    code = ("import sys\nfrom sandbox_kernel.kernel import oneshot_wire as wire\n"
            "kernel = get_ipython().kernel\n"
            "getattr(kernel, 'parent', kernel).channel.conn"
            ".sendall(wire.HEADER.pack(2**32 - 1, wire.FILES))\nprint('after')\n")
    execution = asyncio.run(oneshot.run(pools["hostile"], code, None, 30.0))
    assert execution.error is not None and execution.error.name == "MessageTooLarge"
    assert execution.error.value == (
        "the one-shot kernel sent a message the caller refuses: a record said to be of "
        "4,294,967,295 bytes never ended, and what came after it was taken for its bytes")
    assert execution.stdout == ""


# Eight threads calling refused system calls (acct, syslog) as fast as they can for 2 s, each
# counting its calls and the outcomes it saw.
FLOOD = RAW_SYSCALL + """
import os, threading, time
from collections import Counter

def flood(stop, seen, calls):
    while time.monotonic() < stop:
        for nr in (163, 103):
            seen.add(raw(nr, 10 if nr == 103 else 0))
            calls[nr] += 1

stop = time.monotonic() + 2.0
work = [(set(), Counter()) for _ in range(8)]
threads = [threading.Thread(target=flood, args=(stop, *w)) for w in work]
for t in threads: t.start()
for t in threads: t.join()
seen = set().union(*(s for s, _ in work))
calls = sum((c for _, c in work), Counter())
(sorted(seen), calls[163], calls[103], os.getpid())
"""


def _denials_of(path, kernel, calls):
    """Per system call, the denials of `kernel` the audit file accounts for (its records and
    the counts of its summaries), once they add up to `calls` or after 30 s."""
    from tests.test_audit import records

    deadline = time.monotonic() + 30
    while True:
        found = [r for r in records(path) if r.get("kernel") == kernel]
        counted = Counter(r["syscall"] for r in found if "syscall" in r)
        for summary in (r for r in found if "suppressed" in r):
            counted.update(summary.get("syscalls", {}))
        if counted == calls or time.monotonic() > deadline:
            return counted, found


def test_a_refused_call_flood_is_paced_summarised_and_charged_to_the_run(tmp_path, process):
    """Issue #44 item 3. The flood's calls all fail EPERM; the companion answers a flooding ward
    only as far as the ward's own CPU pays for (its share: confine/share.py; the ratio is
    bench.companion's), and says in the audit that it paced it; what it spent is charged to the
    run's usage; the denials the record's rate limit left out are counted per system call in
    summary records, none lost; and the companion then serves the next run at once."""
    path = tmp_path / "audit.jsonl"
    pool = OneShotPool(SandboxPolicy(audit_log=str(path), **HOSTILE_POLICY), size=1,
                       process=process)
    flood = asyncio.run(oneshot.run(pool, FLOOD, None, 60.0))
    assert flood.error is None, flood.error
    seen, accts, syslogs, pid = ast.literal_eval(flood.text)
    assert seen == [(-1, errno.EPERM)]
    assert flood.usage.companion_cpu_seconds > 0, flood.usage
    assert flood.usage.refused_syscalls == accts + syslogs
    counted, found = _denials_of(path, f"one-shot-{pid}", {"acct": accts, "syslog": syslogs})
    assert counted == {"acct": accts, "syslog": syslogs}
    assert sum(r.get("paced", 0) for r in found) >= 1, found[-3:]
    after = asyncio.run(oneshot.run(pool, RAW_SYSCALL + "raw(163, 0)", None, 30.0))
    assert after.error is None and ast.literal_eval(after.text) == (-1, errno.EPERM)
    assert after.usage.refused_syscalls == 1
