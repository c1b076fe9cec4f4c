"""What a user is told: file refusals explained by the grants, tracebacks that end at the user's
call, the timeout's real source, stdout and stderr in the order written, editable-install grants.
"""

import errno
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

import sandbox_kernel
from sandbox_kernel.client import Sandbox
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import evaluate, ok

OTHER_UID = 54321  # owns a file the kernel's user may not read, whatever that user is


@pytest.fixture(scope="module")
def folders():
    """A notebook's folder (not granted) and a granted folder with a file its host refuses.

    Under a directory every uid may enter, so that Landlock, not the kernel's private view of
    an unreachable directory (see test_a_path_the_view_hides_says_so), is what refuses.
    """
    base = Path(tempfile.mkdtemp(prefix="sandbox-explained-"))
    base.chmod(0o755)
    yield from _project_and_grant(base)
    shutil.rmtree(base)


def _project_and_grant(base):
    project, granted = base / "project", base / "granted"
    project.mkdir()
    (project / "data.csv").write_text("a,b\n1,2\n")
    granted.mkdir()
    (granted / "open.txt").write_text("readable")
    (granted / "open.txt").chmod(0o666)  # the host lets any uid write it: only Landlock refuses
    private = granted / "private.txt"
    private.write_text("the host says no")
    os.chown(private, OTHER_UID, OTHER_UID)
    private.chmod(0o600)
    secret = project / "secret.csv"  # outside the grants, and the host refuses it too
    secret.write_text("the host says no")
    os.chown(secret, OTHER_UID, OTHER_UID)
    secret.chmod(0o600)
    yield project, granted


@pytest.fixture(scope="module")
def kernel(folders):
    """A kernel started in the notebook's folder, as Jupyter starts it, granted one folder."""
    project, granted = folders
    here = os.getcwd()
    os.chdir(project)
    try:
        sb = Sandbox(None, policy=SandboxPolicy(read_paths=[str(granted)]))
        sb.start()
    finally:
        os.chdir(here)
    yield sb
    sb.close()


def error_of(sandbox, code):
    ex = sandbox.run(code)
    assert ex.error is not None, f"{code!r} raised nothing"
    return ex.error


def last_lines(traceback, count):
    """The last count non-blank lines of a traceback (its entries may hold several lines)."""
    lines = [line for line in "\n".join(traceback).splitlines() if line.strip()]
    return lines[-count:]


def sandbox_frames(traceback):
    """Traceback lines that show the sandbox's or a library's insides."""
    return [line for line in traceback if any(
        inside in line for inside in ("denials.py", "deadline.py", "subprocess.py", "pexpect",
                                      "site-packages", "ipykernel", "main_call.py"))]


@pytest.mark.parametrize("call", [
    "open({path!r})",
    "import os\nos.listdir({folder!r})",
    "import os\nlist(os.scandir({folder!r}))",
    "import pathlib\npathlib.Path({path!r}).read_text()",
    "import pathlib\nlist(pathlib.Path({folder!r}).iterdir())",
], ids=["open", "listdir", "scandir", "pathlib-read", "pathlib-iterdir"])
def test_a_path_outside_the_grants_says_so(kernel, folders, call):
    project, _ = folders
    path = str(project / "data.csv")
    error = error_of(kernel, call.format(path=path, folder=str(project)))
    target = path if "data.csv" in call.format(path=path, folder="") else str(project)
    assert error.name == "PermissionError"
    assert error.value == (
        f"[Errno 13] Permission denied: {target!r}: the sandbox refused it: the path is outside "
        "what this kernel was granted; to let user code read it, start the sandbox with "
        f'`SandboxPolicy(read_paths=["{project}"])` (write_paths=["{project}"] to write there '
        "too)")
    # the traceback ends at the user's call, then the one-line reason
    assert error.traceback[-1] == f"PermissionError: {error.value}"
    assert sandbox_frames(error.traceback) == []


