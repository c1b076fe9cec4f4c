"""With --one-shot-pool-size, the stateless routes run on one-shot kernels: SSE flows, a
kernel per run."""

from __future__ import annotations

import os
import time

import pytest

from .helpers import KEY_A, auth, http, sse_events


@pytest.fixture
def server(one_shot_server):
    return one_shot_server


def test_native_one_shot_sse_delivers_stdout_before_the_run_finishes(server):
    code = "import time\nprint('first')\ntime.sleep(1)\nprint('second')\n"
    headers = {**auth(KEY_A), "Accept": "text/event-stream"}
    with http.stream("POST", server.url + "/api/v1/execute", headers=headers,
                     json={"code": code}, timeout=30) as response:
        assert response.status_code == 200
        events = sse_events(response)
    names = [name for _, name, _ in events]
    assert names == ["stdout", "stdout", "done"]
    (first_at, _, first), (_, _, second), (done_at, _, done) = events
    assert first == "first\n" and second == "second\n"
    assert done_at - first_at > 0.8  # the first line came a second before the end
    assert done["stdout"] == "first\nsecond\n" and done["error"] is None


def test_stateless_runs_are_one_shot_kernels(server):
    code = ("def main():\n    import os, sys\n"
            "    return {'pid': os.getpid(), 'threads': len(os.listdir('/proc/self/task')),"
            " 'stdout': type(sys.stdout).__name__}")
    seen = [http.post(server.url + "/api/v1/execute", headers=auth(KEY_A),
                      json={"code": code, "inputs": {}}).json()["result"] for _ in range(3)]
    assert {run["stdout"] for run in seen} == {"CapturedStream"}  # kernel/oneshot.py's
    assert {run["threads"] for run in seen} == {1}  # no ZMQ, IOPub or heartbeat thread
    assert len({run["pid"] for run in seen}) == 3


def test_a_one_shot_run_past_its_deadline_is_killed_and_says_so(server):
    # SIGALRM (the kernel's own deadline) blocked: only the service's kill can end the run.
    code = ("import os, signal, time\nprint(os.getpid(), flush=True)\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGINT})\n"
            "time.sleep(60)\n")
    started = time.monotonic()
    answer = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A),
                       json={"code": code, "timeout": 1}, timeout=30).json()
    assert time.monotonic() - started < 15
    assert answer["error"]["name"] == "ExecutionTimeout", answer
    assert "did not stop" in answer["error"]["value"], answer
    assert answer["state_lost"] is True
    pid = int(answer["stdout"].split()[0])
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}/status") or "Z (zombie)" in open(
        f"/proc/{pid}/status").read(), "the one-shot kernel outlived its run"
