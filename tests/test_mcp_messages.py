"""What a model is told (sandbox_kernel.mcp.messages), from the errors the sandbox produces,
and the `mcp` subcommand's own command line (no kernel needed for either)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest

pytest.importorskip("mcp")

from sandbox_kernel.client import ErrorInfo, Execution
from sandbox_kernel.confine import denials
from sandbox_kernel.mcp import messages
from tests.helpers import write_keys

OPERATOR_WORDS = ("--", "kernelspec", "install", "policy flag")


def said(name: str, value: str, in_session: bool = False, state_lost: bool = False,
         timeout: float | None = 5.0, network: bool = False) -> messages.Said:
    error = ErrorInfo(name, value, ["Cell In[1], line 1", f"{name}: {value}"])
    found = messages.for_model(Execution(error=error, state_lost=state_lost), timeout,
                               in_session, 2**30, network)
    assert found is not None
    return found


@pytest.mark.parametrize("rule", [r for r in denials.RULES if r not in (
    denials.OUTSIDE_GRANTS, denials.READ_ONLY, denials.HIDDEN, denials.NOT_IN_SCRATCH)])
def test_every_refusal_rule_is_said_for_a_model_without_operator_advice(rule):
    value = f"[Errno 1] Operation not permitted: the sandbox blocked something: {rule.why}"
    found = said("PermissionError", value)
    assert found.refused and found.message.endswith(rule.for_model)
    assert rule.why not in found.message and rule.why not in "".join(found.traceback)
    assert not any(word in rule.for_model for word in OPERATOR_WORDS), rule.for_model


@pytest.mark.parametrize("rule", [denials.OUTSIDE_GRANTS, denials.READ_ONLY, denials.HIDDEN,
                                  denials.NOT_IN_SCRATCH])
def test_file_refusals_drop_the_operators_fix_that_follows_the_rule(rule):
    value = (f"[Errno 13] Permission denied: '/srv/x': {rule.why}; to let user code read it, "
             "add it to the kernelspec with `sandbox-kernel install --read-path /srv`")
    found = said("PermissionError", value)
    assert found.message == f"[Errno 13] Permission denied: '/srv/x': {rule.for_model}"
    assert "--read-path" not in "".join(found.traceback)


def test_a_failed_name_lookup_without_network_says_the_network_is_off():
    found = said("URLError", "<urlopen error [Errno -3] Temporary failure in name resolution>")
    assert found.refused and denials.NETWORK_OFF.for_model in found.message
    kept = said("URLError", "<urlopen error [Errno -3] Temporary failure in name resolution>",
                network=True)
    assert not kept.refused and "name resolution" in kept.message


@pytest.mark.parametrize(("in_session", "lost", "expected"), [
    (True, False, "The session's variables and imports are kept."),
    (True, True, "its variables and imports are gone"),
    (False, False, "time limit and was stopped. Make it faster"),
])
def test_a_timeout_says_whether_state_survived(in_session, lost, expected):
    found = said("ExecutionTimeout", "the execution ran longer than its 5 s limit (set by "
                 "Sandbox.run(timeout=)) and was interrupted", in_session, lost)
    assert "its 5 s time limit" in found.message and expected in found.message
    assert "Sandbox.run" not in found.message
    assert found.traceback[-1] == f"ExecutionTimeout: {found.message}"


@pytest.mark.parametrize(("name", "expected"), [
    ("MemoryError", "ran out of memory (this sandbox allows 1,024 MiB)"),
    ("KernelDied", "The session was restarted"),
    ("ResultTooLarge", "write the data to a file"),
    ("PackageInstallError", "use the packages that are installed"),
    ("KeyboardInterrupt", "interrupted. The session's variables are kept."),
])
def test_limits_are_said_with_what_to_do(name, expected):
    found = said(name, "operator text with --max-result", in_session=True)
    assert expected in found.message and "--max-result" not in found.message


def test_the_users_own_errors_are_left_as_they_are():
    found = said("ZeroDivisionError", "division by zero")
    assert found.message == "division by zero" and not found.refused


def test_output_cap_markers_are_said_for_a_model():
    kernel = ("\n[sandbox-kernel: output limit of 1,048,576 bytes per execution reached; 5 more "
              "bytes were dropped (--max-output raises the limit)]\n")
    caller = ("\n[sandbox-kernel client: output limit of 1,048,576 bytes per run reached; 9 "
              "more bytes were dropped (--max-output)]\n")
    for marker in (kernel, caller):
        shown = messages.plain_output("ok" + marker)
        assert shown == "ok" + messages.OUTPUT_CUT and "--" not in shown


def test_cut_keeps_head_and_tail_and_says_how_much_went():
    text = "".join(f"{i:05d}\n" for i in range(10_000))
    shown = messages.cut(text, 3000)
    assert shown.startswith("00000\n") and shown.endswith("09999\n")
    assert f"[... {len(text) - 3000:,} characters cut here" in shown  # head 2/3, tail 1/3
    assert len(shown) < 3300 and messages.cut("short", 3000) == "short"


# --- the command line ----------------------------------------------------------------------

def _mcp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", "mcp", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_print_tools_into_a_pipe_whose_reader_left_ends_quietly():
    # `sandbox-kernel mcp --print-tools openai | head -1`: head leaves after its line, and the
    # writes after that fail. Here the reader leaves before the first byte, every time.
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "mcp", "--print-tools",
                               "openai"], stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=120, check=False)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.parametrize("form", ["openai", "openai-chat"])
def test_print_tools_gives_openai_function_definitions(form):
    done = _mcp("--print-tools", form, "--allow-network")
    assert done.returncode == 0, done.stderr
    tools = json.loads(done.stdout)
    functions = [t if form == "openai" else t["function"] for t in tools]
    assert all(t["type"] == "function" for t in tools)
    by_name = {f["name"]: f for f in functions}
    assert "run_python" in by_name and "write_file" in by_name
    for function in functions:
        jsonschema.Draft202012Validator.check_schema(function["parameters"])
        assert function["description"]
    assert "no network" not in by_name["run_python"]["description"]  # --allow-network


@pytest.mark.parametrize(("args", "says"), [
    (["--http", "127.0.0.1:8999"], "--http needs --keys"),
    (["--keys", "k.json"], "--keys is for --http"),
    (["--http", "127.0.0.1:1", "--keys", "/nonexistent/keys.json"], "cannot read the API keys"),
    (["--http", "nonsense"], "expected HOST:PORT"),
    (["--runtime", "no-such-runtime"], "no runtime named 'no-such-runtime'"),
])
def test_bad_command_lines_are_refused_saying_why(args, says):
    done = _mcp(*args)
    assert done.returncode == 2 and says in done.stderr, done.stderr


def test_a_keys_file_others_may_read_is_refused_as_a_secrets_file_is(tmp_path):
    keys = write_keys(tmp_path / "keys.json", [{"id": "a", "key": "k" * 32}])
    keys.chmod(0o640)
    done = _mcp("--http", "127.0.0.1:1", "--keys", str(keys))
    assert done.returncode == 2
    assert done.stderr == (f"sandbox-kernel mcp: the API keys file {keys}: mode 0640 lets "
                           f"others read it; make it readable by its owner only (chmod 600 "
                           f"{keys})\n")
