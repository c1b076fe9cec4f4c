"""Fairness between tenants (two native keys and the dify route) on a real server under uvicorn:
one tenant's load takes at most its share of workers, places in flight and sessions."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from sandbox_kernel.hosting.admission import Admission
from tests.helpers import write_keys

from .helpers import DIFY_KEY, KEY_A, KEY_B, RUN, Server, auth, http, httpx

SLEEP = 6.0  # each of team A's runs; far longer than a print(1) on a started kernel


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys.json"
    write_keys(keys, [{"id": "team-a", "key": KEY_A},
                      {"id": "team-b", "key": KEY_B}])
    # Three tenants (team-a, team-b, the dify route): each may hold half of the 2 workers, of
    # the 4 places in flight and of the 2 sessions, rounded up.
    srv = Server(tmp, "--api-keys-file", str(keys), "--pool-size", "1",
                 "--max-sessions", "2",
                 env={"MAX_WORKERS": "2", "MAX_REQUESTS": "4", "WORKER_TIMEOUT": "20",
                      "ENABLE_NETWORK": "false"})
    yield srv
    srv.stop()


def _in_background(send, ended: list) -> threading.Thread:
    def go():
        try:
            answer = send()
        except httpx.HTTPError as exc:
            answer = exc
        ended.append((time.monotonic(), answer))
    thread = threading.Thread(target=go)
    thread.start()
    return thread


def _execute(server, key, code, timeout=None):
    body = {"code": code, **({"timeout": timeout} if timeout else {})}
    return http.post(server.url + "/api/v1/execute", headers=auth(key), json=body, timeout=90)


def test_one_keys_load_neither_holds_the_others_worker_nor_fills_their_queue(server):
    a_ended: list = []
    sleepers = [_in_background(lambda: _execute(server, KEY_A, f"import time\n"
                                                f"time.sleep({SLEEP})\n'a'", timeout=20),
                               a_ended) for _ in range(2)]
    server.wait_until(lambda s: s["runs_in_flight"] == 2)
    # Team A has its 2 places in flight (one running, one waiting for A's worker): its next
    # run is refused at once, naming the per-key limit; the service's 4 are not all taken.
    third = _execute(server, KEY_A, "1")
    assert third.status_code == 503, third.text
    assert "'team-a' has its limit of 2 runs in flight (--max-requests-per-key)" \
        in third.json()["detail"]
    # Team B and the dify route each run at once on the worker A may not take, one after the
    # other, while both of A's runs are still in flight.
    b = _execute(server, KEY_B, "print(1)")
    dify = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, timeout=90,
                     json={"language": "python3", "code": "print(2)"})
    others_done = time.monotonic()
    assert b.status_code == 200 and b.json()["stdout"] == "1\n", b.text
    assert dify.json()["data"]["stdout"] == "2\n", dify.text
    for thread in sleepers:
        thread.join(90)
    assert [answer.status_code for _, answer in a_ended] == [200, 200]
    assert others_done < min(at for at, _ in a_ended)
    # A's runs went one after the other (its cap is one worker): the second ended a whole
    # run's time after the first.
    first, second = sorted(at for at, _ in a_ended)
    assert second - first > SLEEP * 0.8


def test_a_key_without_its_own_limit_holds_its_share_of_sessions(server):
    url = server.url + "/api/v1/sessions"
    # Sent at once: kernels still starting count against the key's share (1 of 2).
    ended: list = []
    threads = [_in_background(lambda: http.post(url, headers=auth(KEY_B), json={},
                                                timeout=90), ended) for _ in range(3)]
    for thread in threads:
        thread.join(90)
    answers = [answer for _, answer in ended]
    created = [answer for answer in answers if answer.status_code == 201]
    try:
        assert len(created) == 1, [a.text for a in answers]
        refused = [answer for answer in answers if answer.status_code == 429]
        assert len(refused) == 2
        assert "'team-b' may hold 1 sessions at once" in refused[0].json()["detail"]
        # The other key still gets the other session.
        other = http.post(url, headers=auth(KEY_A), json={}, timeout=90)
        assert other.status_code == 201, other.text
        http.delete(f"{url}/{other.json()['id']}", headers=auth(KEY_A))
    finally:
        for answer in created:
            http.delete(f"{url}/{answer.json()['id']}", headers=auth(KEY_B))


def test_a_freed_worker_goes_to_the_waiting_tenant_with_fewest_running():
    async def scenario():
        admission = Admission(max_requests=10, max_workers=2, requests_per_tenant=10,
                              workers_per_tenant=2)
        order: list[str] = []
        release = asyncio.Event()

        async def run(tenant: str) -> None:
            async with admission.worker(tenant):
                order.append(tenant)
                await release.wait()

        held = [asyncio.ensure_future(run("a")) for _ in range(2)]  # a holds both workers
        await asyncio.sleep(0)
        waiting = [asyncio.ensure_future(run(t)) for t in ("a", "a", "b")]
        gone = asyncio.ensure_future(run("c"))  # waits, then its client leaves
        await asyncio.sleep(0)
        gone.cancel()
        release.set()  # a's two end: the first freed worker goes to b (none running)
        await asyncio.gather(*held, *waiting)
        return order, admission.running_of("a"), admission.running_of("b")

    order, *running = asyncio.run(scenario())
    assert order == ["a", "a", "b", "a", "a"] and running == [0, 0]
