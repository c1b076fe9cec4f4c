"""dify-sandbox's routes: the platform's client gets its results, and the answers, as bytes."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .helpers import DIFY_KEY, KEY_A, RUN, auth, http
from .platform_client import DEFAULT_TEMPLATE, CodeExecutionError, PlatformClient


@pytest.fixture(scope="module")
def platform(server):
    return PlatformClient(server.url)


# --- the platform's client gets its results ------------------------------------------------

@pytest.mark.parametrize("inputs, expected", [
    ({"arg1": "hello, ", "arg2": "world"}, "hello, world"),
    ({"arg1": 40, "arg2": 2}, 42),
    ({"arg1": "日本語 ", "arg2": "émoji 🎉 ✓"}, "日本語 émoji 🎉 ✓"),
    ({"arg1": [{"a": {"b": [1, 2]}}], "arg2": [None, True, "x"]},
     [{"a": {"b": [1, 2]}}, None, True, "x"]),
])
def test_default_template(platform, inputs, expected):
    assert platform.execute(DEFAULT_TEMPLATE, inputs) == {"result": expected}


def test_code_error_arrives_as_the_platform_reports_it(server, platform):
    code = "def main(x):\n    return {'r': 1 / x}\n"
    with pytest.raises(CodeExecutionError) as caught:
        platform.execute(code, {"x": 0})
    message = str(caught.value)
    assert message.startswith("process exited with code 255\n")
    assert "ZeroDivisionError: division by zero" in message
    data = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json={
        "language": "python3", "code": "print('before')\n1/0"}).json()
    assert data["code"] == 0 and data["message"] == "success"
    assert data["data"]["exit_code"] == 255
    assert data["data"]["stdout"] == "before\n"
    assert data["data"]["stderr"].rstrip().endswith("ZeroDivisionError: division by zero")
    assert data["data"]["error"] == "process exited with code 255\n" + data["data"]["stderr"]


def test_syntax_error(platform):
    with pytest.raises(CodeExecutionError) as caught:
        platform.execute("def main(:\n    return {}\n", {})
    assert str(caught.value).startswith("process exited with code 255\n")
    assert "SyntaxError" in str(caught.value)


def test_timeout(server, platform):
    started = time.monotonic()
    with pytest.raises(CodeExecutionError) as caught:
        platform.execute("import time\ndef main():\n    time.sleep(30)\n    return {}\n", {})
    assert time.monotonic() - started < 25  # WORKER_TIMEOUT 3 s + grace 2 s + a kernel start
    assert str(caught.value).startswith("process exited with code -1\nerror: timeout\n")
    data = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, timeout=30, json={
        "language": "python3", "code": "import time\nwhile True:\n    time.sleep(0.1)"}).json()
    assert data["code"] == 0
    assert data["data"]["exit_code"] == -1
    assert data["data"]["error"] == "process exited with code -1\nerror: timeout\n"


def test_blocked_call(platform):
    code = "import os\ndef main():\n    os.fork()\n    return {}\n"
    with pytest.raises(CodeExecutionError) as caught:
        platform.execute(code, {})
    assert "operation not permitted" in str(caught.value).lower()
    assert "PermissionError" in str(caught.value)


def test_stderr_warnings_do_not_fail_a_run(server, platform):
    code = ("import sys, warnings, logging\n"
            "def main(x):\n"
            "    warnings.warn('deprecated thing')\n"
            "    logging.warning('a log line')\n"
            "    print('to stderr', file=sys.stderr)\n"
            "    return {'x': x}\n")
    assert platform.execute(code, {"x": 1}) == {"x": 1}
    data = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json={
        "language": "python3", "code": "import sys\nprint('warn', file=sys.stderr)"}).json()
    assert data == {"code": 0, "message": "success",
                    "data": {"stdout": "", "stderr": "warn\n", "error": "", "exit_code": 0}}


def test_a_kernel_that_dies_is_exit_code_minus_one(server):
    data = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json={
        "language": "python3",
        # (the pause lets the IOPub thread send the line before the process is gone)
        "code": "import os, signal, time\nprint(1, flush=True)\ntime.sleep(0.5)\n"
                "os.kill(os.getpid(), signal.SIGKILL)"}
    ).json()["data"]
    assert data == {"stdout": "1\n", "stderr": "", "exit_code": -1, "error":
                    "process exited with code -1\n"
                    "error: the kernel process died (killed by signal SIGKILL)\n"}


def test_sys_exit_is_an_exit_status(server):
    def run(code):
        body = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY},
                         json={"language": "python3", "code": code}).json()
        assert body["code"] == 0, body
        return body["data"]
    assert run("import sys\nprint('x')\nsys.exit(0)\nprint('y')") == {
        "stdout": "x\n", "stderr": "", "error": "", "exit_code": 0}
    failed = run("import sys\nsys.exit(3)")
    assert failed["exit_code"] == 3 and failed["error"] == "process exited with code 3"


def test_twenty_concurrent_runs_are_correct_and_distinct(platform):
    code = "import os\ndef main(i: int) -> dict:\n    return {'i': i * 7, 'pid': os.getpid()}\n"
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda i: platform.execute(code, {"i": i}), range(20)))
    assert [r["i"] for r in results] == [i * 7 for i in range(20)]
    # A fresh kernel per run: twenty runs, twenty kernel processes.
    assert len({r["pid"] for r in results}) == 20


def test_every_run_gets_a_fresh_kernel(platform):
    leave = ("import builtins\nbuiltins.LEFT = 1\nopen('left.txt', 'w').write('x')\n"
             "def main():\n    return {}\n")
    assert platform.execute(leave, {}) == {}
    look = ("import builtins, os\ndef main():\n"
            "    return {'global': hasattr(builtins, 'LEFT'),\n"
            "            'file': os.path.exists('left.txt')}\n")
    assert platform.execute(look, {}) == {"global": False, "file": False}


# --- status codes and envelopes, as bytes ----------------------------------------------------

def test_health(server):
    answer = http.get(server.url + "/health")
    assert answer.status_code == 200
    assert answer.content == b'"ok"'
    assert answer.headers["content-type"] == "application/json; charset=utf-8"


@pytest.mark.parametrize("method, path", [
    ("POST", RUN), ("GET", "/v1/sandbox/dependencies?language=python3"),
    ("POST", "/v1/sandbox/dependencies/update"),
    ("GET", "/v1/sandbox/dependencies/refresh?language=python3")])
@pytest.mark.parametrize("key", [None, "wrong", DIFY_KEY + "x"])
def test_wrong_or_missing_key_is_401_with_an_empty_body(server, method, path, key):
    headers = {"X-Api-Key": key} if key else {}
    answer = http.request(method, server.url + path, headers=headers,
                          json={"language": "python3", "code": "print(1)"})
    assert answer.status_code == 401
    assert answer.content == b""


def _post(server, body: bytes, content_type: str | None):
    headers = {"X-Api-Key": DIFY_KEY}
    if content_type:
        headers["Content-Type"] = content_type
    return http.post(server.url + RUN, headers=headers, content=body)


REQUIRED_CODE = "Key: 'Code' Error:Field validation for 'Code' failed on the 'required' tag"
REQUIRED_LANGUAGE = ("Key: 'Language' Error:Field validation for 'Language' failed on the "
                     "'required' tag")


@pytest.mark.parametrize("body, message", [
    (b"{not json", "invalid character 'n' looking for beginning of object key string"),
    (b"", "EOF"),
    (b'{"language": "python3"', "unexpected EOF"),
    (b'{"language": "python3"}', REQUIRED_CODE),
    (b'{"language": "python3", "code": ""}', REQUIRED_CODE),
    (b'{"code": "print(1)"}', REQUIRED_LANGUAGE),
    (b"{}", REQUIRED_LANGUAGE + "\n" + REQUIRED_CODE),
    (b'{"language": "python3", "code": 5}',
     "json: cannot unmarshal number into Go struct field .code of type string"),
])
def test_bad_body_is_400_with_json_content_type(server, body, message):
    answer = _post(server, body, "application/json")
    assert answer.status_code == 400
    expected = json.dumps({"code": -400, "message": message, "data": None},
                          separators=(",", ":"))
    assert answer.content == expected.encode()
    # gin has written the status before c.JSON sets its type; net/http sniffs the body.
    assert answer.headers["content-type"] == "text/plain; charset=utf-8"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/json; charset=utf-8"])
def test_bad_body_is_200_with_another_content_type(server, content_type):
    answer = _post(server, b'{"language": "python3"}', content_type)
    assert answer.status_code == 200
    message = REQUIRED_CODE if content_type and "json" in content_type else \
        REQUIRED_LANGUAGE + "\n" + REQUIRED_CODE
    assert answer.content == json.dumps({"code": -400, "message": message, "data": None},
                                         separators=(",", ":")).encode()


def test_a_json_body_with_charset_still_runs(server):
    answer = _post(server, json.dumps({"language": "python3", "code": "print(2)"}).encode(),
                   "application/json; charset=utf-8")
    assert answer.json()["data"]["stdout"] == "2\n"


def test_unsupported_language(server):
    answer = _post(server, b'{"language": "ruby", "code": "puts 1"}', "application/json")
    assert answer.status_code == 400
    assert answer.content == b'{"code":-400,"message":"unsupported language","data":null}'


def test_preload_is_accepted_and_ignored(server):
    answer = _post(server, json.dumps({"language": "python3", "code": "print(globals().get('P'))",
                                       "preload": "P = 1", "enable_network": False}).encode(),
                   "application/json")
    assert answer.json()["data"]["stdout"] == "None\n"


def test_go_escapes_html_characters(server):
    answer = _post(server, json.dumps({"language": "python3",
                                       "code": "print('<a & b>')"}).encode(), "application/json")
    assert b'"stdout":"\\u003ca \\u0026 b\\u003e\\n"' in answer.content


def test_hostile_bodies_get_clear_answers(server):
    deep = _post(server, b'{"language": "python3", "code": ' + b"[" * 100_000, "application/json")
    assert deep.status_code == 400
    assert deep.json()["code"] == -400
    nul = _post(server, json.dumps({"language": "python3", "code": "print(1)\x00"}).encode(),
                "application/json")
    assert nul.status_code == 200 and nul.json()["data"]["exit_code"] == 255
    native = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A),
                       content=b'{"code": ' + b"[" * 100_000)  # deep, and not even JSON
    assert 400 <= native.status_code < 500
    assert http.get(server.url + "/health").status_code == 200


def test_output_that_utf8_cannot_hold(server):
    code = "print('a\\ud800b')"
    dify = _post(server, json.dumps({"language": "python3", "code": code}).encode(),
                 "application/json")
    assert dify.status_code == 200 and dify.json()["data"]["exit_code"] == 0
    native = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), json={"code": code})
    assert native.status_code == 200
    assert native.json()["stdout"] in ("a\ud800b\n", "a\ufffdb\n", "ab\n")
    result = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), json={
        "code": "def main():\n    return {'s': 'x\\ud800'}", "inputs": {}})
    assert result.status_code == 200


def test_dependencies(server):
    headers = {"X-Api-Key": DIFY_KEY}
    listed = http.get(server.url + "/v1/sandbox/dependencies?language=python3", headers=headers)
    assert listed.status_code == 200
    body = listed.json()
    assert body["code"] == 0 and body["message"] == "success"
    names = {d["name"].lower(): d["version"] for d in body["data"]["dependencies"]}
    import ipykernel
    assert names["ipykernel"] == ipykernel.__version__
    assert "numpy" in names
    refreshed = http.get(server.url + "/v1/sandbox/dependencies/refresh?language=python3",
                         headers=headers)
    assert refreshed.json()["data"] == body["data"]
    updated = http.post(server.url + "/v1/sandbox/dependencies/update", headers=headers,
                        json={"language": "python3"})
    assert updated.content == b'{"code":0,"message":"success","data":{}}'
    missing = http.get(server.url + "/v1/sandbox/dependencies", headers=headers)
    assert missing.status_code == 200
    assert missing.content == json.dumps({"code": -400, "message": REQUIRED_LANGUAGE,
                                          "data": None}, separators=(",", ":")).encode()
    other = http.get(server.url + "/v1/sandbox/dependencies?language=nodejs", headers=headers)
    assert other.status_code == 400
