"""The Python client: state, independence under concurrency, deadlines, dead kernels, files."""

import asyncio
import base64
import json
import threading

import pytest

from sandbox_kernel.client import AsyncSandbox, ErrorInfo, Execution, Sandbox
from tests.helpers import evaluate, ok

# A loop inside one C call: no Python-level signal handler runs until it returns, so neither the
# kernel's own time limit nor an interrupt can stop it. Only a restart can.
UNSTOPPABLE = ("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
               "sum(range(10**18))")
# Ignores the kernel's own time limit (SIGALRM) but not an interrupt (SIGINT).
ONLY_INTERRUPTIBLE = ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                      "while True: pass")
RESTARTED = "the kernel was restarted and its state (variables, imports) was lost"


@pytest.fixture(scope="module")
def breakable(kernelspecs):
    """A kernel of this module's own, with a short grace period, for tests that kill it."""
    with Sandbox("sandbox", grace=1.0) as sb:
        yield sb


def test_state_persists_across_runs_with_main(sandbox):
    ok(sandbox.run("_count = 0"))
    code = "def _step(by):\n    global _count\n    _count += by\n    return {'count': _count}"
    assert ok(sandbox.run(code, inputs={"by": 2}, entrypoint="_step")).result == {"count": 2}
    assert ok(sandbox.run("", inputs={"by": 3}, entrypoint="_step")).result == {"count": 5}
    ok(sandbox.run("del _count, _step"))


def test_callbacks_see_output_as_it_arrives(sandbox):
    seen = []
    code = ("import sys\nfrom IPython.display import HTML, display\nprint('one')\n"
            "print('two', file=sys.stderr)\ndisplay(HTML('<b>three</b>'))\nprint('four')")
    ex = ok(sandbox.run(code, on_stdout=lambda t: seen.append(("out", t)),
                        on_stderr=lambda t: seen.append(("err", t)),
                        on_display=lambda d: seen.append(("display", d["text/html"]))))
    assert seen == [("out", "one\n"), ("err", "two\n"), ("display", "<b>three</b>"),
                    ("out", "four\n")]
    assert ex.stdout == "one\nfour\n" and ex.stderr == "two\n"


