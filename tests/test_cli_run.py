"""`sandbox-kernel run`: the examples, exit statuses, --json, --save-displays, usage errors."""

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_kernel import cli

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SUMMARY = {"label": "digits of pi", "count": 8, "total": 31, "mean": 3.875, "median": 3.5,
           "min": 1, "max": 9}
CHART = {"title": "Sales, first half-year", "bars": 6, "total": 100,
         "best": {"label": "Jun", "value": 25}}


def run(*args, stdin=None):
    """`sandbox-kernel run ARGS` in a subprocess, as a user would type it."""
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", "run", *map(str, args)],
                          input=stdin, capture_output=True, text=True, timeout=120)


def own_lines(stderr):
    """stderr without the kernel's own log lines (marked "[kernel <id>]") and denial records."""
    return "".join(line for line in stderr.splitlines(keepends=True)
                   if not line.startswith(("[kernel ", "sandbox-kernel audit:")))


def png_size(data):
    """(width, height) from a PNG's signature and IHDR chunk; fails on anything else."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    return struct.unpack(">II", data[16:24])


def test_summarize_example_result_on_stdout_logs_on_stderr():
    done = run(EXAMPLES / "summarize.py", "--inputs", f"@{EXAMPLES / 'summarize.json'}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == SUMMARY
    assert done.stdout == json.dumps(SUMMARY, indent=2) + "\n"
    assert own_lines(done.stderr) == "summarising 8 digits of pi\nmean of digits of pi is 3.875\n"


def test_chart_example_json_and_saved_png(tmp_path):
    out = tmp_path / "displays"
    done = run(EXAMPLES / "chart.py", "--inputs", f"@{EXAMPLES / 'chart.json'}", "--json",
               "--save-displays", out)
    assert done.returncode == 0, done.stderr
    assert own_lines(done.stderr) == ""
    report = json.loads(done.stdout)
    assert set(report) == {"result", "text", "logs", "displays", "error", "duration",
                           "state_lost", "usage", "stdout", "stderr", "saved_displays",
                           "tool_calls"}
    assert report["result"] == CHART
    usage = report["usage"]  # measured from outside the kernel (tests/test_usage.py has more)
    assert usage["output_bytes"] == len(b"drawing 6 bars\n")
    assert usage["result_bytes"] == len(json.dumps(CHART, separators=(",", ":")))
    assert usage["source"]["cpu_user_seconds"] == "host" and usage["peak_memory_bytes"] > 0
    assert report["text"] == json.dumps(CHART, indent=2)
    assert (report["stdout"], report["stderr"]) == ("drawing 6 bars\n", "")
    assert report["logs"] == [{"name": "stdout", "text": "drawing 6 bars\n"}]
    assert (report["error"], report["state_lost"]) == (None, False)
    assert report["saved_displays"] == [str(out / "display-1.png")]
    assert len(report["displays"]) == 1 and "image/png" in report["displays"][0]
    width, height = png_size((out / "display-1.png").read_bytes())
    assert width > 0 and height > 0
    assert sorted(p.name for p in out.iterdir()) == ["display-1.png"]


def test_saved_displays_are_reported_on_stderr(tmp_path):
    done = run(EXAMPLES / "chart.py", "--inputs", '{"values": [1, 2]}', "--save-displays",
               tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"title": "Values", "bars": 2, "total": 3,
                                       "best": {"label": "2", "value": 2}}
    assert own_lines(done.stderr) == (f"drawing 2 bars\n"
                                      f"sandbox-kernel run: saved {tmp_path / 'display-1.png'}\n")
    assert png_size((tmp_path / "display-1.png").read_bytes())[0] > 0


def test_code_from_stdin_with_main_and_no_inputs():
    done = run("-", stdin="def main():\n    print('hello')\n    return {'ok': True}\n")
    assert (done.returncode, json.loads(done.stdout)) == (0, {"ok": True})
    assert own_lines(done.stderr) == "hello\n"


def test_a_script_without_main_just_runs():
    done = run("-", stdin="print('just a script')\n")
    assert (done.returncode, done.stdout) == (0, "")
    assert own_lines(done.stderr) == "just a script\n"


def test_an_error_in_main_exits_1_with_the_traceback_on_stderr():
    done = run(EXAMPLES / "summarize.py", "--inputs", '{"numbers": []}')
    assert (done.returncode, done.stdout) == (cli.CODE_FAILED, "")
    lines = own_lines(done.stderr).splitlines()
    assert lines[0] == "summarising 0 numbers"
    assert lines[-1] == "ValueError: numbers is empty: give at least one number"


def test_an_error_in_main_with_json():
    done = run(EXAMPLES / "summarize.py", "--inputs", '{"numbers": [1], "unit": "m"}', "--json")
    assert done.returncode == cli.CODE_FAILED
    error = json.loads(done.stdout)["error"]
    assert (error["name"], error["value"]) == (
        "SignatureMismatch", "main() got the unexpected input 'unit' (it takes: numbers, label)")


def test_timeout_exits_1_and_names_the_timeout():
    done = run("-", "--timeout", "1", "--json", stdin="import time\ntime.sleep(60)\n")
    assert done.returncode == cli.CODE_FAILED
    report = json.loads(done.stdout)
    # the flag that set it, and nothing about variables the one-shot kernel no longer has
    assert (report["error"]["name"], report["error"]["value"]) == (
        "ExecutionTimeout", "the execution ran longer than its 1 s limit (set by "
        "sandbox-kernel run --timeout) and was interrupted")
    assert report["state_lost"] is False
    assert not [line for line in report["error"]["traceback"] if "deadline.py" in line]


POLICY_TIMEOUT = "print(get_ipython().kernel.sandbox_info['policy']['timeout'])\n"


def help_text(capsys, *command):
    """`sandbox-kernel COMMAND --help`, with argparse's line wrapping undone."""
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_run_has_a_default_time_limit_and_0_means_none(capsys):
    assert f"time limit: {cli.RUN_TIMEOUT:g} s unless --timeout says otherwise (--timeout 0: " \
        "none)" in help_text(capsys, "run")
    default = run("-", stdin=POLICY_TIMEOUT)
    assert (default.returncode, own_lines(default.stderr)) == (0, f"{cli.RUN_TIMEOUT}\n")
    none = run("-", "--timeout", "0", stdin=POLICY_TIMEOUT)
    assert (none.returncode, own_lines(none.stderr)) == (0, "0.0\n")


