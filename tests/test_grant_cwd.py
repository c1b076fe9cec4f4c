"""--grant-cwd: the folder a kernel starts in (the notebook's) granted, relative paths there.

Real kernels started in a folder the way Jupyter starts them. The hostile side: `..`, symlinks
and hard links must not reach past the folder, and read-only means writes fail with EACCES.
"""

import contextlib
import json
import os
import pwd
import subprocess
import sys
import tempfile
import textwrap
import types

import pytest
from jupyter_client.manager import start_new_kernel

from sandbox_kernel.client import Sandbox
from sandbox_kernel.install import install
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import evaluate, ok

SECRET = "outside the folder"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A notebook's folder with data, a symlink out of it, and a secret next to it."""
    base = tmp_path_factory.mktemp("grant-cwd")
    folder = base / "project"
    (folder / "sub").mkdir(parents=True)
    folder.chmod(0o777)  # the host would let user code write: what stops it is the grant's mode
    (folder / "sales.csv").write_text("month,sales\n1,10\n2,14\n")
    (folder / "sub" / "notes.txt").write_text("nested")
    (base / "secret.txt").write_text(SECRET)
    (folder / "link-to-secret").symlink_to(base / "secret.txt")
    (folder / "link-to-parent").symlink_to(base)
    (folder / "link-to-etc").symlink_to("/etc/shadow")
    return folder


@contextlib.contextmanager
def started_in(folder, mode):
    """A kernel started with cwd folder (as Jupyter starts a notebook's), --grant-cwd mode."""
    with contextlib.chdir(folder):
        sandbox = Sandbox(None, policy=SandboxPolicy(grant_cwd=mode))
        sandbox.start()
    try:
        yield sandbox
    finally:
        sandbox.close()


@pytest.fixture(scope="module")
def read_only(project):
    with started_in(project, "ro") as sandbox:
        yield sandbox


@pytest.fixture
def read_write(project, tmp_path):
    """A writable copy of the project (the kernel's own uid must be let in by the host)."""
    folder = tmp_path / "project"
    folder.mkdir()
    folder.chmod(0o777)
    (folder / "sales.csv").write_text("month,sales\n1,10\n")
    (tmp_path / "secret.txt").write_text(SECRET)
    (folder / "link-to-secret").symlink_to(tmp_path / "secret.txt")
    with started_in(folder, "rw") as sandbox:
        yield sandbox, folder


def outside(sandbox, folder):
    """What user code gets for a path in folder, outside its grants.

    Landlock refuses it (EACCES); started as root in a folder its uid cannot reach (pytest's
    0700 tmp dirs), the kernel's view covers the folder and shows only the grants: ENOENT.
    """
    layers = sandbox.client.kernel_info(reply=True)["content"]["sandbox"]["layers"]
    covered = layers["privileges"].get("covered", [])
    real = os.path.realpath(folder)
    hidden = any(real == path or real.startswith(path.rstrip("/") + "/") for path in covered)
    return "ENOENT" if hidden else "EACCES"


def errno_of(sandbox, code):
    """The errno name of the OSError code raises in the kernel (None when it raises nothing)."""
    wrapped = (f"import errno, os\ntry:\n{textwrap.indent(code, '    ')}\n    _e = None\n"
               "except OSError as exc:\n    _e = errno.errorcode[exc.errno]\n_e")
    return evaluate(sandbox, wrapped)


def test_relative_names_resolve_in_the_folder_and_home_stays_the_scratch(read_only, project):
    code = ("import os, tempfile, pandas\ndf = pandas.read_csv('sales.csv')\n"
            "(int(df.sales.sum()), open('sub/notes.txt').read(), os.getcwd(),"
            " os.environ['HOME'] == os.environ['TMPDIR'] == tempfile.gettempdir()"
            " == os.environ['SANDBOX_KERNEL_SCRATCH'], os.getcwd() != os.environ['HOME'])")
    assert evaluate(read_only, code) == (24, "nested", str(project.resolve()), True, True)
    # HOME and temp stay writable: libraries' caches and temporary files work as before
    assert evaluate(read_only, "import os, tempfile\nwith tempfile.NamedTemporaryFile() as f:\n"
                               "    f.write(b'x')\nopen(os.path.expanduser('~/n'), 'w').write('y')"
                    ) == 1


