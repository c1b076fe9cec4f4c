"""Each extra works alone (#45): the checkout installed with one extra by itself into a venv of its
own (tests/extras_venv.py, cached), then that extra's command run to its first real step; and the
faces import nothing of an extra they do not name.

The test venv installs every extra, so an import of [server]'s packages from the MCP server, or a
command that names a package no extra installs, passes every other test.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from sandbox_kernel.mcp import configs
from tests.helpers import write_keys

from . import extras_venv
from .ci_tools import unavailable
from .mcp_clients import Connected
from .service.helpers import DIFY_KEY, KEY_A, RUN, Server, auth, http
from .test_enterprise_gateway_launcher import connect_client, execute, launch_with_eg
from .test_gateway import LocalExecutor, free_port, stop

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# What the [server] extra installs and [mcp] (with the MCP SDK's own dependencies) does not.
SERVER_ONLY = ("prometheus_client", "fastapi", "fastapi_offline")


def test_the_mcp_server_imports_nothing_of_the_server_extra():
    probe = ("import sys\n"
             "import sandbox_kernel.cli, sandbox_kernel.mcp.command, sandbox_kernel.mcp.server\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(SERVER_ONLY)!r}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- each extra alone, in a venv of its own ------------------------------------------------------

def alone(extra: str) -> Path:
    """The bin/ of extra's venv (built once, then reused; see tests/extras_venv.py)."""
    try:
        return extras_venv.ensure(extra).parent
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        unavailable(f"the checkout could not be installed with [{extra}] alone: {exc}")


def command(bin_dir: Path, *args: object, **options: Any) -> subprocess.CompletedProcess:
    """A command of that venv as a user types it (stdin closed); its output as text."""
    return subprocess.run([str(bin_dir / str(args[0])), *map(str, args[1:])],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, **options)


def kernelspec(bin_dir: Path, tmp_path: Path, name: str) -> dict[str, str]:
    """Install that venv's kernelspec under a prefix of its own; the environment finding it."""
    prefix = tmp_path / "prefix"
    installed = command(bin_dir, "sandbox-kernel", "install", "--prefix", prefix, "--name", name)
    assert installed.returncode == 0, installed.stderr
    return {**os.environ, "JUPYTER_PATH": str(prefix / "share" / "jupyter")}


@pytest.mark.slow
def test_base_alone_runs_a_main(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("def main(numbers):\n    print('adding')\n    return {'total': sum(numbers)}\n")
    done = command(alone(extras_venv.BASE), "sandbox-kernel", "run", job,
                   "--inputs", '{"numbers": [1, 2, 3]}', cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"total": 6}


@pytest.mark.slow
@pytest.mark.parametrize(("face", "extra"), [("serve", "server"), ("mcp", "mcp")])
def test_base_alone_names_the_extra_a_face_needs(face, extra):
    bin_dir = alone(extras_venv.BASE)
    done = command(bin_dir, "sandbox-kernel", face)
    assert done.returncode == 2, done.stderr
    # The package is on no index: the command installs this checkout with the extra.
    fix = f"{bin_dir / 'python'} -m pip install -e '{extras_venv.CHECKOUT}[{extra}]'"
    assert f"install the [{extra}] extra: {fix}\n" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_examples_alone_runs_the_chart_example(tmp_path):
    done = command(alone("examples"), "sandbox-kernel", "run", EXAMPLES / "chart.py",
                   "--inputs", f"@{EXAMPLES / 'chart.json'}", "--save-displays", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bars"] == 6
    assert [path.suffix for path in (tmp_path / "out").iterdir()] == [".png"]


@pytest.mark.slow
def test_mcp_alone_serves_the_config_it_prints(tmp_path):
    bin_dir = alone("mcp")
    printed = command(bin_dir, "sandbox-kernel", "mcp", "--print-config", "claude_desktop")
    assert printed.returncode == 0, printed.stderr
    # [mcp] installs none of the examples' preloads: the printed config leaves them out and says
    # what to install for them.
    server = json.loads(printed.stdout)["mcpServers"][configs.SERVER]
    assert server["command"] == str(bin_dir / "sandbox-kernel")
    assert "--preload" not in server["args"]
    assert "pip install numpy pandas matplotlib" in printed.stderr
    params = StdioServerParameters(command=server["command"],
                                   args=[*server["args"], "--pool-size", "0"],
                                   env=dict(os.environ))
    with (tmp_path / "server.log").open("w") as log:
        client = Connected(lambda: Client(stdio_client(params, errlog=log)))
        try:
            tools = client.call(lambda c: c.list_tools()).tools
            answer = client.tool("run_python", {"code": "6 * 7"})
        finally:
            client.close()
    assert "run_python" in {tool.name for tool in tools}, (tmp_path / "server.log").read_text()
    assert (answer.is_error, answer.structured_content["value"]) == (False, "42")


@pytest.mark.slow
def test_mcp_alone_refuses_a_preload_it_cannot_import():
    # The README's `claude mcp add ... mcp --preload numpy,pandas` after `pip install '.[mcp]'`.
    done = command(alone("mcp"), "sandbox-kernel", "mcp", "--preload", "numpy,pandas")
    assert done.returncode == 2, done.stderr
    assert "--preload names numpy, pandas" in done.stderr
    assert "-m pip install numpy pandas" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["server", "dify"])
def test_serve_alone_answers_health_and_runs(extra, tmp_path):
    keys = tmp_path / "keys.json"
    write_keys(keys, [{"id": "team-a", "key": KEY_A}])
    server = Server(tmp_path, "--api-keys-file", str(keys), "--pool-size", "0",
                    python=str(alone(extra) / "python"))
    try:
        assert http.get(server.url + "/health").status_code == 200
        if extra == "server":
            answer = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), json={
                "code": "def main(x):\n    return {'y': x * 2}", "inputs": {"x": 21}})
            assert answer.json()["result"] == {"y": 42}, answer.text
        else:  # what a Dify Template node runs: jinja2 comes with [dify]
            answer = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json={
                "language": "python3",
                "code": "import jinja2\nprint(jinja2.Template('{{ x }}').render(x=42))"})
            assert answer.json()["data"]["stdout"] == "42\n", answer.text
    finally:
        server.stop()


