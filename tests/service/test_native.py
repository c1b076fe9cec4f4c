"""The native API's executions: one-shot JSON, bearer keys, bad input, server-sent events."""

from __future__ import annotations

import base64

import pytest

from .helpers import KEY_A, KEY_B, auth, http, sse_events

# --- the native API ----------------------------------------------------------------------------

def test_native_one_shot(server):
    answer = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), json={
        "code": "def main(x):\n    print('log line')\n    return {'y': x * 2}",
        "inputs": {"x": 21}})
    assert answer.status_code == 200
    execution = answer.json()
    assert execution["result"] == {"y": 42}
    assert execution["stdout"] == "log line\n"
    assert execution["logs"] == [{"name": "stdout", "text": "log line\n"}]
    assert execution["error"] is None and execution["state_lost"] is False


@pytest.mark.parametrize("headers", [{}, auth("nope"), {"Authorization": f"Basic {KEY_A}"}])
def test_native_needs_a_bearer_key(server, headers):
    answer = http.get(server.url + "/api/v1/sessions", headers=headers)
    assert answer.status_code == 401
    assert "Bearer" in answer.json()["detail"]


@pytest.mark.parametrize("body, status", [
    ({}, 422), ({"code": 1}, 422), ({"code": "1", "inputs": [1]}, 422),
    ({"code": "1", "timeout": -1}, 422), ({"code": "1", "timeout": 10_000}, 400)])
def test_native_bad_input_is_a_clear_4xx(server, body, status):
    answer = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), json=body)
    assert answer.status_code == status
    assert answer.json()["detail"]


def test_sse_delivers_stdout_before_the_run_finishes(server, session):
    code = "import time\nprint('first', flush=True)\ntime.sleep(1)\nprint('second')\n"
    headers = {**auth(KEY_B), "Accept": "text/event-stream"}
    with http.stream("POST", session + "/execute", headers=headers, json={"code": code},
                     timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    names = [name for _, name, _ in events]
    assert names == ["stdout", "stdout", "done"]
    (first_at, _, first), (_, _, second), (done_at, _, done) = events
    assert first == "first\n" and second == "second\n"
    assert done_at - first_at > 0.8  # the first line came a second before the end
    assert done["stdout"] == "first\nsecond\n" and done["error"] is None


def test_sse_result_and_error_events(server, session):
    headers = {**auth(KEY_B), "Accept": "text/event-stream"}
    with http.stream("POST", session + "/execute", headers=headers, timeout=30, json={
            "code": "def main(a):\n    return {'a': a}", "inputs": {"a": [1]}}) as response:
        events = sse_events(response)
    assert [(n, d) for _, n, d in events[:-1]] == [
        ("result", {"result": {"a": [1]}, "text": '{\n  "a": [\n    1\n  ]\n}'})]
    with http.stream("POST", session + "/execute", headers=headers, timeout=30,
                     json={"code": "raise KeyError('k')"}) as response:
        events = sse_events(response)
    assert [n for _, n, _ in events] == ["error", "done"]
    assert events[0][2]["name"] == "KeyError"


def test_a_chart_arrives_as_png(server, session):
    code = ("import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
            "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()\n")
    execution = http.post(session + "/execute", headers=auth(KEY_B), json={
        "code": code, "timeout": 60}, timeout=90).json()
    assert execution["error"] is None, execution["error"]
    pngs = [d["image/png"] for d in execution["displays"] if "image/png" in d]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")
