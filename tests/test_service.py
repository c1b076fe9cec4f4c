"""`sandbox-kernel serve` as its users meet it: the real server under uvicorn on 127.0.0.1, spoken
to over HTTP by a client written like the platform's code executor and by plain httpx."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandbox_kernel.launch import forkserver

httpx = pytest.importorskip("httpx")

DIFY_KEY = "test-dify-key"
KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
RUN = "/v1/sandbox/run"
# Generous: on a loaded 2-core machine a fresh kernel can take seconds to start. Tests that time
# a response (503 at once) or need a client to give up (disconnects) set their own.
http = httpx.Client(timeout=60)


# --- the server ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children(pid: int) -> set[int]:
    """Live child processes of pid (the service's kernels)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether pid is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    """`python -m sandbox_kernel serve` in a subprocess, stopped with SIGTERM."""

    def __init__(self, tmp: Path, *flags: str, env: dict[str, str] | None = None,
                 launcher: tuple[str, ...] = ("-m", "sandbox_kernel")) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        environ = {**os.environ, "API_KEY": DIFY_KEY, "SANDBOX_PORT": str(self.port),
                   **(env or {})}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, *launcher, "serve", "--host", "127.0.0.1", *flags],
                env=environ, stdout=log, stderr=subprocess.STDOUT)
        self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                answer = http.get(f"{self.url}/ready", timeout=2)
                if answer.status_code == 200:
                    return answer.json()
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the server did not become ready:\n{self.log.read_text()}")

    def ready(self) -> dict:
        return http.get(f"{self.url}/ready", timeout=5).json()

    def wait_until(self, check, timeout: float = 20) -> dict:
        deadline = time.monotonic() + timeout
        state = self.ready()
        while not check(state) and time.monotonic() < deadline:
            time.sleep(0.1)
            state = self.ready()
        return state

    def stop(self) -> None:
        """SIGTERM; the service must shut down in order (uvicorn re-raises the signal after)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)  # grace 10 s, then kernels shut down in parallel
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        log = self.log.read_text()
        assert self.process.returncode in (0, -signal.SIGTERM), log
        assert '"event":"stopped"' in log, log


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"keys": [
        {"id": "team-a", "key": KEY_A, "max_sessions": 2},
        {"id": "team-b", "key": KEY_B}]}))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, keys_file):
    """The main server: dify's defaults except a short WORKER_TIMEOUT."""
    srv = Server(tmp_path_factory.mktemp("serve"), "--api-keys-file", str(keys_file),
                 "--pool-size", "1", env={"WORKER_TIMEOUT": "3", "MAX_WORKERS": "4"})
    yield srv
    srv.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- a client written like the platform's code executor ------------------------------------

class CodeExecutionError(Exception):
    pass


RUNNER = """{code}

import json
from base64 import b64decode

# decode and prepare input dict
inputs_obj = json.loads(b64decode('{inputs}').decode('utf-8'))

# execute main function
output_obj = main(**inputs_obj)

# convert output to json and print
output_json = json.dumps(output_obj, indent=4)
result = f'''<<RESULT>>{{output_json}}<<RESULT>>'''
print(result)
"""

DEFAULT_TEMPLATE = '''def main(arg1: str, arg2: str) -> dict:
    return {
        "result": arg1 + arg2,
    }
'''


