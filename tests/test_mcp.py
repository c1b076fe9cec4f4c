"""`sandbox-kernel mcp` driven by the MCP SDK's own client, over stdio and Streamable HTTP.

One server per transport for the module (stdio: a subprocess the client started; HTTP: a
subprocess on 127.0.0.1 with a keys file); every call runs real sandboxed kernels.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")
import httpx2
import jsonschema
from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import OAuthClientMetadata

from sandbox_kernel.confine import denials
from sandbox_kernel.hosting.keys import PUBLISHED_KEYS
from tests.helpers import write_keys
from tests.mcp_clients import SERVER, Connected, HttpServer, stdio

EXAMPLE_KEYS = Path(__file__).parent.parent / "examples" / "mcp" / "keys.json"

KEY_A = "mcp-key-a-0123456789abcdef"
KEY_B = "mcp-key-b-0123456789abcdef"
KEY_ONE = "mcp-key-one-0123456789abcdef"
FLAGS_SEEN = re.compile(r"--[a-z]+-[a-z-]+|install|kernelspec")  # operator advice
PLOT = ("import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()\n")


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp-keys") / "keys.json"
    write_keys(path, [
        {"id": "team-a", "key": KEY_A}, {"id": "team-b", "key": KEY_B},
        {"id": "team-one", "key": KEY_ONE, "max_sessions": 1}])
    return path


@pytest.fixture(scope="module")
def http_server(tmp_path_factory, keys_file):
    server = HttpServer(tmp_path_factory.mktemp("mcp-http"), keys_file)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stdio_log(tmp_path_factory):
    return tmp_path_factory.mktemp("mcp-stdio") / "server.log"


@pytest.fixture(scope="module", params=["stdio", "http"])
def mcp(request, stdio_log):
    """A connected client of the transport's server."""
    if request.param == "stdio":
        client = stdio(stdio_log)
    else:
        client = request.getfixturevalue("http_server").client(KEY_A)
    client.transport = request.param
    yield client
    client.close()


@pytest.fixture
def session(mcp):
    """A session of its own for one test, closed after it."""
    answer = mcp.tool("create_session")
    assert not answer.is_error, answer.content
    session_id = answer.structured_content["session"]
    yield session_id
    mcp.tool("close_session", {"session": session_id})


def finished(mcp, answer) -> list:
    """Every answer about a run until it ended (a slow one returns early, then wait_run)."""
    answers = [answer]
    while answers[-1].structured_content.get("status") == "running":
        answers.append(mcp.tool("wait_run", {"run": answer.structured_content["run"]}))
    return answers


def text(answer) -> str:
    return "\n".join(block.text for block in answer.content if block.type == "text")


# --- tools and schemas ---------------------------------------------------------------------

def test_tools_are_listed_with_valid_input_and_output_schemas(mcp):
    tools = {tool.name: tool for tool in mcp.call(lambda c: c.list_tools()).tools}
    assert {"run_python", "wait_run", "create_session", "close_session", "list_sessions",
            "restart_session", "interrupt", "list_files", "read_file",
            "write_file"} <= set(tools)
    for tool in tools.values():
        jsonschema.Draft202012Validator.check_schema(tool.input_schema)
        assert tool.output_schema is not None, tool.name
        jsonschema.Draft202012Validator.check_schema(tool.output_schema)
        assert tool.description
    assert tools["run_python"].input_schema["required"] == ["code"]
    answer = mcp.tool("run_python", {"code": "print('x')"})
    jsonschema.validate(answer.structured_content, tools["run_python"].output_schema)


def test_the_policy_resource_tells_a_model_what_it_may_do(mcp):
    listed = [str(r.uri) for r in mcp.call(lambda c: c.list_resources()).resources]
    assert "sandbox://policy" in listed
    policy = json.loads(mcp.call(lambda c: c.read_resource("sandbox://policy")).contents[0].text)
    assert policy["network"] is False and policy["subprocesses"] is False
    assert "no network" in policy["summary"]
    assert {"numpy", "matplotlib"} <= {name.lower() for name in policy["packages"]}


