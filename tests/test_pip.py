"""%pip install in a sandboxed kernel: wheels from the operator's index into the session only,
refused with the reason when the network is off, for sdists and when the scratch is full."""

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.kernel import pip
from sandbox_kernel.policy import SandboxPolicy

from .packages import LocalIndex, make_sdist, make_wheel, write_simple_index

SCRATCH = 16 * 2**20


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A package index on 127.0.0.1: testpkg (needs testdep), an sdist-only and a big wheel."""
    root = tmp_path_factory.mktemp("index")
    files = root / "dist"
    files.mkdir()
    make_wheel(files, "testpkg", "1.0", {"testpkg/__init__.py": "VALUE = 42\n"},
               requires=("testdep",))
    make_wheel(files, "testdep", "0.1", {"testdep.py": "X = 1\n"})
    make_sdist(files, "sdistonly", "1.0")
    make_wheel(files, "bigpkg", "1.0", {"bigpkg/__init__.py": ""}, stored_bytes=2 * SCRATCH)
    write_simple_index(files, root)
    with LocalIndex(root) as served:
        yield served


def pip_policy(index: LocalIndex, **changes) -> SandboxPolicy:
    """The index on the allowlist, its loopback address granted (the proxy never reaches
    loopback otherwise): what an operator sets for a mirror on the host."""
    where = f"127.0.0.1:{index.server.server_address[1]}"
    settings = {"network": "hosts", "allow_hosts": [where], "allow_addresses": [where],
                "package_index": index.url, "scratch_size": SCRATCH, **changes}
    return SandboxPolicy(**settings)


@pytest.fixture(scope="module")
def pip_kernel(index):
    """A kernel whose network policy reaches the local index."""
    with Sandbox(kernel_name=None, policy=pip_policy(index)) as sb:
        yield sb


def test_installed_wheels_import_in_the_next_cell_from_the_session_dir(pip_kernel, index):
    done = pip_kernel.run("import logging\nhandlers = logging.getLogger().handlers[:]\n"
                          "%pip install testpkg")
    assert done.error is None, done.error
    assert "Installed into this session: testdep==0.1, testpkg==1.0" in done.stdout
    # pip's conflict check once failed in red on sys.path entries the sandbox hides (an
    # editable install's checkout); pip's console (rich) shows its lines as displays (#32 item 4)
    shown = done.stdout + done.stderr + repr(done.displays)
    assert "Error while checking for conflicts" not in shown and "ERROR" not in shown, shown
    done = pip_kernel.run("import os, testpkg, testdep\nprint(testpkg.VALUE, testdep.X)\n"
                          "print(testpkg.__file__.startswith(os.getcwd() + "
                          "'/session-packages/'))\n"
                          "print(logging.getLogger().handlers == handlers)")
    assert done.stdout == "42 1\nTrue\nTrue\n"
    assert pip_kernel.run("%pip list").stdout == "testdep==0.1\ntestpkg==1.0\n"
    assert "/files/testpkg-1.0-py3-none-any.whl" in index.requests


def test_a_second_kernel_does_not_see_the_first_ones_packages(pip_kernel, index):
    assert pip_kernel.run("%pip install testpkg").error is None
    with Sandbox(kernel_name=None, policy=pip_policy(index)) as other:
        done = other.run("import testpkg")
        assert done.error.name == "ModuleNotFoundError"
        assert other.run("%pip list").stdout == pip.NOTHING_LISTED + "\n"


def test_with_the_network_off_it_fails_at_once_naming_the_setting(sandbox, index):
    before = len(index.requests)
    done = sandbox.run("%pip install testpkg")
    assert done.error.name == "PackageInstallError"
    assert done.error.value.startswith("the network is off in this sandbox (--network off), "
                                       "so %pip cannot reach the package index")
    assert "--network hosts --allow-host INDEX-HOST" in done.error.value
    assert done.error.traceback == [f"PackageInstallError: {done.error.value}"]
    assert len(index.requests) == before  # nothing was tried
    assert sandbox.run("import testpkg").error.name == "ModuleNotFoundError"


def test_an_index_not_on_the_allowlist_is_refused_naming_the_flag(index):
    before = len(index.requests)
    policy = pip_policy(index, allow_hosts=["example.org"])
    with Sandbox(kernel_name=None, policy=policy) as sb:
        done = sb.run("%pip install testpkg")
    port = index.server.server_address[1]
    assert done.error.name == "PackageInstallError"
    assert done.error.value == (
        f"%pip cannot reach the package index {index.url}: 127.0.0.1:{port} is not on the "
        f"allowlist; allow it with --allow-host 127.0.0.1 (or 127.0.0.1:{port})")
    assert len(index.requests) == before


def test_a_source_distribution_is_refused_with_the_reason(pip_kernel, index):
    done = pip_kernel.run("%pip install sdistonly")
    assert done.error.name == "PackageInstallError"
    assert done.error.value.startswith("sdistonly has no wheel for this Python on the index, "
                                       "only a source distribution")
    assert "runs its setup code in a new process" in done.error.value
    assert not any(request.endswith(".tar.gz") for request in index.requests)  # not fetched
    done = pip_kernel.run("%pip install ./sdistonly-1.0.tar.gz")
    assert done.error.name == "PackageInstallError"
    assert done.error.value.startswith("./sdistonly-1.0.tar.gz is a source distribution")
    assert pip_kernel.run("import sdistonly").error.name == "ModuleNotFoundError"


def test_a_package_larger_than_the_scratch_is_a_clear_error_and_the_kernel_lives(pip_kernel):
    done = pip_kernel.run("%pip install bigpkg")
    assert done.error.name == "PackageInstallError"
    assert done.error.value.startswith("the packages do not fit in the session's scratch "
                                       "directory (16 MiB)")
    assert "--scratch-size" in done.error.value
    done = pip_kernel.run("import shutil\nprint(shutil.disk_usage('.').free > 8 * 2**20)\n"
                          "import bigpkg")
    assert done.stdout == "True\n"  # pip's temporary files went away
    assert done.error.name == "ModuleNotFoundError"


def test_options_that_would_leave_the_sandbox_are_refused(pip_kernel):
    for line in ("%pip install --index-url http://127.0.0.1:1/ testpkg",
                 "%pip install --target /tmp testpkg", "%pip install -e /tmp/x"):
        done = pip_kernel.run(line)
        assert done.error.name == "PackageInstallError", line
        assert "not available in the sandbox" in done.error.value
    assert pip_kernel.run("%pip freeze").error.name == "PackageInstallError"
    done = pip_kernel.run("open('reqs.txt', 'w').write('testpkg\\n--index-url http://x/\\n')\n"
                          "%pip install -r reqs.txt")
    assert done.error.name == "PackageInstallError"
    assert "options in requirements files are not available" in done.error.value


def test_sandbox_install_is_pip_install_in_the_session(index):
    with Sandbox(kernel_name=None, policy=pip_policy(index)) as sb:
        done = sb.install("testdep==0.1")
        assert done.error is None, done.error
        assert sb.run("import testdep; print(testdep.X)").stdout == "1\n"
        with pytest.raises(ValueError, match="options are not available"):
            sb.install("--target=/tmp")


@pytest.mark.parametrize("cold_start", [False, True], ids=["fork-served", "cold"])
def test_pips_output_is_one_text_stream_as_in_stock_ipykernel(index, cold_start):
    """pip's console (rich) took the kernel for a notebook and sent each line as an HTML
    display; stock ipykernel's %pip runs pip with its output on a pipe: plain text, in order,
    on stdout (#45 item 8)."""
    with Sandbox(kernel_name=None, policy=pip_policy(index), cold_start=cold_start) as sb:
        done = sb.run("%pip install testpkg")
    assert done.error is None, done.error
    assert done.displays == [], done.displays
    lines = done.stdout.splitlines()
    collected = [line for line in lines if line.startswith("Collecting ")]
    assert collected[:2] == ["Collecting testpkg", "Collecting testdep (from testpkg)"], lines
    assert lines.index(collected[0]) < lines.index(next(
        line for line in lines if line.startswith("Successfully installed")))
    assert lines[-1].startswith("Installed into this session: testdep==0.1, testpkg==1.0")
