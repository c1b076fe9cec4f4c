"""The native API's tool calls: a run declares tools, each call is a `tool_call` event on its
stream, and the caller answers on POST /api/v1/runs/{run}/tool_calls/{call}, once, in time,
with its own key, within the size cap; without the stream a call fails at once."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from ..ci_tools import unavailable
from .helpers import KEY_A, KEY_B, Server, auth, free_port, http, httpx

SEARCH = {"name": "search", "description": "Search the catalogue.",
          "parameters": {"type": "object", "properties": {
              "query": {"type": "string"}, "limit": {"type": "integer", "default": 5}},
              "required": ["query"]}, "returns": "list"}
PRICE = {"name": "price", "description": "A price.", "parameters": {
    "type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}
CODE = ("from sandbox_tools import search, price, ToolError\n"
        "import inspect\n"
        "def main(words):\n"
        "    found = [search(w, limit=2) for w in words]\n"
        "    try:\n        price('broken')\n        failed = None\n"
        "    except ToolError as exc:\n        failed = str(exc)\n"
        "    return {'found': found, 'failed': failed, 'sig': str(inspect.signature(search))}\n")


def answer(base, run, call, key=KEY_A, **body):
    return http.post(f"{base}/api/v1/runs/{run}/tool_calls/{call}", headers=auth(key),
                     json=body, timeout=30)


def serve(base, url, body, key, reply, checks=None, timeout=60):
    """Run with the stream, answering each tool_call with reply(event); the events."""
    headers = {**auth(key), "Accept": "text/event-stream"}
    events = []
    with http.stream("POST", url, headers=headers, json=body, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        name = None
        for line in response.iter_lines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and name:
                data = json.loads(line[5:])
                events.append((name, data))
                if name == "tool_call":
                    if checks is not None:
                        checks(data)
                    reply(data)
                name = None
    return events


def hostile_checks(base):
    def checks(call):
        run, call_id = call["run"], call["call"]
        # another key: as unknown as no run at all
        assert answer(base, run, call_id, key=KEY_B, result=1).status_code == 404
        assert answer(base, run, "no-such-call", result=1).status_code == 404
        assert answer(base, run, call_id, result=1, error="x").status_code == 422
        big = answer(base, run, call_id, result="x" * (1 << 20 + 1))
        assert big.status_code == 413, big.text
    return checks


def reply_for(base, answered):
    def reply(call):
        run, call_id = call["run"], call["call"]
        if call["tool"] == "price":
            done = answer(base, run, call_id, error="no price for that")
        else:
            done = answer(base, run, call_id, result=[f"{call['arguments']['query']}-"
                                                      f"{i}" for i in range(call[
                                                          "arguments"]["limit"])])
        assert done.status_code == 204, done.text
        again = answer(base, run, call_id, result=1)  # answering twice: refused
        assert again.status_code == 409 and "already answered" in again.json()["detail"]
        answered.append(call)
    return reply


@pytest.mark.parametrize("which", ["server", "one_shot_server"])
def test_a_run_calls_tools_and_the_caller_answers_each_on_the_stream(which, request):
    base = request.getfixturevalue(which).url
    answered: list = []
    events = serve(base, base + "/api/v1/execute",
                   {"code": CODE, "inputs": {"words": ["chair", "desk"]},
                    "tools": [SEARCH, PRICE]}, KEY_A, reply_for(base, answered),
                   hostile_checks(base))
    done = dict(events)["done"]
    assert done["error"] is None, done["error"]
    assert done["result"]["found"] == [["chair-0", "chair-1"], ["desk-0", "desk-1"]]
    assert "no price for that" in done["result"]["failed"]
    assert done["result"]["sig"] == "(query: str, limit: int = 5) -> list"
    assert done["usage"]["tool_calls"] == 3
    assert [c["tool"] for c in answered] == ["search", "search", "price"]
    assert answered[0]["arguments"] == {"query": "chair", "limit": 2}
    # the run has ended: a late answer is told so
    late = answer(base, answered[0]["run"], "whatever", result=1)
    assert late.status_code == 410


def test_a_session_run_serves_them_too(server, session):
    answered: list = []
    events = serve(server.url, session + "/execute",
                   {"code": CODE, "inputs": {"words": ["lamp"]}, "tools": [SEARCH, PRICE]},
                   KEY_B, lambda call: answered.append(call) or answer(
                       server.url, call["run"], call["call"], key=KEY_B,
                       **({"error": "none"} if call["tool"] == "price" else
                          {"result": ["lamp"]})))
    done = dict(events)["done"]
    assert done["result"]["found"] == [["lamp"]] and done["usage"]["tool_calls"] == 2


def test_without_the_stream_a_call_fails_at_once_saying_why(server):
    code = ("from sandbox_tools import search, ToolUnavailable\nimport time\n"
            "def main():\n    t = time.monotonic()\n    try:\n        search('x')\n"
            "    except ToolUnavailable as exc:\n"
            "        return {'why': str(exc), 'seconds': time.monotonic() - t}\n")
    done = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), timeout=60,
                     json={"code": code, "inputs": {}, "tools": [SEARCH]}).json()
    assert done["error"] is None, done["error"]
    assert "event stream" in done["result"]["why"] and done["result"]["seconds"] < 2


def test_a_call_nobody_answers_ends_at_its_deadline_and_a_late_answer_is_refused(server):
    code = ("from sandbox_tools import search, ToolTimeout\n"
            "def main():\n    try:\n        search('x')\n"
            "    except ToolTimeout as exc:\n        return {'timeout': str(exc)}\n")
    calls: list = []
    started = time.monotonic()
    events = serve(server.url, server.url + "/api/v1/execute",
                   {"code": code, "inputs": {}, "tools": [SEARCH], "tool_timeout": 1},
                   KEY_A, calls.append)
    done = dict(events)["done"]
    assert done["result"]["timeout"] and time.monotonic() - started < 10
    assert calls[0]["timeout"] == 1
    late = answer(server.url, calls[0]["run"], calls[0]["call"], result=["x"])
    assert late.status_code == 410, late.text


@pytest.mark.parametrize("tools", [[{"name": "_hidden"}], [{"name": "ToolError"}],
                                   [SEARCH, SEARCH], [{"name": "x", "parameters": 3}]])
def test_bad_declarations_are_422(server, tools):
    refused = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A),
                        json={"code": "1", "tools": tools})
    assert refused.status_code == 422, refused.text


def test_an_answer_at_the_instance_not_holding_the_run_is_409_naming_it(tmp_path, keys_file):
    holder = Server(tmp_path, "--api-keys-file", str(keys_file), "--pool-size", "0",
                    "--instance-id", "holder-1")
    other = Server(tmp_path, "--api-keys-file", str(keys_file), "--pool-size", "0",
                   "--instance-id", "other-2")
    try:
        def reply(call):
            assert call["run"].startswith("holder-1.")
            elsewhere = answer(other.url, call["run"], call["call"], result=["x"])
            assert elsewhere.status_code == 409 and "holder-1" in elsewhere.json()["detail"]
            assert answer(holder.url, call["run"], call["call"], result=["x"]).status_code \
                == 204

        code = "from sandbox_tools import search\ndef main():\n    return {'r': search('q')}\n"
        events = serve(holder.url, holder.url + "/api/v1/execute",
                       {"code": code, "inputs": {}, "tools": [SEARCH]}, KEY_A, reply)
        assert dict(events)["done"]["result"] == {"r": ["x"]}
    finally:
        holder.stop()
        other.stop()


# --- docs/tools.md's two instances behind haproxy, as written there ----------------------------

DOC_INSTANCES = ("sandbox-a", "sandbox-b")


def documented_haproxy(port: int, a: int, b: int, routed: bool) -> str:
    """docs/tools.md's haproxy file on these ports; routed: with its `use-server` lines (an
    answer goes to its run's holder), else plain round robin. Each answer says which instance
    served it (X-Served-By), for the test to know."""
    text = (Path(__file__).parents[2] / "docs" / "tools.md").read_text()
    [config] = re.findall(r"```haproxy\n(.*?)```", text, re.S)
    assert "bind 127.0.0.1:8194" in config and "use-server sandbox-a" in config
    config = config.replace(":8194", f":{port}").replace(":8195", f":{a}") \
        .replace(":8196", f":{b}")
    if not routed:
        config = "\n".join(line for line in config.splitlines() if "use-server" not in line)
    return config.replace("    balance roundrobin\n", "    balance roundrobin\n"
                          "    http-response set-header X-Served-By %s\n") + "\n"


@pytest.fixture(scope="module")
def two_instances(tmp_path_factory, keys_file):
    """The two instances of docs/tools.md (shared keys, an --instance-id each)."""
    haproxy = "/usr/sbin/haproxy"
    if not os.path.exists(haproxy):
        unavailable("Debian's haproxy is not installed: `apt-get install haproxy`")
    tmp = tmp_path_factory.mktemp("two-instances")
    servers = [Server(tmp, "--api-keys-file", str(keys_file), "--pool-size", "0",
                      "--instance-id", name) for name in DOC_INSTANCES]
    yield haproxy, tmp, servers
    for server in servers:
        server.stop()


@contextlib.contextmanager
def balancer(two_instances, routed):
    """haproxy over the two instances; its URL, once it answers."""
    haproxy, tmp, (a, b) = two_instances
    port = free_port()
    config = tmp / f"haproxy-{port}.cfg"
    config.write_text(documented_haproxy(port, a.port, b.port, routed))
    process = subprocess.Popen([haproxy, "-f", str(config), "-db"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            assert process.poll() is None, process.stderr.read()
            try:
                http.get(url + "/ready", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def served_by(url: str) -> str:
    """Which instance the balancer sent one request to (round robin: the next goes to the
    other, unless a rule routes it)."""
    return http.get(url + "/ready", timeout=10).headers["X-Served-By"]


@pytest.mark.parametrize("routed", [False, True], ids=["round-robin", "routed-by-run-id"])
def test_two_instances_behind_haproxy_answer_on_the_holder_or_409_naming_it(two_instances,
                                                                            routed):
    with balancer(two_instances, routed) as url:
        seen = []

        def reply(call):
            holder = call["run"].partition(".")[0]
            assert holder in DOC_INSTANCES
            while served_by(url) != holder:  # the next request would go to the other one
                pass
            first = answer(url, call["run"], call["call"], result=["via the balancer"])
            seen.append((first.status_code, first.headers.get("X-Served-By")))
            if routed:  # the use-server rule sent it to the holder all the same
                assert (first.status_code, first.headers["X-Served-By"]) == (204, holder), \
                    first.text
                return
            other = next(name for name in DOC_INSTANCES if name != holder)
            assert (first.status_code, first.headers["X-Served-By"]) == (409, other)
            detail = first.json()["detail"]
            assert f"is held by instance {holder!r}, not this one ({other!r})" in detail
            again = answer(url, call["run"], call["call"], result=["via the balancer"])
            seen.append((again.status_code, again.headers.get("X-Served-By")))
            assert (again.status_code, again.headers["X-Served-By"]) == (204, holder), again.text

        code = "from sandbox_tools import search\ndef main():\n    return {'r': search('q')}\n"
        events = serve(url, url + "/api/v1/execute",
                       {"code": code, "inputs": {}, "tools": [SEARCH]}, KEY_A, reply)
        assert dict(events)["done"]["result"] == {"r": ["via the balancer"]}
        assert len(seen) == (1 if routed else 2)


def tool_call_metrics(base: str) -> dict[tuple[str, str], float]:
    """/metrics' tool-call counts and seconds summed, {(series, outcome): value}, native API."""
    found: dict[tuple[str, str], float] = {}
    for line in http.get(base + "/metrics").text.splitlines():
        for series in ("sandbox_tool_calls_total", "sandbox_tool_call_seconds_count",
                       "sandbox_tool_call_seconds_sum"):
            prefix = f'{series}{{api="native",outcome="'
            if line.startswith(prefix):
                outcome, value = line[len(prefix):].split('"} ')
                found[series, outcome] = float(value)
    return found