@pytest.mark.parametrize("code", [
    "open('new.txt', 'w')",
    "open('sales.csv', 'a')",
    "os.mkdir('made')",
    "os.remove('sales.csv')",
    "os.rename('sales.csv', 'renamed.csv')",
    "os.symlink('sales.csv', 'alias')",
    "os.truncate('sales.csv', 0)",
])
def test_read_only_means_every_write_fails_with_eacces(read_only, project, code):
    assert errno_of(read_only, code) == "EACCES"
    assert (project / "sales.csv").read_text() == "month,sales\n1,10\n2,14\n"
    assert sorted(p.name for p in project.iterdir()) == [
        "link-to-etc", "link-to-parent", "link-to-secret", "sales.csv", "sub"]


@pytest.mark.parametrize("code", [
    "open('../secret.txt').read()",
    "open('sub/../../secret.txt').read()",
    "os.listdir('..')",
    "open('link-to-secret').read()",
    "os.listdir('link-to-parent')",
    "open('link-to-parent/secret.txt').read()",
    "open('link-to-etc').read()",
    "os.chdir('..')\nopen('secret.txt').read()",
    "os.chdir('link-to-parent')\nopen('secret.txt').read()",
])
def test_dot_dot_and_symlinks_do_not_leave_the_folder(read_only, project, code):
    # listing the folder above is Landlock's EACCES; a file there is outside()'s answer
    expected = "EACCES" if "etc" in code or "listdir" in code \
        else outside(read_only, project.parent)
    assert errno_of(read_only, code) == expected
    # chdir itself is allowed (Landlock checks what is opened): back for the next case
    back = f"import os\nos.chdir({str(project)!r})\nopen('sales.csv').read(5)"
    assert evaluate(read_only, back) == "month"
    assert (project.parent / "secret.txt").read_text() == SECRET


def test_a_refused_write_names_the_flag_that_allows_it(read_only):
    error = read_only.run("open('out.csv', 'w')").error
    assert error.name == "PermissionError"
    assert error.value.endswith(
        "the sandbox refused it: this kernel was granted the folder it started in read-only "
        "(--grant-cwd); to let user code write there, start the sandbox with "
        '`SandboxPolicy(grant_cwd="rw")`')


def test_the_banner_and_kernel_info_say_what_is_granted(read_only, project):
    reply = read_only.client.kernel_info(reply=True)["content"]
    assert f"  {project.resolve()} (the folder the kernel started in, its working directory: " \
           "relative paths resolve there): read-only\n" in reply["banner"]
    assert "  scratch (HOME and temp, removed with the kernel): read-write\n" in reply["banner"]
    layer = reply["sandbox"]["layers"]["cwd"]
    assert (layer["mode"], layer["path"], layer["refused"]) == ("ro", str(project.resolve()),
                                                                None)


def test_read_write_writes_in_the_folder_and_nowhere_past_it(read_write):
    sandbox, folder = read_write
    assert evaluate(sandbox, "import pandas\ndf = pandas.read_csv('sales.csv')\n"
                             "df.assign(double=df.sales * 2).to_csv('out.csv', index=False)\n"
                             "import os\nos.mkdir('made')\nopen('made/x', 'w').write('x')") == 1
    assert (folder / "out.csv").read_text() == "month,sales,double\n1,10,20\n"
    assert (folder / "made" / "x").read_text() == "x"
    hidden = outside(sandbox, folder.parent)  # a file there, when looked for
    for code, expected in (("open('../escaped.txt', 'w')", "EACCES"),  # creating one there
                           ("open('link-to-secret').read()", hidden),
                           ("open('link-to-secret', 'w')", "EACCES"),  # may create it
                           ("os.symlink('../secret.txt', 'mine')\nopen('mine').read()", hidden)):
        assert errno_of(sandbox, "import os\n" + code) == expected, code
    # a hard link would carry the outside file's inode into the folder: refused. Hidden by the
    # view, the source is not found; otherwise Landlock refuses reparenting it (EXDEV, or
    # EACCES on hosts that check the source's rights first).
    linked = errno_of(sandbox, "import os\nos.link('../secret.txt', 'hard')")
    assert linked in ({"ENOENT"} if hidden == "ENOENT" else {"EXDEV", "EACCES"})
    assert not (folder / "hard").exists()
    assert not (folder.parent / "escaped.txt").exists()
    assert (folder.parent / "secret.txt").read_text() == SECRET