@pytest.mark.slow
def test_eg_alone_launches_for_enterprise_gateway(eg_python, tmp_path):
    python = alone("eg") / "python"
    with launch_with_eg(eg_python, tmp_path / "launcher.log",
                        command=(str(python), "-I", "-m", "sandbox_kernel", "eg-launch")) as eg:
        kc = connect_client(eg["info"])
        try:
            assert execute(kc, "6 * 7")["text"] == "42"
        finally:
            kc.stop_channels()


@pytest.mark.slow
def test_lab_alone_executes_a_notebook_with_jupyter_execute_and_papermill(tmp_path):
    bin_dir = alone("lab")
    env = kernelspec(bin_dir, tmp_path, "sandbox-lab")
    shutil.copy(EXAMPLES / "summarize.ipynb", tmp_path)
    executed = command(bin_dir, "jupyter", "execute", "--kernel_name=sandbox-lab",
                       "--output=executed", "summarize.ipynb", cwd=tmp_path, env=env)
    assert executed.returncode == 0, executed.stderr
    papermill = command(bin_dir, "papermill", "summarize.ipynb", "papermill.ipynb",
                        "-k", "sandbox-lab", cwd=tmp_path, env=env)
    assert papermill.returncode == 0, papermill.stderr
    for name in ("executed.ipynb", "papermill.ipynb"):
        last = json.loads((tmp_path / name).read_text())["cells"][-1]
        results = [output["data"].get("application/json") for output in last["outputs"]
                   if output["output_type"] == "execute_result"]
        assert results == [{"count": 5, "total": 14}], (name, last["outputs"])


@pytest.mark.slow
def test_gateway_alone_serves_the_kernel_to_a_websocket_client(tmp_path):
    bin_dir = alone("gateway")
    env = kernelspec(bin_dir, tmp_path, "sandbox-gateway")
    port, token = free_port(), secrets.token_urlsafe(13)
    with (tmp_path / "gateway.log").open("wb") as log:
        gateway = subprocess.Popen(
            [str(bin_dir / "jupyter"), "kernelgateway", "--KernelGatewayApp.ip=127.0.0.1",
             f"--KernelGatewayApp.port={port}", "--KernelGatewayApp.port_retries=0",
             f"--KernelGatewayApp.auth_token={token}",
             "--KernelGatewayApp.default_kernel_name=sandbox-gateway"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        executor = LocalExecutor(f"127.0.0.1:{port}", token)
        answer = executor.run_code("6 * 7")
    finally:
        stop(gateway)
    assert (answer.error, answer.result) == (None, "42"), (tmp_path / "gateway.log").read_text()
