"""The agent frameworks' own interfaces (sandbox_kernel/frameworks/, docs/agents.md, #47 item 3):
each driven end to end by the real framework package and its own scripted or fake model, in a
venv of its own with that extra alone (tests/extras_venv.py; their pins conflict with [test]).

Each framework's runnable block of docs/agents.md is run as written in that venv: an agent whose
code calls two host tools, one holding a secret the host's environment has and the sandbox
must never see. The block's `pip install -e '.[extra]'` line is the command extras_venv.py builds
the venv with (checked below).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from . import extras_venv
from .test_extras import alone
from .test_gateway import free_port

AGENTS = extras_venv.CHECKOUT / "docs" / "agents.md"
BLOCK = re.compile(r"<!-- runnable: tests/test_frameworks.py runs it in the \[([\w-]+)\] venv "
                   r"-->\n```bash\n(.*?)```", re.S)
INSTALL = re.compile(r"^pip install -e '\.\[([\w,-]+)\]'", re.M)
SECRET = "sk-live-do-not-leak"
FRAMEWORKS = extras_venv.FRAMEWORKS
RUN_TIMEOUT = 300
CHECKS = Path(__file__).resolve().parent / "frameworks"
# Put on a recipe's PYTHONPATH (the kernels run `python -I`, so only the host process loads it):
# every connection or name look-up the host process makes beyond loopback, one line each.
NETWORK_AUDIT = """
import os, sys

LOG = os.environ["NETWORK_AUDIT_LOG"]
LOCAL = {None, "", "localhost", "127.0.0.1", "::1", b"localhost", b"127.0.0.1"}


def audit(event, args):
    if event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex"):
        host = args[0]
    elif event in ("socket.connect", "socket.sendto") and isinstance(args[1], tuple):
        host = args[1][0]
    else:
        return
    if host not in LOCAL:
        with open(LOG, "a") as log:
            log.write(f"{event} {args[1:] if event.startswith('socket.c') else args!r}\\n")


sys.addaudithook(audit)
"""


def blocks(extra: str) -> list[str]:
    """docs/agents.md's runnable blocks for that extra's venv, in order."""
    return [block for name, block in BLOCK.findall(AGENTS.read_text()) if name == extra]


def run_in(extra: str, block: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """A doc block in bash, with that extra's venv first on PATH (as if activated), and a
    Jupyter data dir of its own: a kernelspec a recipe installs (`sandbox-kernel install --user
    --name sandbox`, for Kernel Gateway) must not replace the session's, which later tests'
    kernels start from (they then ran on that venv's interpreter)."""
    bin_dir = alone(extra)
    environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
               "VIRTUAL_ENV": str(bin_dir.parent), "JUPYTER_DATA_DIR": str(cwd / "jupyter-data"),
               **env}
    environ.pop("BANK_API_KEY", None)
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)


def checks(extra: str, script: str, cwd: Path) -> dict:
    """Run tests/frameworks/<script> in that extra's venv; the JSON object it prints last."""
    done = run_in(extra, f"python {CHECKS / script}", cwd)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def lines(text: str) -> dict[str, str]:
    """`label: value` lines of a script's output."""
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def test_each_framework_has_a_recipe_installed_with_its_extra():
    text = AGENTS.read_text()
    extras = extras_venv._project()["project"]["optional-dependencies"]
    for extra in FRAMEWORKS:
        assert extra in extras, extra
        assert blocks(extra), f"docs/agents.md has no runnable block for [{extra}]"
    for installed in INSTALL.findall(text):
        assert all(extra in extras for extra in installed.split(",")), installed


@pytest.mark.slow
def test_each_module_without_its_framework_names_the_extra_and_the_command():
    python = alone(extras_venv.BASE) / "python"
    for extra in FRAMEWORKS:
        module = extra.replace("-", "_")
        done = subprocess.run([str(python), "-c", f"import sandbox_kernel.frameworks.{module}"],
                              capture_output=True, text=True, timeout=120)
        fix = f"{python} -m pip install -e '{extras_venv.CHECKOUT}[{extra}]'"
        assert done.returncode == 1, (extra, done.stderr)
        assert done.stderr.rstrip().endswith(f"install the [{extra}] extra: {fix}"), done.stderr


def agent_said(extra: str, cwd: Path, **env: str) -> dict[str, str]:
    """Run the extra's first recipe (an agent whose code calls both host tools, account_balance
    first) and check what every recipe prints; its lines by label."""
    done = run_in(extra, blocks(extra)[0], cwd, **env)
    assert done.returncode == 0, done.stderr[-4000:]
    said = lines(done.stdout)
    pid = said["this process"]  # the tool's process: the host's
    assert said["the sandbox printed"] == \
        f"['sunny in Paris, 21 C 1234 {pid}', 'key in the sandbox: None']"
    assert said["tool calls"] == "['account_balance', 'get_weather']"
    assert said["answer"] == "Paris is sunny and acme holds 1234."
    return said


