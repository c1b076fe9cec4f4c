"""The tool bridge (client/tools.py, kernel/tools.py): the caller's tools, called from sandboxed
code as data, on a ZMQ kernel and on a one-shot kernel alike.

Every test runs real code in a real sandboxed kernel of each transport. The tools record each
call they run on the host, so a test can say exactly what ran.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from sandbox_kernel.client import AsyncSandbox, Sandbox
from sandbox_kernel.client.tools import Toolbox, ToolLimits
from sandbox_kernel.policy import SandboxPolicy

TRANSPORTS = ["zmq", "one-shot"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def sb(request):
    with Sandbox(None, policy=SandboxPolicy(), one_shot=request.param == "one-shot") as sandbox:
        yield sandbox


class Ran(list):
    """What the host's tools ran: (tool, args, kwargs), in order."""


@pytest.fixture
def ran():
    return Ran()


def grant(sb, tools, **kwargs):
    """Give the module's sandbox these tools (and limits, hook) for one test."""
    sb.toolbox = Toolbox(tools, **kwargs)


@pytest.fixture(autouse=True)
def _no_tools_after(request):
    yield
    if "sb" in request.fixturenames:
        grant(request.getfixturevalue("sb"), {})


def recorded(ran, name):
    def tool(*args, **kwargs):
        ran.append((name, args, kwargs))
        return {"tool": name, "args": list(args), "kwargs": kwargs}
    return tool


def search(query: str, limit: int = 5, *, exact: bool = False) -> list:
    """Search the catalogue for `query`; at most `limit` hits."""
    return [f"{query}-{i}" for i in range(limit)] if not exact else [query]


def _ok(ex):
    assert ex.error is None, (ex.error, ex.stderr)
    return ex.stdout


# --- what code in the kernel sees --------------------------------------------------------------


def test_tools_have_their_names_signatures_and_docstrings(sb):
    marker = object()

    def with_host_default(x: int, opts=marker) -> dict:
        """Takes a default that is not JSON: it stays on the host."""
        return {"x": x, "host_default_used": opts is marker}

    grant(sb, {"search": search, "with_host_default": with_host_default})
    out = _ok(sb.run(
        "import inspect, sandbox_tools\n"
        "from sandbox_tools import search, with_host_default\n"
        "print(inspect.signature(search))\n"
        "print(search.__doc__)\n"
        "print(search.__module__, search.__name__, sandbox_tools.__all__)\n"
        "print(inspect.signature(with_host_default))\n"
        "print(with_host_default(3))\n"
        "help(search)\n"))
    lines = out.splitlines()
    assert lines[0] == "(query: str, limit: int = 5, *, exact: bool = False) -> list"
    assert lines[1] == "Search the catalogue for `query`; at most `limit` hits."
    assert lines[2] == "sandbox_tools search ['search', 'with_host_default']"
    assert lines[3] == "(x: int, opts=<default on the host>) -> dict"
    assert lines[4] == "{'x': 3, 'host_default_used': True}"
    assert "search(query: str, limit: int = 5, *, exact: bool = False) -> list" in out


def test_a_call_returns_the_tools_json_result(sb):
    grant(sb, {"search": search})
    ex = sb.run("from sandbox_tools import search\n"
                "def main(q):\n    return {'hits': search(q, 2), 'exact': search(q, exact=True)}",
                inputs={"q": "chair"})
    assert ex.error is None
    assert ex.result == {"hits": ["chair-0", "chair-1"], "exact": ["chair"]}
    assert [(c.tool, c.outcome) for c in ex.tool_calls] == [("search", "ok")] * 2
    assert ex.usage.tool_calls == 2 and ex.usage.tool_seconds >= 0
    assert ex.tool_calls[0].args_bytes > 0 and ex.tool_calls[0].result_bytes == \
        len(b'["chair-0","chair-1"]')
    assert ex.tool_calls[0].arguments is None and ex.tool_calls[0].result is None  # no payload


def test_payloads_are_audited_only_when_asked(sb):
    grant(sb, {"search": search}, audit_payloads=True)
    ex = sb.run("from sandbox_tools import search\nsearch('a', 1)")
    assert ex.tool_calls[0].arguments == {"args": ["a", 1], "kwargs": {}}
    assert ex.tool_calls[0].result == ["a-0"]


