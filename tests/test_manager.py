"""Sandbox's kernel managers keep jupyter_client's `ready` bookkeeping, without its pauses;
its clients stop the channels they opened and create no other on the way."""

import asyncio
import signal
import types

import pytest
import zmq
from jupyter_client.kernelspec import NoSuchKernel

from sandbox_kernel.client import AsyncSandbox, Sandbox


@pytest.fixture
def pauses(monkeypatch):
    """Every asyncio.sleep of 10 ms (in_pending_state's pause), wherever it comes from."""
    seen = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay, *args, **kwargs):
        if delay == 0.01:
            seen.append(delay)
        return await real_sleep(delay, *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    return seen


def test_start_and_close_settle_ready_without_pausing(pauses):
    sandbox = Sandbox(None)
    sandbox.start()
    try:
        assert sandbox.manager.ready.done() and sandbox.manager.ready.exception() is None
        assert sandbox.run("def main():\n    return {'ok': 1}\n", inputs={}).result == {"ok": 1}
    finally:
        sandbox.close(now=True)
    assert sandbox.manager.ready.done() and not sandbox.manager.is_alive()
    assert pauses == []


def test_restart_gives_a_fresh_kernel_without_pausing(pauses):
    with Sandbox(None) as sandbox:
        sandbox.run("x = 1")
        sandbox.restart()
        assert sandbox.run("print('x' in globals())").stdout == "False\n"
        assert sandbox.manager.ready.done()
    assert pauses == []


def test_a_failed_start_sets_ready_to_the_error():
    sandbox = Sandbox("no-such-kernel-here")
    with pytest.raises(NoSuchKernel):
        sandbox.start()
    assert isinstance(sandbox.manager.ready.exception(), NoSuchKernel)


def test_the_async_manager_settles_ready_without_pausing(pauses):
    async def scenario():
        sandbox = AsyncSandbox(None)
        await sandbox.start()
        try:
            assert sandbox.manager.ready.done()
            execution = await sandbox.run("def main():\n    return {'ok': 2}\n", inputs={})
            assert execution.result == {"ok": 2}
        finally:
            await sandbox.close()
        assert not await sandbox.manager.is_alive()

    asyncio.run(scenario())
    assert pauses == []


def test_close_stops_the_channels_it_opened_and_creates_no_other():
    sandbox = Sandbox(None)
    sandbox.start()
    client = sandbox.client
    control = client.control_channel  # opened on purpose: it must be stopped too
    control.start()
    sandbox.close(now=True)
    assert (client._stdin_channel, client._hb_channel) == (None, None)
    assert client._control_channel is control and not control.is_alive()
    assert not client.shell_channel.is_alive() and not client.iopub_channel.is_alive()


def test_the_async_sandbox_closes_the_same_way():
    # AsyncKernelManager's own client_factory used to win over client_class: the plain
    # AsyncKernelClient then created stdin and control sockets at every close.
    async def scenario():
        sandbox = AsyncSandbox(None)
        await sandbox.start()
        client = sandbox.client
        await sandbox.close(now=True)
        return client

    client = asyncio.run(scenario())
    assert type(client).__name__ == "AsyncSandboxKernelClient"
    assert (client._stdin_channel, client._hb_channel, client._control_channel) == (None,) * 3


def test_sandboxes_share_a_context_and_closing_one_leaves_the_others_working(sandbox):
    # One ZMQ context (I/O thread) per process and limits, not one per kernel.
    other = Sandbox(None)
    assert other.context is sandbox.context is other.manager.context
    other.start()
    other.close(now=True)
    assert not sandbox.context.closed
    assert sandbox.run("print(6 * 7)").stdout == "42\n"
    smaller = Sandbox(None, max_output=1234, max_result=1234)
    assert smaller.context is not sandbox.context  # sockets of other limits


def test_the_control_socket_is_connected_only_to_send_on_it():
    # A killed kernel never needed it; a graceful shutdown connects it and is still answered.
    killed = Sandbox(None)
    killed.start()
    assert killed.manager._control_socket is None
    killed.close(now=True)
    assert killed.manager._control_socket is None
    polite = Sandbox(None)
    polite.start()
    kernel = polite.manager.provisioner.process
    assert polite.manager._control_socket is None
    polite.close()
    assert kernel.returncode == 0  # it shut itself down on the request: it was not killed


def test_the_sandbox_client_shares_the_managers_session_and_other_clients_get_a_clone(
        fresh_sandbox):
    sandbox = fresh_sandbox
    # One Session per kernel for the sandbox's own client; a client made with manager.client()
    # gets jupyter_client's clone (a replay history of its own), as before.
    assert sandbox.client.session is sandbox.manager.session
    other = sandbox.manager.client()
    assert other.session is not sandbox.manager.session
    assert other.session.key == sandbox.manager.session.key
    sandbox.restart()  # a new client for the new kernel: the session is still the manager's
    assert sandbox.client.session is sandbox.manager.session
    assert sandbox.run("print('mine')").stdout == "mine\n"


class _ClientOf:
    """Stands in for a client: its IOPub socket, and what was closed when it was stopped."""

    def __init__(self, context):
        self.iopub_channel = types.SimpleNamespace(socket=context.socket(zmq.SUB))
        self.monitor = None
        self.monitor_closed_first = None

    def stop_channels(self):
        self.monitor_closed_first = self.monitor.closed
        self.iopub_channel.socket.close(linger=0)


def test_the_iopub_monitor_is_closed_before_the_clients_sockets():
    # Sandboxes share a context. libzmq stops a socket's monitor only while the socket is
    # open: stopped after it closed (the old order), the monitor's own socket could stay in
    # the context, and a service's context went deaf after a few hundred kernels (its next
    # kernel never heard its kernel_info reply). Both ways out of a client close it first.
    context = zmq.Context()
    sandbox = Sandbox(None)
    try:
        for leave in (sandbox._stop_client, lambda: sandbox.close.__wrapped__(sandbox)):
            client = sandbox.client = _ClientOf(context)
            client.monitor = sandbox._current_inbox().monitor  # as a run makes it
            steps = leave()
            if steps is not None:  # close(): its steps, run to the end (no kernel to stop)
                for _ in steps:
                    pass
            assert client.monitor_closed_first is True and client.iopub_channel.socket.closed
            assert sandbox._inbox is None
    finally:
        sandbox.client = None
        context.destroy(linger=0)


@pytest.mark.parametrize("now", [True, False])
def test_a_kill_sends_no_interrupt_first_and_a_graceful_close_still_does(now):
    """jupyter_client interrupts before every shutdown; a kill (now=True) no longer does."""
    sandbox = Sandbox(None)
    sandbox.start()
    sent = []
    provisioner = sandbox.manager.provisioner
    original = provisioner.send_signal

    async def recorded(signum):
        sent.append(signum)
        return await original(signum)

    provisioner.send_signal = recorded
    process = provisioner.process
    sandbox.close(now=now)
    assert process.poll() is not None  # the kernel is gone either way
    assert (signal.SIGINT in sent) is (not now)