def test_one_sandbox_shared_by_threads_keeps_each_runs_output_apart(sandbox):
    outputs = {}

    def worker(tag):
        outputs[tag] = [sandbox.run(f"print('{tag}', {i})").stdout for i in range(5)]

    threads = [threading.Thread(target=worker, args=(tag,)) for tag in ("left", "right")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outputs == {tag: [f"{tag} {i}\n" for i in range(5)] for tag in ("left", "right")}


def _isolation_code(tag, other, i):
    """Sets this sandbox's variable, and reports whether the other sandbox's is visible."""
    return (f"_mine_{tag} = {i}\nprint('{tag}', _mine_{tag}, "
            f"'_mine_{other}' in globals(), flush=True)")


def test_two_sandboxes_in_two_threads_are_independent(kernelspecs):
    boxes = {tag: Sandbox("sandbox") for tag in ("a", "b")}
    starters = [threading.Thread(target=box.start) for box in boxes.values()]
    for thread in starters:
        thread.start()
    for thread in starters:
        thread.join()
    together = threading.Barrier(2)
    seen = {}

    def worker(tag, other):
        together.wait()  # both sandboxes busy at the same time
        seen[tag] = [boxes[tag].run(_isolation_code(tag, other, i)).stdout for i in range(5)]
        seen[tag + "-pid"] = evaluate(boxes[tag], "import os; os.getpid()")

    try:
        workers = [threading.Thread(target=worker, args=pair) for pair in (("a", "b"), ("b", "a"))]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
    finally:
        for box in boxes.values():
            box.close()
    assert seen["a"] == [f"a {i} False\n" for i in range(5)]
    assert seen["b"] == [f"b {i} False\n" for i in range(5)]
    assert seen["a-pid"] != seen["b-pid"]


def test_two_async_sandboxes_in_two_tasks_are_independent(kernelspecs):
    async def use(box, tag, other):
        return [(await box.run(_isolation_code(tag, other, i))).stdout for i in range(5)]

    async def scenario():
        async with AsyncSandbox("sandbox") as a, AsyncSandbox("sandbox") as b:
            return await asyncio.gather(use(a, "a", "b"), use(b, "b", "a"))

    seen_a, seen_b = asyncio.run(scenario())
    assert seen_a == [f"a {i} False\n" for i in range(5)]
    assert seen_b == [f"b {i} False\n" for i in range(5)]


def test_async_sandbox_runs_main_and_survives_a_dead_kernel(kernelspecs):
    async def scenario():
        async with AsyncSandbox("sandbox", grace=1.0) as box:
            first = await box.run("def main(x):\n    return {'y': x + 1}", inputs={"x": 1})
            dead = await box.run("import os; os._exit(7)")
            after = await box.run("print(globals().get('main'))")
            return first, dead, after

    first, dead, after = asyncio.run(scenario())
    assert first.result == {"y": 2}
    assert (dead.error.name, dead.error.value, dead.state_lost) == (
        "KernelDied", f"the kernel process died (exit status 7); {RESTARTED}", True)
    assert ok(after).stdout == "None\n"


def test_client_deadline_restarts_a_kernel_that_never_returns(breakable):
    ok(breakable.run("before = 1"))
    ex = breakable.run(UNSTOPPABLE, timeout=1)
    assert (ex.error.name, ex.error.value, ex.state_lost) == (
        "ExecutionTimeout",
        f"the execution ran past its 1 s limit and did not stop when interrupted; {RESTARTED}",
        True)
    assert breakable.run("before").error.name == "NameError"
    assert evaluate(breakable, "6 * 7") == 42


def test_client_deadline_interrupts_and_keeps_the_state(breakable):
    ok(breakable.run("kept = 'still here'"))
    ex = breakable.run(ONLY_INTERRUPTIBLE, timeout=1)
    assert (ex.error.name, ex.error.value, ex.state_lost) == (
        "ExecutionTimeout", "the execution ran past its 1 s limit and was interrupted; the "
        "kernel and its variables are still there", False)
    assert ex.error.traceback[-2:] == ["KeyboardInterrupt: ", f"ExecutionTimeout: {ex.error.value}"]
    assert evaluate(breakable, "kept") == "still here"


@pytest.mark.parametrize("code, how", [
    ("import os\nprint('bye', flush=True)\nos._exit(1)", "exit status 1"),
    ("import ctypes\nctypes.string_at(0)", "killed by signal SIGSEGV"),
])
def test_a_dead_kernel_is_reported_and_replaced(breakable, code, how):
    ok(breakable.run("doomed = 1"))
    pid = evaluate(breakable, "import os; os.getpid()")
    ex = breakable.run(code)
    assert (ex.error.name, ex.error.value, ex.state_lost) == (
        "KernelDied", f"the kernel process died ({how}); {RESTARTED}", True)
    assert ex.result is None
    assert evaluate(breakable, "import os; os.getpid()") != pid
    assert breakable.run("doomed").error.name == "NameError"
    assert ok(breakable.run("def main():\n    return {'fine': True}", inputs={})).result == {
        "fine": True}


# --- Execution as data and files (no kernel) ----------------------------------------------------

PNG_1x1 = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg==")


def _execution():
    return Execution(
        result={"a": 1}, text='{\n  "a": 1\n}',
        logs=[{"name": "stdout", "text": "x\n"}, {"name": "stderr", "text": "y\n"}],
        displays=[
            {"image/png": base64.b64encode(PNG_1x1).decode(), "text/plain": "<Figure>"},
            {"image/svg+xml": "<svg/>", "text/plain": "svg"},
            {"text/html": "<b>hi</b>", "text/plain": "hi"},
            {"application/json": {"k": [1]}, "text/plain": "{'k': [1]}"},
            {"text/markdown": "# T", "text/plain": "T"},
            {"text/plain": "only text"},
            {"application/x-unknown": "?"},
        ],
        error=ErrorInfo("ValueError", "bad", ["ValueError: bad"]), duration=1.5)


def test_to_dict_is_the_whole_execution_as_json():
    as_dict = _execution().to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert set(as_dict) == {"result", "text", "logs", "displays", "error", "duration",
                            "state_lost", "usage", "stdout", "stderr", "tool_calls"}
    assert as_dict["error"] == {"name": "ValueError", "value": "bad",
                                "traceback": ["ValueError: bad"]}
    assert (as_dict["stdout"], as_dict["stderr"], as_dict["state_lost"]) == ("x\n", "y\n", False)


def test_save_displays_writes_each_in_its_richest_format(tmp_path):
    paths = _execution().save_displays(tmp_path / "out")
    names = ["display-1.png", "display-2.svg", "display-3.html", "display-4.json",
             "display-5.md", "display-6.txt"]
    assert paths == [str(tmp_path / "out" / name) for name in names]
    contents = [(tmp_path / "out" / name).read_bytes() for name in names]
    assert contents == [PNG_1x1, b"<svg/>", b"<b>hi</b>", b'{\n  "k": [\n    1\n  ]\n}', b"# T",
                        b"only text"]


def test_a_cancelled_run_that_then_fails_does_not_abort_the_next():
    """A run whose task was cancelled goes on in the kernel; when it fails, the run queued
    behind it still runs (it was aborted, and read as an empty success)."""
    async def go():
        async with AsyncSandbox(None) as sb:
            task = asyncio.ensure_future(sb.run("import time\ntime.sleep(2)\n1 / 0"))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await sb.run("print('next')\n6 * 7")

    ex = asyncio.run(go())
    assert (ex.error, ex.stdout, ex.text) == (None, "next\n", "42")


def test_a_run_the_kernel_aborts_is_an_error_never_an_empty_success():
    with Sandbox(None) as sb:
        sb.client.execute("import time\ntime.sleep(1)\n1 / 0", stop_on_error=True)
        ex = sb.run("print('never')")
    assert ex.error.name == "ExecutionAborted"
    assert ex.error.value.startswith("the kernel aborted this run without running it")
    assert ex.stdout == ""