class PlatformClient:
    """Posts the runner script with X-Api-Key and applies the platform's error rules."""

    def __init__(self, endpoint: str, key: str = DIFY_KEY) -> None:
        self.endpoint, self.key = endpoint, key
        self.http = httpx.Client(timeout=httpx.Timeout(60, connect=10, write=10),
                                 limits=httpx.Limits(max_connections=100))

    def execute(self, code: str, inputs: dict) -> dict:
        encoded = base64.b64encode(json.dumps(inputs, ensure_ascii=False).encode()).decode()
        runner = RUNNER.format(code=code, inputs=encoded)
        try:
            response = self.http.post(
                f"{self.endpoint}/v1/sandbox/run", headers={"X-Api-Key": self.key},
                json={"language": "python3", "code": runner, "preload": "",
                      "enable_network": True})
        except httpx.HTTPError as exc:
            raise CodeExecutionError("Failed to execute code") from exc
        if response.status_code == 503:
            raise CodeExecutionError("Code execution service is unavailable")
        if response.status_code != 200:
            raise CodeExecutionError(f"Failed to execute code, got status {response.status_code}")
        try:
            body = response.json()
        except ValueError as exc:
            raise CodeExecutionError("Failed to parse response") from exc
        if body["code"] != 0:
            raise CodeExecutionError(f"Got error code: {body['code']}. Got error msg: "
                                     f"{body['message']}")
        if body["data"].get("error"):
            raise CodeExecutionError(body["data"]["error"])
        found = re.search(r"<<RESULT>>(.*?)<<RESULT>>", body["data"]["stdout"], re.DOTALL)
        if not found:
            raise CodeExecutionError("Failed to parse result")
        result = json.loads(found.group(1))
        if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
            raise CodeExecutionError("Result must be a dict with string keys")
        return result


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


def test_sessions_keep_state_and_keys_see_only_their_own(server):
    url = server.url + "/api/v1/sessions"
    created = http.post(url, headers=auth(KEY_A), json={"idle_timeout": 60}, timeout=60)
    assert created.status_code == 201, created.text
    session = created.json()["id"]
    try:
        run = f"{url}/{session}/execute"
        assert http.post(run, headers=auth(KEY_A), json={"code": "x = 41"}).json()["error"] is None
        second = http.post(run, headers=auth(KEY_A), json={
            "code": "def main(d):\n    return {'x': x + d}", "inputs": {"d": 1}}).json()
        assert second["result"] == {"x": 42}
        listed = http.get(url, headers=auth(KEY_A)).json()
        assert [s["id"] for s in listed] == [session]
        # The other key: not in its list, and every route answers 404 as if it did not exist.
        assert http.get(url, headers=auth(KEY_B)).json() == []
        for method, path in (("GET", ""), ("POST", "/execute"), ("POST", "/interrupt"),
                             ("GET", "/files/a.txt"), ("DELETE", "")):
            answer = http.request(method, f"{url}/{session}{path}", headers=auth(KEY_B),
                                  json={"code": "x"} if path == "/execute" else None)
            assert answer.status_code == 404, (method, path, answer.text)
        assert http.get(f"{url}/{session}", headers=auth(KEY_A)).json()["alive"] is True
    finally:
        assert http.delete(f"{url}/{session}", headers=auth(KEY_A)).status_code == 204
    assert http.get(f"{url}/{session}", headers=auth(KEY_A)).status_code == 404


def test_a_key_is_held_to_its_session_limit(server):
    url = server.url + "/api/v1/sessions"
    made = [http.post(url, headers=auth(KEY_A), json={}, timeout=60) for _ in range(2)]
    try:
        assert [m.status_code for m in made] == [201, 201]
        refused = http.post(url, headers=auth(KEY_A), json={}, timeout=60)
        assert refused.status_code == 429
        assert "team-a" in refused.json()["detail"]
    finally:
        for m in made:
            http.delete(f"{url}/{m.json()['id']}", headers=auth(KEY_A))


@pytest.fixture
def session(server):
    url = server.url + "/api/v1/sessions"
    created = http.post(url, headers=auth(KEY_B), json={}, timeout=60)
    assert created.status_code == 201, created.text
    session_url = f"{url}/{created.json()['id']}"
    yield session_url
    http.delete(session_url, headers=auth(KEY_B))


def _events(response) -> list[tuple[float, str, object]]:
    """(arrival time, event name, data) of a server-sent event stream."""
    events, name, started = [], None, time.monotonic()
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and name:
            events.append((time.monotonic() - started, name, json.loads(line[5:])))
            name = None
    return events


