"""The caller enforces its own deadline, output cap and result cap, whatever the kernel sends.

Each test is hostile code in a real kernel that switches off the kernel's own (courtesy)
check, and asserts what the caller receives and whether the kernel survived.
"""

import json
import subprocess
import sys
import time

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import ok

MAX_OUTPUT = 10_000
MAX_RESULT = 100_000
RESTARTED = "the kernel was restarted and its state (variables, imports) was lost"
# The kernel object, as user code reaches it.
KERNEL = "_k = get_ipython().kernel\n"
SEND = KERNEL + ("def _send(kind, content):\n"
                 "    _k.session.send(_k.iopub_socket, kind, content, parent=_k.get_parent())\n")


def client_marker(dropped):
    return (f"\n[sandbox-kernel client: output limit of {MAX_OUTPUT:,} bytes per run reached; "
            f"{dropped:,} more bytes were dropped (--max-output, or Sandbox(max_output=...), "
            "raises the limit)]\n")


@pytest.fixture(scope="module")
def capped(kernelspecs):
    """A kernel with small caps, a short grace, and a marker variable to see restarts by."""
    policy = SandboxPolicy(max_output_bytes=MAX_OUTPUT, max_result_bytes=MAX_RESULT)
    with Sandbox(None, policy=policy, grace=1.0) as sb:
        yield sb


def _mark(sandbox):
    ok(sandbox.run("_still_here = True"))


def _state_kept(sandbox):
    return sandbox.run("_still_here").error is None


# --- the deadline ----------------------------------------------------------------------------

STATUS_EVERY_50_MS = SEND + """
import signal, threading, time
def _chatter():
    while True:
        _send("status", {"execution_state": "busy"})
        time.sleep(0.05)
threading.Thread(target=_chatter, daemon=True).start()
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGALRM, signal.SIG_IGN)
while True:
    pass
"""


def test_a_chattering_kernel_cannot_hold_off_the_deadline(capped):
    _mark(capped)
    started = time.monotonic()
    ex = capped.run(STATUS_EVERY_50_MS, timeout=3)
    waited = time.monotonic() - started
    assert ex.error is not None and ex.error.name == "ExecutionTimeout", ex.error
    assert ex.error.value.endswith(RESTARTED) and ex.state_lost
    # 3 s, then the grace before the interrupt and the grace after it (1 s each), plus restart.
    assert 5.0 <= waited < 15.0, waited
    assert not _state_kept(capped)  # a fresh kernel
    assert ok(capped.run("print('fresh')")).stdout == "fresh\n"


# --- the output cap --------------------------------------------------------------------------

@pytest.mark.parametrize("bypass", [
    "import sys\nsys.stdout.write_uncapped('x' * 50_000)\nsys.stdout.flush()",
    "from sandbox_kernel.kernel.output import BUDGET\n"
    "BUDGET.limit = 0\nprint('x' * 50_000, end='')",
    SEND + "_send('stream', {'name': 'stdout', 'text': 'x' * 50_000})",
])
def test_output_past_the_cap_is_cut_by_the_caller(capped, bypass):
    _mark(capped)
    ex = capped.run(bypass)
    assert ex.error is None, ex.error
    assert ex.stdout == "x" * MAX_OUTPUT
    assert ex.stderr == client_marker(40_000)
    assert _state_kept(capped)


def test_twenty_mb_of_messages_deliver_only_the_cap(capped):
    _mark(capped)
    seen = []
    flood = SEND + ("for _ in range(20):\n"
                    "    _send('stream', {'name': 'stderr', 'text': 'y' * 1_000_000})")
    ex = capped.run(flood, on_stderr=seen.append)
    assert ex.error is None, ex.error
    assert ex.stderr == "y" * MAX_OUTPUT + client_marker(20_000_000 - MAX_OUTPUT)
    assert "".join(seen) == ex.stderr  # the callbacks see the same bounded text
    assert _state_kept(capped)