# --- running code --------------------------------------------------------------------------

def test_run_returns_output_in_order_and_the_value(mcp):
    code = "import sys\nprint('one')\nprint('two', file=sys.stderr, flush=True)\n" \
           "print('three')\n6 * 7"
    answer = mcp.tool("run_python", {"code": code})
    data = answer.structured_content
    assert not answer.is_error and data["status"] == "ok" and data["state"] == "fresh"
    assert [(c["stream"], c["text"]) for c in data["output"]] == [
        ("stdout", "one\n"), ("stderr", "two\n"), ("stdout", "three\n")]
    assert data["value"] == "42" and data["result"] is None
    assert text(answer).index("one") < text(answer).index("two") < text(answer).index("42")


def test_main_with_inputs_returns_its_dict(mcp):
    code = "def main(x, name):\n    print('log line')\n    return {'y': x * 2, 'hi': name}\n"
    answer = mcp.tool("run_python", {"code": code, "inputs": {"x": 21, "name": "é"}})
    data = answer.structured_content
    assert data["result"] == {"y": 42, "hi": "é"} and data["stdout"] == "log line\n"
    assert data["value"] is None


def test_each_call_without_a_session_starts_fresh(mcp):
    mcp.tool("run_python", {"code": "leaked = 1\nopen('left.txt', 'w').write('x')"})
    answer = mcp.tool("run_python", {"code": "import os\n('leaked' in globals(), "
                                             "os.path.exists('left.txt'))"})
    assert answer.structured_content["value"] == "(False, False)"


def test_a_chart_comes_back_as_image_content(mcp):
    answers = finished(mcp, mcp.tool("run_python", {"code": PLOT}))  # matplotlib may be slow
    images = [block for answer in answers for block in answer.content if block.type == "image"]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data).startswith(b"\x89PNG\r\n\x1a\n")
    assert [display for answer in answers for display in answer.structured_content[
        "displays"]] == [{"mime_type": "image/png", "text": None}]
    assert answers[-1].structured_content["status"] == "ok"
    # numpy's BLAS gives NUMA hints the sandbox refuses; the audit keeps them, the model is not
    # shown them as refused calls of its own (#32 item 13)
    assert answers[-1].structured_content["usage"]["refused_syscalls"] == 0
    assert "refused calls" not in text(answers[-1])


def test_a_chart_drawn_under_agg_comes_back_too(mcp):
    """matplotlib.use('Agg') then plt.show(), as models write it, once returned nothing."""
    code = PLOT.replace("module://matplotlib_inline.backend_inline", "Agg")
    answers = finished(mcp, mcp.tool("run_python", {"code": code}))
    images = [block for answer in answers for block in answer.content if block.type == "image"]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert "non-interactive" not in "".join(text(answer) for answer in answers)


def test_an_error_has_its_name_message_and_the_users_line(mcp):
    answer = mcp.tool("run_python", {"code": "x = 1\n\ndef f():\n    return undefined_name\nf()"})
    error = answer.structured_content["error"]
    assert answer.is_error and error["name"] == "NameError" and not error["refused"]
    assert "undefined_name" in error["value"]
    assert "[error] NameError: name 'undefined_name' is not defined" in text(answer)
    assert any("return undefined_name" in line for line in error["traceback"])


def test_a_fresh_runs_small_files_come_back_embedded(mcp):
    answer = mcp.tool("run_python", {"code": "open('report.csv', 'w').write('a,b\\n1,2\\n')"})
    embedded = [block for block in answer.content if block.type == "resource"]
    assert len(embedded) == 1 and embedded[0].resource.text == "a,b\n1,2\n"
    assert answer.structured_content["files"] == [
        {"path": "report.csv", "size": 8, "uri": None, "embedded": True}]


WRITES_AND_NAMES_ITS_KERNEL = (
    "open('small.txt', 'w').write('kept')\n"
    "open('large.bin', 'wb').write(b'x' * 300_000)\n"  # above --embed-files' 256 KiB
    "type(get_ipython().kernel).__name__")


