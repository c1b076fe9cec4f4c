"""Shared fixtures: isolated Jupyter dirs, installed kernelspecs, and kernels to share."""

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# Isolate every Jupyter and IPython path before jupyter_client is imported anywhere, so the
# tests never read or write the real user's Jupyter dirs.
_ROOT = Path(tempfile.mkdtemp(prefix="sandbox-kernel-tests-"))
atexit.register(shutil.rmtree, _ROOT, True)  # after pytest, once every kernel is gone
for _var, _sub in (("JUPYTER_DATA_DIR", "data"), ("JUPYTER_CONFIG_DIR", "config"),
                   ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython"),
                   ("HOME", "home")):
    (_ROOT / _sub).mkdir()
    os.environ[_var] = str(_ROOT / _sub)
os.environ.pop("JUPYTER_PATH", None)

import pytest  # noqa: E402

from sandbox_kernel.client import Sandbox  # noqa: E402
from sandbox_kernel.install import install  # noqa: E402
from sandbox_kernel.policy import SandboxPolicy  # noqa: E402

from . import eg_venv  # noqa: E402
from .ci_tools import unavailable  # noqa: E402

# The slow groups (pyproject.toml's markers, docs/contributing.md): each test of these files, or
# using Enterprise Gateway's venv, gets its group's marker and `slow`.
SLOW_FILES = {"container": "test_container.py", "browser": "test_jupyterlab.py",
              "load": "test_load.py", "lint": "test_lint.py"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    """Mark the slow groups' tests."""
    for item in items:
        groups = [group for group, name in SLOW_FILES.items() if item.path.name == name]
        if "eg_python" in getattr(item, "fixturenames", ()):
            groups.append("gateway")
        for group in [*groups, "slow"] if groups else []:
            item.add_marker(group)


@pytest.fixture(scope="session")
def eg_python():
    """Enterprise Gateway's interpreter (its own venv, cached between runs)."""
    try:
        return eg_venv.ensure()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        unavailable(f"Enterprise Gateway could not be installed in its own venv: {exc}")


@pytest.fixture(scope="session")
def jupyter_root():
    """The temporary directory holding this test session's Jupyter dirs."""
    return _ROOT


@pytest.fixture(scope="session", autouse=True)
def kernelspecs():
    """The kernelspecs the tests start kernels from, installed into the temporary data dir."""
    install(SandboxPolicy(), name="sandbox", user=True)
    install(SandboxPolicy(allow_network=True), name="sandbox-net", user=True)


@pytest.fixture(scope="session")
def sandbox(kernelspecs):
    """One kernel shared by tests that leave no trace in it."""
    with Sandbox("sandbox") as sb:
        yield sb


@pytest.fixture(scope="session")
def net_sandbox(kernelspecs):
    """A shared kernel started with --allow-network."""
    with Sandbox("sandbox-net") as sb:
        yield sb


@pytest.fixture
def fresh_sandbox(kernelspecs):
    """A kernel of its own, for tests that break or taint it."""
    with Sandbox("sandbox") as sb:
        yield sb



@pytest.fixture(scope="session", autouse=True)
def fork_servers():
    """Fork servers this session started end with it (their kernels have ended already)."""
    yield
    from sandbox_kernel.launch import forkserver

    forkserver.stop_servers()