def test_stdout_and_stderr_keep_their_order():
    code = ("import logging, sys\nlogging.basicConfig(format='%(message)s')\n"
            "for i in range(3):\n    print(f'print {i}')\n    logging.warning(f'log {i}')\n")
    done = run("-", stdin=code)
    assert done.returncode == 0
    assert own_lines(done.stderr) == "print 0\nlog 0\nprint 1\nlog 1\nprint 2\nlog 2\n"


def test_ctrl_c_ends_quietly_with_one_line():
    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox_kernel", "run", "-"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    process.stdin.write("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    process.stdin.close()
    process.stdin = None  # closed: communicate() must not flush it
    try:
        assert process.stderr.readline() == "started\n"
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does to its job
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert (process.returncode, out) == (cli.INTERRUPTED, "")
    assert own_lines(err) == "sandbox-kernel run: interrupted (Ctrl-C); the kernel was stopped\n"


def test_uninstall_removes_what_install_wrote(tmp_path, capsys):
    assert cli.main(["install", "--prefix", str(tmp_path), "--name", "gone-soon"]) == 0
    spec_dir = tmp_path / "share" / "jupyter" / "kernels" / "gone-soon"
    assert (spec_dir / "kernel.json").is_file()
    capsys.readouterr()
    assert cli.main(["uninstall", "--prefix", str(tmp_path), "--name", "gone-soon"]) == 0
    assert capsys.readouterr().out == f"Removed kernelspec gone-soon from {spec_dir}\n"
    assert not spec_dir.exists()
    assert cli.main(["uninstall", "--prefix", str(tmp_path), "--name", "gone-soon"]) == \
        cli.USAGE_ERROR
    assert capsys.readouterr().err.startswith(
        f"sandbox-kernel uninstall: no kernelspec named 'gone-soon' in {spec_dir.parent}; ")