def _kept_files(answer) -> tuple[list, list]:
    embedded = [(block.resource.uri, block.resource.text) for block in answer.content
                if block.type == "resource"]
    listed = sorted((f["path"], f["size"], f["embedded"])
                    for f in answer.structured_content["files"])
    return embedded, listed


def test_a_run_without_a_session_is_a_one_shot_kernel_that_sends_its_files(mcp):
    answer = mcp.tool("run_python", {"code": WRITES_AND_NAMES_ITS_KERNEL})
    assert answer.structured_content["value"] == "'LeanOneShot'"  # the lean process
    embedded, listed = _kept_files(answer)
    assert [text for _, text in embedded] == ["kept"]
    assert listed == [("large.bin", 300_000, False), ("small.txt", 4, True)]


def test_with_no_one_shot_pool_a_run_takes_a_zmq_kernel_and_keeps_its_files(tmp_path,
                                                                            keys_file):
    server = HttpServer(tmp_path, keys_file, "--one-shot-pool-size", "0")
    client = server.client(KEY_A)
    try:
        answer = client.tool("run_python", {"code": WRITES_AND_NAMES_ITS_KERNEL})
        assert answer.structured_content["value"] == "'SandboxKernel'"
        embedded, listed = _kept_files(answer)
        assert [text for _, text in embedded] == ["kept"]
        assert listed == [("large.bin", 300_000, False), ("small.txt", 4, True)]
    finally:
        client.close()
        server.stop()


def test_a_one_shot_kernels_lies_about_its_files_stay_within_the_callers_bounds(mcp):
    # User code runs in the process that sends its files afterwards, so it can make that
    # answer anything: here 5,001 files, one outside the scratch, and files never listed.
    # The caller keeps the first 50 listed, embeds only listed ones, and the run stands.
    code = ("import sys\n"
            "listed = [[f'f{i}.txt', 2, 0.0] for i in range(5000)]\n"
            "listed.append(['../../etc/passwd', 2, 0.0])\n"
            "embedded = {name: {'data': 'aGk='} for name in "
            "[*(f'f{i}.txt' for i in range(100)), '../../etc/passwd', 'unlisted.txt']}\n"
            "answer = {'files': listed, 'more': False, 'embedded': embedded}\n"
            "sys.modules['sandbox_kernel.kernel.oneshot_io']._file_op = "
            "lambda: lambda *args, **kwargs: answer\n"
            "'done'")
    answer = mcp.tool("run_python", {"code": code})
    data = answer.structured_content
    assert data["status"] == "ok" and data["value"] == "'done'"
    assert [f["path"] for f in data["files"]] == [f"f{i}.txt" for i in range(50)]
    embedded = {block.resource.text for block in answer.content if block.type == "resource"}
    assert embedded == {"hi"} and all(f["embedded"] for f in data["files"])


def test_huge_output_is_capped_with_a_marker_for_a_model(mcp):
    answer = mcp.tool("run_python", {"code": "print('y' * 5_000_000)\nprint('end')"})
    data = answer.structured_content
    assert data["status"] == "ok"
    assert 1000 < len(data["stdout"]) < 6000  # --max-text 4000, plus the marker
    assert "characters cut here" in data["stdout"]  # the server's cut, head and tail kept
    assert data["stdout"].startswith("yyy") and data["stdout"].endswith("yyy")
    assert "[output cut:" in data["stderr"]  # the kernel's cap (1 MiB), said for a model
    assert "--max-output" not in text(answer) and "sandbox-kernel client" not in text(answer)


# --- what each run cost ---------------------------------------------------------------------

MiB = 2**20
BUSY = ("import time\nstart = time.process_time()\n"
        "while time.process_time() - start < 0.4:\n    for _ in range(10**5): pass")
HOST = {"cpu_user_seconds": "host", "cpu_system_seconds": "host", "peak_memory_bytes": "host",
        "wall_seconds": "caller", "output_bytes": "caller", "result_bytes": "caller",
        "refused_syscalls": "kernel", "egress_cpu_seconds": "kernel",
        "companion_cpu_seconds": "kernel"}


