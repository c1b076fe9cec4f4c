"""Connections and keys an attacker controls: silent sockets, empty and public keys."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.helpers import write_keys

from .helpers import DIFY_KEY, KEY_A, RUN, Server, auth, http

BODY = {"language": "python3", "code": "print(6 * 7)"}


def _silent(url: str) -> socket.socket:
    """A connection that never sends a byte."""
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed it (without waiting: the check must not take time)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("guarded"), "--pool-size", "1", "--head-timeout", "3",
                 "--max-idle-connections", "250", env={"ENABLE_NETWORK": "false"})
    yield srv
    srv.stop()


def test_idle_connections_never_take_the_place_of_requests(guarded):
    silent = [_silent(guarded.url) for _ in range(200)]
    answer = http.post(guarded.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json=BODY, timeout=2)
    assert answer.status_code == 200 and answer.json()["data"]["stdout"] == "42\n"
    assert not any(_closed_by_server(sock) for sock in silent)  # nothing had to be dropped yet
    # Past --max-idle-connections, the oldest idle connections make room.
    more = [_silent(guarded.url) for _ in range(100)]
    time.sleep(0.5)
    closed = [_closed_by_server(sock) for sock in silent + more]
    # (the test client's own keep-alive connections are idle too, and may be older)
    assert all(closed[:45]) and 45 <= sum(closed) <= 50 and not any(closed[60:])
    answer = http.post(guarded.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json=BODY, timeout=2)
    assert answer.status_code == 200
    for sock in silent + more:
        sock.close()


def test_a_client_that_sends_nothing_costs_a_bounded_time(guarded):
    silent, trickle = _silent(guarded.url), _silent(guarded.url)
    trickle.sendall(b"POST /v1/sandbox/run HTTP/1.1\r\n")  # a head that never ends
    time.sleep(3.5)
    assert _closed_by_server(silent) and _closed_by_server(trickle)


def _status(url: str, path: str, header: bytes, body: dict) -> int:
    """The status of a request sent as raw bytes (HTTP clients refuse blank header values)."""
    data = json.dumps(body).encode()
    with _silent(url) as sock:
        sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + header +
                     b"\r\nContent-Type: application/json\r\nContent-Length: " +
                     str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)
        return int(sock.makefile("rb").readline().split()[1])


@pytest.mark.parametrize("header", [b"X-Api-Key:", b"X-Api-Key: ", b"X-Api-Key: \t"])
def test_an_empty_key_runs_nothing(guarded, header):
    assert _status(guarded.url, RUN, header, BODY) == 401


@pytest.mark.parametrize("header", [b"Authorization: Bearer", b"Authorization: Bearer ",
                                    b"Authorization:"])
def test_an_empty_bearer_runs_nothing(guarded, header):
    assert _status(guarded.url, "/api/v1/execute", header, {"code": "1"}) == 401


def test_with_a_keys_file_the_public_default_key_opens_nothing(tmp_path):
    keys = tmp_path / "keys.json"
    write_keys(keys, [{"id": "team-a", "key": KEY_A}])
    srv = Server(tmp_path, "--pool-size", "0", "--api-keys-file", str(keys),
                 env={"ENABLE_NETWORK": "false"}, unset=("API_KEY",))
    try:
        for key in ("dify-sandbox", ""):
            assert http.post(srv.url + RUN, headers={"X-Api-Key": key},
                             json=BODY).status_code == 401
        assert http.post(srv.url + "/api/v1/execute", headers=auth(KEY_A),
                         json={"code": "1"}).status_code == 200
    finally:
        srv.stop()
    assert "WARNING: the dify-sandbox routes (/v1/sandbox/*) are OFF" in srv.log.read_text()


def test_the_public_default_key_is_warned_about_loudly(tmp_path):
    srv = Server(tmp_path, "--pool-size", "0", env={"ENABLE_NETWORK": "false"},
                 unset=("API_KEY",))
    try:
        answer = http.post(srv.url + RUN, headers={"X-Api-Key": "dify-sandbox"}, json=BODY)
        assert answer.status_code == 200
    finally:
        srv.stop()
    assert "WARNING: the X-Api-Key of /v1/sandbox/* and the native API's bearer key is " \
           "dify-sandbox's public default" in srv.log.read_text()


def test_a_request_refused_unparsed_is_answered_not_reset(guarded):
    # A head past uvicorn's size bound is refused with a 400 before all of it is read. The
    # server reads and drops the rest before it closes: closing with bytes unread would reset
    # the connection, and the reset would destroy the 400 the client has not read yet.
    request = (b"POST " + RUN.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 300_000
               + b"\r\nContent-Length: 2\r\n\r\n{}")
    for _ in range(3):
        with _silent(guarded.url) as sock:
            sock.sendall(request)
            answer = sock.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert "head (request line and headers) is too large" in json.loads(
            answer.split(b"\r\n\r\n", 1)[1])["detail"]


def _answer_to_head(url: str, padding: int, pieces: int = 1) -> bytes:
    """The first line of the answer to a dify run whose head carries `padding` bytes of one
    header, sent in `pieces` writes (a head's end split between two of them when several)."""
    data = json.dumps(BODY).encode()
    head = (b"POST " + RUN.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Api-Key: " + DIFY_KEY.encode()
            + b"\r\nX-Padding: " + b"a" * padding + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n")
    step = -(-len(head) // pieces)
    with _silent(url) as sock:
        for start in range(0, len(head) - 2, step):  # the last piece starts inside "\r\n\r\n"
            sock.sendall(head[start:min(start + step, len(head) - 2)])
            time.sleep(0.01)
        sock.sendall(head[-2:] + data)
        return sock.makefile("rb").readline()


@pytest.mark.parametrize("pieces", [1, 40])
def test_a_head_past_16_kib_is_refused_one_within_it_served(guarded, pieces):
    # The service bounds a head itself: h11 did, httptools (uvicorn's choice where installed)
    # would buffer a header of any size.
    assert _answer_to_head(guarded.url, 15_000, pieces).startswith(b"HTTP/1.1 200 ")
    assert _answer_to_head(guarded.url, 17_000, pieces).startswith(b"HTTP/1.1 400 ")


def test_the_service_parses_http_with_httptools_on_uvloop(guarded):
    """The [server] extra's faster HTTP parser and event loop are the ones serving (the bound
    above is then the service's own)."""
    import psutil

    loaded = [region.path for region in psutil.Process(guarded.process.pid).memory_maps()]
    assert any("/httptools/parser/" in path for path in loaded), loaded
    assert any("/uvloop/loop." in path for path in loaded), loaded