def test_uninstall_leaves_other_kernelspecs_alone(tmp_path, capsys):
    other = tmp_path / "share" / "jupyter" / "kernels" / "python3"
    other.mkdir(parents=True)
    (other / "kernel.json").write_text(json.dumps({"argv": ["python"], "display_name": "P",
                                                   "language": "python"}))
    assert cli.main(["uninstall", "--prefix", str(tmp_path), "--name", "python3"]) == \
        cli.USAGE_ERROR
    assert capsys.readouterr().err == (
        f"sandbox-kernel uninstall: {other} was not installed by sandbox-kernel; leaving it "
        "alone (`jupyter kernelspec remove python3` removes any kernelspec)\n")
    assert (other / "kernel.json").is_file()


def test_user_uninstall_from_the_command_line():
    installed = subprocess.run(["sandbox-kernel", "install", "--user", "--name", "cli-user"],
                               capture_output=True, text=True, timeout=60)
    assert installed.returncode == 0, installed.stderr
    removed = subprocess.run(["sandbox-kernel", "uninstall", "--user", "--name", "cli-user"],
                             capture_output=True, text=True, timeout=60)
    spec_dir = Path(os.environ["JUPYTER_DATA_DIR"]) / "kernels" / "cli-user"
    assert (removed.returncode, removed.stdout) == (0, f"Removed kernelspec cli-user from "
                                                       f"{spec_dir}\n")
    assert not spec_dir.exists()


@pytest.mark.parametrize("args, message", [
    (["--inputs", "{not json"], "sandbox-kernel run: --inputs is not valid JSON: Expecting "
     "property name enclosed in double quotes: line 1 column 2 (char 1)\n"),
    (["--inputs", "[1, 2]"], "sandbox-kernel run: --inputs must be a JSON object of main()'s "
     "arguments by name, got list\n"),
    (["--inputs", "@/nonexistent/inputs.json"],
     "sandbox-kernel run: cannot read /nonexistent/inputs.json: No such file or directory\n"),
])
def test_bad_inputs_are_usage_errors(capsys, args, message):
    assert cli.main(["run", str(EXAMPLES / "summarize.py"), *args]) == cli.USAGE_ERROR
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", message)


def test_missing_file_is_a_usage_error(capsys):
    assert cli.main(["run", "/nonexistent/job.py"]) == cli.USAGE_ERROR
    assert capsys.readouterr().err == ("sandbox-kernel run: cannot read /nonexistent/job.py: "
                                       "No such file or directory\n")


def test_unusable_save_dir_is_a_usage_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = ["run", str(EXAMPLES / "summarize.py"), "--save-displays", str(blocker / "sub")]
    assert cli.main(args) == cli.USAGE_ERROR
    assert capsys.readouterr().err == (f"sandbox-kernel run: cannot create {blocker / 'sub'}: "
                                       "Not a directory\n")


def test_usage_error_exits_2_from_the_command_line():
    done = run("/nonexistent/job.py")
    assert (done.returncode, done.stdout) == (cli.USAGE_ERROR, "")
    assert done.stderr == ("sandbox-kernel run: cannot read /nonexistent/job.py: "
                           "No such file or directory\n")