def test_sse_delivers_stdout_before_the_run_finishes(server, session):
    code = "import time\nprint('first', flush=True)\ntime.sleep(1)\nprint('second')\n"
    headers = {**auth(KEY_B), "Accept": "text/event-stream"}
    with http.stream("POST", session + "/execute", headers=headers, json={"code": code},
                     timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
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
        events = _events(response)
    assert [(n, d) for _, n, d in events[:-1]] == [
        ("result", {"result": {"a": [1]}, "text": '{\n  "a": [\n    1\n  ]\n}'})]
    with http.stream("POST", session + "/execute", headers=headers, timeout=30,
                     json={"code": "raise KeyError('k')"}) as response:
        events = _events(response)
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


def test_interrupt(server, session):
    outcome = {}

    def run():
        outcome["answer"] = http.post(session + "/execute", headers=auth(KEY_B), timeout=60,
                                      json={"code": "import time\ntime.sleep(30)",
                                            "timeout": 60}).json()

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 20
    while not http.get(session, headers=auth(KEY_B)).json()["busy"]:
        assert time.monotonic() < deadline, "the execution never started"
        time.sleep(0.1)
    time.sleep(0.5)  # into the sleep
    busy = http.post(session + "/execute", headers=auth(KEY_B), json={"code": "1"})
    assert busy.status_code == 409
    assert http.post(session + "/interrupt", headers=auth(KEY_B)).status_code == 204
    worker.join(20)
    assert outcome["answer"]["error"]["name"] == "KeyboardInterrupt"
    again = http.post(session + "/execute", headers=auth(KEY_B), json={"code": "2 + 2"}).json()
    assert again["text"] == "4"


def test_a_session_whose_kernel_died_says_so(server, session):
    pid = int(http.post(session + "/execute", headers=auth(KEY_B),
                        json={"code": "import os\nos.getpid()"}).json()["text"])
    code = ("import os, signal, threading, time\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), "
            "os.kill(os.getpid(), signal.SIGKILL))).start()\n")
    assert http.post(session + "/execute", headers=auth(KEY_B),
                     json={"code": code}).json()["error"] is None
    deadline = time.monotonic() + 20
    while running(pid) and time.monotonic() < deadline:  # died between calls
        time.sleep(0.1)
    answer = http.post(session + "/execute", headers=auth(KEY_B), json={"code": "1"})
    if answer.status_code == 200:
        # The death was noticed only once the call had started (the process not yet reaped):
        # the client restarted the kernel, and the execution says so.
        execution = answer.json()
        assert execution["error"]["name"] == "KernelDied", execution
        assert "killed by signal SIGKILL" in execution["error"]["value"]
        assert execution["state_lost"] is True
        return
    assert answer.status_code == 410, answer.text
    assert "kernel is gone" in answer.json()["detail"]
    assert http.get(session, headers=auth(KEY_B)).json()["alive"] is False


def _idle(session_url: str, timeout: float = 30) -> dict:
    return _idle_as(session_url, KEY_B, timeout)


def _idle_as(session_url: str, key: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while (state := http.get(session_url, headers=auth(key)).json())["busy"]:
        assert time.monotonic() < deadline, f"the session stayed busy: {state}"
        time.sleep(0.05)
    return state


# When the caller leaves: while the kernel dies, while the client restarts it, or after. Each used
# to be able to leave the session's client with closed sockets (ZMQError "Socket operation on
# non-socket" on its next call: a 500) or without a kernel (410).
@pytest.mark.parametrize("leaves_after", [0.1, 0.2, 0.4])
def test_a_departing_client_does_not_break_the_session(server, session, leaves_after):
    assert http.post(session + "/execute", headers=auth(KEY_B),
                     json={"code": "x = 1"}).json()["error"] is None
    try:
        answered = httpx.post(session + "/execute", headers=auth(KEY_B), timeout=leaves_after,
                              json={"code": "import os\nos._exit(1)"}).json()
        assert answered["state_lost"] is True  # the run ended before its caller left
    except httpx.TimeoutException:
        answered = None
    assert _idle(session)["alive"] is True
    after = http.post(session + "/execute", headers=auth(KEY_B), json={"code": "x"})
    assert after.status_code == 200, after.text
    assert after.json()["error"]["name"] == "NameError"
    # The loss is told once: to the caller whose run restarted the kernel, or, if that caller
    # had left, to the next one.
    assert after.json()["state_lost"] is (answered is None)
    put = http.put(session + "/files/kept.txt", headers=auth(KEY_B), content=b"still here")
    assert put.status_code == 201, put.text
    assert http.get(session + "/files/kept.txt", headers=auth(KEY_B)).content == b"still here"
    again = http.post(session + "/execute", headers=auth(KEY_B), json={"code": "1 + 1"}).json()
    assert again["text"] == "2" and again["state_lost"] is False


def test_a_departing_streaming_client_interrupts_its_code_and_keeps_the_session(server, session):
    headers = {**auth(KEY_B), "Accept": "text/event-stream"}
    with http.stream("POST", session + "/execute", headers=headers, json={
            "code": "import time\nkept = 1\nprint('bye', flush=True)\ntime.sleep(20)\n"
                    "finished = True"}) as response:
        for line in response.iter_lines():
            if line.startswith("event: stdout"):
                break  # hang up mid-stream
    assert _idle(session, timeout=15)["alive"] is True  # interrupted, not waited out
    after = http.post(session + "/execute", headers=auth(KEY_B),
                      json={"code": "kept, 'finished' in dir()"})
    assert after.status_code == 200, after.text
    assert after.json()["text"] == "(1, False)" and after.json()["state_lost"] is False


def test_a_call_on_a_session_deleted_under_it_answers_410(server):
    url = server.url + "/api/v1/sessions"
    created = http.post(url, headers=auth(KEY_B), json={}, timeout=60).json()
    session_url = f"{url}/{created['id']}"
    outcome = {}

    def run():
        outcome["answer"] = http.post(session_url + "/execute", headers=auth(KEY_B), json={
            "code": "import time\ntime.sleep(20)", "timeout": 30})

    worker = threading.Thread(target=run)
    worker.start()
    _busy_then(session_url)
    assert http.delete(session_url, headers=auth(KEY_B)).status_code == 204
    worker.join(20)
    answer = outcome["answer"]
    assert answer.status_code == 410, answer.text  # was a 500 (CancelledError from pyzmq)
    assert "the session was closed" in answer.json()["detail"]


def _busy_then(session_url: str) -> None:
    deadline = time.monotonic() + 20
    while not http.get(session_url, headers=auth(KEY_B)).json()["busy"]:
        assert time.monotonic() < deadline, "the execution never started"
        time.sleep(0.05)
    time.sleep(0.3)  # into the run


def test_idle_sessions_are_culled(server):
    url = server.url + "/api/v1/sessions"
    created = http.post(url, headers=auth(KEY_B), json={"idle_timeout": 1}, timeout=60).json()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if http.get(f"{url}/{created['id']}", headers=auth(KEY_B)).status_code == 404:
            break
        time.sleep(0.3)
    else:
        raise AssertionError("the idle session was not culled")


def test_openapi_schema_documents_the_native_api(server):
    schema = http.get(server.url + "/openapi.json").json()
    for path in ("/api/v1/execute", "/api/v1/sessions", "/api/v1/sessions/{session_id}/execute",
                 "/api/v1/sessions/{session_id}/files/{path}", "/v1/sandbox/run"):
        assert path in schema["paths"], path
    assert "ExecutionShape" in schema["components"]["schemas"]


def test_metrics_and_readiness(server):
    text = http.get(server.url + "/metrics").text
    assert 'sandbox_requests_total{route="/v1/sandbox/run",status="200"}' in text
    assert "sandbox_kernels_live" in text and "sandbox_kernels_pooled" in text
    assert 'sandbox_denials_total{reason="bad_key"}' in text
    ready = server.ready()
    assert ready["ready"] is True and set(ready["pool"]) == {"offline", "network"}


def test_log_lines_never_carry_code(server):
    secret = "print('do-not-log-this-123')"
    http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY},
              json={"language": "python3", "code": secret})
    time.sleep(0.2)
    lines = server.log.read_text().splitlines()
    assert "do-not-log-this" not in "\n".join(lines)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    runs = [r for r in records if r.get("route") == RUN and r.get("status") == 200]
    assert runs[-1]["kernel"] and runs[-1]["duration"] > 0 and runs[-1]["key"] is None
    native = [r for r in records if r.get("route", "").startswith("/api/v1")]
    assert {r["key"] for r in native} <= {"team-a", "team-b", None}


