"""The MCP server's snapshot tools tried as an attacker would (#44 items 2 and 7): another key's
ids, ids that are not ids, sizes past the limits, and each key's quota, over Streamable HTTP
with two keys sharing one --state-dir; every call runs real sandboxed kernels."""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("mcp")
from tests.helpers import at_once, write_keys
from tests.mcp_clients import HttpServer

KEY_A = "mcp-key-a-0123456789abcdef"
KEY_B = "mcp-key-b-0123456789abcdef"
FLAGS_SEEN = re.compile(r"--[a-z]+-[a-z-]+")  # operator advice, never for a model
# The kernel's snapshot steps replaced by session code: it claims a size and sends nothing.
CLAIMS = """
import sandbox_kernel.kernel.snapshot as s
real = s._OPS['take']
s._OPS['take'] = lambda **kw: {{**real(**kw), 'bytes': {size}}}
s._OPS['read'] = lambda **_: {{}}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcp-snapshots")
    keys = tmp / "keys.json"
    write_keys(keys, [{"id": "team-a", "key": KEY_A},
                      {"id": "team-b", "key": KEY_B}])
    srv = HttpServer(tmp, keys, "--state-dir", str(tmp / "state"), "--pool-size", "0",
                     "--max-snapshot-size", "4M", "--max-snapshots-per-key", "2",
                     "--max-snapshot-bytes-per-key", "2M")
    yield srv
    srv.stop()


@pytest.fixture
def clients(server):
    a, b = server.client(KEY_A), server.client(KEY_B)
    yield a, b
    for client in (a, b):
        for snap in client.tool("list_snapshots").structured_content["snapshots"]:
            client.tool("delete_snapshot", {"snapshot": snap["snapshot"]})
        for session in client.tool("list_sessions").structured_content["sessions"]:
            client.tool("close_session", {"session": session["session"]})
        client.close()


def text(answer) -> str:
    return "\n".join(block.text for block in answer.content if block.type == "text")


def new_session(client, code: str = "x = 1") -> str:
    session = client.tool("create_session").structured_content["session"]
    ran = client.tool("run_python", {"session": session, "code": code})
    assert not ran.is_error, text(ran)
    return session


def test_another_keys_snapshot_is_as_unknown_to_every_tool(clients):
    a, b = clients
    snap = a.tool("snapshot_session", {"session": new_session(a, "secret = 'of team a'")})
    assert not snap.is_error, text(snap)
    snap_id = snap.structured_content["snapshot"]
    unknown = "0" * 32
    for tried in (snap_id, unknown):
        opened = b.tool("create_session", {"snapshot": tried})
        deleted = b.tool("delete_snapshot", {"snapshot": tried})
        assert opened.is_error and deleted.is_error
        # The same words for another key's id as for none: ids cannot be probed.
        for answer, tool in ((opened, "create_session"), (deleted, "delete_snapshot")):
            assert text(answer) == f"Error executing tool {tool}: there is no snapshot " \
                                   f"{tried!r}: see yours with list_snapshots"
    assert b.tool("list_snapshots").structured_content["snapshots"] == []
    assert [s["snapshot"] for s in a.tool("list_snapshots").structured_content[
        "snapshots"]] == [snap_id]  # still there, still team a's


@pytest.mark.parametrize("bad", ["../key", "..", "", "key", "../snapshots/" + "0" * 32,
                                 "A" * 32, "0" * 65, "0" * 32 + "\n", "%2e%2e%2fkey"])
def test_ids_that_are_not_snapshot_ids_name_no_file(clients, bad):
    a, _ = clients
    for answer in (a.tool("create_session", {"snapshot": bad}),
                   a.tool("delete_snapshot", {"snapshot": bad})):
        assert answer.is_error and "there is no snapshot" in text(answer), text(answer)
    # As a session id (which a tool resumes when it is paused): no session, nothing read.
    ran = a.tool("run_python", {"session": bad, "code": "1"})
    assert ran.is_error and "no session" in text(ran), text(ran)


def test_a_session_id_is_not_a_snapshot_id(clients):
    """A paused session and a snapshot are files of two kinds under one MAC'd name: the id of
    one never opens the other."""
    a, _ = clients
    session = new_session(a)
    opened = a.tool("create_session", {"snapshot": session})
    assert opened.is_error and "there is no snapshot" in text(opened)


def test_sizes_past_the_limits_are_refused_for_a_model_before_the_bytes_leave(clients):
    """A kernel claiming more than --max-snapshot-size, or than the key's quota leaves, is
    refused before it sends a byte; a claim within them that sends nothing is refused too.
    Each answer says what to do, not the operator's flags; the session goes on."""
    a, _ = clients
    for size, said in ((5 * 2**20, "more than the 4194304 bytes a snapshot may have"),
                       (3 * 2**20, "does not fit in the 2097152 bytes this server allows you"),
                       (2**20, "sent 0 bytes of the snapshot")):
        session = new_session(a, CLAIMS.format(size=size) + "\nstill = 'here'")
        refused = a.tool("snapshot_session", {"session": session})
        assert refused.is_error and said in text(refused), text(refused)
        assert not FLAGS_SEEN.search(text(refused)), text(refused)
        still = a.tool("run_python", {"session": session, "code": "still"})
        assert still.structured_content["value"] == "'here'", text(still)
        a.tool("close_session", {"session": session})
    assert a.tool("list_snapshots").structured_content["snapshots"] == []