@pytest.mark.slow
def test_smolagents_code_agent_calls_host_tools_from_the_sandbox(tmp_path):
    [recipe] = blocks("smolagents")
    done = run_in("smolagents", recipe, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    said = lines(done.stdout)
    assert said["answer"].startswith("sunny in Paris, 21 C; balance 1234; tool pid "), said
    assert said["tools ran in this process"] == "True"
    assert said["tool calls"] == "['get_weather', 'account_balance', 'final_answer']"
    assert said["the sandbox printed"] == \
        "['sunny in Paris, 21 C 1234', 'key in the sandbox: None']"
    assert SECRET not in done.stdout.replace(f'"{SECRET}"', "")


@pytest.mark.slow
def test_smolagents_executor_maps_steps_errors_refusals_and_timeouts(tmp_path):
    seen = checks("smolagents", "smolagents_checks.py", tmp_path)
    assert seen["step"] == ["12", "sum 6\n", False]  # a variable sent, a class tool, the value
    assert seen["host_pid"][0] == repr(seen["host_pid"][1])  # the tool ran in the host process
    assert seen["default_applied"] == "'none'"  # the tool's own default, applied on the host
    assert seen["tool_error"].endswith("ToolError: lookup(): ValueError: the host's lookup failed")
    assert "/ 0" in seen["zero"] and seen["zero"].endswith("ZeroDivisionError: division by zero")
    assert seen["subprocess"].endswith("creating processes is not allowed in the sandbox (no "
                                       "policy flag allows it: run external programs outside "
                                       "the kernel)")
    assert seen["budget"].endswith("double(): this run's budget of 5 tool calls is spent")
    assert seen["timeout"].endswith("ran longer than its 3 s limit (set by Sandbox.run("
                                    "timeout=)) and was interrupted")
    assert seen["kept_after_timeout"] == "42"  # the variables survived the timeout
    assert seen["secret_visible"] == "False"
    assert seen["final"] == ["{'total': 6, 'set': {1}}", True]  # not JSON: its str()
    assert seen["non_json_variable"].startswith("the sandbox takes only JSON values")


@pytest.mark.slow
def test_autogen_assistant_runs_code_that_calls_host_tools(tmp_path):
    agent_said("autogen", tmp_path)


@pytest.mark.slow
def test_autogen_executor_maps_blocks_languages_errors_timeouts_and_cancellation(tmp_path):
    seen = checks("autogen", "autogen_checks.py", tmp_path)
    assert seen["two_blocks"] == [0, "21\n40"]  # one kernel: the second block sees x
    assert seen["host_pid"][0] == [0, str(seen["host_pid"][1])]  # the tool ran on the host
    exit_code, said = seen["shell"]
    assert exit_code == 1 and said.startswith("before\nthis sandbox runs Python only and "
                                              "creates no processes, so `bash` blocks")
    assert seen["other_language"] == [1, "this sandbox runs Python only: not javascript"]
    exit_code, said = seen["error"]
    assert exit_code == 1 and said.startswith("so far\n") and "9" not in said.splitlines()
    assert said.endswith("ZeroDivisionError: division by zero")
    exit_code, said = seen["timeout"]
    assert exit_code == 124 and said.endswith("ran longer than its 3 s limit (set by "
                                              "Sandbox.run(timeout=)) and was interrupted")
    assert seen["kept"] == [0, "20"]
    assert seen["cancelled"] is True
    assert seen["after_cancel"] == [0, "(20, 1)"]  # interrupted, its variables kept
    assert seen["after_restart"] == [0, "(False, True)"]  # a fresh kernel, the tool still bound
    assert seen["agent"] == "True"  # CodeExecutorAgent ran a block that called the host tool


@pytest.mark.slow
def test_autogen_docker_jupyter_executor_reaches_the_sandbox_through_kernel_gateway(tmp_path):
    recipe = blocks("autogen")[1]
    done = run_in("autogen", recipe, tmp_path, PORT=str(free_port()))
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    said = lines(done.stdout)
    assert said["exit code"] == "0"
    assert said["state kept"] == "42"
    assert "no subprocesses" in said["subprocess"] or "not allowed" in said["subprocess"], said


@pytest.mark.slow
def test_llamaindex_codeact_agent_calls_host_tools_from_a_stateful_session(tmp_path):
    said = agent_said("llamaindex", tmp_path)
    assert said["the next step saw"] == "2468"  # the first step's variable, a step later


@pytest.mark.slow
def test_llamaindex_session_answers_errors_timeouts_and_refusals(tmp_path):
    seen = checks("llamaindex", "llamaindex_checks.py", tmp_path)
    assert seen["description"].startswith("execute(code: 'str') -> 'dict[str, Any]'\nExecute "
                                          "Python code in the sandbox")
    assert seen["step"] == {"stdout": "x is 5\n", "stderr": "", "output": str(seen["host_pid"]),
                            "error": None}
    assert seen["error"]["error"].endswith("ZeroDivisionError: division by zero")
    assert seen["timeout"]["error"].endswith("ran longer than its 3 s limit (set by "
                                             "Sandbox.run(timeout=)) and was interrupted")
    assert "creating processes is not allowed in the sandbox" in seen["subprocess"]["error"]
    assert seen["kept"]["output"] == "10"  # after the timeout and the refusal
    assert seen["as_the_agent_reads_it"] == \
        "{'stdout': '', 'stderr': '', 'output': '6', 'error': None}"


@pytest.mark.slow
def test_langchain_agent_calls_host_tools_through_the_python_tool(tmp_path):
    said = agent_said("langchain", tmp_path)
    assert said["the next call saw"] == "2468"  # the session kept the first call's variable


@pytest.mark.slow
def test_pydantic_ai_code_toolset_calls_host_tools_from_a_session(tmp_path):
    said = agent_said("pydantic-ai", tmp_path)
    assert said["the next call saw"] == "2468"  # the session kept the first call's variable


@pytest.mark.slow
def test_openai_agents_runner_calls_host_tools_through_the_function_tool_offline(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(NETWORK_AUDIT)
    log = tmp_path / "network.log"
    # An API key the SDK would use, were it to reach for the network (traces, a default model).
    offline = {"PYTHONPATH": str(hooks), "NETWORK_AUDIT_LOG": str(log),
               "OPENAI_API_KEY": "sk-test-not-a-real-key"}
    said = agent_said("openai-agents", tmp_path, **offline)
    assert said["the next call saw"] == "2468"  # the session kept the first call's variable
    assert not log.exists(), log.read_text()
    # The audit hook does see a look-up: the check above can fail.
    done = run_in("openai-agents", "python -c \"import socket\ntry:\n socket.getaddrinfo("
                  "'example.invalid', 443)\nexcept OSError:\n pass\"", tmp_path, **offline)
    assert done.returncode == 0, done.stderr
    assert log.read_text().startswith("socket.getaddrinfo ('example.invalid', 443"), \
        log.read_text()


@pytest.mark.slow
def test_openai_agents_tool_answers_errors_timeouts_refusals_across_event_loops(tmp_path):
    seen = checks("openai-agents", "openai_agents_checks.py", tmp_path)
    assert seen["context_tool"] == "tool 'who' takes the run's context, which cannot reach " \
        "the sandbox: give it a function of its arguments alone"
    assert seen["schema"]["required"] == ["code"]
    assert seen["schema"]["additionalProperties"] is False  # strict, as the SDK wants
    # a hand-made FunctionTool: its on_invoke_tool ran on the host, with no run context
    assert json.loads(ast.literal_eval(seen["hand_made"])) == \
        {"tripled": 15, "context": None, "pid": seen["host_pid"]}
    assert seen["error"].startswith("so far\n")
    assert seen["error"].endswith("ZeroDivisionError: division by zero")
    assert seen["timeout"].endswith("ran longer than its 3 s limit (set by Sandbox.run("
                                    "timeout=)) and was interrupted")
    assert seen["subprocess"].endswith("creating processes is not allowed in the sandbox (no "
                                       "policy flag allows it: run external programs outside "
                                       "the kernel)")
    assert seen["kept"] == "10"  # a later Runner.run_sync, another loop: the same session
    assert seen["runs"] == 5  # the call below, without code, ran nothing
    assert seen["bad_arguments"] == 'run_python takes {"code": "<Python source>"}, not ' \
        '{"source":"1"}'


@pytest.mark.slow
def test_pydantic_ai_reaches_the_mcp_server_as_a_toolset(tmp_path):
    done = run_in("pydantic-ai", blocks("pydantic-ai")[1], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    said = lines(done.stdout)
    assert said["value"] == "42"
    # The MCP server's wording for a model, not the operator's
    assert said["refused"].endswith("the sandbox blocked os.system(): no subprocesses in this "
                                    "sandbox: you cannot run programs or shell commands; do "
                                    "the work in Python (call the library directly instead of "
                                    "its command-line tool)")
