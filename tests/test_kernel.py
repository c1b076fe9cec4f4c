"""The foundation: ordinary Python works in the sandboxed kernel, and the kernel stays usable."""

import json
import os
import subprocess
import sys
import threading

import pytest

from tests.helpers import evaluate, ok


def test_print_result_and_error(sandbox):
    ex = ok(sandbox.run("print('hello')\n6 * 7"))
    assert ex.stdout == "hello\n"
    assert ex.text == "42"
    ex = sandbox.run("1 / 0")
    assert ex.error.name == "ZeroDivisionError"
    assert any("1 / 0" in line for line in ex.error.traceback)


def test_state_persists_between_runs(sandbox):
    ok(sandbox.run("_persist = {'a': 1}"))
    assert evaluate(sandbox, "_persist['a'] + 1") == 2
    ok(sandbox.run("del _persist"))


def test_threads_and_thread_pool(sandbox):
    code = """
import threading, concurrent.futures
box = []
t = threading.Thread(target=lambda: box.append(sum(range(10))))
t.start(); t.join()
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    squares = list(pool.map(lambda x: x * x, range(8)))
(box, squares)
"""
    assert evaluate(sandbox, code) == ([45], [x * x for x in range(8)])


def test_top_level_await_and_asyncio(sandbox):
    code = """
import asyncio
async def twice(x):
    await asyncio.sleep(0.01)
    return 2 * x
first = await twice(3)
import concurrent.futures
# A fresh event loop in a thread: asyncio.run needs socketpair(AF_UNIX), allowed without network.
with concurrent.futures.ThreadPoolExecutor(1) as pool:
    second = pool.submit(asyncio.run, twice(4)).result()
(first, second)
"""
    assert evaluate(sandbox, code) == (6, 8)


def test_standard_library(sandbox):
    code = """
import sqlite3, hashlib, json, zoneinfo, datetime
db = sqlite3.connect(":memory:")
db.execute("create table t (x)"); db.executemany("insert into t values (?)", [(1,), (2,)])
total = db.execute("select sum(x) from t").fetchone()[0]
digest = hashlib.sha256(b"abc").hexdigest()[:8]
tz = datetime.datetime(2024, 7, 1, 12, tzinfo=zoneinfo.ZoneInfo("Europe/Paris")).utcoffset()
(total, digest, json.loads('{"k": [1]}'), tz.total_seconds())
"""
    assert evaluate(sandbox, code) == (3, "ba7816bf", {"k": [1]}, 7200.0)


def test_scientific_stack(sandbox):
    code = """
import numpy as np, pandas as pd
import matplotlib.pyplot as plt
df = pd.DataFrame({"x": np.arange(5), "y": np.arange(5) ** 2})
fig, ax = plt.subplots(); ax.plot(df.x, df.y); plt.show()
float(np.linalg.inv(np.eye(3) * 2).trace()), int(df.y.sum())
"""
    ex = ok(sandbox.run(code))
    assert ex.text == "(1.5, 30)"
    pngs = [d["image/png"] for d in ex.displays if "image/png" in d]
    assert len(pngs) == 1 and len(pngs[0]) > 1000


def test_large_output_and_late_zmq_threads(sandbox):
    # New libzmq threads set their own scheduling policy by thread id: once, the filter
    # refused it and libzmq aborted the kernel on large output or a user's zmq.Context.
    ex = ok(sandbox.run("print('x' * 2**19)"))
    assert len(ex.stdout) == 2**19 + 1
    code = ("import zmq\nctx = zmq.Context()\na, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)\n"
            "a.bind('inproc://t'); b.connect('inproc://t'); a.send(b'ping')\n"
            "got = b.recv(); a.close(); b.close(); ctx.term(); got")
    assert evaluate(sandbox, code) == b"ping"


def test_interrupt_stops_a_busy_loop(fresh_sandbox):
    import threading

    timer = threading.Timer(1.0, fresh_sandbox.interrupt)
    timer.start()
    ex = fresh_sandbox.run("x = 5\nwhile True:\n    pass")
    timer.join()
    assert ex.error.name == "KeyboardInterrupt"
    assert evaluate(fresh_sandbox, "x") == 5


def test_restart_gives_a_fresh_kernel(fresh_sandbox):
    ok(fresh_sandbox.run("gone = 1"))
    before = evaluate(fresh_sandbox, "import os; os.getpid()")
    fresh_sandbox.restart()
    assert evaluate(fresh_sandbox, "import os; os.getpid()") != before
    assert fresh_sandbox.run("gone").error.name == "NameError"


def test_shutdown_ends_the_process(kernelspecs):
    from sandbox_kernel.client import Sandbox

    sb = Sandbox("sandbox")
    sb.start()
    ok(sb.run("1"))
    process = sb.manager.provisioner.process
    sb.close()
    assert process.wait(timeout=10) is not None
    assert not sb.manager.has_kernel


