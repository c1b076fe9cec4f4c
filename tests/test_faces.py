"""The same behaviour on both faces (#46): one table of cases, each run through the HTTP
service's native API and through the MCP server's tools, both over hosting/.

A case speaks to a `Face`: run code (fresh or in a session), open, snapshot, list and close
sessions. Each face translates its protocol's answer back into the same terms (the output, the
error's name, or the kind of refusal), so a case added to CASES runs on both. Fresh runs run on
both transports: a one-shot kernel (the servers' default here) and a ZMQ kernel (a server with
--one-shot-pool-size 0, the fallback rule's other kernel), and through the fallback itself (a
server whose one-shot pool cannot be had runs them on ZMQ kernels, and says nothing different);
every run is a real sandboxed kernel.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("mcp")
from tests.mcp_clients import HttpServer
from tests.service.helpers import KEY_A, KEY_B, Server, auth, http

PAUSE_AFTER = "2"  # seconds idle before a session is paused into the state dir
STATUS_KINDS = {404: "unknown", 429: "limit", 409: "conflict"}  # the service's refusals


@dataclass
class Ran:
    """A run as a case sees it: what it printed, and its error's name."""

    stdout: str
    error: str | None


@dataclass
class Refused(Exception):
    """A request the face refused: `kind` is unknown, limit or conflict."""

    kind: str
    said: str


class Face:
    """What a case may ask of a face; each subclass speaks one protocol."""

    def run(self, code: str, session: str | None = None, key: str = KEY_B) -> Ran:
        raise NotImplementedError

    def create(self, snapshot: str | None = None, key: str = KEY_B) -> str:
        raise NotImplementedError

    def snapshot(self, session: str, key: str = KEY_B) -> str:
        raise NotImplementedError

    def paused(self, session: str, key: str = KEY_B) -> bool:
        raise NotImplementedError

    def close(self, session: str, key: str = KEY_B) -> None:
        raise NotImplementedError


class ServiceFace(Face):
    """The native HTTP API; a refusal is its status."""

    def __init__(self, server: Server) -> None:
        self.api = server.url + "/api/v1"

    def _call(self, method: str, path: str, key: str, **body: Any) -> Any:
        answer = http.request(method, self.api + path, headers=auth(key),
                              json=body if method != "GET" else None, timeout=120)
        if answer.status_code in STATUS_KINDS:
            raise Refused(STATUS_KINDS[answer.status_code], answer.text)
        assert answer.status_code < 300, answer.text
        return answer.json() if answer.content else None

    def run(self, code, session=None, key=KEY_B):
        path = f"/sessions/{session}/execute" if session else "/execute"
        done = self._call("POST", path, key, code=code)
        return Ran(done["stdout"], done["error"]["name"] if done["error"] else None)

    def create(self, snapshot=None, key=KEY_B):
        return self._call("POST", "/sessions", key, **({"snapshot": snapshot} if snapshot
                                                        else {}))["id"]

    def snapshot(self, session, key=KEY_B):
        return self._call("POST", f"/sessions/{session}/snapshots", key)["id"]

    def paused(self, session, key=KEY_B):
        return bool(self._call("GET", f"/sessions/{session}", key)["paused"])

    def close(self, session, key=KEY_B):
        self._call("DELETE", f"/sessions/{session}", key)


class McpFace(Face):
    """The MCP server's tools; a refusal is a tool error, its words for a model."""

    KINDS = (("there is no", "unknown"), ("you may hold", "limit"), ("is running", "conflict"))

    def __init__(self, server: HttpServer) -> None:
        self.clients = {key: server.client(key) for key in (KEY_A, KEY_B)}

    def _tool(self, key: str, name: str, **arguments: Any) -> Any:
        answer = self.clients[key].tool(name, arguments)
        said = "\n".join(block.text for block in answer.content if block.type == "text")
        if answer.is_error and answer.structured_content is None:
            kind = next((kind for words, kind in self.KINDS if words in said), said)
            raise Refused(kind, said)
        return answer.structured_content

    def run(self, code, session=None, key=KEY_B):
        done = self._tool(key, "run_python", code=code,
                          **({"session": session} if session else {}))
        return Ran(done["stdout"], done["error"]["name"] if done.get("error") else None)

    def create(self, snapshot=None, key=KEY_B):
        return self._tool(key, "create_session",
                          **({"snapshot": snapshot} if snapshot else {}))["session"]

    def snapshot(self, session, key=KEY_B):
        return self._tool(key, "snapshot_session", session=session)["snapshot"]

    def paused(self, session, key=KEY_B):
        listed = self._tool(key, "list_sessions")["sessions"]
        return any(s["session"] == session and s["paused"] for s in listed)

    def close(self, session, key=KEY_B):
        self._tool(key, "close_session", session=session)

    def stop(self) -> None:
        for client in self.clients.values():
            client.close()


# --- the cases ---------------------------------------------------------------------------------

def fresh_runs(face: Face) -> None:
    assert face.run("print(6 * 7)") == Ran("42\n", None)
    assert face.run("print(x)").error == "NameError"  # nothing kept from the run before


def an_error_is_named(face: Face) -> None:
    assert face.run("1 / 0").error == "ZeroDivisionError"


def a_session_keeps_state(face: Face) -> None:
    session = face.create()
    try:
        face.run("x = 41", session)
        assert face.run("print(x + 1)", session) == Ran("42\n", None)
    finally:
        face.close(session)


