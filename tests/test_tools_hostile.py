"""The tool bridge tried as an attacker: user code forges its own tool messages.

Code in the kernel holds the kernel's session and channels, so it can send any
`sandbox_tool_request` it likes on the transport the bridge uses (the stdin channel of a ZMQ
kernel, the one-shot's connection). Each case forges one kind of request from inside a real
sandboxed kernel of each transport, reads what the caller answered, and the test checks both
the answer and what the host ran: only the tools of the run's grant, only with JSON, within
the caller's caps and budget. The caller never parses anything but JSON.
"""

from __future__ import annotations

import json
import pickle

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.client.tools import MAX_RECORDS_BEYOND_BUDGET, ToolLimits
from sandbox_kernel.policy import SandboxPolicy

# In the kernel: send forged requests on the bridge's own transport, collect the answers.
FORGE = """
import json, time
kernel = get_ipython().kernel
transport = kernel.tool_transport()

def forge(content, parent=None, msg_id=None, buffers=None):
    msg = kernel.session.msg("sandbox_tool_request", content, parent or kernel.get_parent())
    if msg_id:
        msg["header"]["msg_id"] = msg_id
    if buffers:
        msg["buffers"] = buffers
    transport.send(msg)
    return msg["header"]["msg_id"]

def answers(expected, wait=10.0):
    got, end = {}, time.monotonic() + wait
    while time.monotonic() < end and sum(map(len, got.values())) < expected:
        for reply in transport.receive(0.1):
            got.setdefault(reply["parent_header"]["msg_id"], []).append(reply["content"])
    return got
"""


class Ran(list):
    """(tool, args, kwargs) of every call a host tool ran."""


@pytest.fixture(scope="module")
def ran():
    return Ran()


@pytest.fixture(scope="module", params=["zmq", "one-shot"])
def sb(request, ran):
    def recorded(name):
        def tool(*args, **kwargs):
            ran.append((name, args, kwargs))
            return name
        return tool

    with Sandbox(None, policy=SandboxPolicy(), one_shot=request.param == "one-shot",
                 tools={"secret": recorded("secret"), "search": recorded("search")},
                 tool_limits=ToolLimits(max_args=1000)) as sandbox:
        sandbox.grant_search = {"search": recorded("search")}  # what each run grants
        yield sandbox


@pytest.fixture(autouse=True)
def _forget(ran):
    ran.clear()


def forged(sb, body):
    """Run FORGE + body granting only `search`; the printed JSON, and the Execution."""
    ex = sb.run(FORGE + body, tools=sb.grant_search, timeout=60)
    assert ex.error is None, (ex.error, ex.stderr)
    return json.loads(ex.stdout.strip().splitlines()[-1]), ex


def test_a_tool_outside_the_runs_grant_is_refused_and_never_runs(sb, ran):
    out, ex = forged(sb, "i = forge({'tool': 'secret', 'args': [], 'kwargs': {}})\n"
                         "print(json.dumps(answers(1)[i]))")
    assert out == [{"status": "error", "kind": "refused",
                    "evalue": "no tool named 'secret' was granted to this run; granted: search"}]
    assert ran == []  # the sandbox's registry has it; this run did not grant it
    assert [(c.tool, c.outcome) for c in ex.tool_calls] == [("secret", "refused")]


def test_a_request_with_a_parent_other_than_the_run_is_dropped(sb, ran):
    out, ex = forged(sb, "fake = {'header': {'msg_id': 'an-earlier-run'}}\n"
                         "forge({'tool': 'search', 'args': [], 'kwargs': {}}, parent=fake)\n"
                         "print(json.dumps(answers(1, wait=1.0)))")
    assert out == {}  # no answer: the caller serves only this run's requests
    assert ran == [] and ex.tool_calls == [] and ex.usage.tool_calls == 0


def test_malformed_requests_are_refused_and_arguments_stay_data(sb, ran):
    out, _ = forged(sb, "ids = [forge({'tool': 'search', 'args': 'x', 'kwargs': {}}),\n"
                        "       forge(b'[\"search\"]'),\n"
                        "       forge({'tool': 'search', 'args': [{'__class__': 'os.system',"
                        " 'py/object': 'os.system'}], 'kwargs': {}})]\n"
                        "got = answers(3)\nprint(json.dumps([got[i] for i in ids]))")
    malformed = {"status": "error", "kind": "refused", "evalue":
                 'a call that is not {"tool": name, "args": [...], "kwargs": {...}}'}
    assert out == [[malformed], [malformed], [{"status": "ok", "result": "search"}]]
    assert ran == [("search", ({"__class__": "os.system", "py/object": "os.system"},), {})]


