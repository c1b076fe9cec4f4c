"""`sandbox-kernel mcp --tools-from`: another MCP server's tools called from run_python's code.

The other server is a tiny one written here (the SDK's MCPServer), started by the sandbox's
MCP server over stdio with its environment, or reached over Streamable HTTP. One of its tools
reads a secret from its own environment: the sandbox never sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from sandbox_kernel.hosting.tools import Declared, render, stub_signature
from sandbox_kernel.mcp.bridge import Upstream
from tests.mcp_clients import SERVER, free_port, stdio

SECRET = "s3cret-weather-token-7f1c"
WEATHER = '''
import os, sys
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("weather")


@server.tool()
def forecast(city: str, days: int = 1) -> dict:
    """The forecast for a city: its temperature over the next days."""
    if os.environ.get("WEATHER_TOKEN") != SECRET_TOKEN:
        raise ValueError("unauthorized: no WEATHER_TOKEN")
    if not city:
        raise ToolError("no such city")
    return {"city": city, "days": days, "temp": len(city) * 3 + days}


@server.tool(name="shout-it")
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


def guarded(app, expected):
    """app refusing every HTTP request without the header `Authorization: <expected>`."""
    async def guard(scope, receive, send):
        if scope["type"] == "http" and \
                dict(scope["headers"]).get(b"authorization") != expected.encode():
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"no or wrong Authorization"})
            return
        await app(scope, receive, send)
    return guard


if len(sys.argv) > 1 and os.environ.get("WEATHER_BEARER"):
    import uvicorn
    uvicorn.run(guarded(server.streamable_http_app(), os.environ["WEATHER_BEARER"]),
                host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
elif len(sys.argv) > 1:
    server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
else:
    server.run("stdio")
'''.replace("SECRET_TOKEN", repr(SECRET))

CODE = """
import os
from sandbox_tools import weather__forecast, weather__shout_it, ToolError

def main(cities):
    temps = {city: weather__forecast(city, days=2)["temp"] for city in cities}
    try:
        weather__forecast("")
        failed = None
    except ToolError as exc:
        failed = str(exc)
    environment = repr(dict(os.environ))
    return {"temps": temps, "loud": weather__shout_it("hi"), "failed": failed,
            "secret_seen": SECRET_TOKEN in environment or "WEATHER_TOKEN" in environment}
""".replace("SECRET_TOKEN", repr(SECRET))


@pytest.fixture(scope="module")
def weather(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("weather") / "weather.py"
    path.write_text(WEATHER)
    return path


@pytest.fixture(scope="module")
def bridged(tmp_path_factory, weather):
    """A stdio sandbox MCP server whose environment holds the weather server's token."""
    os.environ["WEATHER_TOKEN"] = SECRET  # the operator's environment, the server's own
    try:
        client = stdio(tmp_path_factory.mktemp("bridge") / "server.log", "--tools-from",
                       f"weather={sys.executable} {weather}", "--tool-max-calls", "20")
    finally:
        del os.environ["WEATHER_TOKEN"]
    yield client
    client.close()


def run_python(mcp, **arguments):
    answer = mcp.tool("run_python", arguments)
    while answer.structured_content.get("status") == "running":
        answer = mcp.tool("wait_run", {"run": answer.structured_content["run"]})
    return answer


def check_distilled(answer, calls: int) -> None:
    assert not answer.is_error, answer.content
    content = answer.structured_content
    assert content["error"] is None, content["error"]
    result = content["result"]
    assert result["temps"] == {"Oslo": 14, "Lima": 14, "Rome": 14}
    assert result["loud"] == "HI"
    assert "no such city" in result["failed"]
    assert result["secret_seen"] is False
    assert content["usage"]["tool_calls"] == calls


