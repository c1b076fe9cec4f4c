"""Closing a sandbox: graceful or one-shot, the kernel is gone when close() returns, and
nothing of it is left behind (process, connection file, scratch directory)."""

import asyncio
import contextlib
import os
import select
import signal
import threading
import time
from pathlib import Path

import pytest

from sandbox_kernel.client import AsyncSandbox, Sandbox

from .helpers import evaluate, ok

SCRATCH_GONE_WITHIN = 30.0  # the reaper removes it once it sees the kernel's end


def _gone(path, timeout=SCRATCH_GONE_WITHIN):
    end = time.monotonic() + timeout
    while os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _traces(sb):
    """What a kernel leaves on the host: its process, connection file and scratch."""
    process = sb.manager.provisioner.process
    return process, sb.manager.connection_file, evaluate(sb, "import os; os.getcwd()")


def _assert_nothing_left(process, connection_file, scratch):
    assert process.poll() is not None  # ended and reaped before close() returned
    assert not Path(f"/proc/{process.pid}").exists()
    assert not os.path.exists(connection_file)
    assert _gone(scratch), f"the scratch {scratch} outlived its kernel"


@pytest.mark.parametrize("cold", [False, True], ids=["fork-served", "cold"])
def test_a_one_shot_close_kills_the_kernel_and_leaves_nothing_behind(cold):
    sb = Sandbox(None, cold_start=cold)
    sb.start()
    assert sb.manager.provisioner.fork_served is not cold
    ok(sb.run("open('left-behind', 'w').write('x' * 1000)"))
    process, connection_file, scratch = _traces(sb)
    sb.close(now=True)
    assert process.poll() == -9  # killed, not asked
    _assert_nothing_left(process, connection_file, scratch)


def test_a_graceful_close_lets_the_kernel_exit_by_itself():
    sb = Sandbox(None)
    sb.start()
    process, connection_file, scratch = _traces(sb)
    sb.close()
    assert process.poll() == 0  # it exited on the shutdown request, no signal needed
    _assert_nothing_left(process, connection_file, scratch)


def test_the_async_sandbox_closes_both_ways():
    async def one(now):
        sb = AsyncSandbox(None)
        await sb.start()
        assert (await sb.run("x = 1")).error is None
        execution = await sb.run("import os; os.getcwd()")
        scratch = eval(execution.text)
        process, connection_file = sb.manager.provisioner.process, sb.manager.connection_file
        await sb.close(now=now)
        return process, connection_file, scratch

    for now, code in ((True, -9), (False, 0)):
        process, connection_file, scratch = asyncio.run(one(now))
        assert process.poll() == code
        _assert_nothing_left(process, connection_file, scratch)


def test_a_kernel_that_ignores_the_shutdown_request_is_still_ended():
    """A kernel whose main thread never returns to its loop gets jupyter_client's sequence."""
    sb = Sandbox(None)
    sb.start()
    sb.manager.shutdown_wait_time = 2.0
    ok(sb.run("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)"))
    sb.client.execute("while True: pass")  # busy: the request waits behind it
    process, connection_file = sb.manager.provisioner.process, sb.manager.connection_file
    started = time.monotonic()
    sb.close()
    assert process.poll() is not None
    assert time.monotonic() - started < 30
    assert not os.path.exists(connection_file)


def test_history_stays_in_memory_and_works(fresh_sandbox):
    """No history file nor saving thread in the scratch; the session's history still works."""
    ok(fresh_sandbox.run("a = 40"))
    ok(fresh_sandbox.run("b = a + 2"))
    state = evaluate(fresh_sandbox, "import os, threading; (get_ipython().history_manager"
                     ".hist_file, sorted(t.name for t in threading.enumerate()), "
                     "os.path.exists('.ipython/profile_default/history.sqlite'), In[1:3])")
    hist_file, threads, history_file, inputs = state
    assert hist_file == ":memory:"
    assert not any("History" in name for name in threads)
    assert history_file is False
    assert inputs == ["a = 40", "b = a + 2"]
    listed = fresh_sandbox.run("%history -n 1-2")
    assert listed.error is None
    assert "1: a = 40" in listed.stdout and "2: b = a + 2" in listed.stdout


def test_a_sandbox_starts_only_the_channels_it_reads(fresh_sandbox):
    """No client heartbeat thread per sandbox (liveness is the process's); control still works."""
    from jupyter_client.channels import HBChannel

    assert not any(isinstance(thread, HBChannel) for thread in threading.enumerate())
    client = fresh_sandbox.client
    client.control_channel.send(client.session.msg("kernel_info_request"))
    assert client.control_channel.get_msg(timeout=30)["msg_type"] == "kernel_info_reply"
    assert evaluate(fresh_sandbox, "6 * 7") == 42


@pytest.mark.parametrize("now", [True, False], ids=["one-shot", "graceful"])
def test_closing_a_kernel_that_just_died_is_no_error(now):
    """Its exit not yet reported, jupyter_client still interrupts it first: no ESRCH escapes."""
    sb = Sandbox(None)
    sb.start()
    process, connection_file, scratch = _traces(sb)
    os.kill(process.pid, signal.SIGKILL)
    # Reaped and reported by the server, the report not read yet: the pid names no process.
    assert select.select([process.exit_fd()], [], [], 30)[0]
    assert process.returncode is None
    sb.close(now=now)
    assert process.poll() == -9
    _assert_nothing_left(process, connection_file, scratch)


@pytest.mark.parametrize("after", [0.3, 0.8])
def test_a_cold_start_stopped_while_it_starts_prints_no_traceback(capfd, after):
    # A server closing (or a pool's start cancelled) shuts down a kernel that is still importing;
    # jupyter_client interrupts every kernel it shuts down, and that SIGINT was a
    # KeyboardInterrupt traceback in the launcher's stderr (the kernel's, until it confines).
    async def start_then_stop() -> None:
        sandbox = AsyncSandbox(None, cold_start=True)
        starting = asyncio.ensure_future(sandbox.start())
        await asyncio.sleep(after)
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await sandbox.close()

    asyncio.run(start_then_stop())
    time.sleep(1)  # what the kernel would write, it has written
    said = capfd.readouterr().err
    assert "Traceback" not in said, said


def test_a_cold_started_kernel_is_still_interrupted_in_an_execution():
    with Sandbox(None, cold_start=True) as sandbox:
        threading.Timer(1.5, lambda: sandbox.interrupt()).start()
        execution = sandbox.run("import time\nfor _ in range(100):\n    time.sleep(0.1)",
                                timeout=30)
        assert execution.error is not None and execution.error.name == "KeyboardInterrupt"
        assert evaluate(sandbox, "1 + 1") == 2
