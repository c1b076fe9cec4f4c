"""`sandbox-kernel mcp --tools-from`: another MCP server's tools called from run_python's code.

The other server is a tiny one written here (the SDK's MCPServer), started by the sandbox's
MCP server over stdio with its environment, or reached over Streamable HTTP. One of its tools
reads a secret from its own environment: the sandbox never sees it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from sandbox_kernel.hosting.tools import Declared, render, stub_signature
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


if len(sys.argv) > 1:
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


def test_the_streamable_http_variant(tmp_path, weather):
    port = free_port()
    env = {**os.environ, "WEATHER_TOKEN": SECRET}
    log = (tmp_path / "weather.log").open("w")
    upstream = subprocess.Popen([sys.executable, str(weather), str(port)], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        import socket
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and upstream.poll() is None
                time.sleep(0.1)
        client = stdio(tmp_path / "server.log", "--tools-from",
                       f"weather=http://127.0.0.1:{port}/mcp")
        try:
            answer = run_python(client, code=CODE, inputs={"cities": ["Oslo", "Lima", "Rome"]})
            check_distilled(answer, calls=5)
        finally:
            client.close()
    finally:
        upstream.terminate()
        upstream.wait(30)


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