def test_run_python_describes_the_bridged_tools_as_typed_stubs(bridged):
    listed = bridged.call(lambda c: c.list_tools())
    run_python = next(tool for tool in listed.tools if tool.name == "run_python")
    description = run_python.description
    assert "from sandbox_tools import" in description
    assert "def weather__forecast(city: str, days: int = 1) -> dict | list | str:" in description
    assert "The forecast for a city" in description
    assert "def weather__shout_it(text: str) -> str:" in description


def test_many_calls_in_one_run_return_only_what_the_code_distils(bridged):
    answer = run_python(bridged, code=CODE, inputs={"cities": ["Oslo", "Lima", "Rome"]})
    check_distilled(answer, calls=5)


def test_a_session_run_is_granted_them_too(bridged):
    session = bridged.tool("create_session").structured_content["session"]
    try:
        answer = run_python(bridged, code=CODE, inputs={"cities": ["Oslo", "Lima", "Rome"]},
                            session=session)
        check_distilled(answer, calls=5)
    finally:
        bridged.tool("close_session", {"session": session})


def test_the_runs_budget_is_the_operators(bridged):
    code = ("from sandbox_tools import weather__shout_it, ToolRefused\n"
            "def main():\n    n = 0\n    try:\n        for _ in range(50):\n"
            "            weather__shout_it('x'); n += 1\n"
            "    except ToolRefused as exc:\n        return {'n': n, 'why': str(exc)}\n")
    answer = run_python(bridged, code=code, inputs={})
    result = answer.structured_content["result"]
    assert result["n"] == 20 and "budget of 20" in result["why"], result


def test_print_tools_shows_the_stubs_as_the_model_sees_them(weather):
    env = {**os.environ, "WEATHER_TOKEN": SECRET}
    printed = subprocess.run(
        [*SERVER, "--print-tools", "mcp", "--tools-from", f"weather={sys.executable} {weather}"],
        capture_output=True, text=True, env=env, timeout=120, check=True)
    tools = {tool["name"]: tool for tool in json.loads(printed.stdout)}
    assert "def weather__forecast(city: str, days: int = 1) -> dict | list | str:" in \
        tools["run_python"]["description"]


def test_a_server_that_cannot_be_reached_stops_the_start_saying_which(tmp_path):
    printed = subprocess.run(
        [*SERVER, "--print-tools", "mcp", "--tools-from", "gone=/nonexistent/server --x"],
        capture_output=True, text=True, timeout=120)
    assert printed.returncode == 2, printed.stderr
    assert "--tools-from gone=/nonexistent/server --x" in printed.stderr


