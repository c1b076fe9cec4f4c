"""The real Enterprise Gateway server (its own venv) starting our EG kernelspec on 127.0.0.1.

DistributedProcessProxy with EG_REMOTE_HOSTS=localhost runs the kernelspec's argv
(`sandbox-kernel eg-launch ...`) as a local process, no ssh: its _launch_remote_process takes
the local branch when the host's address is local. A client then works through EG's REST API
and websocket exactly as against any gateway.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from websockets.sync.client import connect

from sandbox_kernel.install import install
from sandbox_kernel.policy import SandboxPolicy

from .test_enterprise_gateway_launcher import alive, wait_until

TOKEN = "eg-test-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, eg_python):
    """EG on 127.0.0.1 serving only our distributed kernelspec from a temporary data dir."""
    root = tmp_path_factory.mktemp("eg-server")
    path = Path(install(SandboxPolicy(timeout=60), name="sandbox_distributed",
                        prefix=str(root / "prefix"), enterprise_gateway="distributed"))
    spec = json.loads((path / "kernel.json").read_text())
    spec["argv"][5:5] = ["--ip", "127.0.0.1"]  # after "eg-launch": keep the test off 0.0.0.0
    (path / "kernel.json").write_text(json.dumps(spec))
    port = free_port()
    env = {**os.environ, "JUPYTER_PATH": str(root / "prefix" / "share" / "jupyter"),
           "EG_REMOTE_HOSTS": "localhost", "EG_RESPONSE_IP": "127.0.0.1",
           "EG_RESPONSE_PORT": str(free_port()), "EG_KERNEL_LOG_DIR": str(root),
           "EG_KERNEL_LAUNCH_TIMEOUT": "90", "EG_AUTH_TOKEN": TOKEN}
    log = open(root / "eg.log", "w")  # closed in the finally below
    server = subprocess.Popen(
        [str(eg_python), "-m", "enterprise_gateway", "--ip=127.0.0.1", f"--port={port}",
         "--EnterpriseGatewayApp.list_kernels=True",
         "--EnterpriseGatewayApp.allowed_kernels=['sandbox_distributed']",
         "--EnterpriseGatewayApp.default_kernel_name=sandbox_distributed"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    base = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(base), 90, f"Enterprise Gateway on {base} (log: {log.name})")
        yield {"base": base, "log": root / "eg.log"}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        log.close()


def _request(base: str, method: str, path: str, body: dict | None = None, timeout: float = 120):
    req = urllib.request.Request(
        f"http://{base}{path}", method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        text = response.read()
        return response.status, json.loads(text) if text else None


def _ready(base: str) -> bool:
    try:
        return _request(base, "GET", "/api/kernelspecs", timeout=5)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


def run(ws, code: str, inputs: dict | None = None, timeout: float = 60) -> dict:
    """Execute over EG's websocket like a typical sandbox executor; read on to idle."""
    msg_id = str(uuid.uuid4())
    metadata = {} if inputs is None else {"sandbox": {"entrypoint": "main", "inputs": inputs}}
    ws.send(json.dumps({
        "header": {"msg_id": msg_id, "session": str(uuid.uuid4()), "username": "client",
                   "msg_type": "execute_request", "version": "5.3"},
        "parent_header": {}, "metadata": metadata, "channel": "shell",
        "content": {"code": code, "silent": False, "store_history": True,
                    "user_expressions": {}, "allow_stdin": False, "stop_on_error": False}}))
    out: dict = {"result": None, "text": None, "stdout": "", "error": None, "busy": False}
    deadline = time.monotonic() + timeout
    while True:
        msg = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out["stdout"] += content["text"]
        elif kind == "execute_result":
            out["result"] = content["data"].get("application/json")
            out["text"] = content["data"].get("text/plain")
        elif kind == "error":
            out["error"] = (content["ename"], content["evalue"])
        elif kind == "status" and content["execution_state"] == "idle":
            return out


def test_code_runs_fork_is_refused_interrupt_and_delete_work(gateway):
    base = gateway["base"]
    try:
        status, kernel = _request(base, "POST", "/api/kernels", {
            "name": "sandbox_distributed", "env": {"KERNEL_USERNAME": "alice"}})
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc}: {exc.read()!r}; EG log: "
                             f"{gateway['log'].read_text()[-3000:]}") from None
    assert status == 201
    kernel_id = kernel["id"]
    url = f"ws://{base}/api/kernels/{kernel_id}/channels"
    with connect(url, additional_headers={"Authorization": f"token {TOKEN}"},
                 open_timeout=60) as ws:
        out = run(ws, "import os\nprint('hi')\n(os.getpid(), os.getcwd())")
        assert out["error"] is None and out["stdout"] == "hi\n", out
        kernel_pid, scratch = eval(out["text"])
        out = run(ws, "import os\n(dict(os.environ), open('/proc/self/environ', 'rb').read())")
        environ, raw = eval(out["text"])
        assert not [name for name in environ if name.startswith(("EG_", "KERNEL_"))], environ
        assert TOKEN.encode() not in raw and b"alice" not in raw
        out = run(ws, "def main(x):\n    return {'double': 2 * x}", inputs={"x": 21})
        assert out["result"] == {"double": 42}, out
        out = run(ws, "import os\nos.fork()")
        assert out["error"] is not None and out["error"][0] == "PermissionError", out
        assert "fork" in out["error"][1]
        # EG's interrupt goes through the comm port: the listener signals the kernel.
        ws.send(json.dumps({
            "header": {"msg_id": "sleep", "session": "s", "username": "client",
                       "msg_type": "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": "import time\nfor _ in range(600):\n    time.sleep(0.1)",
                        "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": False}}))
        error = None
        deadline = time.monotonic() + 60
        interrupted = False
        while time.monotonic() < deadline:
            msg = json.loads(ws.recv(timeout=30))
            if msg["parent_header"].get("msg_id") != "sleep":
                continue
            if msg["msg_type"] == "status" and not interrupted:
                if msg["content"]["execution_state"] == "busy":
                    time.sleep(1)
                    assert _request(base, "POST", f"/api/kernels/{kernel_id}/interrupt")[0] == 204
                    interrupted = True
            elif msg["msg_type"] == "error":
                error = msg["content"]["ename"]
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        assert interrupted and error == "KeyboardInterrupt"
        assert run(ws, "6 * 7")["text"] == "42"
    assert _request(base, "DELETE", f"/api/kernels/{kernel_id}")[0] == 204
    wait_until(lambda: not alive(kernel_pid), 30, f"kernel {kernel_pid} to end")
    wait_until(lambda: not Path(scratch).exists(), 30, "the kernel's scratch to be removed")
    assert _request(base, "GET", "/api/kernels")[1] == []
