"""The provisioner: chosen by the kernelspec, found through its entry point, used by frontends."""

import json
import os
import select
import socket
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from jupyter_client.provisioning import KernelProvisionerFactory
from nbclient import NotebookClient

from sandbox_kernel import cli
from sandbox_kernel.launch import forkserver
from sandbox_kernel.launch.provisioner import ForkServerProvisioner


def _spec(name):
    directory = Path(KernelSpecManager().get_kernel_spec(name).resource_dir)
    return json.loads((directory / "kernel.json").read_text())


def test_install_names_the_provisioner_and_stores_the_options(kernelspecs):
    assert cli.main(["install", "--user", "--name", "sandbox-cold", "--cold-start",
                     "--preload", "numpy, pandas"]) == 0
    cold = _spec("sandbox-cold")["metadata"]["kernel_provisioner"]
    assert cold == {"provisioner_name": "sandbox-fork-provisioner",
                    "config": {"cold_start": True, "preload": ["numpy", "pandas"]}}
    default = _spec("sandbox")["metadata"]["kernel_provisioner"]
    assert default["config"] == {"cold_start": False, "preload": []}


def test_jupyter_client_finds_the_provisioner_through_its_entry_point(kernelspecs):
    spec = KernelSpecManager().get_kernel_spec("sandbox")
    factory = KernelProvisionerFactory.instance()
    assert factory.is_provisioner_available(spec)
    manager = KernelManager(kernel_name="sandbox")
    manager.start_kernel()
    try:
        assert isinstance(manager.provisioner, ForkServerProvisioner)
        assert manager.provisioner.fork_served
        assert manager.is_alive()
    finally:
        manager.shutdown_kernel()
    assert manager.provisioner is None or not manager.provisioner.has_process


def test_a_cold_start_kernelspec_starts_cold(kernelspecs):
    cli.main(["install", "--user", "--name", "sandbox-cold2", "--cold-start"])
    manager = KernelManager(kernel_name="sandbox-cold2")
    manager.start_kernel()
    try:
        assert isinstance(manager.provisioner, ForkServerProvisioner)
        assert not manager.provisioner.fork_served
        assert manager.provisioner.process.args[0] == sys.executable  # a real Popen
    finally:
        manager.shutdown_kernel(now=True)


def test_nbclient_runs_a_notebook_in_a_fork_served_kernel(kernelspecs):
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import os\nos.getppid()"),
        nbformat.v4.new_code_cell("def main(x):\n    return {'y': x + 1}"),
        nbformat.v4.new_code_cell('%main {"x": 41}'),
    ])
    NotebookClient(notebook, kernel_name="sandbox", timeout=120).execute()
    parent = int(notebook.cells[0].outputs[0]["data"]["text/plain"])
    assert parent == forkserver.ForkServerClient().server_pid()
    assert notebook.cells[2].outputs[0]["data"]["application/json"] == {"y": 42}


def _ports_listening(manager):
    """Which of the kernel's five ports accept a TCP connection right now."""
    listening = {}
    for name in ("shell_port", "iopub_port", "stdin_port", "hb_port", "control_port"):
        probe = socket.socket()
        try:
            probe.connect((manager.ip, getattr(manager, name)))
            listening[name] = True
        except OSError:
            listening[name] = False
        finally:
            probe.close()
    return listening


@pytest.mark.parametrize("name", ["sandbox", "sandbox-cold3"])
def test_start_kernel_returns_once_every_socket_listens(kernelspecs, name):
    """A stock KernelManager's first connections succeed (no wait for libzmq's reconnect)."""
    if name == "sandbox-cold3":
        cli.main(["install", "--user", "--name", name, "--cold-start"])
    manager = KernelManager(kernel_name=name)
    manager.start_kernel()
    try:
        assert _ports_listening(manager) == dict.fromkeys(
            ("shell_port", "iopub_port", "stdin_port", "hb_port", "control_port"), True)
        client = manager.client()
        client.start_channels()
        try:
            assert client.kernel_info(reply=True, timeout=30)["content"]["status"] == "ok"
        finally:
            client.stop_channels()
    finally:
        manager.shutdown_kernel(now=True)


def test_the_ready_pipe_is_closed_before_user_code_and_names_nothing(kernelspecs):
    """The kernel says "listening" once and keeps no copy of the pipe; user code sees no trace."""
    read_end, write_end = os.pipe()
    manager = KernelManager(kernel_name="sandbox")
    manager.write_connection_file()
    client = forkserver.ForkServerClient()
    argv = ["-f", manager.connection_file]
    stdio = forkserver.stdio_fds(None, None)
    kernel = client.spawn(argv, {"LANG": "C.UTF-8"}, stdio, ready=write_end)
    os.close(stdio[0])
    os.close(write_end)
    try:
        assert select.select([read_end], [], [], 60)[0]
        assert os.read(read_end, 100) == b"listening\n"
        assert os.read(read_end, 100) == b""  # EOF: no process holds the write end any more
        assert kernel.poll() is None
        kc = manager.client()
        kc.start_channels()
        try:
            msg_id = kc.execute("import os\nprint(sorted(k for k in os.environ "
                                "if 'READY' in k))")
            out = ""
            while True:
                msg = kc.get_iopub_msg(timeout=30)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["msg_type"] == "stream":
                    out += msg["content"]["text"]
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
            assert out == "[]\n"
        finally:
            kc.stop_channels()
    finally:
        os.close(read_end)
        kernel.kill()
        kernel.wait(10)


def test_only_a_pipe_is_taken_for_the_ready_pipe(tmp_path):
    from sandbox_kernel.confine.environment import READY_VAR, ready_pipe

    read_end, write_end = os.pipe()
    with open(tmp_path / "file", "w") as regular:
        try:
            assert ready_pipe({READY_VAR: str(write_end)}) == write_end
            assert ready_pipe({READY_VAR: str(regular.fileno())}) is None
            assert ready_pipe({READY_VAR: "1"}) is None  # never stdio
            assert ready_pipe({READY_VAR: "x"}) is None
            assert ready_pipe({}) is None
        finally:
            os.close(read_end)
            os.close(write_end)


def test_a_kernel_whose_port_is_taken_ends_instead_of_hanging(kernelspecs):
    """Another process holds the shell port: the kernel refuses to start (exit status 3) and
    start_kernel returns, since the ready pipe ends with the kernel."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    manager = KernelManager(kernel_name="sandbox", cache_ports=False)
    manager.shell_port = taken.getsockname()[1]
    try:
        manager.start_kernel()  # returns: the ready pipe ends with the kernel
        process = manager.provisioner.process
        assert manager.provisioner.fork_served
        assert process.wait(timeout=30) == 3
    finally:
        taken.close()
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)
