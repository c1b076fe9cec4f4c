"""Snapshots, pausing and resuming (`--state-dir`): the store's files, then the service's routes
on real kernels, a restart, and two instances behind a load balancer."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from sandbox_kernel.hosting.store import Quota, QuotaError, Store, StoreError

OWNER, OTHER = "team-a", "team-b"


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "state", max_size=4096)


# --- the store: bytes, MACs, owners, leases (no kernel needed) ---

def test_key_is_made_once_and_private(tmp_path, store):
    key_file = tmp_path / "state" / "key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert Store(tmp_path / "state", 4096).key == store.key == key_file.read_bytes()


def test_a_snapshot_is_its_owners_only(store):
    item = store.save_snapshot(OWNER, b"sealed bytes", {"network": {"mode": "off"}})
    assert store.snapshot(OWNER, item.id, payload=True).payload == b"sealed bytes"
    assert store.snapshot(OWNER, item.id).size == len(b"sealed bytes")  # record only
    assert [s.id for s in store.snapshots(OWNER)] == [item.id]
    assert store.snapshots(OTHER) == []
    for attempt in (lambda: store.snapshot(OTHER, item.id),
                    lambda: store.delete_snapshot(OTHER, item.id)):
        with pytest.raises(StoreError) as refused:
            attempt()
        assert refused.value.status == 404
    store.delete_snapshot(OWNER, item.id)
    assert store.snapshots(OWNER) == []


@pytest.mark.parametrize("where", ["record mac", "whole mac", "record", "payload"])
def test_one_altered_byte_is_refused(store, where):
    item = store.save_snapshot(OWNER, b"x" * 100, {"network": {"mode": "off"}})
    path = store.root / "snapshots" / item.id
    data = bytearray(path.read_bytes())
    offset = {"record mac": 3, "whole mac": 40, "record": 70, "payload": len(data) - 5}[where]
    data[offset] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError) as refused:
        store.snapshot(OWNER, item.id, payload=True)  # as a restore reads it
    if where.endswith("record mac") or where == "record":
        assert refused.value.status == 404  # as unknown: its record names no one
        assert store.snapshots(OWNER) == []  # a listing, which reads only the record
    else:
        assert refused.value.status == 422 and "altered" in str(refused.value)
        assert [s.id for s in store.snapshots(OWNER)] == [item.id]  # listed, to delete


def test_an_owner_rewritten_in_the_record_is_refused(store):
    """A tenant who could write the volume still cannot make another's snapshot theirs."""
    item = store.save_snapshot(OTHER, b"payload", {"network": {"mode": "off"}})
    path = store.root / "snapshots" / item.id
    path.write_bytes(path.read_bytes().replace(OTHER.encode(), OWNER.encode()))
    with pytest.raises(StoreError):
        store.snapshot(OWNER, item.id)


def test_a_file_copied_to_another_id_or_kind_is_refused(store):
    item = store.save_snapshot(OWNER, b"payload", {"network": {"mode": "off"}})
    other_id = "ab" * 16
    data = (store.root / "snapshots" / item.id).read_bytes()
    (store.root / "snapshots" / other_id).write_bytes(data)
    (store.root / "paused" / other_id).write_bytes(data)
    with pytest.raises(StoreError):
        store.snapshot(OWNER, other_id)
    assert store.paused(OWNER, other_id) is None
    assert store.all_paused() == []


def test_ids_that_are_not_the_services_name_no_file(store):
    for bad in ("../key", "key", "..", "ABC", ""):
        with pytest.raises(StoreError):
            store.snapshot(OWNER, bad)


def test_too_large_is_413_with_the_flag(store):
    with pytest.raises(StoreError) as refused:
        store.save_snapshot(OWNER, b"x" * 4097, {})
    assert refused.value.status == 413
    assert "--max-snapshot-size" in str(refused.value)
    assert list((store.root / "snapshots").iterdir()) == []