def an_unknown_session_is_refused(face: Face) -> None:
    with pytest.raises(Refused) as refused:
        face.run("1", "0" * 16)
    assert refused.value.kind == "unknown", refused.value.said


def a_keys_session_limit_is_its_own(face: Face) -> None:
    held = face.create(key=KEY_A)  # team-a may hold one
    try:
        with pytest.raises(Refused) as refused:
            face.create(key=KEY_A)
        assert refused.value.kind == "limit", refused.value.said
        other = face.create(key=KEY_B)  # team-b's limit is its own
        face.close(other)
    finally:
        face.close(held, key=KEY_A)


def a_snapshot_opens_as_a_new_session(face: Face) -> None:
    session = face.create()
    face.run("kept = 'from the snapshot'", session)
    snapshot = face.snapshot(session)
    face.run("kept = 'changed later'", session)
    copy = face.create(snapshot=snapshot)
    try:
        assert face.run("print(kept)", copy).stdout == "from the snapshot\n"
        assert face.run("print(kept)", session).stdout == "changed later\n"
    finally:
        face.close(copy)
        face.close(session)


def an_unknown_snapshot_is_refused(face: Face) -> None:
    with pytest.raises(Refused) as refused:
        face.create(snapshot="0" * 32)
    assert refused.value.kind == "unknown", refused.value.said


def an_idle_session_pauses_and_resumes_with_its_state(face: Face) -> None:
    session = face.create()
    try:
        face.run("z = 9", session)
        deadline = time.monotonic() + 60
        while not face.paused(session):
            assert time.monotonic() < deadline, "the session was never paused"
            time.sleep(0.5)
        assert face.run("print(z)", session) == Ran("9\n", None)  # resumed, state restored
    finally:
        face.close(session)


CASES: list[Callable[[Face], None]] = [
    fresh_runs, an_error_is_named, a_session_keeps_state, an_unknown_session_is_refused,
    a_keys_session_limit_is_its_own, a_snapshot_opens_as_a_new_session,
    an_unknown_snapshot_is_refused, an_idle_session_pauses_and_resumes_with_its_state]
ON_ZMQ_TOO = [fresh_runs, an_error_is_named]  # fresh runs: the other transport's kernel
FALLBACK = "-fallback"  # a face whose one-shot pool cannot be had (unreachable_pools)
RUNS = [pytest.param(case, face, id=f"{case.__name__}-{face}")
        for face in ("service", "mcp") for case in CASES] + [
    pytest.param(case, face, id=f"{case.__name__}-{face}")
    for face in ("service-zmq", "mcp-zmq", "service" + FALLBACK, "mcp" + FALLBACK)
    for case in ON_ZMQ_TOO]


# --- the faces ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Any:
    path = tmp_path_factory.mktemp("faces") / "keys.json"
    path.write_text(json.dumps({"keys": [{"id": "team-a", "key": KEY_A, "max_sessions": 1},
                                         {"id": "team-b", "key": KEY_B}]}))
    path.chmod(0o600)  # a keys file others may read is refused
    return path


def flags(tmp: Any, one_shots: str) -> list[str]:
    return ["--pool-size", "0", "--one-shot-pool-size", one_shots, "--state-dir",
            str(tmp / "state"), "--session-pause-after", PAUSE_AFTER]


def unreachable_pools(tmp: Any) -> dict[str, str]:
    """The environment of a server whose one-shot pools cannot be had: a JUPYTER_RUNTIME_DIR
    where the fork server's sockets fit in a unix socket's path and a pool's, a few bytes
    longer, does not (the server answers the pool request with why). Its fresh runs take the
    fallback: ZMQ kernels (hosting/oneshots.py), fork-served as ever."""
    from sandbox_kernel.launch.forkserver.pools import pool_path
    from sandbox_kernel.launch.forkserver.protocol import pools_path, server_key

    key, name = server_key(sys.executable, ()), "r"
    while True:
        sockets = f"{tmp}/{name}/sandbox-kernel"
        if len(pool_path(sockets, key, [], {}, "/")) > 108:  # sun_path: 108 bytes at most
            break
        name += "r"
    assert len(pools_path(f"{sockets}/{key}.sock")) < 108, "no length fits the server's"
    return {"JUPYTER_RUNTIME_DIR": f"{tmp}/{name}"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, keys) -> Any:
    """Each face's server, started when a case first needs it, stopped after the module."""
    started: dict[str, Any] = {}

    def face(name: str) -> Face:
        if name not in started:
            tmp = tmp_path_factory.mktemp(name)
            one_shots = "0" if name.endswith("zmq") else "1"
            env = unreachable_pools(tmp) if name.endswith(FALLBACK) else {}
            if name.startswith("service"):
                # Not ready while a pool cannot be had (/ready says why): it answers runs.
                server = Server(tmp, "--api-keys-file", str(keys), *flags(tmp, one_shots),
                                env=env, ready=not env)
                started[name] = (server, ServiceFace(server))
            else:
                server = HttpServer(tmp, keys, *flags(tmp, one_shots), env=env)
                started[name] = (server, McpFace(server))
        return started[name][1]

    face.log = lambda name: started[name][0].log  # type: ignore[attr-defined]
    yield face
    for server, face_of in started.values():
        if isinstance(face_of, McpFace):
            face_of.stop()
        server.stop()


@pytest.mark.parametrize(("case", "face"), RUNS)
def test_a_case_behaves_the_same_on_both_faces(case, face, servers):
    case(servers(face))
    if face.endswith(FALLBACK):  # the runs did take the fallback
        assert "one_shot_unavailable" in servers.log(face).read_text()