def test_the_kernels_own_marker_still_arrives(capped):
    ex = ok(capped.run("print('z' * 30_000, end='')"))
    assert ex.stdout == "z" * MAX_OUTPUT
    assert ex.stderr == (f"\n[sandbox-kernel: output limit of {MAX_OUTPUT:,} bytes per execution "
                         "reached; 20,000 more bytes were dropped (--max-output raises the "
                         "limit)]\n")


def test_a_message_past_the_largest_accepted_is_refused_before_it_is_read(capped):
    _mark(capped)
    too_big = MAX_RESULT + 2**20 + 1  # the sockets' ZMQ_MAXMSGSIZE is max_result + 1 MiB
    ex = capped.run(SEND + f"_send('stream', {{'name': 'stdout', 'text': 'x' * {too_big}}})\n"
                    "import time\ntime.sleep(30)")
    assert ex.error is not None and ex.error.name == "MessageTooLarge", ex.error
    assert ex.error.value == (
        f"the kernel sent a message larger than the caller accepts ({MAX_RESULT + 2**20:,} "
        f"bytes: --max-result or --max-output plus {2**20:,}); the connection refused it; "
        + RESTARTED)
    assert ex.stdout == "" and ex.state_lost
    assert not _state_kept(capped)
    assert ok(capped.run("print('fresh')")).stdout == "fresh\n"


# --- the result cap --------------------------------------------------------------------------

OVER = "def main(n):\n    return {'data': 'r' * n}"


def test_the_kernel_refuses_a_large_result_as_a_courtesy(capped):
    ex = capped.run(OVER, inputs={"n": MAX_RESULT})
    assert ex.error is not None and ex.error.name == "InvalidResult"
    assert ex.error.value == (f"main() returned {MAX_RESULT + 11:,} bytes of JSON, more than the "
                              f"result limit of {MAX_RESULT:,} bytes (--max-result raises it)")


def test_the_caller_refuses_a_large_result_when_the_kernel_check_is_off(capped):
    _mark(capped)
    ex = capped.run("get_ipython().kernel.policy.max_result_bytes = 0\n" + OVER,
                    inputs={"n": MAX_RESULT})
    assert ex.result is None and ex.text is None
    assert ex.error is not None and ex.error.name == "ResultTooLarge", ex.error
    assert ex.error.value == (
        f"the kernel sent {MAX_RESULT + 11:,} bytes of JSON, more than the caller's result "
        f"limit of {MAX_RESULT:,} bytes (--max-result, or Sandbox(max_result=...), raises it)")
    assert _state_kept(capped)  # the kernel did nothing wrong by its own lights: kept


def test_a_forged_result_far_past_the_cap_is_refused_unparsed(capped):
    _mark(capped)
    forged = SEND + ("_send('execute_result', {'execution_count': 1, 'metadata': {}, "
                     "'data': {'application/json': {'k': 'v' * 600_000}}})")
    ex = capped.run(forged)
    assert ex.error is not None and ex.error.name == "ResultTooLarge", ex.error
    assert ex.error.value.startswith("the kernel sent 600,0")  # measured exactly, then refused
    ex = capped.run(SEND + ("_send('execute_result', {'execution_count': 1, 'metadata': {}, "
                            "'data': {'application/json': {'k': 'v' * 900_000}}})"))
    assert ex.error.value.startswith("the kernel sent a 900,")
    assert ex.error.value.endswith("-byte result message, more than the caller's result limit "
                                   f"of {MAX_RESULT:,} bytes (--max-result, or "
                                   "Sandbox(max_result=...), raises it)")
    assert _state_kept(capped)


def test_displays_share_the_result_budget(capped):
    code = ("from IPython.display import HTML, display\n"
            "for _ in range(3):\n    display(HTML('h' * 60_000))")
    ex = ok(capped.run(code))
    assert [len(d["text/html"]) for d in ex.displays] == [60_000]
    assert ex.stderr == (f"\n[sandbox-kernel client: 2 displays dropped: displays and the result "
                         f"may carry {MAX_RESULT:,} bytes per run (--max-result raises the "
                         "limit)]\n")


# --- the CLI -----------------------------------------------------------------------------------