def test_a_keys_snapshot_count_is_bounded_counted_and_freed_by_a_delete(tmp_path):
    refused = []
    store = Store(tmp_path / "state", 4096, Quota(count=2), refused.append)
    kept = [store.save_snapshot(OWNER, b"x", {}) for _ in range(2)]
    for attempt in (lambda: store.room(OWNER),  # asked before the kernel is
                    lambda: store.save_snapshot(OWNER, b"x", {})):
        with pytest.raises(QuotaError) as full:
            attempt()
        assert full.value.status == 429 and full.value.reason == "key_count"
        assert "keeps 2 snapshots, the most it may (--max-snapshots-per-key 2)" in \
            str(full.value)
        assert "delete snapshots it no longer needs" in str(full.value)
    assert refused == ["key_count", "key_count"]
    assert len(store.snapshots(OWNER)) == 2
    assert [p.name for p in (store.root / "snapshots").iterdir()
            if p.name.startswith(".")] == []  # the refused one's staged file is gone
    store.save_snapshot(OTHER, b"x", {})  # each key its own quota
    store.save_paused(OWNER, "ef" * 16, b"x", {})  # a pause is bounded by sessions instead
    store.delete_snapshot(OWNER, kept[0].id)
    store.save_snapshot(OWNER, b"x", {})


def test_a_keys_snapshot_bytes_are_bounded_before_and_after_the_kernel_is_asked(tmp_path):
    refused = []
    store = Store(tmp_path / "state", 4096, Quota(bytes=1000), refused.append)
    assert store.room(OWNER) == (1000, "--max-snapshot-bytes-per-key")
    store.save_snapshot(OWNER, b"x" * 600, {})
    assert store.room(OWNER) == (400, "--max-snapshot-bytes-per-key")
    with pytest.raises(QuotaError) as full:
        store.save_snapshot(OWNER, b"x" * 401, {})
    assert full.value.status == 413 and full.value.reason == "key_bytes"
    assert "hold 600 bytes and this one needs 401 more, past the 1000 bytes it may keep " \
           "(--max-snapshot-bytes-per-key)" in str(full.value)
    claimed = store.refuse_size(OWNER, 500)  # a kernel's claim past room(): never taken
    assert isinstance(claimed, QuotaError) and claimed.status == 413
    too_big = store.refuse_size(OWNER, 5000)
    assert too_big.status == 413 and "--max-snapshot-size" in str(too_big)
    assert refused == ["key_bytes", "key_bytes", "size"]
    assert Store(tmp_path / "big", 4096, Quota(bytes=10**9)).room(OWNER) == \
        (4096, "--max-snapshot-size")  # the quota's room is past one snapshot's limit


COUNTING_REPLICA = """
import sys, time
from sandbox_kernel.hosting.store import Quota, Store, Stored
store = Store(sys.argv[1], 4096, Quota(count=1))
with store._quota_lock("team-a"):  # a replica between its count and its write
    print("counting", flush=True)
    time.sleep(1.5)
    store._write("snapshots", Stored("ab" * 16, "team-a", {}, b"x"))
"""


def test_a_replica_saving_at_the_same_instant_never_passes_the_keys_quota(store, tmp_path):
    """Replicas sharing the directory, each counting the key's snapshots at once, would each
    see room for one more: the count and the write happen under the key's lock, so the
    second waits for the first and is refused."""
    replica = subprocess.Popen([sys.executable, "-c", COUNTING_REPLICA, str(store.root)],
                               stdout=subprocess.PIPE, text=True)
    assert replica.stdout.readline().strip() == "counting"
    mine = Store(store.root, 4096, Quota(count=1))
    with pytest.raises(QuotaError):
        mine.save_snapshot(OWNER, b"y", {})
    assert replica.wait(timeout=60) == 0
    assert [item.id for item in mine.snapshots(OWNER)] == ["ab" * 16]


HOLD = """
import sys, time
from sandbox_kernel.hosting.store import Store
Store(sys.argv[1], 4096).lease(sys.argv[2], "team-a")
print("held", flush=True)
time.sleep(60)
"""


