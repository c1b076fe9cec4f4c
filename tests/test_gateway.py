"""Jupyter Kernel Gateway serves the sandbox kernel to a client written like the seed executor.

`LocalExecutor` below is the seed's `SandboxExecutor` (shared/seeds/kernel-gateway-executor-example)
with a gateway on 127.0.0.1 in place of the Modal sandbox. Its message handling is the seed's; the
changes are the local `ws://` URL, bounded waits (a receive timeout, a shorter poll that also rides
out "connection refused" while the server starts), a variant of `_send_execute_request` that puts
the main() metadata in, and one fix: after an error the loop reads on to the idle status before it
returns. The seed returns on the error message, which comes before the kernel's execute_reply; a
request sent that early counts as queued behind the failed one and, by the protocol's default
`stop_on_error`, is aborted without output (see test_request_queued_behind_an_error_is_aborted).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.client import RemoteDisconnected
from pathlib import Path
from time import sleep
from typing import Any
from urllib.error import URLError
from urllib.request import Request, urlopen

import pytest
from websockets.sync.client import connect
from websockets.sync.connection import Connection

from tests.helpers import refused_folder

RECV_TIMEOUT = 30.0  # seconds any single message may take; the seed waits forever
POLL_SECONDS = 0.1
POLLS = 300  # so a server gets 30 s to answer
STOP_TIMEOUT = 20.0


# --- the seed executor, pointed at a local server ------------------------------------------------

@dataclass
class ExecutionError:
    """The seed's error record."""

    name: str
    value: str
    traceback: list[str]


@dataclass
class ExecutionResults:
    """The seed's results record: the text result, the logs and the error kept apart."""

    result: str | None = None
    logs: list[str] = field(default_factory=list)
    error: ExecutionError | None = None


@dataclass
class LocalExecutor:
    """The seed's SandboxExecutor, with a local gateway (or Jupyter Server) instead of Modal."""

    host: str
    token: str
    kernel_id: str = ""  # empty: start one through the REST API, as the seed does
    ws_url: str = field(init=False)

    def __post_init__(self) -> None:
        self._wait_for_server(self.host, self.token)
        self.kernel_id = self.kernel_id or self._start_kernel(self.host, self.token)
        self.ws_url = f"ws://{self.host}/api/kernels/{self.kernel_id}/channels?token={self.token}"

    def run_code(self, code: str) -> ExecutionResults:
        """Run code on a fresh websocket connection, as the seed does."""
        with connect(self.ws_url) as ws:
            return self._run_code(ws, code)

    def run_main(self, code: str, inputs: dict) -> ExecutionResults:
        """Run code, then its main(**inputs), through the message metadata."""
        with connect(self.ws_url) as ws:
            return self._run_main(ws, code, inputs)

    @classmethod
    def _execute_request(cls, code: str) -> dict:
        """The seed's execute_request message."""
        return {
            "header": {
                "msg_id": str(uuid.uuid4()),
                "username": "anonymous",
                "session": str(uuid.uuid4()),
                "msg_type": "execute_request",
                "version": "5.0",
            },
            "parent_header": {},
            "metadata": {},
            "content": {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
            },
        }

    @classmethod
    def _send_execute_request(cls, ws: Connection, code: str) -> str:
        """Send the seed's execute_request; return its msg_id."""
        execute_request = cls._execute_request(code)
        ws.send(json.dumps(execute_request))
        return execute_request["header"]["msg_id"]

    @classmethod
    def _send_main_request(cls, ws: Connection, code: str, inputs: dict) -> str:
        """The same request, asking the kernel to call main(**inputs) after the code."""
        execute_request = cls._execute_request(code)
        execute_request["metadata"] = {"sandbox": {"entrypoint": "main", "inputs": inputs}}
        ws.send(json.dumps(execute_request))
        return execute_request["header"]["msg_id"]

    @classmethod
    def _run_code(cls, ws: Connection, code: str) -> ExecutionResults:
        """Run code on the websocket connection."""
        return cls._collect(ws, cls._send_execute_request(ws, code))

    @classmethod
    def _run_main(cls, ws: Connection, code: str, inputs: dict) -> ExecutionResults:
        """Run code and its main(**inputs) on the websocket connection."""
        return cls._collect(ws, cls._send_main_request(ws, code, inputs))

    @classmethod
    def _collect(cls, ws: Connection, msg_id: str) -> ExecutionResults:
        """The seed's receive loop: stream logs, the text result, or the error, until idle."""
        result = None
        logs = []
        error = None

        while True:
            msg = json.loads(ws.recv(timeout=RECV_TIMEOUT))
            parent_msg_id = msg.get("parent_header", {}).get("msg_id")
            if parent_msg_id != msg_id:
                continue
            msg_type = msg.get("msg_type", "")
            msg_content = msg.get("content", {})
            if msg_type == "stream":
                logs.append(msg_content["text"])
            elif msg_type == "execute_result":
                result = msg_content["data"].get("text/plain", None)
            elif msg_type == "error":
                traceback = [
                    _strip_ansi_colors(line)
                    for line in msg_content.get("traceback", [])
                ]
                error = ExecutionError(
                    name=msg_content.get("ename", ""),
                    value=msg_content.get("evalue", ""),
                    traceback=traceback,
                )
            elif msg_type == "status" and msg_content["execution_state"] == "idle":
                break

        if error is not None:  # the seed returns here as soon as the error arrives: see above
            return ExecutionResults(error=error)
        return ExecutionResults(result=result, logs=logs)

    @classmethod
    def _wait_for_server(cls, host: str, token: str) -> None:
        """Wait for server to start up."""
        counter = 0
        req = Request(f"http://{host}/api/kernelspecs?token={token}", method="GET")
        while True:
            try:
                with urlopen(req):
                    pass
                break
            except (URLError, RemoteDisconnected, ConnectionError):  # URLError: not yet bound
                counter += 1
                if counter > POLLS:
                    raise RuntimeError("Unable to connect to sandbox") from None
            sleep(POLL_SECONDS)

    @classmethod
    def _start_kernel(cls, host: str, token: str) -> str:
        """Start kernel."""
        kernels_url = f"http://{host}/api/kernels?token={token}"
        req = Request(kernels_url, method="POST")
        with urlopen(req) as response:
            body = response.read()
            json_resp = json.loads(body)

        return json_resp["id"]