class NotebookKernel:
    """A kernel started as Jupyter starts a notebook's: from a kernelspec, in the notebook's
    folder, by jupyter_client alone (no Sandbox client, which refuses a grant not given)."""

    def __init__(self, folder, mode):
        name = f"grant-cwd-{mode}"
        install(SandboxPolicy(grant_cwd=mode), name=name, user=True)
        self.manager, self.client = start_new_kernel(kernel_name=name, cwd=str(folder),
                                                     startup_timeout=60)

    def run(self, code):
        """What Sandbox.run returns, as far as these tests read it: text and error."""
        found = types.SimpleNamespace(text=None, error=None)

        def keep(msg):
            if msg["msg_type"] == "execute_result":
                found.text = msg["content"]["data"]["text/plain"]
            elif msg["msg_type"] == "error":
                found.error = types.SimpleNamespace(name=msg["content"]["ename"],
                                                    value=msg["content"]["evalue"])
        self.client.execute_interactive(code, output_hook=keep, timeout=60)
        return found

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.mark.parametrize("folder, holds", [
    (tempfile.gettempdir(), "Jupyter's runtime directory (the connection files of every kernel)"),
    (os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir),
     "the home directory of the user who started it (keys, tokens, Jupyter's files)"),
], ids=["connection-files", "home"])
def test_a_folder_holding_secrets_is_never_granted(folder, holds):
    kernel = NotebookKernel(folder, "ro")
    try:
        if "runtime" in holds:  # where this client writes its kernels' connection files
            assert os.path.dirname(kernel.manager.connection_file) == folder
            with tempfile.NamedTemporaryFile(dir=folder, suffix=".csv") as beside:
                os.chmod(beside.name, 0o644)
                name = os.path.basename(beside.name)
                error = kernel.run(f"open({name!r})").error
            assert error.name == "FileNotFoundError"
            assert error.value.endswith(
                f"which has {name!r}; --grant-cwd could not grant that folder: the folder "
                f"{folder} holds {holds}, which user code must never see: move the notebook and "
                "its data into a folder of their own, or open the file by an absolute path "
                "granted with --read-path")
        assert evaluate(kernel, "import os\nos.getcwd() == os.environ['HOME']") is True
        assert errno_of(kernel, f"import os\nos.listdir({folder!r})") == "EACCES"
        banner = kernel.client.kernel_info(reply=True)["content"]["banner"]
    finally:
        kernel.close()
    assert (f"the folder the kernel started in: NOT granted (the folder {folder} holds {holds}, "
            "which user code must never see); relative paths resolve in the scratch") in banner


# --- runs that ask for the folder: `run`, Sandbox, one-shot or not ----------------------------

REFUSED_AT_ROOT = ("--grant-cwd=ro could not grant the folder the run started in: the kernel "
                   "was started in /, and granting it would grant the whole host; start it from "
                   "a folder that holds only the data it needs, or grant files by absolute path "
                   "with --read-path (--write-path to write)")