def test_a_lease_held_by_another_process_is_refused_until_it_dies(store):
    session_id = "cd" * 16
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(store.root), session_id],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreError) as refused:
            store.lease(session_id, OWNER)
        assert refused.value.status == 409
        assert "another instance" in str(refused.value)
        assert store.held_elsewhere(OWNER, session_id)
        assert not store.held_elsewhere(OTHER, session_id)  # no hint to another owner
    finally:
        holder.kill()
        holder.wait()
    assert not store.held_elsewhere(OWNER, session_id)
    store.lease(session_id, OWNER)  # the lock went with the process
    store.release(session_id)


def test_paused_sessions_are_listed_with_their_expiry(store):
    store.save_paused(OWNER, "ef" * 16, b"payload", {"expires": 123.0})
    assert store.all_paused() == [("ef" * 16, 123.0)]
    assert store.paused(OTHER, "ef" * 16) is None
    store.drop_paused("ef" * 16)
    assert store.all_paused() == []


def test_pause_after_needs_a_state_dir():
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "serve",
                           "--session-pause-after", "5"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "SANDBOX_STATE_DIR": ""})
    assert done.returncode != 0
    assert "session-pause-after needs --state-dir" in done.stderr



# --- the service: snapshots, forks, pauses and restarts on real kernels ---

httpx = pytest.importorskip("httpx")
from ..ci_tools import unavailable  # noqa: E402
from ..helpers import at_once  # noqa: E402
from .helpers import KEY_A, KEY_B, Server, auth, free_port, http  # noqa: E402

STATE = """
import numpy as np
import pandas as pd

class Point:
    def __init__(self, x):
        self.x = x

def adder(n):
    return lambda value: value + n

frame = pd.DataFrame({"a": [1, 2, 3]})
array = np.arange(5)
point = Point(7)
add3 = adder(3)
counting = (i for i in range(3))
handle = open("notes.txt", "w")
handle.write("kept in the scratch")
handle.flush()
"""
CHECK = ("def main():\n"
         "    return {'frame': int(frame['a'].sum()), 'array': array.tolist(),\n"
         "            'point': point.x, 'add3': add3(1), 'file': open('notes.txt').read(),\n"
         "            'cls': type(point).__name__}\n")
EXPECTED = {"frame": 6, "array": [0, 1, 2, 3, 4], "point": 7, "add3": 4,
            "file": "kept in the scratch", "cls": "Point"}


def sessions_url(srv) -> str:
    return srv.url + "/api/v1/sessions"


def create(url, key=KEY_B, **body):
    answer = http.post(url, headers=auth(key), json=body, timeout=120)
    assert answer.status_code == 201, answer.text
    return answer.json()


def execute(session_url, code, key=KEY_B, **body):
    answer = http.post(f"{session_url}/execute", headers=auth(key), timeout=120,
                       json={"code": code, **body})
    return answer


def result_of(session_url, code, key=KEY_B):
    answer = execute(session_url, code, key, inputs={})
    assert answer.status_code == 200, answer.text
    assert answer.json()["error"] is None, answer.json()["error"]
    return answer.json()["result"]


@pytest.fixture(scope="module")
def state_server(tmp_path_factory, keys_file):
    state = tmp_path_factory.mktemp("state")
    srv = Server(tmp_path_factory.mktemp("serve-state"), "--api-keys-file", str(keys_file),
                 "--pool-size", "0", "--state-dir", str(state),
                 "--session-pause-after", "3")
    srv.state = state
    yield srv
    srv.stop()