def test_a_path_the_host_refuses_too_does_not_promise_a_grant_helps(kernel, folders):
    project, _ = folders
    secret = str(project / "secret.csv")
    uid = evaluate(kernel, "import os\nos.getuid()")
    error = error_of(kernel, f"open({secret!r})")
    assert (error.name, error.value) == ("PermissionError", (
        f"[Errno 13] Permission denied: {secret!r}: the sandbox refused it: the path is outside "
        f"what this kernel was granted, and the host does not let its uid ({uid}) read it "
        "either; to let user code read it, make it readable by that uid (or have it run as a "
        "user who may read it: --run-as USER), then start the sandbox with "
        f'`SandboxPolicy(read_paths=["{project}"])` (write_paths=["{project}"] to write there '
        "too)"))


def test_user_code_still_catches_the_same_error(kernel, folders):
    project, _ = folders
    assert evaluate(kernel, f"try:\n    open({str(project / 'data.csv')!r})\n"
                            "except PermissionError as exc:\n    e = exc.errno\ne") == errno.EACCES


def test_writing_a_read_only_grant_names_write_path(kernel, folders):
    _, granted = folders
    error = error_of(kernel, f"open({str(granted / 'open.txt')!r}, 'a')")
    assert (error.name, error.value) == ("PermissionError", (
        f"[Errno 13] Permission denied: {str(granted / 'open.txt')!r}: the sandbox refused it: "
        "this kernel was granted the path read-only; to let user code write there, start the "
        f'sandbox with `SandboxPolicy(write_paths=["{granted}"])`'))


def test_what_the_host_refuses_inside_a_grant_is_left_as_it_is(kernel, folders):
    _, granted = folders
    assert ok(kernel.run(f"open({str(granted / 'open.txt')!r}).read()")).text == "'readable'"
    private = str(granted / "private.txt")
    error = error_of(kernel, f"open({private!r})")
    assert (error.name, error.value) == ("PermissionError",
                                         f"[Errno 13] Permission denied: {private!r}")


def test_a_relative_name_points_at_the_notebooks_folder(kernel, folders):
    project, _ = folders
    error = error_of(kernel, "import pandas\npandas.read_csv('data.csv')")
    scratch = evaluate(kernel, "import os\nos.getcwd()")
    assert error.name == "FileNotFoundError"
    assert error.value.endswith(
        f"the kernel's working directory is its private scratch ({scratch}), not the folder it "
        f"was started in ({project}: the notebook's folder under Jupyter), which has "
        "'data.csv'; to read it by this name, start the sandbox with "
        '`SandboxPolicy(grant_cwd="ro")` (grant_cwd="rw" to write there too): it then starts in '
        "that folder")
    # a name that is nowhere stays the plain error
    assert error_of(kernel, "open('nowhere.csv')").value == \
        "[Errno 2] No such file or directory: 'nowhere.csv'"


@pytest.mark.parametrize("code, call", [
    ("import subprocess\nsubprocess.run(['ls'])", "subprocess.run(['ls'])"),
    ("!ls", "get_ipython().system('ls')"),
    ("import os\nos.system('ls')", "os.system('ls')"),
], ids=["subprocess", "bang", "os.system"])
def test_refusal_tracebacks_end_at_the_users_call(kernel, code, call):
    error = error_of(kernel, code)
    assert error.name == "PermissionError"
    assert sandbox_frames(error.traceback) == []
    user_line, reason = last_lines(error.traceback, 2)  # the user's line, then the reason
    assert call in user_line and user_line.startswith("---->")
    assert reason == error.traceback[-1]
    assert error.traceback[-1].startswith("PermissionError: [Errno 1] Operation not permitted: "
                                          "the sandbox blocked ")
    assert "creating processes is not allowed in the sandbox" in error.traceback[-1]


def test_a_refusal_in_main_ends_at_mains_line(kernel):
    ex = kernel.run("def main():\n    import subprocess\n    subprocess.run(['true'])\n", {})
    assert ex.error.name == "PermissionError" and sandbox_frames(ex.error.traceback) == []
    user_line, _ = last_lines(ex.error.traceback, 2)
    assert "subprocess.run(['true'])" in user_line and user_line.startswith("---->")


def test_timeout_names_sandbox_run_and_hides_the_deadline(kernel):
    ex = kernel.run("import time\ntime.sleep(30)", timeout=1)
    assert (ex.error.name, ex.error.value) == (
        "ExecutionTimeout",
        "the execution ran longer than its 1 s limit (set by Sandbox.run(timeout=)) and was "
        "interrupted")
    assert sandbox_frames(ex.error.traceback) == []
    assert ex.error.traceback[-1] == f"ExecutionTimeout: {ex.error.value}"