def test_the_tools_error_is_its_type_and_message_without_the_hosts_traceback(sb):
    def failing(x):
        raise ValueError(f"no such item: {x}")

    grant(sb, {"failing": failing})
    out = _ok(sb.run(
        "import sandbox_tools\n"
        "try:\n    sandbox_tools.failing(7)\n"
        "except sandbox_tools.ToolError as e:\n"
        "    print(type(e).__name__, '|', e, '|', e.tool, e.ename, e.evalue)\n"
        "    import traceback; print(''.join(traceback.format_exception(e)))\n"))
    first = out.splitlines()[0]
    assert first == "ToolError | failing(): ValueError: no such item: 7 | failing ValueError " \
        "no such item: 7"
    assert __file__ not in out and "test_tools" not in out  # nothing of the host's frames
    ex = sb.run("import sandbox_tools\nsandbox_tools.failing(1)")
    assert (ex.error.name, ex.error.value) == ("ToolError", "failing(): ValueError: no such "
                                                            "item: 1")


def test_a_tool_not_granted_raises_with_the_names_that_were(sb, ran):
    grant(sb, {"search": search, "fetch": recorded(ran, "fetch")})
    ex = sb.run("from sandbox_tools import delete_everything")
    assert ex.error.name == "ToolNotGranted"
    assert ex.error.value == "no tool named 'delete_everything' was granted to this run; " \
        "granted: search, fetch"
    ex = sb.run("import sandbox_tools\nsandbox_tools.fetch(1)", tools={"search": search})
    assert ex.error.value == "no tool named 'fetch' was granted to this run; granted: search"
    assert ran == []
    grant(sb, {})
    ex = sb.run("from sandbox_tools import search")
    assert ex.error.name == "ToolNotGranted"
    assert "none was granted to this run" in ex.error.value


def test_arguments_and_results_must_be_json(sb):
    grant(sb, {"echo": lambda value: value, "makes_a_set": lambda: {1, 2}})
    ex = sb.run("from sandbox_tools import echo\necho({1, 2})")
    assert (ex.error.name, ex.error.value) == (
        "TypeError", "echo(): the arguments of a tool call must be JSON; arguments[\"args\"][0]: "
        "set")
    ex = sb.run("from sandbox_tools import makes_a_set\nmakes_a_set()")
    assert (ex.error.name, ex.error.value) == (
        "ToolError", "makes_a_set(): ToolResultError: the tool returned what is not JSON: "
        "result: set")
    ex = sb.run("from sandbox_tools import echo\necho(1, 2)")
    assert (ex.error.name, ex.error.value) == (
        "TypeError", "echo(): too many positional arguments")


def test_sizes_are_capped_both_ways(sb):
    grant(sb, {"echo": lambda value: value, "big": lambda: "x" * 5000},
          limits=ToolLimits(max_args=1000, max_result=1000))
    ex = sb.run("from sandbox_tools import echo\necho('y' * 2000)")
    assert ex.error.name == "ToolRefused"
    assert "more than the 1,000 a call may send" in ex.error.value
    ex = sb.run("from sandbox_tools import big\nbig()")
    assert (ex.error.name, ex.error.value) == (
        "ToolError", "big(): ToolResultError: the tool's result is 5,002 bytes of JSON, more "
        "than the 1,000 a call may return")


def test_a_run_has_a_call_budget(sb, ran):
    grant(sb, {"f": recorded(ran, "f")}, limits=ToolLimits(max_calls=3))
    ex = sb.run("from sandbox_tools import f\nfor i in range(4):\n    f(i)")
    assert (ex.error.name, ex.error.value) == (
        "ToolRefused", "f(): this run's budget of 3 tool calls is spent")
    assert [args for _, args, _ in ran] == [(0,), (1,), (2,)]


def test_the_approval_hook_refuses_before_the_tool_runs(sb, ran):
    def approve(name, arguments):
        return True if arguments["args"] == ["ok"] else "writes need a human's approval"

    grant(sb, {"write": recorded(ran, "write")}, approve=approve)
    ex = sb.run("from sandbox_tools import write\nprint(write('ok')['args'])\nwrite('rm')")
    assert ex.stdout == "['ok']\n"
    assert (ex.error.name, ex.error.value) == (
        "ToolRefused", "write(): writes need a human's approval")
    assert ran == [("write", ("ok",), {})]
    assert [c.outcome for c in ex.tool_calls] == ["ok", "refused"]


def test_a_call_has_a_timeout(sb):
    grant(sb, {"slow": lambda: time.sleep(3)}, limits=ToolLimits(timeout=0.5))
    ex = sb.run("from sandbox_tools import slow\nslow()")
    assert (ex.error.name, ex.error.value) == ("ToolTimeout", "slow(): no answer within 0.5 s")
    assert ex.tool_calls[0].outcome == "timeout"


