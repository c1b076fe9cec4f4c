"""The provisioner: chosen by the kernelspec, found through its entry point, used by frontends."""

import json
import sys
from pathlib import Path

import nbformat
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
