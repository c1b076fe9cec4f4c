"""With --one-shot-pool-size, the stateless routes run on one-shot kernels: SSE flows, a
kernel per run."""

from __future__ import annotations

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