# --- limits, disconnects, shutdown (a small server of their own) ------------------------------

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


def fork_served(pid: int | None) -> set[int]:
    """Kernels forked by the fork server at pid (none without one)."""
    return children(pid) if pid else set()


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


def test_network_kernels_get_the_proxy(tmp_path):
    srv = Server(tmp_path, "--pool-size", "0", env={"HTTPS_PROXY": "http://127.0.0.1:3128"})
    try:
        code = "import os\nprint(os.environ.get('HTTPS_PROXY'))"
        for network, seen in ((True, "http://127.0.0.1:3128\n"), (False, "None\n")):
            answer = http.post(srv.url + RUN, headers={"X-Api-Key": DIFY_KEY}, timeout=60, json={
                "language": "python3", "code": code, "enable_network": network})
            assert answer.json()["data"]["stdout"] == seen
    finally:
        srv.stop()


def test_a_kernel_that_cannot_start_is_a_500_envelope(tmp_path):
    srv = Server(tmp_path, "--pool-size", "0", "--memory-limit", "1M")
    try:
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


# --- settings ----------------------------------------------------------------------------------

def _settings(argv: list[str], environ: dict[str, str]):
    import argparse

    from sandbox_kernel.service import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_arguments(parser.parse_args(argv), environ)


def test_settings_flag_beats_variable_beats_default():
    assert _settings([], {}).port == 8194
    assert _settings([], {}).api_key == "dify-sandbox"
    assert _settings([], {"SANDBOX_PORT": "9000"}).port == 9000
    assert _settings(["--port", "9001"], {"SANDBOX_PORT": "9000"}).port == 9001
    settings = _settings([], {"MAX_WORKERS": "2", "MAX_REQUESTS": "7", "WORKER_TIMEOUT": "15",
                              "ENABLE_NETWORK": "false", "API_KEY": "k"})
    assert (settings.max_workers, settings.max_requests, settings.worker_timeout,
            settings.enable_network, settings.api_key) == (2, 7, 15.0, False, "k")
    assert _settings(["--enable-network"], {"ENABLE_NETWORK": "false"}).enable_network is True