def test_each_tool_call_is_counted_by_api_and_outcome_with_its_duration(server):
    stall = {"name": "stall", "description": "Never answered."}
    code = ("from sandbox_tools import search, price, stall, ToolError, ToolTimeout\n"
            "def main():\n    search('a'), search('b')\n    caught = []\n"
            "    for call, error in ((lambda: price('x'), ToolError), (stall, ToolTimeout)):\n"
            "        try:\n            call()\n        except error as exc:\n"
            "            caught.append(type(exc).__name__)\n    return {'caught': caught}\n")
    unserved = ("from sandbox_tools import search, ToolUnavailable\ndef main():\n    try:\n"
                "        search('x')\n    except ToolUnavailable as exc:\n"
                "        return {'refused': type(exc).__name__}\n")

    def reply(call):
        if call["tool"] == "search":
            time.sleep(0.3)  # the answer's wait: in the seconds the metrics sum
            answer(server.url, call["run"], call["call"], result=["found"])
        elif call["tool"] == "price":
            answer(server.url, call["run"], call["call"], error="no price")

    before = tool_call_metrics(server.url)
    events = serve(server.url, server.url + "/api/v1/execute",
                   {"code": code, "inputs": {}, "tools": [SEARCH, PRICE, stall],
                    "tool_timeout": 1}, KEY_A, reply)
    done = dict(events)["done"]
    assert done["result"] == {"caught": ["ToolError", "ToolTimeout"]}, done["error"]
    # without the event stream no call can be served: each is refused at once
    refused = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), timeout=60,
                        json={"code": unserved, "inputs": {}, "tools": [SEARCH]}).json()
    assert refused["result"] == {"refused": "ToolUnavailable"}, refused["error"]
    after = tool_call_metrics(server.url)
    added = {key: after[key] - before.get(key, 0) for key in after}
    assert {outcome: added["sandbox_tool_calls_total", outcome]
            for outcome in ("ok", "error", "refused", "timeout")} == \
        {"ok": 2, "error": 1, "refused": 1, "timeout": 1}, added
    assert added["sandbox_tool_call_seconds_count", "ok"] == 2
    assert 0.6 <= added["sandbox_tool_call_seconds_sum", "ok"] < 5
    # the service runs on uvloop, whose timers count from libuv's loop time, read once per
    # loop iteration: a 1 s wait can end up to a few milliseconds early by time.monotonic
    assert 0.98 <= added["sandbox_tool_call_seconds_sum", "timeout"] < 5
