"""The shell a fork server builds for its kernels to adopt (kernel/prebuilt.py).

The server builds one ZMQInteractiveShell in `prepare`; each fork-served kernel adopts it and
makes again what is per kernel. These tests check that the server's process is otherwise as it
was (no singleton, builtins, __main__, environment, prompts, warning filters, atexit handler, open
database or thread of the shell), that an adopted shell keeps nothing of the server's build and
two kernels of one server share no shell state, and that a kernel whose configuration concerns
the shell builds its own.
"""

import json
import subprocess
import sys
import textwrap

from jupyter_client import KernelManager

from sandbox_kernel.client import Sandbox

from .helpers import evaluate, ok

# Run in a fresh interpreter: prepare() imports, freezes and warms the whole process.
SERVER_PROBE = textwrap.dedent("""
    import atexit, builtins, gc, json, os, sys, threading, warnings
    from IPython.core.interactiveshell import InteractiveShell
    from sandbox_kernel.launch.forkserver import Server

    # Marks a server shell's exit handler, should one still be registered at exit.
    original = InteractiveShell.atexit_operations
    def marked(self):
        os.write(1, b"SERVER SHELL ATEXIT\\n")
        return original(self)
    InteractiveShell.atexit_operations = marked

    import sandbox_kernel.kernel.app  # the imports prepare makes, before the snapshot
    before = {"builtins": sorted(vars(builtins)), "main": id(sys.modules["__main__"]),
              "environ": dict(os.environ), "path": list(sys.path),
              "filters": len(warnings.filters), "hooks": [id(sys.displayhook), id(sys.excepthook)],
              "ps1": hasattr(sys, "ps1"), "home": sorted(os.listdir(os.environ["HOME"]))}
    Server(sys.argv[1]).prepare()
    after = {"builtins": sorted(vars(builtins)), "main": id(sys.modules["__main__"]),
             "environ": dict(os.environ), "path": list(sys.path),
             "filters": len(warnings.filters), "hooks": [id(sys.displayhook), id(sys.excepthook)],
             "ps1": hasattr(sys, "ps1"), "home": sorted(os.listdir(os.environ["HOME"]))}
    import sqlite3
    from sandbox_kernel.kernel import prebuilt
    shell, database = prebuilt.pending(), "none kept"
    if shell is not None:
        try:
            shell.history_manager.db.execute("select 1")
            database = "open"
        except sqlite3.ProgrammingError:
            database = "closed"
    print(json.dumps({"changed": [k for k in before if before[k] != after[k]],
                      "shell": type(shell).__name__, "database": database,
                      "singleton": InteractiveShell.initialized(),
                      "threads": threading.active_count()}), flush=True)
    del shell
    if os.fork() == 0:  # a kernel's exit runs the inherited handlers (server._exit_like_python)
        atexit._run_exitfuncs()
        os._exit(0)
    os.wait()
    """)