def run_cli(folder, *argv):
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", "run", *argv], cwd=folder,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("start", [[], ["--cold-start"]], ids=["one-shot", "cold-start"])
def test_run_reads_beside_it_and_keeps_what_it_writes(tmp_path, start):
    """`sandbox-kernel run --grant-cwd=rw` on either path: the folder is the working directory,
    and a file the code writes there is there after the run (it was lost on the one-shot)."""
    folder = tmp_path / "project"
    folder.mkdir()
    folder.chmod(0o777)
    (folder / "sales.csv").write_text("month,sales\n1,10\n2,14\n")
    (tmp_path / "job.py").write_text(
        "def main():\n    import os\n    rows = open('sales.csv').read().count('\\n')\n"
        "    open('summary.txt', 'w').write(f'{rows} lines')\n"
        "    return {'rows': rows, 'here': os.getcwd()}\n")
    done = run_cli(folder, str(tmp_path / "job.py"), "--grant-cwd=rw", *start)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"rows": 3, "here": str(folder)}
    assert (folder / "summary.txt").read_text() == "3 lines"


@pytest.mark.parametrize("start", [[], ["--cold-start"]], ids=["one-shot", "cold-start"])
def test_run_refuses_a_folder_it_cannot_grant_and_says_why(tmp_path, start):
    (tmp_path / "job.py").write_text("print('the job ran')\n")
    # The bare flag before the file: argparse once read the file as the flag's value.
    done = run_cli("/", "--grant-cwd", str(tmp_path / "job.py"), *start)
    assert done.returncode == 3, done.stderr
    assert "the job ran" not in done.stdout + done.stderr
    assert done.stderr == f"sandbox-kernel run: the kernel did not start: {REFUSED_AT_ROOT}\n"


@pytest.mark.parametrize("one_shot", [True, False], ids=["one-shot", "zmq"])
def test_a_sandbox_refuses_a_folder_it_cannot_grant(one_shot):
    with contextlib.chdir("/"):
        sandbox = Sandbox(None, one_shot=one_shot, policy=SandboxPolicy(grant_cwd="ro"))
        with pytest.raises(RuntimeError) as refused:
            sandbox.start()
            sandbox.run("print('ran')")
    sandbox.close()
    assert str(refused.value) == REFUSED_AT_ROOT


def test_a_one_shot_sandbox_writes_into_its_folder(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    folder.chmod(0o777)
    with contextlib.chdir(folder), \
            Sandbox(None, one_shot=True, policy=SandboxPolicy(grant_cwd="rw")) as sandbox:
        ok(sandbox.run("open('kept.txt', 'w').write('kept')"))
    assert (folder / "kept.txt").read_text() == "kept"


@pytest.mark.parametrize("one_shot", [True, False], ids=["one-shot", "zmq"])
def test_a_relative_open_says_where_the_file_is_on_both_transports(tmp_path, one_shot):
    """Without the grant, a file beside the run is named in the error on both transports (the
    one-shot once started in /, and said nothing)."""
    folder = tmp_path / "project"
    folder.mkdir()
    folder.chmod(0o777)
    (folder / "sales.csv").write_text("month,sales\n")
    with contextlib.chdir(folder), Sandbox(None, one_shot=one_shot) as sandbox:
        error = sandbox.run("open('sales.csv')").error
    assert error.name == "FileNotFoundError"
    assert f"not the folder it was started in ({folder}" in error.value
    # said as the caller gave the policy, on both transports (#45 item 3)
    assert 'start the sandbox with `SandboxPolicy(grant_cwd="ro")`' in error.value


def test_install_writes_the_flag_and_check_reports_it(tmp_path):
    def cli(*argv):
        done = subprocess.run([sys.executable, "-m", "sandbox_kernel", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    for flags, mode in ((["--grant-cwd"], "ro"), (["--grant-cwd=rw"], "rw")):
        cli("install", "--prefix", str(tmp_path / mode), "--name", "nb", *flags)
        spec = json.loads((tmp_path / mode / "share/jupyter/kernels/nb/kernel.json").read_text())
        assert spec["argv"][-1] == f"--SandboxPolicy.grant_cwd={mode}"
        assert spec["metadata"]["sandbox_kernel"]["policy"]["grant_cwd"] == mode
    report = cli("check", "--grant-cwd=rw")
    assert ("  the folder the kernel starts in (the notebook's folder under Jupyter), its "
            "working directory: read-write") in report