def test_run_enforces_max_result_on_the_caller_side(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("get_ipython().kernel.policy.max_result_bytes = 0\n"
                   "def main():\n    return {'data': 'r' * 5000}\n")
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "run", str(job), "--json",
                           "--max-result", "4K"], capture_output=True, text=True, timeout=110,
                          check=False)
    assert done.returncode == 1, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["result"] is None
    assert report["error"]["name"] == "ResultTooLarge"
    assert report["error"]["value"].startswith("the kernel sent 5,011 bytes of JSON, more than "
                                               "the caller's result limit of 4,096 bytes")


def test_the_async_client_enforces_the_same_limits(kernelspecs):
    import asyncio

    from sandbox_kernel.client import AsyncSandbox

    async def scenario():
        policy = SandboxPolicy(max_output_bytes=MAX_OUTPUT, max_result_bytes=MAX_RESULT)
        async with AsyncSandbox(None, policy=policy, grace=1.0) as sb:
            flood = await sb.run(SEND + "_send('stream', {'name': 'stdout', 'text': 'x' * 50_000})")
            result = await sb.run("get_ipython().kernel.policy.max_result_bytes = 0\n" + OVER,
                                  inputs={"n": MAX_RESULT})
            started = time.monotonic()
            chatter = await sb.run(STATUS_EVERY_50_MS, timeout=2)
            return flood, result, chatter, time.monotonic() - started

    flood, result, chatter, waited = asyncio.run(scenario())
    assert (flood.stdout, flood.stderr) == ("x" * MAX_OUTPUT, client_marker(40_000))
    assert result.error is not None and result.error.name == "ResultTooLarge"
    assert chatter.error is not None and chatter.error.name == "ExecutionTimeout"
    assert chatter.state_lost and 4.0 <= waited < 14.0, waited


PUBLISHER = """
import sys, time, zmq
pub = zmq.Context().socket(zmq.PUB)
print(pub.bind_to_random_port("tcp://127.0.0.1"), flush=True)
for line in sys.stdin:  # one message per line: its size
    pub.send(b"x" * int(line))
"""


def _watched_subscriber(max_message):
    """A kernel-like process publishing what it is told, and a caller's size-capped SUB socket
    connected to it, with the SUB's connection events."""
    import zmq

    from sandbox_kernel.client.receive import Refusals, watch_connection

    kernel = subprocess.Popen([sys.executable, "-c", PUBLISHER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    port = int(kernel.stdout.readline())
    caller = zmq.Context()
    caller.setsockopt(zmq.MAXMSGSIZE, max_message)
    caller.setsockopt(zmq.RECONNECT_IVL, 10)
    sub = caller.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    events = watch_connection(sub)
    sub.connect(f"tcp://127.0.0.1:{port}")
    deadline = time.monotonic() + 10
    while not sub.poll(50):  # a PUB drops what it sends before the subscription reaches it
        assert time.monotonic() < deadline, "the subscriber never connected"
        publish(kernel, 10)
    return kernel, caller, (sub, events), Refusals()


def publish(kernel, size):
    kernel.stdin.write(f"{size}\n")
    kernel.stdin.flush()


def _take_events(watched, refusals, seconds):
    _, events = watched  # the socket itself is kept alive: gone, it would report nothing
    deadline = time.monotonic() + seconds
    while events.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        refusals.note(events.recv_multipart())


@pytest.mark.parametrize("gone", [False, True], ids=["refused", "peer-gone"])
def test_a_refused_frame_is_told_from_a_kernel_gone(gone):
    # A04 (a kernel closing its own sockets) read as MessageTooLarge when it took more than a
    # second to die: both drop the connection; only a peer gone is tried again.
    kernel, caller, watched, refusals = _watched_subscriber(1000)
    try:
        if gone:
            kernel.kill()
        else:
            publish(kernel, 5000)
        _take_events(watched, refusals, 1.0)
        assert refusals.dropped and refusals.refused == (not gone)
    finally:
        kernel.kill()
        kernel.wait()
        caller.destroy(linger=0)