ANSI_ESCAPE = re.compile(r"\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])")


def _strip_ansi_colors(text: str) -> str:
    """Remove ansi colors from text."""
    return ANSI_ESCAPE.sub("", text)


# --- raw protocol messages over the same websocket -----------------------------------------------

def send_request(ws: Connection, msg_type: str, content: dict, metadata: dict | None = None) -> str:
    """Send any shell request over a kernel's websocket channel; return its msg_id."""
    msg_id = str(uuid.uuid4())
    ws.send(json.dumps({
        "header": {"msg_id": msg_id, "username": "test", "session": str(uuid.uuid4()),
                   "msg_type": msg_type, "version": "5.3"},
        "parent_header": {}, "metadata": metadata or {}, "content": content,
        "channel": "shell"}))
    return msg_id


def answers(ws: Connection, msg_id: str) -> list[dict]:
    """Every message answering msg_id, until both its shell reply and the idle status came."""
    return answers_of(ws, [msg_id])[msg_id]


def answers_of(ws: Connection, msg_ids: list[str]) -> dict[str, list[dict]]:
    """The messages answering each request, read together: the shell and IOPub channels share
    the websocket but not an order, so one request's reply may come after the next one's idle."""
    found: dict[str, list[dict]] = {msg_id: [] for msg_id in msg_ids}

    def complete(messages: list[dict]) -> bool:
        return any(is_reply(m) for m in messages) and any(is_idle(m) for m in messages)

    while not all(complete(messages) for messages in found.values()):
        msg = json.loads(ws.recv(timeout=RECV_TIMEOUT))
        parent = msg.get("parent_header", {}).get("msg_id")
        if parent in found:
            found[parent].append(msg)
    return found


def is_reply(msg: dict) -> bool:
    """Whether msg is a shell reply (it may arrive before or after the IOPub messages)."""
    return msg["msg_type"].endswith("_reply")


def is_idle(msg: dict) -> bool:
    """Whether msg is the kernel's "idle" status."""
    return msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"