def test_timeout_from_bare_metadata_names_the_metadata(kernel, monkeypatch):
    monkeypatch.setattr(kernel, "timeout_source", "")  # a client that sends no label
    ex = kernel.run("while True:\n    pass", timeout=1)
    assert ex.error.value == ("the execution ran longer than its 1 s limit (set by "
                              "metadata.sandbox.timeout) and was interrupted")


def test_stdout_and_stderr_keep_the_order_written(kernel):
    code = ("import logging, sys\nlog = logging.getLogger('order')\n"
            "log.addHandler(logging.StreamHandler(sys.stderr))\nlog.propagate = False\n"
            "for i in range(3):\n    print(f'print {i}')\n    log.warning(f'log {i}')\n"
            "print('last')")
    ex = ok(kernel.run(code))
    lines = [(chunk["name"], line) for chunk in ex.logs for line in chunk["text"].splitlines()]
    assert lines == [("stdout", "print 0"), ("stderr", "log 0"), ("stdout", "print 1"),
                     ("stderr", "log 1"), ("stdout", "print 2"), ("stderr", "log 2"),
                     ("stdout", "last")]


def test_an_editable_checkout_is_not_granted_as_a_whole(kernel):
    package = Path(sandbox_kernel.__file__).resolve().parent
    checkout = package.parent
    if "site-packages" in package.parts or not (checkout / "pyproject.toml").exists():
        pytest.skip("sandbox_kernel is not an editable install from a checkout here")
    secrets = [checkout / "pyproject.toml"]
    git = checkout / ".git"
    secrets.append(git / "config" if git.is_dir() else git)  # a worktree's .git is a file
    for secret in secrets:
        assert evaluate(kernel, f"try:\n    open({str(secret)!r}).read()\n    e = None\n"
                                "except OSError as exc:\n    e = exc.errno\ne") == errno.EACCES
    # what imports need is still there
    assert evaluate(kernel, "import sandbox_kernel.check\nsandbox_kernel.check.__name__") == \
        "sandbox_kernel.check"


def test_a_path_the_view_hides_says_so(kernel):
    """A directory the uid cannot enter shows, in the kernel's view, only what was granted."""
    layers = kernel.client.kernel_info(reply=True, timeout=30)["content"]["sandbox"]["layers"]
    covered = layers["privileges"].get("covered")
    if not covered:
        pytest.skip("no directory is covered here: the kernel's uid reaches its interpreter")
    path = os.path.join(covered[0], "data.csv")
    error = error_of(kernel, f"open({path!r})")
    assert (error.name, error.value) == ("FileNotFoundError", (
        f"[Errno 2] No such file or directory: {path!r}: the sandbox hides it: the path is "
        "outside what this kernel was granted; to let user code read it (or a folder above it), "
        f'start the sandbox with `SandboxPolicy(read_paths=["{path}"])` '
        f'(write_paths=["{path}"] to write there too)'))


# --- the network off: the cell says so, and which setting opens it (#32 item 3) ----------------

LOOKUPS = """
import socket, urllib.request
said = []
for attempt in (lambda: urllib.request.urlopen('http://example.com', timeout=5),
                lambda: socket.getaddrinfo('example.com', 80)):
    try:
        attempt()
    except OSError as exc:
        said.append((type(exc).__name__, str(exc), getattr(exc, 'errno', None)))
said
"""


def test_a_lookup_with_the_network_off_says_so_and_the_narrowest_setting_first(sandbox):
    (url_name, url_said, _), (lookup_name, lookup_said, lookup_errno) = \
        evaluate(sandbox, LOOKUPS)
    assert (url_name, lookup_name) == ("URLError", "gaierror")
    assert lookup_errno == socket.EAI_AGAIN  # the resolver's own answer, explained
    for said in (url_said, lookup_said):
        assert "name resolution: the sandbox blocked a name lookup: the network is off in " \
               "this sandbox (--network off)" in said, said
        assert said.index("`sandbox-kernel install --network hosts --allow-host NAME`") < \
            said.index("--network on")