def test_usage_reports_cpu_memory_and_refusals_as_the_client_measures_them(mcp, session):
    def usage(code):
        return mcp.tool("run_python", {"code": code, "session": session}
                        ).structured_content["usage"]

    baseline = usage("pass")["peak_memory_bytes"]
    busy = usage(BUSY)
    assert busy["source"] == HOST
    cpu = busy["cpu_user_seconds"] + busy["cpu_system_seconds"]
    assert 0.4 - 0.02 <= cpu <= 0.4 + 0.15 and cpu <= busy["wall_seconds"] + 0.02
    big = usage("x = b'1' * (200 * 2**20)\ndel x")
    assert big["peak_memory_bytes"] >= 200 * MiB + baseline // 2
    assert usage("y = 1 + 1")["peak_memory_bytes"] < baseline + 20 * MiB  # reset per run
    refused = mcp.tool("run_python", {"session": session, "code": "import os\nos.fork()"})
    assert refused.structured_content["usage"]["refused_syscalls"] == 1
    assert "[usage] wall" in text(refused)
    assert usage("print('ab')")["output_bytes"] == 3


# --- what the sandbox refuses, said for a model --------------------------------------------

@pytest.mark.parametrize(("code", "said"), [
    ("import subprocess\nsubprocess.run(['ls'])", "no subprocesses in this sandbox"),
    ("import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=2)",
     "the network is off in this sandbox: you cannot download"),
    ("open('/etc/shadow').read()", "outside what this sandbox may read"),
    ("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=5)",
     "the network is off in this sandbox: you cannot download"),
])
def test_a_refused_call_is_explained_for_a_model_without_operator_flags(mcp, stdio_log,
                                                                        code, said):
    answer = finished(mcp, mcp.tool("run_python", {"code": code}))[-1]  # slow under load
    error = answer.structured_content["error"]
    assert answer.is_error and error["refused"] and said in error["value"]
    shown = text(answer) + json.dumps(answer.structured_content)
    assert not FLAGS_SEEN.search(shown), shown
    assert f"{error['name']}: {error['name']}" not in shown  # the name once (#32 item 13)
    if mcp.transport == "stdio":  # the operator's wording (with its fix) is in the log
        rule = next(rule for rule in denials.RULES if said in rule.for_model)
        assert rule.why in stdio_log.read_text()


# --- sessions ------------------------------------------------------------------------------

def test_a_session_keeps_state_and_files_across_calls(mcp, session):
    mcp.tool("run_python", {"code": "import math\ntotal = 40", "session": session})
    answer = mcp.tool("run_python", {"code": "total + int(math.sqrt(4))", "session": session})
    assert answer.structured_content["value"] == "42"
    assert answer.structured_content["state"] == "kept"
    listed = mcp.tool("list_sessions").structured_content["sessions"]
    assert session in [s["session"] for s in listed]
    # What its sandbox spent in all (tests/test_usage.py shows a thread's CPU after a run in it).
    spent = next(s for s in listed if s["session"] == session)["usage"]
    assert 0 <= spent["cpu_user_seconds"] + spent["cpu_system_seconds"] < 5, spent


def test_files_written_read_listed_and_linked(mcp, session):
    wrote = mcp.tool("write_file", {"session": session, "path": "data/in.txt",
                                    "content": "hello from the agent"})
    assert wrote.structured_content["size"] == 20
    answer = mcp.tool("run_python", {"session": session, "code":
                                     "text = open('data/in.txt').read()\n"
                                     "open('out.txt', 'w').write(text.upper())"})
    links = [block for block in answer.content if block.type == "resource_link"]
    assert [link.name for link in links] == ["out.txt"]
    linked = mcp.call(lambda c: c.read_resource(str(links[0].uri))).contents[0]
    assert linked.text == "HELLO FROM THE AGENT"
    read = mcp.tool("read_file", {"session": session, "path": "out.txt"})
    assert read.structured_content["content"] == "HELLO FROM THE AGENT"
    listed = mcp.tool("list_files", {"session": session}).structured_content["files"]
    assert {f["path"] for f in listed} == {"data/in.txt", "out.txt"}


