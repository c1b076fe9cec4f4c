"""Files in a session's scratch: round trips, paths and symlinks kept inside, the size cap."""

from __future__ import annotations

import http.client as http_client
import json
import os
from urllib.parse import urlsplit

import pytest

from .helpers import KEY_B, auth, http


def test_files_round_trip(server, session):
    content = os.urandom(200_000)
    put = http.put(session + "/files/data/blob.bin", headers=auth(KEY_B), content=content)
    assert put.status_code == 201, put.text
    assert put.json() == {"path": "data/blob.bin", "size": len(content)}
    seen = http.post(session + "/execute", headers=auth(KEY_B), json={
        "code": "import hashlib\nhashlib.sha256(open('data/blob.bin','rb').read()).hexdigest()"})
    import hashlib
    assert seen.json()["text"] == repr(hashlib.sha256(content).hexdigest())
    got = http.get(session + "/files/data/blob.bin", headers=auth(KEY_B))
    assert got.status_code == 200
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.content == content
    missing = http.get(session + "/files/nope.txt", headers=auth(KEY_B))
    assert missing.status_code == 404


def _get_as_is(url: str):
    """GET with the path sent as written: `files/.` stays `files/.` (curl --path-as-is; httpx
    would send `files`). (status, JSON body)."""
    parts = urlsplit(url)
    connection = http_client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request("GET", parts.path, headers=auth(KEY_B))
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def test_a_sessions_files_are_listed_and_a_folder_asked_as_a_file_says_where(server, session):
    for name, content in (("a.txt", b"1"), ("data/b.bin", b"22"), (".hidden", b"333")):
        assert http.put(f"{session}/files/{name}", headers=auth(KEY_B),
                        content=content).status_code == 201
    listing = http.get(session + "/files", headers=auth(KEY_B))
    assert listing.status_code == 200, listing.text
    assert [(entry["path"], entry["size"]) for entry in listing.json()["files"]] == [
        ("a.txt", 1), ("data/b.bin", 2)]
    assert listing.json()["truncated"] is False
    folder = http.get(session + "/files", params={"path": "data"}, headers=auth(KEY_B)).json()
    assert [entry["path"] for entry in folder["files"]] == ["data/b.bin"]
    # What `curl .../files/.` sends (or, without --path-as-is, `files/`), and folders by name.
    session_id = session.rsplit("/", 1)[1]
    lists = f"GET /api/v1/sessions/{session_id}/files"
    for path, said in (("files/.", f"the scratch directory is a folder, not a file: name a "
                                   f"file in it ({lists} lists them)"),
                       ("files/", f"the scratch directory is a folder, not a file: name a "
                                  f"file in it ({lists} lists them)"),
                       ("files/data", f"'data' is a folder, not a file: name a file in it "
                                      f"({lists}?path=data lists them)"),
                       ("files/data/", f"'data/' is a folder, not a file: name a file in it "
                                       f"({lists}?path=data lists them)")):
        status, body = _get_as_is(f"{session}/{path}")
        assert (status, body.get("detail")) == (400, said), (path, body)
    missing = http.get(session + "/files/nope.txt", headers=auth(KEY_B))
    assert (missing.status_code, missing.json()["detail"]) == (404, (
        f"there is no file 'nope.txt' in the session's scratch directory ({lists} lists "
        "them)"))


@pytest.mark.parametrize("path", ["%2e%2e/%2e%2e/etc/passwd", "a/%2e%2e/%2e%2e/x", "%2fetc/passwd"])
def test_file_paths_stay_in_the_scratch(server, session, path):
    got = http.get(f"{session}/files/{path}", headers=auth(KEY_B))
    assert got.status_code in (400, 404), got.text
    assert got.status_code == 400 or "passwd" not in got.text


def test_a_symlink_out_of_the_scratch_is_refused(server, session):
    made = http.post(session + "/execute", headers=auth(KEY_B), json={
        "code": "import os\nos.symlink('/etc/hostname', 'out')"}).json()
    if made["error"] is not None:  # the sandbox may refuse symlink() itself: nothing to follow
        assert made["error"]["name"] == "PermissionError"
        return
    got = http.get(session + "/files/out", headers=auth(KEY_B))
    assert got.status_code == 403
    assert "outside the scratch" in got.json()["detail"]


def test_file_size_is_capped(server, session, tmp_path):
    big = b"x" * (8 * 2**20 + 1)
    put = http.put(session + "/files/big.bin", headers=auth(KEY_B), content=big, timeout=60)
    assert put.status_code == 413
    made = http.post(session + "/execute", headers=auth(KEY_B), json={
        "code": "open('big.bin', 'wb').write(b'x' * (8 * 2**20 + 1))"}).json()
    assert made["error"] is None
    got = http.get(session + "/files/big.bin", headers=auth(KEY_B), timeout=60)
    assert got.status_code == 413