def contents(messages: list[dict], msg_type: str) -> list[dict]:
    """The contents of the messages of one type, in order."""
    return [m["content"] for m in messages if m["msg_type"] == msg_type]


def kernel_info(ws_url: str) -> dict:
    """The kernel_info_reply content of the kernel behind a websocket URL."""
    with connect(ws_url) as ws:
        msg_id = send_request(ws, "kernel_info_request", {})
        [info] = contents(answers(ws, msg_id), "kernel_info_reply")
    return info


# --- server processes ----------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """SIGTERM (servers then shut their kernels down), SIGKILL if that takes too long."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT)


@contextmanager
def serving(args: list[str], host: str, token: str, log_path: Path) -> Iterator[subprocess.Popen]:
    """Run `jupyter <args>` with this session's isolated environment until the block ends."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "jupyter", *args], stdout=log,
                                   stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            try:
                LocalExecutor._wait_for_server(host, token)
            except RuntimeError:
                pytest.fail(f"jupyter {args[0]} did not answer:\n{log_path.read_text()}")
            yield process
        finally:
            stop(process)


def get_json(host: str, path: str, token: str) -> Any:
    """GET a REST path with the token, parsed from JSON."""
    with urlopen(f"http://{host}{path}?token={token}", timeout=RECV_TIMEOUT) as response:
        return json.loads(response.read())


# --- the gateway ---------------------------------------------------------------------------------

@dataclass
class Gateway:
    """A running gateway: where it listens, its token and the kernels it spawned in advance."""

    host: str
    port: int
    token: str
    prespawned: list[dict]


def wait_for_prespawned(host: str, token: str) -> list[dict]:
    """The kernels the gateway spawned at start-up (it registers them just after it listens)."""
    deadline = time.monotonic() + POLLS * POLL_SECONDS
    while time.monotonic() < deadline:
        kernels = get_json(host, "/api/kernels", token)
        if kernels:
            return kernels
        sleep(POLL_SECONDS)
    pytest.fail("the gateway spawned no kernel in advance")


@pytest.fixture(scope="module")
def gateway(kernelspecs, tmp_path_factory) -> Iterator[Gateway]:
    """One Kernel Gateway for this module, defaulting to (and pre-spawning) the sandbox kernel."""
    port, token = free_port(), secrets.token_urlsafe(13)
    host = f"127.0.0.1:{port}"
    args = ["kernelgateway", "--KernelGatewayApp.ip=127.0.0.1", f"--KernelGatewayApp.port={port}",
            "--KernelGatewayApp.port_retries=0", f"--KernelGatewayApp.auth_token={token}",
            "--KernelGatewayApp.default_kernel_name=sandbox",
            "--KernelGatewayApp.prespawn_count=1",
            "--JupyterWebsocketPersonality.list_kernels=True"]
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with serving(args, host, token, log):
        yield Gateway(host, port, token, wait_for_prespawned(host, token))


@pytest.fixture(scope="module")
def executor(gateway) -> LocalExecutor:
    """The seed-style executor, with a kernel it started through the gateway's REST API."""
    return LocalExecutor(gateway.host, gateway.token)


def test_statement_has_no_result_logs_or_error(executor):
    assert executor.run_code("a = 10") == ExecutionResults(result=None, logs=[], error=None)


def test_expression_gives_its_value_as_result(executor):
    executor.run_code("a = 10")
    assert executor.run_code("a") == ExecutionResults(result="10", logs=[], error=None)


# ipykernel flushes stdout on a 0.2 s timer, so now and then one print() arrives as two stream
# chunks (plain ipykernel does this too): the tests compare the logs' joined text.
def test_print_goes_to_logs_not_result(executor):
    executor.run_code("a = 10")
    output = executor.run_code("print(a + 100)")
    assert (output.result, output.error) == (None, None)
    assert "".join(output.logs) == "110\n"


def test_error_has_name_value_and_plain_traceback(executor):
    executor.run_code("a = 10")
    output = executor.run_code("a/0")
    assert (output.result, output.logs) == (None, [])
    assert (output.error.name, output.error.value) == ("ZeroDivisionError", "division by zero")
    assert output.error.traceback[-1] == "ZeroDivisionError: division by zero"
    assert "----> 1 a/0" in "".join(output.error.traceback)
    assert not any("\x1b" in line for line in output.error.traceback)