def test_binary_files_and_images_round_trip(mcp, session):
    png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
                           "z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
    mcp.tool("write_file", {"session": session, "path": "dot.png",
                            "content": base64.b64encode(png).decode(), "encoding": "base64"})
    read = mcp.tool("read_file", {"session": session, "path": "dot.png"})
    images = [block for block in read.content if block.type == "image"]
    assert base64.b64decode(images[0].data) == png
    blob = bytes(range(256))
    mcp.tool("write_file", {"session": session, "path": "blob.bin",
                            "content": base64.b64encode(blob).decode(), "encoding": "base64"})
    read = mcp.tool("read_file", {"session": session, "path": "blob.bin"}).structured_content
    assert read["encoding"] == "base64" and base64.b64decode(read["content"]) == blob


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "a/../../b"])
def test_file_paths_outside_the_working_directory_are_refused(mcp, session, path):
    answer = mcp.tool("read_file", {"session": session, "path": path})
    assert answer.is_error and "not inside the working directory" in text(answer)
    answer = mcp.tool("write_file", {"session": session, "path": path, "content": "x"})
    assert answer.is_error and "not inside the working directory" in text(answer)


def test_a_symlink_out_of_the_working_directory_is_not_followed(mcp, session):
    mcp.tool("run_python", {"session": session, "code":
                            "import os\nos.symlink('/etc/hostname', 'link')"})
    answer = mcp.tool("read_file", {"session": session, "path": "link"})
    assert answer.is_error and "outside the working directory" in text(answer)


def test_a_long_run_returns_early_and_can_be_interrupted(mcp, session):
    mcp.tool("run_python", {"session": session, "code": "kept = 'yes'"})
    code = "import time\nfor i in range(1000):\n    print(i, flush=True)\n    time.sleep(0.02)\n"
    first = mcp.tool("run_python", {"session": session, "code": code})  # --patience 3
    data = first.structured_content
    assert data["status"] == "running" and "wait_run" in text(first)
    assert data["stdout"].startswith("0\n1\n")
    busy = mcp.tool("run_python", {"session": session, "code": "1"})
    assert busy.is_error and "still busy" in text(busy)
    stopped = mcp.tool("interrupt", {"session": session}).structured_content
    assert stopped["ok"], stopped
    rest = mcp.tool("wait_run", {"run": data["run"]}).structured_content
    assert rest["status"] == "error" and rest["error"]["name"] == "KeyboardInterrupt"
    assert "variables are kept" in rest["error"]["value"] and rest["state"] == "kept"
    assert not rest["stdout"].startswith("0\n")  # only what the first answer did not carry
    after = mcp.tool("run_python", {"session": session, "code": "kept"})
    assert after.structured_content["value"] == "'yes'"


def test_a_long_run_without_a_session_returns_early_and_can_be_interrupted(mcp):
    code = ("open('partial.txt', 'w').write('so far')\n"
            "import time\nfor i in range(1000):\n    print(i, flush=True)\n    time.sleep(0.02)\n")
    first = mcp.tool("run_python", {"code": code})  # --patience 3
    data = first.structured_content
    assert data["status"] == "running" and data["stdout"].startswith("0\n1\n")
    assert mcp.tool("interrupt", {"run": data["run"]}).structured_content["ok"]
    rest = mcp.tool("wait_run", {"run": data["run"]}).structured_content
    assert rest["status"] == "error" and rest["error"]["name"] == "KeyboardInterrupt"
    assert rest["state"] == "fresh"
    assert rest["files"] == [{"path": "partial.txt", "size": 6, "uri": None, "embedded": True}]


def test_a_timeout_says_the_session_state_survived(mcp, session):
    mcp.tool("run_python", {"session": session, "code": "x = 7"})
    answer = mcp.tool("run_python", {"session": session, "code": "while True:\n    pass",
                                     "timeout": 1})
    data = answer.structured_content
    assert data["timed_out"] and data["error"]["name"] == "ExecutionTimeout"
    assert data["state"] == "kept" and "variables and imports are kept" in \
        data["error"]["value"]
    assert "--timeout" not in text(answer)
    assert mcp.tool("run_python", {"session": session, "code": "x"}
                    ).structured_content["value"] == "7"