class _Planted:
    """Unpickling this creates a file: proof the host unpickled what the kernel sent."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_host_deserializes_nothing_but_json(sb, ran, tmp_path):
    planted = tmp_path / "unpickled"
    blob = pickle.dumps(_Planted(str(planted)))
    out, _ = forged(sb, f"i = forge({blob!r})\n"  # the content frame: a pickle, not JSON
                         "print(json.dumps(answers(1)[i]))")
    assert out == [{"status": "error", "kind": "refused",
                    "evalue": "a call whose content is not JSON"}]
    assert not planted.exists() and ran == []


def test_binary_buffers_are_refused(sb, ran):
    out, _ = forged(sb, "i = forge({'tool': 'search', 'args': [], 'kwargs': {}}, "
                        "buffers=[b'\\x80\\x04binary'])\nprint(json.dumps(answers(1)[i]))")
    assert out == [{"status": "error", "kind": "refused",
                    "evalue": "a tool call carries JSON only, no binary buffers"}]
    assert ran == []


def test_an_oversized_request_is_refused_before_it_is_parsed(sb, ran):
    out, ex = forged(sb, "i = forge({'tool': 'search', 'args': ['x' * 20000], 'kwargs': {}})\n"
                         "print(json.dumps(answers(1)[i]))")
    size = ex.tool_calls[0].args_bytes
    assert size > 20000
    assert out == [{"status": "error", "kind": "refused", "evalue":
                    f"a call of {size:,} bytes, more than the 1,000 bytes of arguments a call "
                    "may send"}]
    assert ran == [] and ex.tool_calls[0].tool == ""  # refused unparsed: no name known


def test_a_replayed_request_runs_once(sb, ran):
    out, _ = forged(sb, "i = forge({'tool': 'search', 'args': [1], 'kwargs': {}})\n"
                        "forge({'tool': 'search', 'args': [1], 'kwargs': {}}, msg_id=i)\n"
                        "print(json.dumps(answers(2)[i]))")
    assert sorted(out, key=json.dumps) == sorted([
        {"status": "ok", "result": "search"},
        {"status": "error", "kind": "refused",
         "evalue": "a call id that was already used (a replayed request)"}], key=json.dumps)
    assert ran == [("search", (1,), {})]


def test_a_flood_of_requests_spends_the_budget_and_no_more(sb, ran):
    limits = sb.toolbox.limits
    sb.toolbox.limits = ToolLimits(max_calls=5, max_args=1000)
    try:
        out, ex = forged(sb, "ids = [forge({'tool': 'search', 'args': [n], 'kwargs': {}})"
                             " for n in range(300)]\n"
                             "got = answers(300, wait=60)\n"
                             "print(json.dumps([got[i][0]['status'] for i in ids]))")
    finally:
        sb.toolbox.limits = limits
    assert out == ["ok"] * 5 + ["error"] * 295
    assert sorted(args for _, args, _ in ran) == [(n,) for n in range(5)]
    assert ex.usage.tool_calls == 300
    assert len(ex.tool_calls) == 5 + MAX_RECORDS_BEYOND_BUDGET  # the audit is bounded too
    assert {c.message for c in ex.tool_calls[5:]} == {
        "this run's budget of 5 tool calls is spent"}


def test_a_request_forged_for_a_run_that_has_ended_is_dropped(sb, ran):
    # The first run keeps its own parent header (a one-shot's is printed: its process ends
    # with the run); a later run, granting the same tool, sends a request under it.
    first, _ = forged(sb, "print(json.dumps(kernel.get_parent()['header'], default=str))")
    out, ex = forged(sb, f"old = {{'header': {first!r}}}\n"
                         "forge({'tool': 'search', 'args': ['late'], 'kwargs': {}}, parent=old)\n"
                         "print(json.dumps(answers(1, wait=1.0)))")
    assert out == {}  # the ended run is served no more, and this run does not take it as its own
    assert ran == [] and ex.tool_calls == [] and ex.usage.tool_calls == 0


@pytest.mark.parametrize("transport", ["zmq", "one-shot"])
def test_a_request_forged_past_the_callers_message_cap_harms_neither_side(transport, ran):
    # The kernel refuses an honest call this large (test_tools.py); forged past that check, the
    # caller's connection refuses it before it is allocated (1,049,576 bytes a message here).
    def size(value):
        ran.append(("size", (len(value),), {}))
        return len(value)

    with Sandbox(None, policy=SandboxPolicy(), one_shot=transport == "one-shot",
                 max_output=1000, max_result=1000, tools={"size": size}) as sb:
        ex = sb.run(FORGE + "kept = 'state'\nimport os\npid = os.getpid()\n"
                    "forge({'tool': 'size', 'args': ['y' * 3_000_000], 'kwargs': {}})\n"
                    "print(json.dumps(answers(1, wait=1.0)))", timeout=60)
        if transport == "zmq":  # nothing answers it; the stdin channel was dropped
            assert ex.error is None and ex.stdout == "{}\n", (ex.error, ex.stderr)
        else:  # the one-shot's connection refused the record: its run is lost
            assert ex.error.name == "MessageTooLarge", ex.error
        assert ran == []
        # The next run's tools work (a ZMQ sandbox connected its stdin channel again), on the
        # same kernel with its state for ZMQ.
        ex = sb.run("import os\nfrom sandbox_tools import size\n"
                    "print(size('y' * 30), globals().get('kept'), os.getpid() == "
                    "globals().get('pid'))", timeout=60)
        assert ex.error is None, (ex.error, ex.stderr)
        assert ex.stdout == ("30 state True\n" if transport == "zmq" else "30 None False\n")
        assert ran == [("size", (30,), {})]
