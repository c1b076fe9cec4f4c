"""The main() convention, as a gateway client sends it (raw messages), through the client, in
notebooks (%main, nbclient) and in every error case."""

import json
import threading

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import ok

SUMMARY = """
import sys
def main(numbers, label="n"):
    print(f"summing {label}")
    print("to stderr", file=sys.stderr)
    return {"label": label, "total": sum(numbers), "pair": (1, 2.5), "none": None}
"the code's own last value, never displayed"
"""
SUMMARY_RESULT = {"label": "xs", "total": 6, "pair": [1, 2.5], "none": None}


@pytest.fixture(autouse=True)
def no_main_left(sandbox):
    """Each test defines its own main; none survives into the next test."""
    yield
    ok(sandbox.run("for _name in ('main', 'handler', 'helper'):\n    globals().pop(_name, None)"))


def raw_execute(client, code, sandbox_metadata, timeout=30):
    """Send an execute_request the way a gateway client does; (IOPub messages, execute_reply)."""
    msg = client.session.msg("execute_request", {
        "code": code, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": False, "stop_on_error": True})
    msg["metadata"]["sandbox"] = sandbox_metadata
    client.shell_channel.send(msg)
    msg_id = msg["header"]["msg_id"]
    published = []
    while True:
        reply = client.get_iopub_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") != msg_id:
            continue
        if reply["msg_type"] == "status":
            if reply["content"]["execution_state"] == "idle":
                break
            continue
        published.append(reply)
    while True:  # the client's earlier runs leave their execute_replies unread
        reply = client.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return [m for m in published if m["msg_type"] != "execute_input"], reply


def kinds(messages):
    return [m["msg_type"] for m in messages]


# --- the result ------------------------------------------------------------------------------

def test_raw_request_gives_one_result_apart_from_the_logs(sandbox):
    published, reply = raw_execute(sandbox.client, SUMMARY,
                                   {"entrypoint": "main", "inputs": {"numbers": [1, 2, 3],
                                                                     "label": "xs"}})
    assert reply["content"]["status"] == "ok"
    assert kinds(published) == ["stream", "stream", "execute_result"]
    streams = [(m["content"]["name"], m["content"]["text"]) for m in published[:2]]
    assert streams == [("stdout", "summing xs\n"), ("stderr", "to stderr\n")]
    result = published[2]["content"]
    assert result["data"] == {"application/json": SUMMARY_RESULT,
                              "text/plain": json.dumps(SUMMARY_RESULT, indent=2)}
    assert result["metadata"] == {"sandbox": {"entrypoint": "main"}}
    assert result["execution_count"] == reply["content"]["execution_count"]


def test_entrypoint_defaults_to_main_and_inputs_to_nothing(sandbox):
    published, _ = raw_execute(sandbox.client, "def main():\n    return {'called': True}",
                               {"entrypoint": "main"})
    assert kinds(published) == ["execute_result"]
    assert published[0]["content"]["data"]["application/json"] == {"called": True}
    published, _ = raw_execute(sandbox.client, "", {"inputs": {}})
    assert published[0]["content"]["data"]["application/json"] == {"called": True}


def test_other_entrypoint_name_is_reported_in_the_metadata(sandbox):
    published, _ = raw_execute(sandbox.client, "def handler(x):\n    return {'twice': 2 * x}",
                               {"entrypoint": "handler", "inputs": {"x": 4}})
    assert published[0]["content"]["data"]["application/json"] == {"twice": 8}
    assert published[0]["content"]["metadata"] == {"sandbox": {"entrypoint": "handler"}}


def test_without_the_convention_nothing_is_called(sandbox):
    published, reply = raw_execute(sandbox.client, "def main():\n    print('called')\n6 * 7",
                                   {"timeout": 30})
    assert reply["content"]["status"] == "ok"
    assert kinds(published) == ["execute_result"]
    assert published[0]["content"]["data"] == {"text/plain": "42"}


def test_client_run_gives_result_logs_and_text(sandbox):
    ex = ok(sandbox.run(SUMMARY, inputs={"numbers": [1, 2, 3], "label": "xs"}))
    assert ex.result == SUMMARY_RESULT
    assert ex.text == json.dumps(SUMMARY_RESULT, indent=2)
    assert ex.stdout == "summing xs\n"
    assert ex.stderr == "to stderr\n"
    assert ex.logs == [{"name": "stdout", "text": "summing xs\n"},
                       {"name": "stderr", "text": "to stderr\n"}]


def test_main_defined_in_an_earlier_run_is_called(sandbox):
    ok(sandbox.run("def main(a, *, b=10, **more):\n    return {'a': a, 'b': b, 'more': more}"))
    ex = ok(sandbox.run("", inputs={"a": 1, "extra": "yes"}))
    assert ex.result == {"a": 1, "b": 10, "more": {"extra": "yes"}}


def test_async_main_is_awaited(sandbox):
    code = ("import asyncio\nasync def main(delay):\n    await asyncio.sleep(delay)\n"
            "    print('awake')\n    return {'slept': delay}")
    ex = ok(sandbox.run(code, inputs={"delay": 0.01}))
    assert (ex.result, ex.stdout) == ({"slept": 0.01}, "awake\n")


def test_unicode_result_is_kept_verbatim(sandbox):
    ex = ok(sandbox.run("def main():\n    return {'city': 'Zürich', 'emoji': '✓'}", inputs={}))
    assert ex.result == {"city": "Zürich", "emoji": "✓"}
    assert ex.text == '{\n  "city": "Zürich",\n  "emoji": "✓"\n}'


# --- errors -----------------------------------------------------------------------------------

ERRORS = [
    ("globals().pop('main', None)", {},
     "EntrypointNotFound",
     "no function named 'main' is defined: the code must define def main(**inputs) -> dict"),
    ("main = 42", {}, "EntrypointNotFound", "'main' is not a function (it is int)"),
    ("def main(x):\n    return {}", [1, 2], "InvalidInputs",
     "inputs must be a JSON object of argument names to values, got array"),
    ("def main(x):\n    return {}", "x=1", "InvalidInputs",
     "inputs must be a JSON object of argument names to values, got string"),
    ("def main(numbers, label='n'):\n    return {}", {"label": "a"}, "SignatureMismatch",
     "main() is missing the required input 'numbers' (it takes: numbers, label)"),
    ("def main(numbers, label='n'):\n    return {}", {"numbers": [], "size": 2, "colour": "red"},
     "SignatureMismatch",
     "main() got the unexpected inputs 'colour', 'size' (it takes: numbers, label)"),
    ("def main(a, b):\n    return {}", {"c": 1}, "SignatureMismatch",
     "main() is missing the required inputs 'a', 'b'; got the unexpected input 'c' "
     "(it takes: a, b)"),
    ("def main():\n    return {}", {"x": 1}, "SignatureMismatch",
     "main() got the unexpected input 'x' (it takes no inputs)"),
    ("def main(x, /):\n    return {}", {}, "SignatureMismatch",
     "main() has positional-only parameters that inputs cannot fill: x (it takes no inputs)"),
    ("def main():\n    return [1, 2]", {}, "InvalidResult", "main() must return a dict, got list"),
    ("def main():\n    pass", {}, "InvalidResult",
     "main() must return a dict, got None (did main() forget to return?)"),
    ("import datetime\ndef main():\n    return {'when': datetime.datetime(2024, 1, 1)}", {},
     "InvalidResult", 'main() returned a value that is not JSON: result["when"]: datetime'),
    ("def main():\n    return {'stats': [1.0, float('nan')]}", {}, "InvalidResult",
     'main() returned a value that is not JSON: result["stats"][1]: float nan '
     "(NaN and Infinity are not JSON)"),
    ("def main():\n    return {'a': {'b': -float('inf')}}", {}, "InvalidResult",
     'main() returned a value that is not JSON: result["a"]["b"]: float -inf '
     "(NaN and Infinity are not JSON)"),
    ("def main():\n    return {'ok': 1, 'tags': {'x'}}", {}, "InvalidResult",
     'main() returned a value that is not JSON: result["tags"]: set'),
    ("def main():\n    return {1: 'one'}", {}, "InvalidResult",
     "main() returned a value that is not JSON: result[1]: int key (JSON keys are strings)"),
    ("def main():\n    loop = {}\n    loop['self'] = loop\n    return loop", {}, "InvalidResult",
     'main() returned a value that is not JSON: result["self"]: circular reference'),
]


@pytest.mark.parametrize("code, inputs, ename, evalue", ERRORS,
                         ids=[f"{e[2]}-{i}" for i, e in enumerate(ERRORS)])
def test_raw_errors_are_named_and_explained(sandbox, code, inputs, ename, evalue):
    published, reply = raw_execute(sandbox.client, code, {"inputs": inputs})
    assert kinds(published) == ["error"]
    error = published[0]["content"]
    assert (error["ename"], error["evalue"]) == (ename, evalue)
    assert error["traceback"] == [f"{ename}: {evalue}"]
    content = reply["content"]
    assert (content["status"], content["ename"], content["evalue"]) == ("error", ename, evalue)


def test_client_sees_the_same_errors(sandbox):
    for code, inputs, ename, evalue in ERRORS[:3] + ERRORS[-3:]:
        ex = sandbox.run(code, inputs=inputs)
        assert (ex.error.name, ex.error.value, ex.error.traceback) == (
            ename, evalue, [f"{ename}: {evalue}"])
        assert ex.result is None and ex.text is None


def test_entrypoint_must_be_a_name(sandbox):
    published, _ = raw_execute(sandbox.client, "", {"entrypoint": 5, "inputs": {}})
    assert published[0]["content"]["evalue"] == (
        "the entrypoint must be the name of a function, got 5")


RAISES = """
def check(value):
    if value < 0:
        raise ValueError(f"bad input: {value}")
def main(value):
    print("checking")
    check(value)
    return {}
"""


@pytest.mark.parametrize("code", [RAISES, RAISES.replace("def main", "async def main")])
def test_main_raising_shows_only_the_users_frames(sandbox, code):
    published, reply = raw_execute(sandbox.client, code, {"inputs": {"value": -1}})
    assert kinds(published) == ["stream", "error"]
    assert published[0]["content"]["text"] == "checking\n"
    error = published[1]["content"]
    assert (error["ename"], error["evalue"]) == ("ValueError", "bad input: -1")
    assert reply["content"]["status"] == "error"
    ex = sandbox.run(code, inputs={"value": -1})
    frames = [line.splitlines()[0] for line in ex.error.traceback if line.startswith("Cell In")]
    assert [frame.split(", in ")[1] for frame in frames] == ["main(value)", "check(value)"]
    text = "\n".join(ex.error.traceback)
    for internal in ("main_call.py", "sandbox_kernel", "asyncio", "ipykernel"):
        assert internal not in text
    assert ex.error.traceback[-1] == "ValueError: bad input: -1"


def test_failing_code_does_not_call_main(sandbox):
    ex = sandbox.run("def main():\n    print('called')\n    return {}\n1 / 0", inputs={})
    assert ex.error.name == "ZeroDivisionError"
    assert ex.stdout == ""
    assert ex.result is None


def test_interrupt_stops_main_and_keeps_the_kernel(sandbox):
    code = "import time\nkept = 'yes'\ndef main():\n    while True:\n        time.sleep(0.05)"
    timer = threading.Timer(1.0, sandbox.interrupt)
    timer.start()
    ex = sandbox.run(code, inputs={})
    timer.join()
    assert ex.error.name == "KeyboardInterrupt"
    assert ok(sandbox.run("print(kept)\ndel kept")).stdout == "yes\n"


def test_the_kernels_time_limit_covers_main(sandbox):
    ex = sandbox.run("import time\ndef main():\n    time.sleep(30)", inputs={}, timeout=1)
    assert ex.error.name == "ExecutionTimeout"
    assert ex.state_lost is False
    ok(sandbox.run("1"))


# --- %main in notebooks -------------------------------------------------------------------------

def test_main_magic_displays_and_binds_the_result(sandbox):
    ok(sandbox.run("def main(x, y=1):\n    print('adding')\n    return {'sum': x + y}"))
    ex = ok(sandbox.run('%main {"x": 2}'))
    assert (ex.result, ex.text, ex.stdout) == ({"sum": 3}, '{\n  "sum": 3\n}', "adding\n")
    ex = ok(sandbox.run('r = %main {"x": 5, "y": 5}\nprint(r["sum"], type(r).__name__)\ndel r'))
    assert ex.stdout == "adding\n10 MainResult\n"
    assert ex.result is None


@pytest.mark.parametrize("line, ename, evalue", [
    ("%main", "SignatureMismatch", "main() is missing the required input 'x' (it takes: x)"),
    ("%main [1]", "InvalidInputs",
     "inputs must be a JSON object of argument names to values, got array"),
    ("%main {x: 1}", "InvalidInputs", "%main takes a JSON object of inputs: Expecting property "
     "name enclosed in double quotes: line 1 column 2 (char 1)"),
    ('%main {"x": 1, "z": 2}', "SignatureMismatch",
     "main() got the unexpected input 'z' (it takes: x)"),
    ('%main {"x": "0"}', "InvalidResult",
     'main() returned a value that is not JSON: result["value"]: bytes'),
])
def test_main_magic_errors(sandbox, line, ename, evalue):
    ok(sandbox.run("def main(x):\n    return {'value': x.encode() if isinstance(x, str) else x}"))
    ex = sandbox.run(line)
    assert (ex.error.name, ex.error.value) == (ename, evalue)
    assert ex.error.traceback == [f"{ename}: {evalue}"]


def test_main_magic_shows_only_the_users_frames(sandbox):
    ex = sandbox.run("def main():\n    return {'ratio': 1 / 0}\n%main")
    text = "\n".join(ex.error.traceback)
    assert ex.error.name == "ZeroDivisionError"
    assert "run_line_magic" not in text and "main_call.py" not in text
    frames = [line.splitlines()[0] for line in ex.error.traceback if line.startswith("Cell In")]
    assert len(frames) == 1 and frames[0].endswith(", line 2, in main()")
    assert ex.error.traceback[-1] == "ZeroDivisionError: division by zero"


def test_main_magic_refuses_async_main(sandbox):
    ex = sandbox.run("async def main():\n    return {}\n%main")
    assert (ex.error.name, ex.error.value) == (
        "EntrypointError", "%main cannot await an async main(); in a cell write "
        "`await main(**inputs)`, or send the code with the main() request")


def test_main_magic_in_a_notebook_run_by_nbclient(kernelspecs):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("def main(x, y=1):\n    print('adding')\n"
                                  "    return {'sum': x + y}"),
        nbformat.v4.new_code_cell('%main {"x": 2}'),
        nbformat.v4.new_code_cell('%main {"x": 2'),
    ]
    NotebookClient(nb, kernel_name="sandbox", timeout=60, allow_errors=True).execute()
    stream, result = nb.cells[1].outputs
    assert (stream.output_type, stream.name, stream.text) == ("stream", "stdout", "adding\n")
    assert result.output_type == "execute_result"
    assert result.data == {"application/json": {"sum": 3}, "text/plain": '{\n  "sum": 3\n}'}
    assert result.metadata == {"sandbox": {"entrypoint": "main"}}
    assert result.execution_count == 2
    (error,) = nb.cells[2].outputs
    assert (error.output_type, error.ename) == ("error", "InvalidInputs")
    assert error.evalue == ("%main takes a JSON object of inputs: Expecting ',' delimiter: "
                            "line 1 column 8 (char 7)")


SQUARES = "def main(n):\n    return {'squares': [i * i for i in range(n)], 'pair': (1, 2)}"


def test_larger_results_arrive_whole_with_compact_text(sandbox):
    ex = ok(sandbox.run(SQUARES, inputs={"n": 15_000}))  # ~100 KB: too big to indent
    expected = {"squares": [i * i for i in range(15_000)], "pair": [1, 2]}
    assert ex.result == expected
    assert json.loads(ex.text) == expected and "\n" not in ex.text


def test_large_results_are_sent_once_with_a_summary_as_text(sandbox):
    published, _ = raw_execute(sandbox.client, SQUARES, {"inputs": {"n": 100_000}})
    (result,) = published
    expected = {"squares": [i * i for i in range(100_000)], "pair": [1, 2]}
    assert result["content"]["data"]["application/json"] == expected
    size = len(json.dumps(expected, separators=(",", ":")))
    assert result["content"]["data"]["text/plain"] == (
        f"<main() result: {size:,} bytes of JSON, in this message's application/json>")


def test_only_notebook_cells_keep_ipykernels_pause_before_the_reply(sandbox):
    """A main() caller reads output until idle: its reply is not held back by the pause that
    protects frontends stopping at the reply; cells keep the configured pause."""
    pause = "get_ipython().kernel._execute_sleep"
    assert ok(sandbox.run(pause)).text == "0.0005"
    reading = f"def main():\n    return {{'pause': {pause}}}"
    assert ok(sandbox.run(reading, inputs={})).result == {"pause": 0.0}
    assert ok(sandbox.run(pause)).text == "0.0005"


def test_a_plain_functions_parameters_are_read_as_inspect_reads_them():
    """check_signature reads a plain function's parameters off its code object: the same
    names, defaults and kinds inspect.signature gives, for every shape of parameter list;
    anything else (wrapped, a partial, a class) goes to inspect itself."""
    import functools
    import inspect

    from sandbox_kernel.kernel.main_call import _parameters

    def by_inspect(func):
        params = list(inspect.signature(func).parameters.values())
        return ([(p.name, p.default is not p.empty) for p in params
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)],
                any(p.kind is p.VAR_KEYWORD for p in params),
                [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty])

    shapes = ["()", "(a, b)", "(a, b=1)", "(a, /, b, *, c, d=2)", "(a=1, /, b=2, *args, c, **kw)",
              "(*args)", "(**kw)", "(a, b, /, c=3, *, d)", "(a, b=2, /)", "(x, *, y=1)"]
    for shape in shapes:
        namespace: dict = {}
        exec(f"def f{shape}:\n    inner = 1\n    return lambda: inner\n", namespace)
        assert _parameters(namespace["f"]) == by_inspect(namespace["f"]), shape
        exec(f"async def g{shape}:\n    pass\n", namespace)
        assert _parameters(namespace["g"]) == by_inspect(namespace["g"]), shape
    f = namespace["f"]

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    class Main:
        def __init__(self, numbers, label="n"):
            pass

    for other in (wrapper, functools.partial(f, 1), Main):
        assert _parameters(other) == by_inspect(other)
    f.__signature__ = inspect.Signature()  # said by the function itself: inspect reads it
    assert _parameters(f) == ([], False, [])
    assert _parameters(len) == by_inspect(len)
