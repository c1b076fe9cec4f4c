"""Jupyter Server (what JupyterLab talks to) lists, starts, drives, interrupts and restarts it."""

from __future__ import annotations

import json
import os
import secrets
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
from websockets.sync.client import connect
from websockets.sync.connection import Connection

from tests.helpers import refused_folder
from tests.test_gateway import (
    RECV_TIMEOUT,
    ExecutionResults,
    LocalExecutor,
    answers,
    contents,
    free_port,
    kernel_info,
    serving,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class Server:
    """A running Jupyter Server: where it listens, its token and the directory it serves."""

    host: str
    token: str
    root_dir: Path

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        """An authenticated REST call; its status and raw body (errors included)."""
        data = None if body is None else json.dumps(body).encode()
        request = Request(f"http://{self.host}{path}", data=data, method=method,
                          headers={"Authorization": f"token {self.token}"})
        try:
            with urlopen(request, timeout=RECV_TIMEOUT) as response:
                return response.status, response.read()
        except HTTPError as exc:
            return exc.code, exc.read()

    def json(self, method: str, path: str, body: dict | None = None) -> Any:
        """An authenticated REST call that must succeed; its JSON answer."""
        status, payload = self.call(method, path, body)
        assert status in (200, 201), (status, payload)
        return json.loads(payload)


@pytest.fixture(scope="module")
def server(kernelspecs, tmp_path_factory) -> Iterator[Server]:
    """One Jupyter Server for this module, serving a temporary root dir."""
    port, token = free_port(), secrets.token_urlsafe(13)
    root = tmp_path_factory.mktemp("server-root")
    args = ["server", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
            "--ServerApp.open_browser=False", f"--ServerApp.root_dir={root}"]
    if os.geteuid() == 0:
        args.append("--ServerApp.allow_root=True")  # the server refuses root otherwise
    with serving(args, f"127.0.0.1:{port}", token, root.parent / f"{root.name}.log"):
        yield Server(f"127.0.0.1:{port}", token, root)


@pytest.fixture
def kernel(server) -> Iterator[LocalExecutor]:
    """A sandbox kernel started the way JupyterLab starts one; deleted afterwards."""
    model = server.json("POST", "/api/kernels", {"name": "sandbox"})
    yield LocalExecutor(server.host, server.token, kernel_id=model["id"])
    server.call("DELETE", f"/api/kernels/{model['id']}")


def wait_until_printing(ws: Connection, msg_id: str) -> None:
    """Wait until the execution msg_id prints something (so its code is surely running)."""
    while True:
        msg = json.loads(ws.recv(timeout=RECV_TIMEOUT))
        if msg.get("parent_header", {}).get("msg_id") == msg_id and msg["msg_type"] == "stream":
            return


def test_kernelspec_is_listed_with_display_name_and_logos(server):
    specs = server.json("GET", "/api/kernelspecs")
    sandbox = specs["kernelspecs"]["sandbox"]
    assert sandbox["spec"]["display_name"] == "Python 3 (sandbox)"
    assert sandbox["spec"]["language"] == "python"
    assert sandbox["resources"] == {
        "logo-32x32": "/kernelspecs/sandbox/logo-32x32.png",
        "logo-64x64": "/kernelspecs/sandbox/logo-64x64.png",
        "logo-svg": "/kernelspecs/sandbox/logo-svg.svg",
    }


def test_logo_is_a_64_pixel_png(server):
    status, png = server.call("GET", "/kernelspecs/sandbox/logo-64x64.png")
    assert status == 200
    assert png[:8] == PNG_SIGNATURE
    assert struct.unpack(">II", png[16:24]) == (64, 64)  # IHDR width, height


def test_started_kernel_runs_code_over_its_websocket(server, kernel):
    model = server.json("GET", f"/api/kernels/{kernel.kernel_id}")
    assert model["name"] == "sandbox"
    output = kernel.run_code("print('from lab')\n6 * 7")
    assert (output.result, "".join(output.logs), output.error) == ("42", "from lab\n", None)
    assert kernel.run_code("import os; os.fork()").error.name == "PermissionError"


def test_interrupt_stops_a_busy_loop(server, kernel):
    code = "x = 5\nprint('looping', flush=True)\nwhile True:\n    pass"
    with connect(kernel.ws_url) as ws:
        msg_id = kernel._send_execute_request(ws, code)
        wait_until_printing(ws, msg_id)
        assert server.call("POST", f"/api/kernels/{kernel.kernel_id}/interrupt")[0] == 204
        errors = contents(answers(ws, msg_id), "error")
    assert [error["ename"] for error in errors] == ["KeyboardInterrupt"]
    assert kernel.run_code("x") == ExecutionResults(result="5")


def test_restart_forgets_state_and_answers(server, kernel):
    kernel.run_code("before_restart = 1\nimport os")
    pid_before = kernel.run_code("os.getpid()").result
    assert pid_before.isdigit()
    restarted = server.json("POST", f"/api/kernels/{kernel.kernel_id}/restart")
    assert restarted["id"] == kernel.kernel_id
    assert kernel.run_code("before_restart").error.name == "NameError"
    pid_after = kernel.run_code("import os; os.getpid()").result
    assert pid_after.isdigit() and pid_after != pid_before
    assert kernel.run_code("1 + 1") == ExecutionResults(result="2")
    assert kernel.run_code("os.fork()").error.name == "PermissionError"


def test_delete_ends_the_kernel_process(server):
    model = server.json("POST", "/api/kernels", {"name": "sandbox"})
    executor = LocalExecutor(server.host, server.token, kernel_id=model["id"])
    pid = int(executor.run_code("import os; os.getpid()").result)
    assert server.call("DELETE", f"/api/kernels/{model['id']}")[0] == 204
    assert model["id"] not in [k["id"] for k in server.json("GET", "/api/kernels")]
    assert server.call("GET", f"/api/kernels/{model['id']}")[0] == 404
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_kernel_info_over_the_websocket_reports_the_sandbox(kernel):
    info = kernel_info(kernel.ws_url)
    assert info["sandbox"]["policy"]["allow_network"] is False
    assert "debugger" not in info["supported_features"]



def test_notebook_session_runs_in_scratch_not_the_notebook_dir(server):
    session = server.json("POST", "/api/sessions", {  # what JupyterLab sends to open a notebook
        "path": "analysis.ipynb", "type": "notebook", "name": "analysis.ipynb",
        "kernel": {"name": "sandbox"}})
    try:
        assert session["kernel"]["name"] == "sandbox"
        executor = LocalExecutor(server.host, server.token, kernel_id=session["kernel"]["id"])
        root = str(server.root_dir)
        cwd = "import os; os.getcwd() == os.environ['HOME'], os.getcwd() == "
        where = executor.run_code(cwd + repr(root)).result
        assert where == "(True, False)"  # the kernel's private scratch, not the served root dir
        denied = executor.run_code(f"os.listdir({root!r})").error
        uid = int(executor.run_code("os.getuid()").result)
        assert (denied.name, denied.value) == (
            "PermissionError",
            f"[Errno 13] Permission denied: {root!r}: {refused_folder(root, uid)}")
    finally:
        assert server.call("DELETE", f"/api/sessions/{session['id']}")[0] == 204
