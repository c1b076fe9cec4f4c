"""Each layer imports only what lies below it (DESIGN.md §13): checked in a fresh interpreter.

The confinement procedure must confine a process that has no ipykernel kernel, ZMQ or Jupyter
session in it; the runner must run a cell for a transport that has no ipykernel kernel class.
"""

import subprocess
import sys

JUPYTER = ("ipykernel", "IPython", "zmq", "jupyter_client")


def _imported_after(module: str) -> set[str]:
    """The modules a fresh `python -I` holds after importing module."""
    probe = f"import sys\nimport {module}\nprint('\\n'.join(sys.modules))"
    done = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_confinement_procedure_imports_nothing_of_jupyter():
    imported = _imported_after("sandbox_kernel.confine.sequence")
    assert "sandbox_kernel.confine.sequence" in imported
    assert sorted({name.split(".")[0] for name in imported} & set(JUPYTER)) == []


def test_the_runner_imports_no_kernel_class():
    """A one-shot drives the runner with a shell's run_cell: none of ipykernel is needed."""
    imported = _imported_after("sandbox_kernel.kernel.runner")
    assert "sandbox_kernel.kernel.runner" in imported
    assert sorted(name for name in imported if name.split(".")[0] == "ipykernel") == []


def test_the_runner_and_the_message_builder_import_no_zmq_or_jupyter_client():
    """The lean one-shot process runs cells and answers with neither (kernel/messages.py)."""
    for module in ("sandbox_kernel.kernel.runner", "sandbox_kernel.kernel.messages"):
        imported = _imported_after(module)
        assert module in imported
        assert sorted({name.split(".")[0] for name in imported}
                      & {"zmq", "jupyter_client", "ipykernel"}) == [], module


def test_the_lean_one_shot_process_imports_no_kernel_zmq_or_jupyter_client():
    """The lean zygote's own modules: IPython's shell, but none of ipykernel, ZMQ or
    jupyter_client (the egress proxy's libraries neither: the companion serves egress)."""
    for module in ("sandbox_kernel.kernel.oneshot_io", "sandbox_kernel.kernel.lean_shell",
                   "sandbox_kernel.kernel.lean", "sandbox_kernel.launch.forkserver.lean_zygote"):
        imported = _imported_after(module)
        assert module in imported
        assert sorted({name.split(".")[0] for name in imported}
                      & {"zmq", "jupyter_client", "ipykernel", "tornado", "aiohttp"}) == [], \
            module