def test_a_call_in_flight_when_the_run_times_out_ends_on_both_sides(sb):
    release = threading.Event()
    grant(sb, {"hang": lambda: release.wait(30)})
    ex = sb.run("from sandbox_tools import hang\nhang()", timeout=1)
    release.set()
    assert ex.error.name == "ExecutionTimeout"
    assert [c.outcome for c in ex.tool_calls] == ["abandoned"]
    assert _ok(sb.run("print('still here')")) == "still here\n"


def test_concurrent_calls_are_answered_in_any_order(sb):
    acked = threading.Event()

    def first():  # answered only after a later call: the two were in flight together
        assert acked.wait(20), "the calls were not concurrent"
        return "first"

    grant(sb, {"first": first, "second": lambda: "second", "ack": acked.set})
    out = _ok(sb.run(
        "import threading\nfrom sandbox_tools import first, second, ack\n"
        "done = []\n"
        "t = threading.Thread(target=lambda: done.append(first()))\nt.start()\n"
        "done.append(second())\nack()\nt.join()\nprint(done)\n"))
    assert out == "['second', 'first']\n"


def test_asyncio_code_awaits_tools(sb):
    async def lookup(key: str) -> str:
        await asyncio.sleep(0.01)
        return key.upper()

    grant(sb, {"lookup": lookup})
    out = _ok(sb.run(
        "import asyncio\nfrom sandbox_tools import lookup\n"
        "async def both():\n"
        "    return await asyncio.gather(lookup.acall('a'), lookup.acall('b'))\n"
        "import threading\nout = []\n"  # a loop of its own (a ZMQ kernel's cell has one)
        "t = threading.Thread(target=lambda: out.append(asyncio.run(both())))\n"
        "t.start()\nt.join()\nprint(out[0])\n"))
    assert out == "['A', 'B']\n"


def test_a_tool_may_not_call_back_into_its_sandbox(sb):
    def reenter():
        return sb.run("1").to_dict()

    grant(sb, {"reenter": reenter})
    ex = sb.run("from sandbox_tools import reenter\nreenter()", timeout=20)
    assert (ex.error.name, ex.error.value) == (
        "ToolError", "reenter(): RuntimeError: a tool may not call back into the sandbox that "
        "is running it (that run waits for the tool): use another Sandbox")


def test_a_stub_kept_past_its_run_refuses():
    with Sandbox(None, tools={"search": search}) as sb:  # state persists: a ZMQ kernel
        _ok(sb.run("from sandbox_tools import search as kept"))
        ex = sb.run("kept('x')")
        assert (ex.error.name, ex.error.value) == (
            "ToolRefused", "search(): the run this tool was granted to has ended (a tool is "
            "called during its own run)")


def test_async_tools_on_a_blocking_sandbox_get_a_loop_of_their_own(sb):
    async def sleepy() -> str:
        await asyncio.sleep(0.01)  # needs a running loop: the blocking caller has none
        return "slept"

    grant(sb, {"sleepy": sleepy})
    assert _ok(sb.run("from sandbox_tools import sleepy\nprint(sleepy())")) == "slept\n"


def test_async_sandbox_runs_sync_tools_off_its_loop():
    async def scenario():
        loop_thread = threading.current_thread().name

        def where() -> str:
            return threading.current_thread().name

        async def reenter() -> str:
            await sb.run("1")
            return "ran"

        async with AsyncSandbox(None, tools={"where": where, "reenter": reenter}) as sb:
            ex = await sb.run("from sandbox_tools import where, reenter\nprint(where())\n"
                              "reenter()")
            return loop_thread, ex

    loop_thread, ex = asyncio.run(scenario())
    assert ex.stdout.strip() not in ("", loop_thread)
    assert (ex.error.name, ex.error.value) == (
        "ToolError", "reenter(): RuntimeError: a tool may not call back into the sandbox that "
        "is running it (that run waits for the tool): use another Sandbox")


def test_async_sandbox_one_shot_serves_tools():
    async def scenario():
        async with AsyncSandbox(None, one_shot=True, tools={"search": search}) as sb:
            return await sb.run("from sandbox_tools import search\nprint(search('z', 1))")

    assert _ok(asyncio.run(scenario())) == "['z-0']\n"


def test_reserved_and_private_names_are_refused_at_once():
    for name in ("ToolError", "_private", "not a name", "class"):
        with pytest.raises(ValueError, match="not a tool name"):
            Toolbox({name: search})
