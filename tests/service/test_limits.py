"""Limits, disconnects, shutdown: small servers of their own."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox_kernel.launch import forkserver

from .helpers import DIFY_KEY, RUN, Server, auth, children, fork_served, http, httpx, running


@pytest.fixture
def small_server(tmp_path):
    srv = Server(tmp_path, "--pool-size", "0", "--max-body", "65536",
                 "--max-output-total", "100000",
                 env={"MAX_REQUESTS": "2", "MAX_WORKERS": "1", "WORKER_TIMEOUT": "20",
                      "ENABLE_NETWORK": "false"})
    yield srv
    srv.stop()


def _sleeper(server, seconds, results):
    body = {"language": "python3", "code": f"import time\ntime.sleep({seconds})"}

    def run():
        try:
            results.append(http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY},
                                     timeout=60, json=body))
        except httpx.HTTPError as exc:
            results.append(exc)
    worker = threading.Thread(target=run)
    worker.start()
    return worker


def test_past_max_requests_answers_503_at_once(small_server):
    results: list = []
    workers = [_sleeper(small_server, 3, results) for _ in range(2)]
    small_server.wait_until(lambda s: s["runs_in_flight"] == 2)
    started = time.monotonic()
    answer = http.post(small_server.url + RUN, headers={"X-Api-Key": DIFY_KEY},
                       json={"language": "python3", "code": "print(1)"})
    assert time.monotonic() - started < 2  # the runs in flight sleep 3 s
    assert answer.status_code == 503
    assert answer.content == b'{"code":-503,"message":"Too many requests","data":null}'
    native = http.post(small_server.url + "/api/v1/execute", headers=auth(DIFY_KEY),
                       json={"code": "1"})
    assert native.status_code == 503
    for worker in workers:
        worker.join(60)
    assert [r.status_code for r in results] == [200, 200]


def test_network_disabled(small_server):
    answer = http.post(small_server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json={
        "language": "python3", "code": "print(1)", "enable_network": True})
    assert answer.status_code == 200
    assert answer.content == (b'{"code":-400,"message":"network is disabled, please enable it in '
                              b'the configuration","data":null}')
    assert small_server.ready()["pool"] == {"offline": 0}


def test_body_too_large(small_server):
    answer = http.post(small_server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json={
        "language": "python3", "code": "#" * 70_000})
    assert answer.status_code == 413


def _post_async(url: str, content, headers: dict[str, str]) -> httpx.Response:
    """One POST from httpx's asyncio client (the one that saw the resets: it stops reading
    when its write fails)."""
    async def post() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(url, content=content, headers=headers)
    return asyncio.run(post())


def _too_large(answer: httpx.Response) -> None:
    assert answer.status_code == 413, answer.text
    assert "--max-body" in answer.json()["detail"]


# A body that does not fit in the sockets' buffers: answered unread, the client (still sending)
# saw a connection reset (httpx.ReadError) instead of the 413.
@pytest.mark.parametrize("size", [65_537, 4 * 2**20, 20 * 2**20])
def test_a_refused_body_still_gets_its_413_to_the_client(small_server, size):
    for _ in range(2):
        _too_large(_post_async(small_server.url + RUN, b"x" * size, headers={
            "X-Api-Key": DIFY_KEY, "Content-Type": "application/json"}))


def test_a_refused_chunked_body_still_gets_its_413_to_the_client(small_server):
    async def chunks():
        for _ in range(64):
            yield b"x" * 65536
    for _ in range(2):
        _too_large(_post_async(small_server.url + "/api/v1/execute", chunks(),
                               headers={**auth(DIFY_KEY), "Content-Type": "application/json"}))


def test_a_client_that_disconnects_does_not_leak_its_kernel(small_server):
    before = children(small_server.process.pid)
    with pytest.raises(httpx.ReadTimeout):
        http.post(small_server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, timeout=2.5,
                  json={"language": "python3", "code": "import time\ntime.sleep(15)"})
    state = small_server.wait_until(lambda s: s["kernels_live"] == 0 and s["runs_in_flight"] == 0,
                                    timeout=10)
    assert state["kernels_live"] == 0 and state["runs_in_flight"] == 0
    # The fork server the run may have started is the service's child, and not a kernel.
    before.add(forkserver.ForkServerClient().server_pid() or 0)
    deadline = time.monotonic() + 15
    while children(small_server.process.pid) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not children(small_server.process.pid) - before
    # The same over SSE: the stream is left after the first line.
    headers = {**auth(DIFY_KEY), "Accept": "text/event-stream"}
    with http.stream("POST", small_server.url + "/api/v1/execute", headers=headers, timeout=60,
                     json={"code": "import os, time\nprint(os.getpid(), flush=True)\n"
                           "time.sleep(15)"}) as response:
        event = None
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                assert event == "stdout", (event, line)
                pid = int(json.loads(line[5:]))
                break
    deadline = time.monotonic() + 15
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(pid)
    assert small_server.wait_until(lambda s: s["kernels_live"] == 0)["kernels_live"] == 0


def test_graceful_shutdown_leaves_nothing_behind(tmp_path):
    # Kernels are the service's children when started cold, the fork server's when fork-served.
    fork_server = forkserver.ForkServerClient()
    before = fork_served(fork_server.server_pid())
    srv = Server(tmp_path, "--pool-size", "1", "--api-key", DIFY_KEY)
    url = srv.url + "/api/v1/sessions"
    made = http.post(url, headers=auth(DIFY_KEY), json={}, timeout=60)
    assert made.status_code == 201
    results: list = []
    worker = _sleeper(srv, 1, results)
    srv.wait_until(lambda s: s["runs_in_flight"] == 1)
    server = fork_server.server_pid()  # shared by every kernel of this interpreter: not ours
    kernels: set[int] = set()
    deadline = time.monotonic() + 10  # the pool starts a replacement a moment after a hand-out
    while len(kernels) < 3 and time.monotonic() < deadline:
        kernels = (children(srv.process.pid) | fork_served(server)) - before - {server}
        time.sleep(0.05)
    assert len(kernels) >= 3  # the session's, the run's, the pool's
    srv.stop()
    worker.join(10)
    assert results and results[0].status_code == 200  # the in-flight run finished
    # One-shot kernels waiting in their pools die with the fork server (PDEATHSIG), a moment
    # after it: their exit (a network namespace torn down) is not instant.
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in kernels) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in kernels:
        assert not running(pid), pid
    scratch = Path(f"/tmp/sandbox-kernel-{os.geteuid()}")
    if scratch.exists():
        left = [p.name for p in scratch.iterdir() if int(p.name.split("-")[1]) in kernels]
        assert not left


def test_output_past_the_service_cap_ends_the_run(small_server):
    # Around the kernel's own output cap: messages sent straight to the IOPub socket.
    flood = ("k = get_ipython().kernel\n"
             "for _ in range(200):\n"
             "    k.session.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'x' * 10000},"
             " parent=k.get_parent())\n"
             "import time\ntime.sleep(60)\n")
    started = time.monotonic()
    answer = http.post(small_server.url + "/api/v1/execute", headers=auth(DIFY_KEY), timeout=60,
                       json={"code": flood})
    assert time.monotonic() - started < 20  # cut at the cap, before WORKER_TIMEOUT (20 s)
    execution = answer.json()
    assert execution["error"]["name"] == "OutputLimitExceeded"
    assert "100000 bytes" in execution["error"]["value"]
    assert len(execution["stdout"]) <= 100_000
    assert small_server.wait_until(lambda s: s["kernels_live"] == 0)["kernels_live"] == 0


def test_network_kernels_reach_the_deployments_proxy_through_their_egress_proxy(tmp_path):
    """HTTPS_PROXY (Dify's SSRF proxy) is where the kernels' egress proxy chains to; user code
    sees its own egress proxy. Port 9 on the loopback stands for a proxy that is down."""
    srv = Server(tmp_path, "--pool-size", "0", env={"HTTPS_PROXY": "http://127.0.0.1:9"})
    try:
        code = ("import os, requests\nprint(os.environ.get('HTTPS_PROXY'))\n"
                "print(requests.get('http://example.com/', timeout=30).reason)")
        answer = http.post(srv.url + RUN, headers={"X-Api-Key": DIFY_KEY}, timeout=60, json={
            "language": "python3", "code": code, "enable_network": True})
        assert answer.json()["data"]["stdout"].splitlines() == [
            "http://127.0.0.1:3128",
            "the upstream proxy 127.0.0.1:9 could not be reached: ConnectionRefusedError(111, "
            "\"Connect call failed ('127.0.0.1', 9)\")"]
        offline = http.post(srv.url + RUN, headers={"X-Api-Key": DIFY_KEY}, timeout=60, json={
            "language": "python3", "code": "import os\nprint(os.environ.get('HTTPS_PROXY'))",
            "enable_network": False})
        assert offline.json()["data"]["stdout"] == "None\n"
    finally:
        srv.stop()


def test_a_socks5_upstream_is_refused_at_start(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "serve"], timeout=60,
                          capture_output=True, text=True,
                          env={**os.environ, "API_KEY": DIFY_KEY, "SOCKS5_PROXY": "socks5://p:1"})
    assert done.returncode != 0
    assert "SOCKS5_PROXY: the egress proxy chains to an HTTP proxy only" in done.stderr


def test_a_kernel_that_cannot_start_is_a_500_envelope(tmp_path):
    # ZMQ kernels (--one-shot-pool-size 0) cannot start their threads in 1 MiB; a one-shot
    # kernel starts none and runs a print in it.
    srv = Server(tmp_path, "--pool-size", "0", "--one-shot-pool-size", "0", "--memory-limit",
                 "1M", ready=False)
    try:
        state = srv.wait_until(lambda state: state.get("policies", {}).get(
            "offline", {}).get("error"), timeout=60)
        assert state["ready"] is False  # never ready while no kernel can start
        assert state["reason"].startswith("offline kernels: Kernel died before replying")
        answer = http.post(srv.url + RUN, headers={"X-Api-Key": DIFY_KEY}, timeout=90, json={
            "language": "python3", "code": "print(1)"})
        assert answer.status_code == 200
        body = answer.json()
        assert body["code"] == -500 and body["data"] is None
        assert body["message"].startswith("the offline kernel did not start")
        native = http.post(srv.url + "/api/v1/execute", headers=auth(DIFY_KEY), timeout=90,
                           json={"code": "1"})
        assert native.status_code == 503
        assert srv.ready()["kernels_live"] == 0
    finally:
        srv.stop()