@pytest.mark.parametrize("argv, environ, named", [
    ([], {"MAX_WORKERS": "many"}, "MAX_WORKERS"),
    ([], {"ENABLE_NETWORK": "maybe"}, "ENABLE_NETWORK"),
    (["--max-requests", "0"], {}, "max-requests"),
    ([], {"SANDBOX_PORT": "70000"}, "port")])
def test_bad_settings_name_the_setting(argv, environ, named):
    from traitlets import TraitError

    with pytest.raises(TraitError, match=named):
        _settings(argv, environ)


def test_serve_refuses_a_bad_keys_file(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"id": "a", "key": "short"}]}))
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "serve", "--api-keys-file",
                           str(keys), "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "keys[0]: key must be a string of at least 16 characters" in done.stderr


def test_the_event_loop_never_waits_on_a_kernel_socket(tmp_path):
    """No synchronous ZMQ send, receive or poll on the event loop's thread (one froze the
    service): the paths that start, restart, interrupt, stream from and close kernels."""
    record = tmp_path / "blocking.json"
    srv = Server(tmp_path, "--pool-size", "1", "--kernel-grace", "1",
                 launcher=(str(Path(__file__).parent / "blocking_zmq.py"),),
                 env={"BLOCKING_ZMQ_RECORD": str(record), "WORKER_TIMEOUT": "2"})
    try:
        platform = PlatformClient(srv.url)
        assert platform.execute("def main(x):\n    return {'y': x + 1}\n", {"x": 1}) == {"y": 2}
        with pytest.raises(CodeExecutionError):  # the kernel's own deadline, then the client's
            platform.execute("import time\ndef main():\n    time.sleep(30)\n", {})
        url = srv.url + "/api/v1/sessions"
        session = f"{url}/{http.post(url, headers=auth(DIFY_KEY), json={}).json()['id']}"
        died = http.post(session + "/execute", headers=auth(DIFY_KEY),
                         json={"code": "import os\nos._exit(1)"}).json()
        assert died["state_lost"] is True  # restarted in place
        assert http.put(session + "/files/f", headers=auth(DIFY_KEY), content=b"1").status_code \
            == 201
        with http.stream("POST", session + "/execute", json={"code": "print(1)"},
                         headers={**auth(DIFY_KEY), "Accept": "text/event-stream"}) as events:
            assert "done" in [name for _, name, _ in _events(events)]
        with pytest.raises(httpx.ReadTimeout):  # a client that leaves mid-run
            http.post(session + "/execute", headers=auth(DIFY_KEY), timeout=0.5,
                      json={"code": "import time\ntime.sleep(10)"})
        _idle_as(session, DIFY_KEY)
        assert http.post(session + "/interrupt", headers=auth(DIFY_KEY)).status_code == 204
        assert http.delete(session, headers=auth(DIFY_KEY)).status_code == 204
    finally:
        srv.stop()
    found = json.loads(record.read_text())
    assert [call["call"] for call in found[:1]] == ["Socket.send"]  # the guard's own canary
    assert "_canary" in "".join(found[0]["stack"])
    blocking = found[1:]
    assert not blocking, "\n\n".join(f"{call['call']}:\n{''.join(call['stack'])}"
                                       for call in blocking[:3])