MAIN_CODE = """
def main(x, label="sum"):
    print("computing", x)
    return {"label": label, "doubled": x * 2}
"""


def test_main_through_metadata_keeps_logs_out_of_the_result(executor):
    output = executor.run_main(MAIN_CODE, {"x": 21})
    assert "".join(output.logs) == "computing 21\n"
    assert output.error is None
    assert json.loads(output.result) == {"label": "sum", "doubled": 42}


def test_main_result_is_one_json_execute_result(executor):
    metadata = {"sandbox": {"entrypoint": "main", "inputs": {"x": 4, "label": "four"}}}
    with connect(executor.ws_url) as ws:
        msg_id = send_request(ws, "execute_request", {"code": MAIN_CODE, "silent": False},
                              metadata)
        results = contents(answers(ws, msg_id), "execute_result")
    assert len(results) == 1
    data = results[0]["data"]
    assert set(data) == {"application/json", "text/plain"}
    assert data["application/json"] == {"label": "four", "doubled": 8}
    assert json.loads(data["text/plain"]) == {"label": "four", "doubled": 8}
    assert results[0]["metadata"] == {"sandbox": {"entrypoint": "main"}}


SLOW_FAILURE = "import time\ntime.sleep(0.5)\n1/0"


def statuses_of_back_to_back_requests(ws_url: str, stop_on_error: bool) -> list[str]:
    """execute_reply statuses of a failing request and one sent while it still runs."""
    with connect(ws_url) as ws:
        failing = send_request(ws, "execute_request", {"code": SLOW_FAILURE,
                                                       "stop_on_error": stop_on_error})
        queued = send_request(ws, "execute_request", {"code": "queued = 1"})
        found = answers_of(ws, [failing, queued])
        return [contents(found[msg_id], "execute_reply")[0]["status"]
                for msg_id in (failing, queued)]


def test_request_queued_behind_an_error_is_aborted(executor):
    assert statuses_of_back_to_back_requests(executor.ws_url, True) == ["error", "aborted"]


def test_request_queued_behind_an_error_runs_without_stop_on_error(executor):
    assert statuses_of_back_to_back_requests(executor.ws_url, False) == ["error", "ok"]


def test_kernel_cannot_create_processes(executor):
    error = executor.run_code("import os; os.fork()").error
    assert error.name == "PermissionError"
    assert "the sandbox blocked os.fork()" in error.value


def test_kernel_cannot_connect_back_to_the_gateway(executor, gateway):
    code = f"import socket; socket.create_connection(('127.0.0.1', {gateway.port}), timeout=5)"
    error = executor.run_code(code).error
    assert error.name == "PermissionError"
    assert "the sandbox blocked creating a socket" in error.value


def test_kernel_cannot_read_the_gateway_runtime_dir(executor):
    runtime_dir = os.environ["JUPYTER_RUNTIME_DIR"]
    error = executor.run_code(f"import os; os.listdir({runtime_dir!r})").error
    uid = int(executor.run_code("os.getuid()").result)
    assert (error.name, error.value) == ("PermissionError", (
        f"[Errno 13] Permission denied: {runtime_dir!r}: {refused_folder(runtime_dir, uid)}"))


def test_prespawned_kernel_is_the_sandbox_kernel(gateway):
    assert [kernel["name"] for kernel in gateway.prespawned] == ["sandbox"]
    prespawned = LocalExecutor(gateway.host, gateway.token, kernel_id=gateway.prespawned[0]["id"])
    info = kernel_info(prespawned.ws_url)
    assert info["implementation"] == "sandbox_kernel"
    assert info["sandbox"]["layers"]["seccomp"]["active"] is True
    assert info["sandbox"]["layers"]["landlock"]["active"] is True
    assert prespawned.run_code("import os; os.fork()").error.name == "PermissionError"


def test_gateway_lists_and_defaults_to_the_sandbox_kernelspec(gateway):
    specs = get_json(gateway.host, "/api/kernelspecs", gateway.token)
    assert specs["default"] == "sandbox"
    assert specs["kernelspecs"]["sandbox"]["spec"]["display_name"] == "Python 3 (sandbox)"