def test_kernel_info_reports_the_sandbox(sandbox, net_sandbox):
    info = sandbox.kernel_info()
    assert info["implementation"] == "sandbox_kernel"
    assert info["sandbox"]["policy"]["allow_network"] is False
    assert info["sandbox"]["layers"]["seccomp"]["active"] is True
    assert "debugger" not in info["supported_features"]
    assert net_sandbox.kernel_info()["sandbox"]["policy"]["allow_network"] is True


def test_debugger_is_refused_with_a_reason(sandbox):
    client = sandbox.client
    msg = client.session.msg("debug_request", {"type": "request", "seq": 1, "command": "initialize",
                                               "arguments": {}})
    client.control_channel.send(msg)
    reply = client.control_channel.get_msg(timeout=10)
    assert reply["content"]["success"] is False
    assert "forbids creating processes" in reply["content"]["message"]
    ok(sandbox.run("1"))


def test_kernel_started_by_name_from_a_prefix(tmp_path):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    result = subprocess.run(
        [sys.executable, "-m", "sandbox_kernel", "install", "--prefix", str(tmp_path),
         "--name", "prefixed"], capture_output=True, text=True, check=True)
    assert "Installed kernelspec prefixed" in result.stdout
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "share/jupyter/kernels")])
    km = KernelManager(kernel_name="prefixed", kernel_spec_manager=specs)
    km.start_kernel()
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        printed = []
        reply = kc.execute_interactive(
            "print(open('/proc/self/status').read().count('Seccomp:\\t2'))", timeout=30,
            output_hook=lambda m: printed.append(m["content"].get("text")))
        assert reply["content"]["status"] == "ok"
        assert "1\n" in printed
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)


def test_install_lists_replaces_and_records_policy(tmp_path):
    env_prefix = ["--prefix", str(tmp_path)]
    base = [sys.executable, "-m", "sandbox_kernel", "install", *env_prefix, "--name", "twice"]
    subprocess.run(base, check=True, capture_output=True)
    subprocess.run([*base, "--allow-network", "--display-name", "Net"], check=True,
                   capture_output=True)
    spec_dir = tmp_path / "share/jupyter/kernels/twice"
    spec = json.loads((spec_dir / "kernel.json").read_text())
    assert spec["display_name"] == "Net"
    assert "--SandboxPolicy.allow_network=True" in spec["argv"]
    assert spec["argv"][1:4] == ["-I", "-m", "sandbox_kernel"]
    assert spec["metadata"]["sandbox_kernel"]["policy"]["allow_network"] is True
    assert {p.name for p in spec_dir.iterdir()} == {
        "kernel.json", "logo-32x32.png", "logo-64x64.png", "logo-svg.svg"}
    env = {**os.environ, "JUPYTER_PATH": str(tmp_path / "share/jupyter")}
    listed = subprocess.run(["jupyter", "kernelspec", "list", "--json"], capture_output=True,
                            text=True, check=True, env=env)
    assert "twice" in json.loads(listed.stdout)["kernelspecs"]


@pytest.mark.parametrize("args, message", [
    (["--no-such-flag"], "unrecognized arguments"),
    (["--name", "bad name!"], "invalid kernel name"),
])
def test_install_usage_errors_exit_2(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", "sandbox_kernel", "install", "--prefix",
                             str(tmp_path), *args], capture_output=True, text=True)
    assert result.returncode == 2
    assert message in result.stderr