@pytest.mark.timeout(60)  # before the fix the event loop stayed blocked: only this ended it
def test_a_kernel_port_taken_by_a_wrong_peer_does_not_freeze_the_event_loop():
    """The frozen service of bench/results/load.md: the client's shell socket reached a socket
    of the wrong type (a port another process had taken), and jupyter_client's synchronous
    kernel_info send waited forever on the event loop. Now the start fails in its own time,
    and the loop keeps turning meanwhile."""
    import zmq

    from sandbox_kernel.client import AsyncSandbox

    async def scenario() -> tuple[str, float]:
        with zmq.Context() as context, context.socket(zmq.PUSH) as wrong_peer:
            wrong_peer.linger = 0
            port = wrong_peer.bind_to_random_port("tcp://127.0.0.1")
            sandbox = AsyncSandbox(kernel_name=None, startup_timeout=4)
            await sandbox.start()
            gaps = [0.0]

            async def tick() -> None:
                last = time.monotonic()
                while True:
                    await asyncio.sleep(0.05)
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()

            ticker = asyncio.ensure_future(tick())
            try:
                sandbox.client.stop_channels()
                sandbox.manager.shell_port = port  # the next client's shell goes there
                with pytest.raises(RuntimeError) as failed:
                    await sandbox._connect()
            finally:
                ticker.cancel()
                await sandbox.close()
            return str(failed.value), max(gaps)

    message, longest_gap = asyncio.run(scenario())
    assert message == "Kernel didn't respond in 4 seconds"
    assert longest_gap < 2.0, longest_gap
