"""The main server the route tests share (one for the package, as the tests leave no trace
on it but their sessions, which they delete), and a session of key B."""

from __future__ import annotations

import pytest

from tests.helpers import write_keys

from .helpers import KEY_A, KEY_B, Server, auth, http


@pytest.fixture(scope="package")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    write_keys(path, [
        {"id": "team-a", "key": KEY_A, "max_sessions": 2},
        {"id": "team-b", "key": KEY_B}])
    return path


@pytest.fixture(scope="package")
def server(tmp_path_factory, keys_file):
    """The main server: dify's defaults except a short WORKER_TIMEOUT."""
    srv = Server(tmp_path_factory.mktemp("serve"), "--api-keys-file", str(keys_file),
                 "--pool-size", "1", env={"WORKER_TIMEOUT": "3", "MAX_WORKERS": "4"})
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def one_shot_server(tmp_path_factory, keys_file):
    """A server whose stateless runs are one-shot kernels (--one-shot-pool-size)."""
    srv = Server(tmp_path_factory.mktemp("one-shot"), "--api-keys-file", str(keys_file),
                 "--pool-size", "0", "--one-shot-pool-size", "2",
                 env={"WORKER_TIMEOUT": "3", "MAX_WORKERS": "4"})
    yield srv
    srv.stop()


@pytest.fixture
def session(server):
    """A fresh session of key B, deleted after the test."""
    url = server.url + "/api/v1/sessions"
    created = http.post(url, headers=auth(KEY_B), json={}, timeout=60)
    assert created.status_code == 201, created.text
    session_url = f"{url}/{created.json()['id']}"
    yield session_url
    http.delete(session_url, headers=auth(KEY_B))