def test_install_into_unwritable_prefix_exits_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = subprocess.run(["sandbox-kernel", "install", "--prefix", str(blocker / "sub")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "cannot write the kernelspec" in result.stderr
    assert "Traceback" not in result.stderr


class _CountingShell:
    """A shell whose transform_cell counts its calls (for the transform-once hook)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def transform_cell(self, raw_cell: str) -> str:
        self.calls.append(raw_cell)
        if raw_cell == "boom":
            raise SyntaxError("cannot transform")
        return raw_cell.upper()


class _JudgingShell(_CountingShell):
    """...whose should_run_async counts its calls too (a cell awaits if it says await)."""

    def __init__(self) -> None:
        super().__init__()
        self.judged: list[tuple[str, str]] = []

    def should_run_async(self, raw_cell: str, *, transformed_cell=None,
                         preprocessing_exc_tuple=None) -> bool:
        self.judged.append((raw_cell, transformed_cell))
        return preprocessing_exc_tuple is None and "AWAIT" in transformed_cell


def test_a_cell_is_transformed_once_per_execution():
    from sandbox_kernel.kernel.runner import _transformed_once

    shell = _CountingShell()
    with _transformed_once(shell, "x = 1"):
        # ipykernel's call, then IPython's run_cell: one real transform, the same result
        assert shell.transform_cell("x = 1") == shell.transform_cell("x = 1") == "X = 1"
        assert shell.calls == ["x = 1"]
        assert shell.transform_cell("x = 1") == "X = 1"  # kept once only: computed again
        assert shell.transform_cell("y") == "Y"  # other text: as before
        assert shell.calls == ["x = 1", "x = 1", "y"]
    assert "transform_cell" not in vars(shell)  # the class's method again
    with _transformed_once(shell, "boom"):  # a failed transform is not kept: it fails again
        for _ in range(2):
            with pytest.raises(SyntaxError):
                shell.transform_cell("boom")
    assert shell.calls.count("boom") == 2
    # a subshell's cell runs in a thread of its own beside the main one: left as it is
    seen = []
    worker = threading.Thread(target=lambda: seen.append(_in_context(shell)))
    worker.start()
    worker.join()
    assert seen == [False]


def test_a_cell_is_judged_once_per_execution():
    """Whether the cell runs as a coroutine: ipykernel's (or the lean process's) call, then
    IPython's run_cell's, one real decision; anything else decided as before."""
    from sandbox_kernel.kernel.runner import _transformed_once

    shell = _JudgingShell()
    for code, awaits in (("await x", True), ("x = 1", False)):
        with _transformed_once(shell, code):
            cell = shell.transform_cell(code)
            assert shell.should_run_async(code, transformed_cell=cell) is awaits
            assert shell.should_run_async(code, transformed_cell=cell) is awaits
            assert shell.judged == [(code, cell)]
            assert shell.should_run_async(code, transformed_cell=cell) is awaits  # once only
            assert shell.should_run_async(code, transformed_cell="other") is False
            assert shell.should_run_async("y", transformed_cell="AWAIT y") is True
            assert shell.should_run_async(code, transformed_cell=cell,
                                          preprocessing_exc_tuple=(1, 2, 3)) is False
            assert len(shell.judged) == 5
        assert "should_run_async" not in vars(shell)  # the class's method again
        shell.judged.clear()


def test_a_cell_that_cannot_await_is_judged_without_compiling_it():
    """IPython's should_run_async compiles the cell to find a top-level await; a cell whose
    text says neither await nor async cannot have one: whatever IPython finds, this finds."""
    from IPython.core.async_helpers import _should_be_async

    from sandbox_kernel.kernel.runner import _may_await

    cells = ["x = 1", "await x", "async with a:\n    pass", "[i async for i in x]",
             "async def f():\n    pass", "def f():\n    await x", "print('await')",
             "x = 1\nawait asyncio.sleep(0)\n", "async for i in x:\n    pass",
             "f(await g())", "(await x for x in y)", "lambda: (yield)", "return 1",
             "x = [await y for y in z]", "import asyncio\nasyncio.run(main())"]
    for cell in cells:
        assert not _should_be_async(cell) or _may_await(cell), cell


def _in_context(shell):
    from sandbox_kernel.kernel.runner import _transformed_once

    with _transformed_once(shell, "x = 1"):
        return "transform_cell" in vars(shell)


def test_ipython_syntax_still_runs_in_cells_and_main_calls(sandbox):
    ex = ok(sandbox.run("_here = %pwd\nget_ipython().transform_cell('%time 1')"))
    assert "run_line_magic('time', '1')" in ex.text
    ex = ok(sandbox.run("here = %pwd\ndef main():\n    return {'same': here == _here}", inputs={}))
    assert ex.result == {"same": True}
    ok(sandbox.run("del _here, here, main"))


def test_the_kernel_log_builds_only_the_records_its_handlers_show():
    import logging

    from sandbox_kernel.kernel.app import SandboxKernelApp

    app = SandboxKernelApp()
    app.parse_command_line(["-f", "/tmp/kernel-log.json"])
    assert app.log.isEnabledFor(logging.WARNING)
    assert not app.log.isEnabledFor(logging.DEBUG)  # traitlets left it at DEBUG: every start
    # built the records of its debug lines, for handlers that showed none of them
    app.parse_command_line(["--debug"])
    assert app.log.isEnabledFor(logging.DEBUG)  # --debug still shows them
    app.log_level = logging.WARNING


def test_user_code_runs_with_the_collector_on(sandbox):
    # The start runs without the collector and freezes what it built (kernel/app.py); user
    # code's garbage is collected as in any Python, automatically and on gc.collect().
    code = """
import gc, weakref
class Node: pass
def cycle():
    node = Node(); node.me = node
    return weakref.ref(node)
refs = [cycle() for _ in range(5)]
before = sum(ref() is not None for ref in refs)
for _ in range(2000): cycle()  # allocations enough for automatic collections
automatic = sum(ref() is not None for ref in refs)
gc.collect()
(gc.isenabled(), gc.get_freeze_count() > 0, before, automatic, [ref() for ref in refs])
"""
    enabled, frozen, before, automatic, left = evaluate(sandbox, code)
    ok(sandbox.run("del gc, weakref, Node, cycle, refs, before, automatic"))
    assert (enabled, frozen, before, left) == (True, True, 5, [None] * 5)
    assert automatic == 0
