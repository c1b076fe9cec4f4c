"""The event loop never waits on a kernel's socket."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from .helpers import DIFY_KEY, Server, auth, http, httpx, idle_as, sse_events
from .platform_client import CodeExecutionError, PlatformClient


def test_the_event_loop_never_waits_on_a_kernel_socket(tmp_path):
    """No synchronous ZMQ send, receive or poll on the event loop's thread (one froze the
    service): the paths that start, restart, interrupt, stream from and close kernels."""
    record = tmp_path / "blocking.json"
    srv = Server(tmp_path, "--pool-size", "1", "--kernel-grace", "1",
                 launcher=(str(Path(__file__).parent.parent / "blocking_zmq.py"),),
                 env={"BLOCKING_ZMQ_RECORD": str(record), "WORKER_TIMEOUT": "2"})
    try:
        platform = PlatformClient(srv.url)
        assert platform.execute("def main(x):\n    return {'y': x + 1}\n", {"x": 1}) == {"y": 2}
        with pytest.raises(CodeExecutionError):  # the kernel's own deadline, then the client's
            platform.execute("import time\ndef main():\n    time.sleep(30)\n", {})
        url = srv.url + "/api/v1/sessions"
        session = f"{url}/{http.post(url, headers=auth(DIFY_KEY), json={}).json()['id']}"
        died = http.post(session + "/execute", headers=auth(DIFY_KEY),
                         json={"code": "import os\nos._exit(1)"}).json()
        assert died["state_lost"] is True  # restarted in place
        assert http.put(session + "/files/f", headers=auth(DIFY_KEY), content=b"1").status_code \
            == 201
        with http.stream("POST", session + "/execute", json={"code": "print(1)"},
                         headers={**auth(DIFY_KEY), "Accept": "text/event-stream"}) as events:
            assert "done" in [name for _, name, _ in sse_events(events)]
        with pytest.raises(httpx.ReadTimeout):  # a client that leaves mid-run
            http.post(session + "/execute", headers=auth(DIFY_KEY), timeout=0.5,
                      json={"code": "import time\ntime.sleep(10)"})
        idle_as(session, DIFY_KEY)
        assert http.post(session + "/interrupt", headers=auth(DIFY_KEY)).status_code == 204
        assert http.delete(session, headers=auth(DIFY_KEY)).status_code == 204
    finally:
        srv.stop()
    found = json.loads(record.read_text())
    assert [call["call"] for call in found[:1]] == ["Socket.send"]  # the guard's own canary
    assert "_canary" in "".join(found[0]["stack"])
    blocking = found[1:]
    assert not blocking, "\n\n".join(f"{call['call']}:\n{''.join(call['stack'])}"
                                       for call in blocking[:3])


@pytest.mark.timeout(60)  # before the fix the event loop stayed blocked: only this ended it
def test_a_kernel_port_taken_by_a_wrong_peer_does_not_freeze_the_event_loop():
    """The frozen service of bench/results/load.md: the client's shell socket reached a socket
    of the wrong type (a port another process had taken), and jupyter_client's synchronous
    kernel_info send waited forever on the event loop. Now the start fails in its own time,
    and the loop keeps turning meanwhile."""
    import zmq

    from sandbox_kernel.client import AsyncSandbox

    async def scenario() -> tuple[str, float]:
        with zmq.Context() as context, context.socket(zmq.PUSH) as wrong_peer:
            wrong_peer.linger = 0
            port = wrong_peer.bind_to_random_port("tcp://127.0.0.1")
            sandbox = AsyncSandbox(kernel_name=None, startup_timeout=4)
            await sandbox.start()
            gaps = [0.0]

            async def tick() -> None:
                last = time.monotonic()
                while True:
                    await asyncio.sleep(0.05)
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()

            ticker = asyncio.ensure_future(tick())
            try:
                sandbox.client.stop_channels()
                sandbox.manager.shell_port = port  # the next client's shell goes there
                with pytest.raises(RuntimeError) as failed:
                    await sandbox._connect()
            finally:
                ticker.cancel()
                await sandbox.close()
            return str(failed.value), max(gaps)

    message, longest_gap = asyncio.run(scenario())
    assert message == "Kernel didn't respond in 4 seconds"
    assert longest_gap < 2.0, longest_gap