def test_policy_flags_reach_the_kernel():
    code = ("def main():\n    import socket\n    socket.socket().close()\n"
            "    return {'socket': 'made'}\n")
    allowed = run("-", "--allow-network", stdin=code)
    assert (allowed.returncode, json.loads(allowed.stdout)) == (0, {"socket": "made"})
    denied = run("-", stdin=code)
    assert denied.returncode == cli.CODE_FAILED
    assert own_lines(denied.stderr).splitlines()[-1].startswith(
        "PermissionError: [Errno 1] Operation not permitted: the sandbox blocked creating a socket")


def test_a_kernel_that_cannot_start_exits_3():
    # A ZMQ kernel (--cold-start) cannot start its threads in 1 MiB; a one-shot kernel starts
    # no thread and runs a print in it.
    done = run("-", "--cold-start", "--memory-limit", "1M", stdin="print('never')\n")
    assert (done.returncode, done.stdout) == (cli.KERNEL_FAILED, "")
    assert done.stderr.splitlines()[-1].startswith("sandbox-kernel run: the kernel did not start: ")
    assert "never" not in done.stderr


@pytest.mark.parametrize("command", ["install", "run", "check"])
def test_no_landlock_and_no_seccomp_help_says_what_they_do(capsys, command):
    text = help_text(capsys, command)
    assert "--no-landlock Start even without Landlock: untrusted code then has NO file-system " \
        "confinement" in text
    assert "--no-seccomp Start even without the seccomp filter: untrusted code may then " \
        "create processes" in text
    assert "Refuse to start" not in text


def test_the_kernels_own_flags_say_the_same():
    from sandbox_kernel.policy import app_flags

    flags = app_flags()
    assert flags["no-landlock"][1].startswith("Start even without Landlock")
    assert flags["no-seccomp"][1].startswith("Start even without the seccomp filter")


def test_saved_displays_are_bounded_in_count(tmp_path):
    """User code chooses how many displays it makes; --save-displays writes at most N files."""
    code = tmp_path / "many.py"
    code.write_text("from IPython.display import display\nfor i in range(300):\n"
                    "    display({'text/plain': str(i)}, raw=True)\n")
    out = tmp_path / "out"
    done = run(code, "--save-displays", out, "--max-saved-displays", "20")
    assert done.returncode == 1, done.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(f"display-{n}.txt"
                                                          for n in range(1, 21))
    assert own_lines(done.stderr).endswith(
        "sandbox-kernel run: the code made 300 displays; --save-displays wrote the first 20 and "
        "not the other 280 (raise --max-saved-displays to keep more)\n")
    done = run(code, "--save-displays", tmp_path / "default")
    assert done.returncode == 1 and len(list((tmp_path / "default").iterdir())) == 100
    done = run(code, "--save-displays", out, "--max-saved-displays", "0")
    assert done.returncode == 2 and "expected a whole number of at least 1, not '0'" in done.stderr


def test_a_refusal_names_runs_own_flags(tmp_path, monkeypatch):
    """A kernel `run` started says `sandbox-kernel run --grant-cwd`, not how to reinstall a
    kernelspec it never had (#45 item 3); the network refusal names run's flags too."""
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "read.py").write_text("open('data.csv')\n")
    (tmp_path / "fetch.py").write_text("import urllib.request\n"
                                       "urllib.request.urlopen('http://example.com')\n")
    monkeypatch.chdir(tmp_path)
    read = run("read.py")
    assert read.returncode == cli.CODE_FAILED
    assert "to read it by this name, run it again with `sandbox-kernel run FILE --grant-cwd` " \
        "(--grant-cwd=rw to write there too): it then starts in that folder" in read.stderr, \
        read.stderr
    fetch = run("fetch.py")
    assert "the network is off in this sandbox (--network off); to let the code reach the " \
        "hosts it needs, run it again with `sandbox-kernel run FILE --network hosts " \
        "--allow-host NAME` (--network on for any public address), one --allow-host per host" \
        in fetch.stderr, fetch.stderr
    assert "sandbox-kernel install" not in read.stderr + fetch.stderr