def test_snapshot_then_two_forks_diverge_and_others_cannot_touch_it(state_server):
    url = sessions_url(state_server)
    source = f"{url}/{create(url)['id']}"
    assert execute(source, STATE).json()["error"] is None
    taken = http.post(f"{source}/snapshots", headers=auth(KEY_B), timeout=120)
    assert taken.status_code == 201, taken.text
    snap = taken.json()
    assert snap["bytes"] > 0 and {"frame", "array", "point", "add3", "Point"} <= set(snap["saved"])
    skipped = {entry["name"]: entry["reason"] for entry in snap["skipped"]}
    assert {"counting", "handle"} <= set(skipped), snap["skipped"]
    http.delete(source, headers=auth(KEY_B))

    # Another key: not listed, not restorable, not deletable (all alike: "no such snapshot").
    assert http.get(state_server.url + "/api/v1/snapshots", headers=auth(KEY_A)).json() == []
    assert http.post(url, headers=auth(KEY_A), json={"snapshot": snap["id"]}).status_code == 404
    assert http.delete(f"{state_server.url}/api/v1/snapshots/{snap['id']}",
                       headers=auth(KEY_A)).status_code == 404
    # Another network than the snapshot's is refused.
    other = http.post(url, headers=auth(KEY_B), json={"snapshot": snap["id"], "network": True})
    assert (other.status_code, other.json()["detail"]) == (409, (
        f"snapshot {snap['id']} ran with network 'offline'; a restore gets the same network: "
        "omit network or ask for that"))

    opened = [create(url, snapshot=snap["id"]) for _ in range(2)]
    forks = [f"{url}/{fork['id']}" for fork in opened]
    try:
        # The answer says what came back and what did not, as the snapshot listed them.
        restore = opened[0]["restore"]
        assert set(restore) == {"restored", "skipped", "packages", "files"}
        assert sorted(restore["restored"]) == sorted(snap["saved"])
        assert restore["skipped"] == [] and restore["files"] == ["notes.txt"]
        assert http.get(forks[0], headers=auth(KEY_B)).json()["restore"] is None
        for fork in forks:
            assert result_of(fork, CHECK) == EXPECTED
        result_of(forks[0], "def main():\n    point.x = 100\n    return {}\n")
        assert result_of(forks[1], "def main():\n    return {'x': point.x}\n") == {"x": 7}
        assert result_of(forks[0], "def main():\n    return {'x': point.x}\n") == {"x": 100}
    finally:
        for fork in forks:
            http.delete(fork, headers=auth(KEY_B))
    listed = http.get(state_server.url + "/api/v1/snapshots", headers=auth(KEY_B)).json()
    assert [s["id"] for s in listed] == [snap["id"]]
    assert http.delete(f"{state_server.url}/api/v1/snapshots/{snap['id']}",
                       headers=auth(KEY_B)).status_code == 204
    assert http.get(state_server.url + "/api/v1/snapshots", headers=auth(KEY_B)).json() == []


def test_an_idle_session_pauses_and_resumes_on_its_next_request(state_server):
    url = sessions_url(state_server)
    session = f"{url}/{create(url)['id']}"
    try:
        assert execute(session, "x = 41").json()["error"] is None
        deadline = time.monotonic() + 30
        while not (state := http.get(session, headers=auth(KEY_B)).json())["paused"]:
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        assert state["alive"] and state["snapshot_bytes"] > 0
        assert http.post(f"{session}/interrupt", headers=auth(KEY_B)).status_code == 204
        assert http.get(session, headers=auth(KEY_B)).json()["paused"]  # not resumed by it
        # The other key cannot see, resume or delete it.
        assert http.get(session, headers=auth(KEY_A)).status_code == 404
        assert execute(session, "x", key=KEY_A).status_code == 404
        assert http.delete(session, headers=auth(KEY_A)).status_code == 404
        assert result_of(session, "def main():\n    return {'x': x + 1}\n") == {"x": 42}
        assert http.get(session, headers=auth(KEY_B)).json()["paused"] is False
    finally:
        http.delete(session, headers=auth(KEY_B))
    assert http.get(session, headers=auth(KEY_B)).status_code == 404


