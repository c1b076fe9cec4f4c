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


# --- what the bridge must survive: a cap, an interrupt, a stock client, a tool's error ---------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_call_larger_than_the_callers_message_cap_fails_in_the_kernel_at_once(transport):
    # The caller's connection takes 1,049,576 bytes a message (1,000 of output or result plus
    # MESSAGE_ROOM); its tools' own cap is off. A larger request would have the connection
    # refuse it (a ZMQ stdin channel dropped for good, a one-shot run lost): the grant says so.
    sizes = []
    with Sandbox(None, policy=SandboxPolicy(), one_shot=transport == "one-shot",
                 max_output=1000, max_result=1000, tools={"size": lambda v: sizes.append(
                     len(v)) or len(v)}, tool_limits=ToolLimits(max_args=0)) as sb:
        assert sb.limits.max_message == 1_049_576
        started = time.monotonic()
        ex = sb.run("import os\nfrom sandbox_tools import size\nkernel = os.getpid()\n"
                    "size('y' * 3_000_000)", timeout=60)
        assert time.monotonic() - started < 10  # at once: no timeout waited for
        assert (ex.error.name, ex.error.value) == (
            "ToolRefused", "size(): 3,000,025 bytes of arguments, more than the 1,045,480 a "
                           "call may send")
        assert ex.tool_calls == [] and sizes == []  # refused in the kernel: nothing was sent
        # Just under the cap crosses (the grant is not tighter than the connection), and the
        # client's channel, the kernel (on ZMQ, the same one with its state) and the tools
        # all still work.
        ex = sb.run("import os\nfrom sandbox_tools import size\n"
                    "print(size('y' * 1_045_400), os.getpid() == globals().get('kernel'))",
                    timeout=60)
        assert _ok(ex) == f"1045400 {transport == 'zmq'}\n"
        assert [c.outcome for c in ex.tool_calls] == ["ok"] and sizes == [1_045_400]


def _traceback(ex) -> str:
    return "\n".join(ex.error.traceback)


def test_a_tools_error_shows_the_users_frames_and_none_of_the_bridges(sb):
    def failing(x):
        raise ValueError(f"no such item: {x}")

    grant(sb, {"failing": failing})
    cell = sb.run("import sandbox_tools\ndef lookup():\n    return sandbox_tools.failing(7)\n"
                  "lookup()")
    main = sb.run("import sandbox_tools\ndef main():\n    return {'x': sandbox_tools.failing(8)}",
                  inputs={})
    refused = sb.run("from sandbox_tools import delete_everything")
    for ex, value, line in (
            (cell, "failing(): ValueError: no such item: 7", "return sandbox_tools.failing(7)"),
            (main, "failing(): ValueError: no such item: 8", "sandbox_tools.failing(8)"),
            (refused, "no tool named 'delete_everything' was granted to this run; granted: "
                      "failing", "from sandbox_tools import delete_everything")):
        text = _traceback(ex)
        assert (ex.error.name, ex.error.value) == (value.split(" ")[0] and ex.error.name, value)
        assert line in text and text.rstrip().endswith(f"{ex.error.name}: {value}"), text
        # No frame of the bridge (kernel/tools.py), nor IPython's note of hidden ones.
        assert "tools.py" not in text and "hidden" not in text, text
    assert [cell.error.name, main.error.name, refused.error.name] == [
        "ToolError", "ToolError", "ToolNotGranted"]


def test_an_interrupt_ends_a_call_in_flight_on_both_sides_and_no_stale_reply_is_taken(sb):
    entered, release = threading.Event(), threading.Event()

    def hang() -> str:
        entered.set()
        release.wait(30)
        return "stale"  # computed after its run ended: must reach no later call

    def fresh() -> str:
        release.set()  # the interrupted call's answer is made now, during this run's call
        time.sleep(0.5)
        return "fresh"

    grant(sb, {"hang": hang, "fresh": fresh})
    box = {}
    runner = threading.Thread(target=lambda: box.update(ex=sb.run(
        "from sandbox_tools import hang\nhang()", timeout=60)))
    runner.start()
    assert entered.wait(30)
    started = time.monotonic()
    sb.interrupt()
    runner.join(30)
    interrupted = box["ex"]
    assert time.monotonic() - started < 5  # ended by the interrupt, not the call's timeout
    assert interrupted.error.name == "KeyboardInterrupt", interrupted.error
    assert [(c.tool, c.outcome) for c in interrupted.tool_calls] == [("hang", "abandoned")]
    ex = sb.run("from sandbox_tools import fresh, hang\nprint(fresh())\nprint(fresh())",
                timeout=60)
    assert _ok(ex) == "fresh\nfresh\n"
    assert [(c.tool, c.outcome) for c in ex.tool_calls] == [("fresh", "ok")] * 2


def test_a_stock_jupyter_client_calling_a_tool_fails_at_once(kernelspecs):
    """jupyter_client's own BlockingKernelClient: no stdin channel, allow_stdin false."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="sandbox")
    km.start_kernel()
    kc = km.client()
    kc.start_channels(shell=True, iopub=True, stdin=False,  # noqa: S604 (channels, no shell)
                      hb=False, control=False)
    try:
        kc.wait_for_ready(timeout=60)

        def execute(code, metadata=None):
            msg = kc.session.msg("execute_request", {
                "code": code, "silent": False, "store_history": True, "user_expressions": {},
                "allow_stdin": False, "stop_on_error": False},  # the next one not aborted
                metadata=metadata or {})
            kc.shell_channel.send(msg)
            started = time.monotonic()
            while (reply := kc.get_shell_msg(timeout=60))["parent_header"].get(
                    "msg_id") != msg["header"]["msg_id"]:
                pass
            return reply["content"], time.monotonic() - started

        # Granting none (every stock client): the import, or a call through the module.
        for code in ("from sandbox_tools import search", "import sandbox_tools\n"
                                                         "sandbox_tools.search('chairs')"):
            reply, seconds = execute(code)
            assert (reply["ename"], reply["evalue"]) == (
                "ToolNotGranted", "no tool named 'search' was granted to this run; none was "
                "granted to this run (its client serves no tools: see docs/tools.md)")
            assert seconds < 5
        # A client that grants a tool but never opens its stdin channel: at once too (the
        # channel is given tools.CONNECT_WAIT, 2 s, to connect), not at the call's 30 s.
        grant_only = {"sandbox": {"tools": Toolbox({"search": search}).metadata()}}
        reply, seconds = execute("from sandbox_tools import search\nsearch('chairs')",
                                 grant_only)
        assert reply["ename"] == "ToolUnavailable" and "no client serves tools on this " \
            "kernel's stdin channel" in reply["evalue"], reply
        assert seconds < 10
        reply, _ = execute("print('alive')")
        assert reply["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