def test_a_kernel_that_dies_says_the_session_lost_its_state_and_goes_on(mcp, session):
    mcp.tool("run_python", {"session": session, "code": "before = 1"})
    answer = mcp.tool("run_python", {"session": session, "code":
                                     "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"})
    data = answer.structured_content
    assert data["error"]["name"] == "KernelDied" and data["state"] == "lost"
    assert "variables and imports are gone" in data["error"]["value"]
    assert "LOST" in text(answer)
    after = mcp.tool("run_python", {"session": session, "code": "'before' in globals()"})
    assert after.structured_content["value"] == "False"  # a fresh kernel, same session


def test_restart_clears_a_session(mcp, session):
    mcp.tool("run_python", {"session": session, "code": "gone = 1"})
    assert mcp.tool("restart_session", {"session": session}).structured_content["ok"]
    answer = mcp.tool("run_python", {"session": session, "code": "gone"})
    assert answer.structured_content["error"]["name"] == "NameError"


def test_an_unknown_session_is_refused_with_what_to_do(mcp):
    answer = mcp.tool("run_python", {"code": "1", "session": "nope"})
    assert answer.is_error and "create_session" in text(answer)


def test_a_network_session_is_refused_on_an_offline_server(mcp):
    answer = mcp.tool("create_session", {"network": True})
    assert answer.is_error and "network is off" in text(answer)


def test_a_session_asking_for_missing_packages_is_refused_naming_them(mcp):
    answer = mcp.tool("create_session", {"packages": ["numpy", "no_such_pkg_xyz"]})
    assert answer.is_error and "no_such_pkg_xyz" in text(answer) and "numpy" not in \
        text(answer).split("available in this sandbox:")[1].split(";")[0]


# --- Streamable HTTP: keys, owners, limits -------------------------------------------------