def test_a_session_holding_the_callers_secrets_is_never_paused(state_server):
    """Their values are never written to disk, so a resumed session would lack them: neither
    a pause request nor --session-pause-after pauses it, and it keeps its secret."""
    url = sessions_url(state_server)
    value = "sk-test-" + os.urandom(16).hex()
    made = create(url, network=True,
                  secrets={"MY_KEY": {"value": value, "hosts": ["api.example.com"]}})
    session = f"{url}/{made['id']}"
    try:
        refused = http.post(f"{session}/pause", headers=auth(KEY_B), timeout=60)
        assert refused.status_code == 409, refused.text
        assert "never written to disk: it cannot be paused" in refused.text
        assert value not in refused.text
        time.sleep(5)  # past --session-pause-after 3: the idle pause passes it by
        state = http.get(session, headers=auth(KEY_B)).json()
        assert state["paused"] is False and state["alive"], state
        shown = execute(session, "__import__('os').environ['MY_KEY']").json()
        assert shown["error"] is None and shown["text"].startswith("'sk-sandbox-MY_KEY-"), shown
    finally:
        http.delete(session, headers=auth(KEY_B))


def test_sigterm_pauses_every_session_and_a_restart_resumes_it(tmp_path, keys_file):
    state = tmp_path / "state"
    first = Server(tmp_path, "--api-keys-file", str(keys_file), "--pool-size", "0",
                   "--state-dir", str(state))
    url = sessions_url(first)
    session_id = create(url)["id"]
    assert execute(f"{url}/{session_id}", "kept = {'n': 5}").json()["error"] is None
    first.stop()
    assert '"event":"session_paused"' in first.log.read_text()
    again = Server(tmp_path, "--api-keys-file", str(keys_file), "--pool-size", "0",
                   "--state-dir", str(state))
    try:
        assert session_id in again.log.read_text().split('"event":"paused_sessions"')[1]
        url = sessions_url(again)
        listed = http.get(url, headers=auth(KEY_B)).json()
        assert [(s["id"], s["paused"]) for s in listed] == [(session_id, True)]
        assert result_of(f"{url}/{session_id}", "def main():\n    return kept\n") == {"n": 5}
        http.delete(f"{url}/{session_id}", headers=auth(KEY_B))
    finally:
        again.stop()


def test_a_snapshot_altered_by_one_byte_is_refused(state_server):
    url = sessions_url(state_server)
    source = f"{url}/{create(url)['id']}"
    try:
        assert execute(source, "y = 1").json()["error"] is None
        snap = http.post(f"{source}/snapshots", headers=auth(KEY_B), timeout=120).json()
    finally:
        http.delete(source, headers=auth(KEY_B))
    path = state_server.state / "snapshots" / snap["id"]
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))
    refused = http.post(url, headers=auth(KEY_B), json={"snapshot": snap["id"]})
    assert refused.status_code == 422 and "altered" in refused.json()["detail"], refused.text
    assert http.get(state_server.url + "/ready").status_code == 200
    assert http.delete(f"{state_server.url}/api/v1/snapshots/{snap['id']}",
                       headers=auth(KEY_B)).status_code == 204


HAPROXY = """
global
    nbthread 1
defaults
    mode http
    timeout connect 5s
    timeout client 120s
    timeout server 120s
    http-reuse never
frontend front
    bind 127.0.0.1:{port}
    default_backend services
backend services
    balance roundrobin
    http-response set-header X-Served-By %s
    server a 127.0.0.1:{a}
    server b 127.0.0.1:{b}
"""