def test_the_server_keeps_nothing_of_its_shell_outside_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(
        [sys.executable, "-I", "-c", SERVER_PROBE, str(tmp_path / "server.sock")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert json.loads(lines[0]) == {"changed": [], "shell": "ZMQInteractiveShell",
                                    "database": "closed", "singleton": False, "threads": 1}
    assert lines[1:] == []  # neither the server's exit nor its child's ran the shell's handler
    assert list(tmp_path.iterdir()) == [home]  # no profile or IPython dir left behind


SHELL_STATE = textwrap.dedent("""
    ip = get_ipython()
    ({name: name in ip.user_ns for name in ('planted', 'json')},
     ip.alias_manager.is_alias('planted'),
     ip.Completer.omit__names,
     ip.execution_count, len(In), sorted(k for k in Out), repr(_),
     ip.history_manager.session_number,
     ip.kernel.parent.connection_file, ip.profile_dir.location.startswith(os.environ['HOME']),
     [f.__name__ for f in ip.events.callbacks['post_run_cell']],
     len(list(ip.history_manager.search('*alias' + ' planted*'))))
    """)


# What of the server's build an adopted shell still reaches: each finding a stale reference.
STALE_PROBE = textwrap.dedent("""
    import gc, sys, time, types
    from sandbox_kernel.kernel import prebuilt
    from IPython.core.displayhook import DisplayHook
    ip = get_ipython()
    ih = ip.history_manager.input_hist_parsed
    seen, todo, stale = set(), [ip], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, str):
            if prebuilt.WARM_PREFIX in obj:
                stale.add('the server build dir')
            continue
        if isinstance(obj, dict) and obj.get('_ih', ih) is not ih:
            stale.add('a namespace')
        kind = type(obj).__name__
        if kind == 'HistoryManager' and obj is not ip.history_manager:
            stale.add('a history')
        if isinstance(obj, DisplayHook) and obj is not ip.displayhook:
            stale.add('a display hook')
        if not isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            todo.extend(gc.get_referents(obj))
    (prebuilt.outcome(), sorted(stale), len(seen) > 1000, sys.modules['__main__'] is ip.user_module,
     ip.Completer.namespace is ip.user_ns,
     prebuilt.server_parts(ip),
     (getattr(sys, 'ps1', None), __import__('os').environ.get('PAGER')),  # prompts, environment
     ip.history_manager.db.execute('select 1').fetchall() == [(1,)])
    """)


def test_two_kernels_of_one_server_share_no_shell_state():
    with Sandbox(None) as first, Sandbox(None) as second:
        assert first.manager.provisioner.fork_served and second.manager.provisioner.fork_served
        ok(first.run("import json\nplanted = 1\n%alias planted echo planted\n"
                     "%config IPCompleter.omit__names = 0\n"
                     "def hook(result): pass\n"
                     "get_ipython().events.register('post_run_cell', hook)"))
        ok(first.run("41 + 1"))
        marked = evaluate(first, "import os\n" + SHELL_STATE)
        fresh = evaluate(second, "import os\n" + SHELL_STATE)
        files = first.manager.connection_file, second.manager.connection_file
        assert marked[:3] == ({"planted": True, "json": True}, True, 0)
        assert marked[5] == [2] and marked[6] == "42" and "hook" in marked[10]
        assert fresh[0] == {"planted": False, "json": False}
        assert fresh[1] is False and fresh[2] == 2  # IPython's default
        assert fresh[3] == marked[3] - 2  # counting from where the first kernel started
        assert fresh[4:8] == (2, [], "''", 1)  # its first run: In[1] only, no Out, no _
        assert (marked[8], fresh[8]) == files  # each shell's kernel is its own
        assert fresh[9] is True  # the profile is in the kernel's own scratch (its HOME)
        assert "hook" not in fresh[10]
        assert (marked[11], fresh[11]) == (1, 0)  # each history database its kernel's own
        for sandbox, word in ((first, "first"), (second, "second")):
            ex = ok(sandbox.run(f"print({word!r})\n"
                                f"from IPython.display import display, HTML\n"
                                f"display(HTML('<b>{word}</b>'))"))
            assert ex.stdout == f"{word}\n"
            assert [d["text/html"] for d in ex.displays] == [f"<b>{word}</b>"]
        for sandbox in (first, second):  # each adopted its own copy of the server's shell
            assert evaluate(sandbox, STALE_PROBE) == ("adopted", [], True, True, True, [],
                                                      ("In : ", "cat"), True)


def test_a_shell_option_on_the_kernels_command_line_is_honoured():
    manager = KernelManager(kernel_name="sandbox")
    manager.start_kernel(extra_arguments=["--InteractiveShell.ast_node_interactivity=all"])
    results = []
    try:
        assert manager.provisioner.fork_served
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        reply = client.execute_interactive(
            "from sandbox_kernel.kernel import prebuilt\nprint(prebuilt.outcome())", timeout=30,
            output_hook=lambda msg: results.append(msg["content"]["text"])
            if msg["msg_type"] == "stream" else None)
        assert results == ["built: its configuration or arguments concern the shell\n"]
        results.clear()
        reply = client.execute_interactive(
            "1 + 1\n2 + 2", timeout=30,
            output_hook=lambda msg: results.append(msg["content"]["data"]["text/plain"])
            if msg["msg_type"] == "execute_result" else None)
        assert reply["content"]["status"] == "ok"
        assert results == ["2", "4"]  # every expression shown, not only the last
        client.stop_channels()
    finally:
        manager.shutdown_kernel(now=True)