def test_a_keys_snapshot_count_is_bounded_and_said_for_a_model(clients):
    a, b = clients
    session = new_session(a)
    taken = [a.tool("snapshot_session", {"session": session}) for _ in range(3)]
    assert [answer.is_error for answer in taken] == [False, False, True], text(taken[2])
    said = text(taken[2])
    assert said.startswith("Error executing tool snapshot_session: You keep 2 snapshots, "
                           "the most this server allows you.")
    assert "Delete snapshots you no longer need (list_snapshots, then delete_snapshot)" in said
    assert not FLAGS_SEEN.search(said), said
    # The other key has a quota of its own; a delete frees a place.
    assert not b.tool("snapshot_session", {"session": new_session(b)}).is_error
    first = taken[0].structured_content["snapshot"]
    assert not a.tool("delete_snapshot", {"snapshot": first}).is_error
    assert not a.tool("snapshot_session", {"session": session}).is_error


def test_two_servers_resuming_one_paused_session_at_the_same_instant(tmp_path):
    """Issue #44 item 7 on the MCP face: two servers sharing a --state-dir get a call naming
    a paused session in the same instant: one resumes it; the other says it cannot, and
    never runs a second kernel of it."""
    keys = tmp_path / "keys.json"
    write_keys(keys, [{"id": "team-a", "key": KEY_A}])
    state = tmp_path / "state"
    first = HttpServer(tmp_path, keys, "--state-dir", str(state), "--pool-size", "0",
                       "--session-pause-after", "1")
    second = HttpServer(tmp_path, keys, "--state-dir", str(state), "--pool-size", "0")
    clients = [first.client(KEY_A), second.client(KEY_A)]
    try:
        session = new_session(clients[0], "z = 9")
        deadline = time.monotonic() + 30
        while not any(s["session"] == session and s["paused"] for s in clients[0].tool(
                "list_sessions").structured_content["sessions"]):
            assert time.monotonic() < deadline, first.log.read_text()
            time.sleep(0.2)
        answers = at_once([lambda client=client: client.tool(
            "run_python", {"session": session, "code": "z"}) for client in clients])
        won = [n for n, answer in enumerate(answers) if not answer.is_error]
        assert len(won) == 1, [text(answer) for answer in answers]
        assert answers[won[0]].structured_content["value"] == "9"
        lost = text(answers[1 - won[0]])  # it is resuming, or it was and now runs there
        assert f"session {session} is being resumed by another server" in lost \
            or f"there is no session {session!r}" in lost, lost
        assert not FLAGS_SEEN.search(lost), lost
        live = [[s for s in client.tool("list_sessions").structured_content["sessions"]
                 if s["session"] == session and not s["paused"]] for client in clients]
        assert [len(found) for found in live] == [n == won[0] for n in range(2)], live
    finally:
        for client in clients:
            client.close()
        first.stop()
        second.stop()