def test_two_clients_in_two_sessions_see_nothing_of_each_other(http_server):
    a, b = http_server.client(KEY_A), http_server.client(KEY_B)
    try:
        sessions = {}
        for name, client in (("a", a), ("b", b)):
            sessions[name] = client.tool("create_session").structured_content["session"]
        answers = {}

        def work(name, client):
            answers[name] = client.tool("run_python", {"session": sessions[name], "code": (
                f"import os, glob\nmine = {name!r}\nopen('{name}.txt', 'w').write('{name}')\n"
                "import time; time.sleep(1)\n"
                "(sorted(k for k in ('a', 'b') if os.path.exists(k + '.txt')), mine)")})

        threads = [threading.Thread(target=work, args=item)
                   for item in (("a", a), ("b", b))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert answers["a"].structured_content["value"] == "(['a'], 'a')"
        assert answers["b"].structured_content["value"] == "(['b'], 'b')"
        seen_by_b = [s["session"] for s in b.tool("list_sessions"
                                                  ).structured_content["sessions"]]
        assert sessions["b"] in seen_by_b and sessions["a"] not in seen_by_b
        stolen = b.tool("run_python", {"session": sessions["a"], "code": "mine"})
        assert stolen.is_error and "no session" in text(stolen)
        stolen = b.tool("read_file", {"session": sessions["a"], "path": "a.txt"})
        assert stolen.is_error
    finally:
        a.close()
        b.close()


def test_a_keys_session_limit_is_kept(http_server):
    one = http_server.client(KEY_ONE)
    try:
        assert not one.tool("create_session").is_error
        again = one.tool("create_session")
        assert again.is_error and "you may hold 1 sessions" in text(again)
    finally:
        one.close()


def test_runs_without_a_session_count_against_the_keys_share(tmp_path, keys_file):
    # Three keys share --max-runs 3: each may have 2 fresh kernels, collected or not.
    server = HttpServer(tmp_path, keys_file, "--max-runs", "3", "--patience", "1")
    a, b = server.client(KEY_A), server.client(KEY_B)
    try:
        slow = {"code": "import time\ntime.sleep(60)", "timeout": 60}
        held = [a.tool("run_python", slow).structured_content for _ in range(2)]
        assert [answer["status"] for answer in held] == ["running", "running"]
        refused = a.tool("run_python", {"code": "1"})
        assert refused.is_error
        assert "you have 2 runs without a session still going (at most 2 at once)" \
            in text(refused)
        assert not FLAGS_SEEN.search(text(refused))  # written for a model
        # Another key still has its share; past the server's 3 even it is refused.
        quick = finished(b, b.tool("run_python", {"code": "6 * 7"}))[-1]
        assert quick.structured_content["value"] == "42"
        b_held = b.tool("run_python", slow).structured_content
        full = b.tool("run_python", {"code": "1"})
        assert full.is_error and "this server is running its limit of 3 runs" in text(full)
        # An interrupted run ends, its kernel is shut down, and its place is free again.
        for run in (*held, b_held):
            a_or_b = b if run is b_held else a
            assert a_or_b.tool("interrupt", {"run": run["run"]}).structured_content["ok"]
            finished(a_or_b, a_or_b.tool("wait_run", {"run": run["run"]}))
        deadline = time.monotonic() + 30
        while (again := a.tool("run_python", {"code": "1"})).is_error:
            assert time.monotonic() < deadline, text(again)
            time.sleep(0.2)
    finally:
        a.close()
        b.close()
        server.stop()


def test_the_http_server_says_where_it_serves(http_server):
    deadline = time.monotonic() + 10  # said once it listens, which the fixture waited for
    said = f"sandbox-kernel mcp: serving Streamable HTTP at {http_server.url}\n"
    while said not in (log := http_server.log.read_text(errors="replace")):
        assert time.monotonic() < deadline, log[-4000:]
        time.sleep(0.1)


@pytest.mark.parametrize("header", [None, "Bearer wrong-key-0123456789abcdef", "Basic abc"])
def test_a_wrong_or_missing_key_is_refused(http_server, header):
    headers = {"Accept": "application/json, text/event-stream"}
    if header:
        headers["Authorization"] = header
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    answer = httpx2.post(http_server.url, json=body, headers=headers, timeout=30)
    assert answer.status_code == 401
    # Keys, not OAuth: the 401 names no protected-resource document (an OAuth-aware client
    # would follow it into a login this server cannot do), and none is served.
    assert answer.headers["www-authenticate"].startswith("Bearer ")
    assert "resource_metadata" not in answer.headers["www-authenticate"]
    root = http_server.url.removesuffix("/mcp")
    for document in ("/.well-known/oauth-protected-resource/mcp",
                     "/.well-known/oauth-protected-resource",
                     "/.well-known/oauth-authorization-server"):
        assert httpx2.get(root + document, timeout=30).status_code == 404, document


class _NoTokens:
    """An OAuth client's token storage that holds nothing (the client must discover a login)."""

    async def get_tokens(self):
        return None

    async def set_tokens(self, tokens):
        pass

    async def get_client_info(self):
        return None

    async def set_client_info(self, info):
        pass


def test_an_oauth_aware_sdk_client_finds_no_login_to_try(http_server):
    answers: list[tuple[str, int]] = []

    async def record(response):
        answers.append((response.request.url.path, response.status_code))

    def connect():
        oauth = OAuthClientProvider(
            http_server.url, OAuthClientMetadata(redirect_uris=["http://127.0.0.1:1/cb"]),
            _NoTokens(), redirect_handler=None, callback_handler=None)
        http = httpx2.AsyncClient(headers={"Authorization": "Bearer wrong-key-0123456789abcd"},
                                  auth=oauth, event_hooks={"response": [record]}, timeout=30)
        return Client(streamable_http_client(http_server.url, http_client=http))

    with pytest.raises(Exception):  # noqa: B017  # the SDK wraps the failure in groups
        Connected(connect)
    assert ("/mcp", 401) in answers
    # Whatever discovery the client tries, no document claims this server does OAuth.
    discovered = [(path, status) for path, status in answers if path.startswith("/.well-known")]
    assert discovered and all(status == 404 for _, status in discovered), discovered


def test_a_keys_file_with_the_published_example_key_is_refused(tmp_path):
    copy = tmp_path / "keys.json"  # copied, made private, the placeholders left in
    copy.write_bytes(EXAMPLE_KEYS.read_bytes())
    copy.chmod(0o600)
    done = subprocess.run([*SERVER, "--http", "127.0.0.1:1", "--keys", str(copy)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "keys[0] ('research-agent'): the key is the published example's placeholder" \
        in done.stderr
    # Every secret the project publishes is one the loader knows.
    published = {entry["key"] for path in EXAMPLE_KEYS.parent.parent.rglob("keys.json")
                 for entry in json.loads(path.read_text())["keys"]}
    assert published and published <= PUBLISHED_KEYS


# --- snapshots and pausing (--state-dir) ---------------------------------------------------


def test_a_snapshot_opens_as_new_sessions_and_an_idle_session_pauses_and_resumes(tmp_path):
    log = tmp_path / "server.log"
    client = stdio(log, "--state-dir", str(tmp_path / "state"), "--session-pause-after", "2")
    try:
        source = client.tool("create_session").structured_content["session"]
        made = client.tool("run_python", {"session": source, "code": (
            "kept = 41\ncounting = (i for i in range(3))")})
        assert not made.is_error, text(made)
        taken = client.tool("snapshot_session", {"session": source})
        assert not taken.is_error, text(taken)
        snap = taken.structured_content
        assert "kept" in snap["saved"] and snap["bytes"] > 0
        assert [s["name"] for s in snap["skipped"]] == ["counting"]
        assert [s["snapshot"] for s in client.tool("list_snapshots").structured_content[
            "snapshots"]] == [snap["snapshot"]]
        opened = client.tool("create_session", {"snapshot": snap["snapshot"]})
        fork = opened.structured_content["session"]
        # The answer says what came back and what did not (the generator was never saved).
        restore = opened.structured_content["restore"]
        assert sorted(restore["restored"]) == sorted(snap["saved"]), restore
        assert (restore["skipped"], restore["files"]) == ([], []), restore
        assert '"restored":' in text(opened).replace(" ", "")  # for clients showing text only
        again = client.tool("run_python", {"session": fork, "code": "kept + 1"})
        assert again.structured_content["value"] == "42", text(again)
        # Both sessions idle past --session-pause-after: paused, listed as such, resumed.
        deadline = time.monotonic() + 30
        while not all(s["paused"] for s in client.tool("list_sessions").structured_content[
                "sessions"]):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        resumed = client.tool("run_python", {"session": source, "code": "kept"})
        assert resumed.structured_content["value"] == "41", text(resumed)
        refused = client.tool("create_session", {"snapshot": "00" * 16})
        assert refused.is_error and "no snapshot" in text(refused)
    finally:
        client.close()


def test_a_run_that_waits_sends_progress_to_a_client_that_asked(mcp):
    """A caller that sent a progress token hears, every second, what its run waits for (the
    first run after a start waits ~10 s for the fork server and its kernels, silently before)."""
    heard: list[tuple[float, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        heard.append((done, message))

    answer = mcp.call(lambda client: client.call_tool(
        "run_python", {"code": "import time\ntime.sleep(2.2)\nprint('done')"},
        progress_callback=progress)).structured_content
    while answer["status"] == "running":  # past --patience: the rest comes with wait_run
        answer = mcp.call(lambda client, run=answer["run"]: client.call_tool(
            "wait_run", {"run": run}, progress_callback=progress)).structured_content
    assert answer["status"] == "ok", answer
    assert len(heard) >= 2, heard
    assert [done for done, _ in heard] == sorted(done for done, _ in heard)
    assert all(re.fullmatch(r"(starting a sandbox for the code \(\d+ s; the first run after the "
                            r"server starts also starts its kernels, ~10 s\)|running \(\d+ s\))",
                            message or "") for _, message in heard), heard
    assert heard[-1][1].startswith("running"), heard
