"""Protocol conformance: jupyter_kernel_test's suite, lifecycle, comms, and what is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator

import jupyter_kernel_test as jkt  # not `from ... import KernelTests`: pytest would collect it
import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager, start_new_kernel

from sandbox_kernel.install import install
from sandbox_kernel.kernel.kernel import DEBUGGER_REFUSED
from sandbox_kernel.policy import SandboxPolicy

TIMEOUT = 30


class TestSandboxKernelConformance(jkt.KernelTests):
    """The community's message-level kernel tests, against the installed "sandbox" kernelspec."""

    kernel_name = "sandbox"
    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = ({"text": "zi", "matches": {"zip"}},
                          {"text": "pri", "matches": {"print"}})
    complete_code_samples = ("1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n")
    incomplete_code_samples = ("print('''hello", "def f(x):\n  x*2")
    invalid_code_samples = ("import = 7q",)
    code_page_something = "zip?"
    code_generate_error = "raise Exception('oops')"
    code_execute_result = ({"code": "1+2+3", "result": "6"},
                           {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"})
    code_display_data = (
        {"code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
         "mime": "text/html"},
        {"code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
         "mime": "text/latex"},
    )
    code_history_pattern = "1?2*"
    # "range" is left out as for plain ipykernel: IPython reports the current session as 0.
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"

    @classmethod
    def setUpClass(cls) -> None:
        # unittest classes get no pytest fixtures: install into this session's isolated data dir
        install(SandboxPolicy(), name="sandbox", user=True)
        super().setUpClass()


# --- beyond the suite: lifecycle, comms and what the sandbox refuses --------------------------

@pytest.fixture
def kernel(kernelspecs) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """A sandbox kernel of its own, started by jupyter_client from the kernelspec."""
    km, kc = start_new_kernel(kernel_name="sandbox", startup_timeout=TIMEOUT)
    yield km, kc
    kc.stop_channels()
    if km.has_kernel:
        km.shutdown_kernel()


@pytest.fixture(scope="module")
def shared_client(kernelspecs) -> Iterator[BlockingKernelClient]:
    """One kernel for the tests that leave no state behind."""
    km, kc = start_new_kernel(kernel_name="sandbox", startup_timeout=TIMEOUT)
    yield kc
    kc.stop_channels()
    km.shutdown_kernel()


def execute(kc: BlockingKernelClient, code: str) -> tuple[dict, list[dict]]:
    """Run code; the execute_reply content and the IOPub messages it produced."""
    messages: list[dict] = []
    reply = kc.execute_interactive(code, timeout=TIMEOUT, allow_stdin=False,
                                   output_hook=messages.append)
    return reply["content"], messages


def result_text(kc: BlockingKernelClient, code: str) -> str:
    """The text/plain result of code that must succeed."""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    return next(m["content"]["data"]["text/plain"] for m in messages
                if m["msg_type"] == "execute_result")


def start_busy_loop(kc: BlockingKernelClient) -> str:
    """Start an endless loop in the kernel and return once it is surely running."""
    msg_id = kc.execute("x = 5\nprint('looping', flush=True)\nwhile True:\n    pass")
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            return msg_id


def execute_reply(kc: BlockingKernelClient, msg_id: str) -> dict:
    """The execute_reply content for msg_id, once the kernel is idle again.

    After an error the kernel aborts requests that reach it before it goes idle (stop_on_error).
    """
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status" \
                and msg["content"]["execution_state"] == "idle":
            return reply["content"]


def control_request(kc: BlockingKernelClient, msg_type: str, content: dict) -> dict:
    """Send a request on the control channel; its reply content."""
    msg = kc.session.msg(msg_type, content)
    kc.control_channel.send(msg)
    while True:
        reply = kc.control_channel.get_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply["content"]


def test_signal_interrupt_stops_a_busy_loop(kernel):
    km, kc = kernel
    msg_id = start_busy_loop(kc)
    km.interrupt_kernel()  # interrupt_mode "signal": SIGINT from outside, as Jupyter Server does
    assert execute_reply(kc, msg_id)["ename"] == "KeyboardInterrupt"
    assert result_text(kc, "x") == "5"


def test_message_interrupt_stops_a_busy_loop_and_replies_ok(kernel):
    _, kc = kernel
    msg_id = start_busy_loop(kc)
    reply = control_request(kc, "interrupt_request", {})
    assert execute_reply(kc, msg_id)["ename"] == "KeyboardInterrupt"
    assert reply == {"status": "ok"}, "interrupt_request must not report its own refused killpg"
    assert result_text(kc, "x") == "5"


def test_restart_gives_a_fresh_confined_kernel(kernel):
    km, kc = kernel
    pid_before = result_text(kc, "gone = 1\nimport os\nos.getpid()")
    km.restart_kernel(now=False)  # a shutdown_request with restart=True, then a new process
    kc.wait_for_ready(timeout=TIMEOUT)
    reply, _ = execute(kc, "gone")
    assert reply["ename"] == "NameError"
    assert result_text(kc, "import os\nos.getpid()") != pid_before
    assert execute(kc, "os.fork()")[0]["ename"] == "PermissionError"


def test_shutdown_request_ends_the_process(kernel):
    km, kc = kernel
    assert control_request(kc, "shutdown_request", {"restart": False}) == {
        "status": "ok", "restart": False}
    process = km.provisioner.process
    assert process.wait(timeout=TIMEOUT) == 0


COMM_TARGET = """
from comm import get_comm_manager

def echo_target(comm, open_msg):
    comm.on_msg(lambda msg: comm.send({"echo": msg["content"]["data"]}))
    comm.send({"opened": open_msg["content"]["data"]})

get_comm_manager().register_target("echo", echo_target)
"""


def comm_data(kc: BlockingKernelClient, comm_id: str) -> dict:
    """The data of the next comm_msg the kernel sends on comm_id."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == comm_id:
            return msg["content"]["data"]
    raise AssertionError(f"no comm_msg on {comm_id}")


def test_comms_open_message_info_and_close(shared_client):
    kc = shared_client
    assert execute(kc, COMM_TARGET)[0]["status"] == "ok"
    kc.shell_channel.send(kc.session.msg(
        "comm_open", {"comm_id": "c-1", "target_name": "echo", "data": {"hello": 1}}))
    assert comm_data(kc, "c-1") == {"opened": {"hello": 1}}
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": "c-1", "data": {"x": 2}}))
    assert comm_data(kc, "c-1") == {"echo": {"x": 2}}
    info = kc.comm_info(target_name="echo", reply=True, timeout=TIMEOUT)["content"]
    assert info == {"status": "ok", "comms": {"c-1": {"target_name": "echo"}}}
    kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": "c-1", "data": {}}))
    info = kc.comm_info(target_name="echo", reply=True, timeout=TIMEOUT)["content"]
    assert info == {"status": "ok", "comms": {}}


REFUSED_CODE = {
    "shell escape": "!ls",
    "shell capture": "files = !ls",
    "%system": "%system ls",
    "%sx": "%sx ls",
    "%%bash": "%%bash\necho hi",
    "%%sh": "%%sh\necho hi",
    "%%script": "%%script python3\nprint(1)",
    "os.system": "import os\nos.system('ls')",
    "subprocess": "import subprocess\nsubprocess.run(['ls'])",
    "multiprocessing": "import multiprocessing\nmultiprocessing.Process(target=print).start()",
}


@pytest.mark.parametrize("code", REFUSED_CODE.values(), ids=REFUSED_CODE.keys())
def test_process_creation_is_refused_with_a_clear_message(shared_client, code):
    reply, _ = execute(shared_client, code)
    assert reply["status"] == "error"
    assert reply["ename"] == "PermissionError", reply["evalue"]
    assert "the sandbox blocked" in reply["evalue"]
    assert "creating processes is not allowed in the sandbox" in reply["evalue"]
    assert result_text(shared_client, "'still answering'") == "'still answering'"


def test_pip_installs_in_process_and_says_which_setting_lets_it_reach_an_index(shared_client):
    # %pip is the sandbox's own in-kernel installer (kernel/pip.py), not a process: with the
    # network off it refuses at once and names the flag.
    reply, _ = execute(shared_client, "%pip install requests")
    assert reply["status"] == "error"
    assert reply["ename"] == "PackageInstallError", reply["evalue"]
    assert "the network is off in this sandbox (--network off)" in reply["evalue"]
    assert result_text(shared_client, "'still answering'") == "'still answering'"


@pytest.mark.parametrize("command", ["initialize", "attach", "dumpCell"])
def test_debugger_is_refused_and_not_advertised(shared_client, command):
    reply = control_request(shared_client, "debug_request",
                            {"type": "request", "seq": 7, "command": command, "arguments": {}})
    assert reply == {"type": "response", "request_seq": 7, "success": False,
                     "command": command, "message": DEBUGGER_REFUSED}
    info = shared_client.kernel_info(reply=True, timeout=TIMEOUT)["content"]
    assert "debugger" not in info["supported_features"]
