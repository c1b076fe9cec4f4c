"""--read-path and --write-path naming a symbolic link, or passing through one, are refused.

A grant is checked where it is read (install, run, check, serve: policy.from_arguments) and
again where the kernel confines itself (both transports: kernel/app.py), and the Landlock rule
is refused when the file it opened is not the one of the grant's name (a link swapped in after
the check). Hostile cases run user code in real kernels: a link planted by one kernel's user
code must not redirect the next kernel's grant.
"""

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sandbox_kernel import cli
from sandbox_kernel.client import Sandbox
from sandbox_kernel.confine.paths import GrantError, check_grants
from sandbox_kernel.launch.oneshot import OneShotUnavailable
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import evaluate
from tests.test_confinement import start_kernel_directly

SECRET = "outside every grant"


@pytest.fixture
def tree():
    """data/ (a real folder), out/secret.txt (never granted), and links of every shape.

    In a folder every uid may enter (pytest's are 0700): as root, each kernel's own uid is let
    in by the host, so what keeps it out of out/ is the sandbox, which says EACCES.
    """
    tmp_path = Path(tempfile.mkdtemp(prefix="grant-links-"))
    tmp_path.chmod(0o755)
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "out" / "sub").mkdir(parents=True)
    for folder in ("data", "data/sub", "out", "out/sub"):
        (tmp_path / folder).chmod(0o777)
    (tmp_path / "data" / "table.csv").write_text("a,b\n")
    (tmp_path / "out" / "secret.txt").write_text(SECRET)
    (tmp_path / "out" / "sub" / "secret.txt").write_text(SECRET)
    (tmp_path / "data" / "link").symlink_to(tmp_path / "out" / "secret.txt")
    (tmp_path / "data" / "relative").symlink_to("../out/secret.txt")
    (tmp_path / "data" / "folder-link").symlink_to("../out")
    yield tmp_path
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("name, link", [
    ("data/link", "data/link"),  # the grant is a link
    ("data/relative", "data/relative"),  # a relative link
    ("data/folder-link", "data/folder-link"),  # a link to a folder
    ("data/folder-link/sub", "data/folder-link"),  # a link in a parent component
    ("data/folder-link/../data", "data/folder-link"),  # `..` after a link: its target's parent
    ("data/./folder-link/sub/../secret.txt", "data/folder-link"),
])
def test_a_grant_through_a_link_is_refused_naming_the_link_and_the_real_path(tree, name, link):
    with pytest.raises(GrantError) as refused:
        check_grants([str(tree / name)], "--read-path")
    message = str(refused.value)
    assert message.startswith(f"--read-path {tree / name} ")
    assert f"the symbolic link {tree / link} (-> " in message
    assert f"grant {os.path.realpath(tree / name)} instead" in message


def test_a_relative_grant_is_checked_from_the_real_working_directory(tree):
    with contextlib.chdir(tree / "data"):
        assert check_grants(["sub", "../data/./sub/..", "table.csv"]) == [
            str(tree / "data" / "sub"), str(tree / "data"), str(tree / "data" / "table.csv")]
        with pytest.raises(GrantError, match="passes through the symbolic link"):
            check_grants(["folder-link/sub"])


@pytest.mark.parametrize("name", ["missing", "data/table.csv/..", "data/link-missing/x"])
def test_a_grant_that_does_not_exist_is_named(tree, name):
    with pytest.raises(FileNotFoundError, match=f"granted path does not exist: {tree / name}$"):
        check_grants([str(tree / name)])


@pytest.mark.parametrize("command", ["check", "install"])
@pytest.mark.parametrize("flag", ["--read-path", "--write-path"])
def test_install_and_check_refuse_a_grant_through_a_link(tree, capsys, command, flag):
    argv = [command, flag, str(tree / "data" / "folder-link" / "sub")]
    if command == "install":
        argv += ["--prefix", str(tree / "prefix"), "--name", "linked"]
    assert cli.main(argv) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert error.startswith(f"sandbox-kernel {command}: {flag} {tree}/data/folder-link/sub "
                            f"passes through the symbolic link {tree}/data/folder-link")
    assert not (tree / "prefix").exists()


def test_check_shows_a_real_grant_as_given(tree, capsys):
    assert cli.main(["check", "--read-path", str(tree / "data" / "sub" / ".."),
                     "--landlock-abi", "0", "--no-landlock"]) in (0, 1)
    assert f"  {tree / 'data'}: read-only" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("flag", ["--read-path", "--write-path"])
def test_a_kernel_given_a_link_refuses_to_start(tree, flag):
    _, args = start_kernel_directly(tree, f"{flag}={tree / 'data' / 'link'}")
    result = subprocess.run([sys.executable, "-I", *args], capture_output=True, text=True,
                            timeout=90)
    assert result.returncode == 3, result.stderr
    assert (f"refusing to start: {flag} {tree}/data/link is the symbolic link {tree}/data/link "
            f"(-> {tree}/out/secret.txt)") in result.stderr


def test_a_link_planted_by_user_code_does_not_redirect_the_next_kernels_grant(tree):
    """Kernel A may write in data/; kernel B may read data/sub. A's user code puts a link to
    the secret's folder where data/sub was: B refuses to start, and never reads the secret."""
    shared = tree / "data"
    with Sandbox(None, policy=SandboxPolicy(write_paths=[str(shared)])) as writer:
        assert evaluate(writer, f"import os\nos.rmdir({str(shared / 'sub')!r})\n"
                                f"os.symlink({str(tree / 'out')!r}, {str(shared / 'sub')!r})\n"
                                f"os.readlink({str(shared / 'sub')!r})") == str(tree / "out")
    reader = Sandbox(None, policy=SandboxPolicy(read_paths=[str(shared / "sub")]))
    with pytest.raises(RuntimeError, match="Kernel died"):
        reader.start()
    reader.close()


def test_one_shot_kernels_refuse_a_link_planted_by_an_earlier_run(tree):
    shared = tree / "data"
    policy = SandboxPolicy(write_paths=[str(shared)], read_paths=[str(shared / "sub")])
    with Sandbox(None, one_shot=True, policy=policy) as sandbox:
        first = sandbox.run(f"import os\nos.rmdir({str(shared / 'sub')!r})\n"
                            f"os.symlink({str(tree / 'out')!r}, {str(shared / 'sub')!r})")
        assert first.error is None, first.error
        with pytest.raises(OneShotUnavailable, match=(
                f"--read-path {shared}/sub is the symbolic link {shared}/sub")):
            for _ in range(4):  # processes the pool confined before the link was planted
                later = sandbox.run(f"open({str(tree / 'out' / 'secret.txt')!r}).read()")
                assert later.error is not None and later.error.name == "PermissionError"


def test_a_link_inside_a_granted_folder_reaches_nothing_outside_it(tree):
    with Sandbox(None, policy=SandboxPolicy(read_paths=[str(tree / "data")])) as sandbox:
        code = ("import errno\ndef attempt(path):\n    try:\n        open(path).read()\n"
                "    except OSError as exc:\n        return errno.errorcode[exc.errno]\n"
                "    return 'read'\n")
        names = ["link", "relative", "folder-link/secret.txt", "folder-link/sub/secret.txt"]
        paths = [str(tree / "data" / name) for name in names]
        found = evaluate(sandbox, code + f"[attempt(path) for path in {paths!r}]")
        assert found == [errno.errorcode[errno.EACCES]] * len(names)
        assert evaluate(sandbox, f"open({str(tree / 'data' / 'table.csv')!r}).read()") == "a,b\n"