def test_two_instances_behind_haproxy_share_paused_sessions_never_one_at_once(
        tmp_path, keys_file):
    haproxy = "/usr/sbin/haproxy"
    if not os.path.exists(haproxy):
        unavailable("Debian's haproxy is not installed: `apt-get install haproxy`")
    state = tmp_path / "state"
    flags = ("--api-keys-file", str(keys_file), "--pool-size", "0", "--state-dir", str(state))
    a, b = Server(tmp_path, *flags), Server(tmp_path, *flags)
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(HAPROXY.format(port=port, a=a.port, b=b.port))
    balancer = subprocess.Popen([haproxy, "-f", str(config), "-db"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120,
                          headers=auth(KEY_B))
    try:
        for _ in range(100):
            try:
                client.get("/ready")
                break
            except httpx.TransportError:
                time.sleep(0.05)

        def send(method, path, **body):
            answer = client.request(method, path, **body)
            return answer, answer.headers.get("X-Served-By")

        created, first = send("POST", "/api/v1/sessions", json={})
        assert created.status_code == 201, created.text
        path = f"/api/v1/sessions/{created.json()['id']}"
        # Round robin: this one reaches the other instance, which must not run it too.
        both, second = send("POST", f"{path}/execute", json={"code": "z = 9"})
        assert second != first
        assert both.status_code == 409 and "another instance" in both.json()["detail"]
        done, on = send("POST", f"{path}/execute", json={"code": "z = 9"})
        assert on == first and done.json()["error"] is None
        # Pausing lets the other instance resume it, with its state.
        _, on = send("GET", "/ready")
        paused, on = send("POST", f"{path}/pause")
        assert on == first and paused.status_code == 200 and paused.json()["paused"]
        resumed, on = send("POST", f"{path}/execute", json={"code": "def main():\n    "
                                                                     "return {'z': z}\n",
                                                            "inputs": {}})
        assert on == second and resumed.status_code == 200, resumed.text
        assert resumed.json()["result"] == {"z": 9}
        # Now the first instance is the other one: refused there.
        elsewhere, on = send("POST", f"{path}/execute", json={"code": "z"})
        assert on == first and elsewhere.status_code == 409, elsewhere.text
        deleted, on = send("DELETE", path)
        assert on == second and deleted.status_code == 204
    finally:
        client.close()
        balancer.terminate()
        balancer.wait(timeout=10)
        a.stop()
        b.stop()


EVIL = """
class Evil:
    def __reduce__(self):
        import os
        return (os.system, ("touch {marker}",))

evil = Evil()
kept = 5
"""


def test_a_hostile_reduce_runs_only_inside_the_sandbox_and_the_service_is_unharmed(
        state_server, tmp_path):
    marker = tmp_path / "pwned"
    url = sessions_url(state_server)
    source = f"{url}/{create(url)['id']}"
    try:
        assert execute(source, EVIL.format(marker=marker)).json()["error"] is None
        taken = http.post(f"{source}/snapshots", headers=auth(KEY_B), timeout=120)
        assert taken.status_code == 201, taken.text
        assert not marker.exists()  # saving pickled it in the kernel; nothing ran here
    finally:
        http.delete(source, headers=auth(KEY_B))
    fork = f"{url}/{create(url, snapshot=taken.json()['id'])['id']}"
    try:
        # Loaded in the fresh sandboxed kernel, where os.system is refused: the name is not
        # restored, the rest is, and nothing ran on the host.
        assert result_of(fork, "def main():\n    return {'kept': kept, 'evil': "
                               "'evil' in globals()}\n") == {"kept": 5, "evil": False}
        assert not marker.exists()
    finally:
        http.delete(fork, headers=auth(KEY_B))
        http.delete(f"{state_server.url}/api/v1/snapshots/{taken.json()['id']}",
                    headers=auth(KEY_B))
    assert http.get(state_server.url + "/ready").status_code == 200


CLAIM_10_GB = """
import sandbox_kernel.kernel.snapshot as snapshot
real = snapshot.__sandbox_snapshot__

def claims_ten_gigabytes(op, **inputs):
    answer = real(op, **inputs)
    return {**answer, "bytes": 10 * 2**30} if op == "take" else answer

snapshot.__sandbox_snapshot__ = claims_ten_gigabytes
"""


def test_a_kernel_claiming_a_10_gb_snapshot_is_refused_with_413_and_keeps_running(
        state_server):
    url = sessions_url(state_server)
    session = f"{url}/{create(url)['id']}"
    try:
        assert execute(session, CLAIM_10_GB + "\nstill = 'here'").json()["error"] is None
        refused = http.post(f"{session}/snapshots", headers=auth(KEY_B), timeout=120)
        assert refused.status_code == 413, refused.text
        assert "--max-snapshot-size" in refused.json()["detail"]
        assert result_of(session, "def main():\n    return {'still': still}\n") == \
            {"still": "here"}
        assert http.get(state_server.url + "/api/v1/snapshots",
                        headers=auth(KEY_B)).json() == []
    finally:
        http.delete(session, headers=auth(KEY_B))
    assert http.get(state_server.url + "/ready").status_code == 200


def test_paused_sessions_count_against_the_keys_limit_and_expire_with_its_idle_timeout(
        state_server):
    url = sessions_url(state_server)
    first = f"{url}/{create(url, key=KEY_A, idle_timeout=4)['id']}"  # team-a holds 2 at most
    second = f"{url}/{create(url, key=KEY_A)['id']}"
    try:
        assert http.post(f"{first}/pause", headers=auth(KEY_A), timeout=120).status_code == 200
        full = http.post(url, headers=auth(KEY_A), json={})
        assert full.status_code == 429 and "1 of them paused" in full.json()["detail"]
        time.sleep(4.5)  # past the paused session's idle timeout, counted from its last use
        assert http.get(first, headers=auth(KEY_A)).status_code == 404
        assert execute(first, "1", key=KEY_A).status_code == 404
        third = create(url, key=KEY_A)  # its place is free again
        http.delete(f"{url}/{third['id']}", headers=auth(KEY_A))
    finally:
        for session in (first, second):
            http.delete(session, headers=auth(KEY_A))


CLAIM_1000_MB_SEND_NOTHING = """
import sandbox_kernel.kernel.snapshot as snapshot
real = snapshot.__sandbox_snapshot__

def claims_and_sends_nothing(op, **inputs):
    if op == "read":
        return {}  # not one chunk of the bytes claimed
    answer = real(op, **inputs)
    return {**answer, "bytes": 1000 * 2**20} if op == "take" else answer

snapshot.__sandbox_snapshot__ = claims_and_sends_nothing
"""


def peak_rss(pid: int) -> int:
    """A process's peak resident memory (VmHWM), in bytes."""
    status = open(f"/proc/{pid}/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def test_a_claimed_snapshot_costs_the_service_nothing_until_its_bytes_arrive(state_server):
    """Issue #44 item 2: a session claiming a 1000 MiB snapshot (within --max-snapshot-size)
    and sending none of it: the service's memory grows with bytes that arrived, never with a
    claim, and the request is refused, naming what the kernel did."""
    url = sessions_url(state_server)
    session = f"{url}/{create(url)['id']}"
    try:
        assert execute(session, CLAIM_1000_MB_SEND_NOTHING + "\nstill = 'here'"
                       ).json()["error"] is None
        before = peak_rss(state_server.process.pid)
        refused = http.post(f"{session}/snapshots", headers=auth(KEY_B), timeout=120)
        grown = peak_rss(state_server.process.pid) - before
        assert refused.status_code == 422, refused.text
        assert "sent 0 bytes of the snapshot" in refused.json()["detail"], refused.text
        assert grown < 100 * 2**20, f"the service's peak memory grew {grown >> 20} MiB"
        assert result_of(session, "def main():\n    return {'still': still}\n") == \
            {"still": "here"}
    finally:
        http.delete(session, headers=auth(KEY_B))


def refusals(srv, reason: str) -> float:
    """The service's count of snapshots refused for reason, as /metrics shows it."""
    shown = http.get(srv.url + "/metrics").text
    line = f'sandbox_snapshots_refused_total{{reason="{reason}"}} '
    return float(shown.split(line)[1].split()[0]) if line in shown else 0.0


def test_a_keys_snapshots_are_bounded_in_count_and_bytes_and_counted(tmp_path, keys_file):
    """Issue #44 item 2: --max-snapshots-per-key and --max-snapshot-bytes-per-key, each
    refused naming the flag, the session running on, and counted in /metrics; a claim past
    what the quota leaves is refused before its bytes leave the kernel."""
    srv = Server(tmp_path, "--api-keys-file", str(keys_file), "--pool-size", "0",
                 "--state-dir", str(tmp_path / "state"), "--max-snapshots-per-key", "2",
                 "--max-snapshot-bytes-per-key", str(2 * 2**20))
    url = sessions_url(srv)
    session = f"{url}/{create(url)['id']}"
    try:
        assert execute(session, "x = 1").json()["error"] is None
        taken = [http.post(f"{session}/snapshots", headers=auth(KEY_B), timeout=120)
                 for _ in range(3)]
        assert [answer.status_code for answer in taken] == [201, 201, 429], taken[2].text
        assert "(--max-snapshots-per-key 2)" in taken[2].json()["detail"]
        assert refusals(srv, "key_count") == 1
        # Another key has its own.
        other = f"{url}/{create(url, key=KEY_A)['id']}"
        assert http.post(f"{other}/snapshots", headers=auth(KEY_A),
                         timeout=120).status_code == 201
        http.delete(other, headers=auth(KEY_A))
        # A place freed; 2.5 MiB more does not fit in what the 2 MiB leave.
        assert http.delete(f"{srv.url}/api/v1/snapshots/{taken[0].json()['id']}",
                           headers=auth(KEY_B)).status_code == 204
        assert execute(session, "big = bytes(2560 * 1024)").json()["error"] is None
        over = http.post(f"{session}/snapshots", headers=auth(KEY_B), timeout=120)
        assert over.status_code == 413, over.text
        assert "(--max-snapshot-bytes-per-key)" in over.json()["detail"]
        assert refusals(srv, "key_bytes") == 1
        assert result_of(session, "def main():\n    return {'x': x}\n") == {"x": 1}
        listed = http.get(srv.url + "/api/v1/snapshots", headers=auth(KEY_B)).json()
        assert [s["id"] for s in listed] == [taken[1].json()["id"]]
    finally:
        http.delete(session, headers=auth(KEY_B))
        srv.stop()


def live_sessions(srv) -> float:
    """The sessions an instance holds a kernel for, as its /metrics shows them."""
    shown = http.get(srv.url + "/metrics").text
    return float(shown.split("\nsandbox_sessions ")[1].split()[0])


def test_two_instances_resuming_one_paused_session_at_the_same_instant(tmp_path, keys_file):
    """Issue #44 item 7: both instances sharing the state dir get the session's next request
    in the same instant: one resumes it, the other answers 409 saying it runs elsewhere;
    never two live kernels, and its pause file stays whole. Tried over several rounds, the
    winner pausing it again each time."""
    state = tmp_path / "state"
    flags = ("--api-keys-file", str(keys_file), "--pool-size", "0", "--state-dir", str(state))
    instances = [Server(tmp_path, *flags), Server(tmp_path, *flags)]
    try:
        url = sessions_url(instances[0])
        session_id = create(url)["id"]
        assert execute(f"{url}/{session_id}", "z = 9").json()["error"] is None
        holder = instances[0]
        for _ in range(3):
            paused = http.post(f"{sessions_url(holder)}/{session_id}/pause",
                               headers=auth(KEY_B), timeout=120)
            assert paused.status_code == 200, paused.text
            answers = at_once([
                lambda srv=srv: execute(f"{sessions_url(srv)}/{session_id}",
                                        "def main():\n    return {'z': z}\n", inputs={})
                for srv in instances])
            statuses = sorted(answer.status_code for answer in answers)
            assert statuses == [200, 409], [answer.text for answer in answers]
            won = next(n for n, answer in enumerate(answers) if answer.status_code == 200)
            lost = answers[1 - won].json()["detail"]
            assert f"session {session_id} is running on another instance" in lost, lost
            assert answers[won].json()["result"] == {"z": 9}
            assert [live_sessions(srv) for srv in instances] == \
                [1.0 if n == won else 0.0 for n in range(2)]
            holder = instances[won]
            kept = Store(state, 2**30).paused("team-b", session_id, payload=True)
            assert kept is not None and kept.payload  # its MAC checked: whole
        http.delete(f"{sessions_url(holder)}/{session_id}", headers=auth(KEY_B))
    finally:
        for srv in instances:
            srv.stop()