@pytest.mark.parametrize("flag", ["noequals", "1bad=cmd", "a__b=cmd", "x="])
def test_a_malformed_tools_from_is_refused(flag):
    printed = subprocess.run([*SERVER, "--print-tools", "mcp", "--tools-from", flag],
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 2 and "--tools-from" in printed.stderr


@contextlib.contextmanager
def upstream_http(tmp_path: Path, weather: Path, **env: str) -> Iterator[str]:
    """The weather server over Streamable HTTP (refusing requests without `Authorization:
    $WEATHER_BEARER` when env sets it); its URL while the block runs."""
    port = free_port()
    log = (tmp_path / "weather.log").open("w")
    upstream = subprocess.Popen([sys.executable, str(weather), str(port)],
                                env={**os.environ, "WEATHER_TOKEN": SECRET, **env},
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and upstream.poll() is None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        upstream.terminate()
        upstream.wait(30)
        log.close()


def test_the_streamable_http_variant(tmp_path, weather):
    with upstream_http(tmp_path, weather) as url:
        client = stdio(tmp_path / "server.log", "--tools-from", f"weather={url}")
        try:
            answer = run_python(client, code=CODE, inputs={"cities": ["Oslo", "Lima", "Rome"]})
            check_distilled(answer, calls=5)
        finally:
            client.close()


# --- --tools-header: a URL server's credentials from the host's environment ----------------

BEARER = "Bearer mcp-upstream-token-91b4e"  # the header's whole value
HEADER_FLAGS = ("--tools-header", "weather:Authorization=WEATHER_MCP_AUTH")
LEAKS = """
import os, pathlib

def main():
    seen = repr(dict(os.environ))
    for path in ("/proc/self/environ", "/proc/self/cmdline", f"/proc/{os.getppid()}/environ",
                 f"/proc/{os.getppid()}/cmdline"):
        try:
            seen += repr(pathlib.Path(path).read_bytes())
        except OSError as exc:
            seen += repr(exc)
    return {"token_seen": TOKEN in seen, "variable_seen": "WEATHER_MCP_AUTH" in seen}
""".replace("TOKEN", repr(BEARER.split()[1]))


def print_tools(url: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
    """`--print-tools mcp` with the weather server at url (it connects and lists its tools)."""
    return subprocess.run([*SERVER, "--print-tools", "mcp", "--tools-from", f"weather={url}",
                           *flags], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_a_url_server_that_wants_a_header_refuses_the_start_without_it(tmp_path, weather):
    wrong = "Bearer not-the-token-5d0c"
    with upstream_http(tmp_path, weather, WEATHER_BEARER=BEARER) as url:
        without = print_tools(url)
        mistaken = print_tools(url, *HEADER_FLAGS, WEATHER_MCP_AUTH=wrong)
    for printed in (without, mistaken):
        assert printed.returncode == 2, printed.stderr
        assert printed.stderr.startswith(f"sandbox-kernel mcp: --tools-from weather={url}: "
                                         "could not connect and list its tools: "), \
            printed.stderr
    assert without.stderr.endswith(" (it answered HTTP 401 Unauthorized: give its credentials "
                                   "with --tools-header weather:Header-Name=ENV_VAR)\n"), \
        without.stderr
    assert mistaken.stderr.endswith(" (it answered HTTP 401 Unauthorized: check the headers' "
                                    "values, from $WEATHER_MCP_AUTH)\n"), mistaken.stderr
    assert "not-the-token" not in mistaken.stdout + mistaken.stderr


def test_the_header_s_variable_unset_or_empty_stops_the_start_naming_it(weather):
    for env, state in (({}, "not set"), ({"WEATHER_MCP_AUTH": ""}, "empty")):
        os.environ.pop("WEATHER_MCP_AUTH", None)
        printed = print_tools("http://127.0.0.1:9/mcp", *HEADER_FLAGS, **env)
        assert printed.returncode == 2
        assert printed.stderr == (
            "sandbox-kernel mcp: --tools-header weather:Authorization=WEATHER_MCP_AUTH: the "
            f"environment variable WEATHER_MCP_AUTH is {state} (set it in this server's "
            "environment)\n")


@pytest.mark.parametrize(("flags", "said"), [
    (("--tools-header", "weather:Authorization"), "expected NAME:Header-Name=ENV_VAR"),
    (("--tools-header", "weather:Bad Header=X"), "expected NAME:Header-Name=ENV_VAR"),
    (("--tools-header", "other:Authorization=WEATHER_MCP_AUTH"),
     "no --tools-from is named other"),
])
def test_a_header_that_cannot_be_sent_is_refused(flags, said):
    printed = print_tools("http://127.0.0.1:9/mcp", *flags, WEATHER_MCP_AUTH=BEARER)
    assert printed.returncode == 2 and said in printed.stderr, printed.stderr


def test_a_header_for_a_command_server_is_refused(weather):
    printed = subprocess.run(
        [*SERVER, "--print-tools", "mcp", "--tools-from", f"weather={sys.executable} {weather}",
         *HEADER_FLAGS], capture_output=True, text=True, timeout=60,
        env={**os.environ, "WEATHER_MCP_AUTH": BEARER})
    assert printed.returncode == 2
    assert "weather is a command, which gets this server's environment itself: headers are " \
        "for URLs" in printed.stderr


def test_the_header_from_the_environment_reaches_the_server_and_nothing_else(tmp_path, weather):
    token = BEARER.split()[1]
    with upstream_http(tmp_path, weather, WEATHER_BEARER=BEARER) as url:
        printed = print_tools(url, *HEADER_FLAGS, WEATHER_MCP_AUTH=BEARER)
        assert printed.returncode == 0, printed.stderr
        assert "def weather__forecast(" in printed.stdout
        assert token not in printed.stdout + printed.stderr
        os.environ["WEATHER_MCP_AUTH"] = BEARER  # the operator's environment, the server's own
        try:
            client = stdio(tmp_path / "server.log", "--tools-from", f"weather={url}",
                           *HEADER_FLAGS)
        finally:
            del os.environ["WEATHER_MCP_AUTH"]
        try:
            answers = [run_python(client, code=CODE, inputs={"cities": ["Oslo", "Lima", "Rome"]})]
            check_distilled(answers[0], calls=5)
            session = client.tool("create_session").structured_content["session"]
            answers.append(run_python(client, code=LEAKS, inputs={}, session=session))
            answers.append(run_python(client, code=LEAKS, inputs={}))  # a fresh kernel
            client.tool("close_session", {"session": session})
        finally:
            client.close()
    for answer in answers[1:]:
        assert answer.structured_content["result"] == \
            {"token_seen": False, "variable_seen": False}, answer.structured_content
    said = json.dumps([answer.structured_content for answer in answers]) + \
        (tmp_path / "server.log").read_text()
    assert token not in said


def test_the_logs_and_errors_show_the_variable_not_the_value():
    from sandbox_kernel.mcp.bridge import Header, Redacting, with_headers

    [upstream] = with_headers(
        [Upstream.parse("api=https://example.test/mcp")],
        [Header.parse("api:X-Api-Key=API_KEY")], {"API_KEY": "k-123456"})
    assert "k-123456" not in repr(upstream)
    assert upstream.redact("refused k-123456!") == "refused [redacted $API_KEY]!"
    record = logging.LogRecord("httpx", logging.INFO, __file__, 1, "sent %s", ("k-123456",),
                               None)
    formatted = Redacting(logging.Formatter("%(message)s"), [upstream]).format(record)
    assert formatted == "sent [redacted $API_KEY]"


# --- the stubs, from JSON schemas (hosting/tools.py) ---------------------------------------


def test_a_schema_becomes_a_typed_signature_required_first():
    schema = {"type": "object", "properties": {
        "limit": {"type": "integer", "default": 10}, "query": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "exact": {"type": ["boolean", "null"]}, "score": {"type": "number"},
        "filters": {"type": "object"}, "any": {}}, "required": ["query", "score"]}
    assert render(stub_signature(schema, "dict")) == (
        "(query: str, score: float, limit: int = 10, tags: list[str] | None = None, "
        "exact: bool | None = None, filters: dict | None = None, any=None) -> dict")
    stub = Declared("find", 'Find "it".\nSecond line.', schema, "dict").stub_text()
    assert stub.startswith("def find(query: str, score: float, limit: int = 10, ")
    assert stub.endswith('-> dict:\n    """\n    Find "it".\n    Second line.\n    """')


def test_odd_property_names_are_still_reachable_as_keywords():
    sig = stub_signature({"properties": {"x-y": {"type": "string"}, "ok": {}}})
    assert list(sig.parameters) == ["ok", "kwargs"]


def test_a_declared_callable_sends_only_what_was_given():
    asyncio.run(_sends_only_what_was_given())


async def _sends_only_what_was_given():
    sent = []

    async def send(arguments):
        sent.append(arguments)
        return "ok"

    tool = Declared("search", "Search it.", {"properties": {
        "q": {"type": "string"}, "n": {"type": "integer"}, "x-y": {}}, "required": ["q"]}
    ).callable_for(send)
    assert await tool("chairs") == "ok"
    await tool("chairs", n=None, **{"x-y": 1})
    assert sent == [{"q": "chairs"}, {"q": "chairs", "x-y": 1}]
    assert tool.__doc__ == "Search it."
    with pytest.raises(TypeError):
        await tool()
