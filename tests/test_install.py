"""What `sandbox-kernel install` tells the user: where the kernelspec went and how to undo it."""

import json
import os
import subprocess
import sys

# The CLI with Jupyter's system-wide directory moved to a temporary one (jupyter_client reads
# the same list object), so that a bare install, as root, writes nowhere real.
CLI_WITH_SYSTEM_DIR = """
import sys
from jupyter_core import paths
paths.SYSTEM_JUPYTER_PATH[:] = [sys.argv[1]]
from sandbox_kernel.cli import main
sys.exit(main(sys.argv[2:]))
"""


def cli(system_dir, *argv):
    done = subprocess.run([sys.executable, "-c", CLI_WITH_SYSTEM_DIR, str(system_dir), *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_bare_install_says_it_is_system_wide_and_how_to_undo_it(tmp_path):
    system = tmp_path / "system"
    said = cli(system, "install", "--name", "shared")
    spec_dir = system / "kernels" / "shared"
    assert (spec_dir / "kernel.json").is_file()
    assert said == (
        f"Installed kernelspec shared in {spec_dir}\n"
        '  shown as "Python 3 (sandbox: shared)" in the launcher (--display-name TEXT to '
        'change it)\n'
        "  system-wide: every user of this machine, and Jupyter in every Python environment, "
        f"now lists it; it starts {sys.executable}. For yourself only, install with --user (or "
        "--sys-prefix for this environment only).\n"
        "  to remove it: sandbox-kernel uninstall --name shared\n")
    undo = said.splitlines()[-1].split(": ", 1)[1].split()
    assert cli(system, *undo[1:]) == f"Removed kernelspec shared from {spec_dir}\n"
    assert not spec_dir.exists()


def test_a_user_install_names_the_matching_uninstall(tmp_path):
    said = cli(tmp_path / "system", "install", "--user", "--name", "mine")
    assert "system-wide" not in said
    assert said.endswith("  to remove it: sandbox-kernel uninstall --user --name mine\n")
    assert cli(tmp_path / "system", "uninstall", "--user", "--name", "mine").startswith(
        "Removed kernelspec mine from ")


def test_kernelspecs_of_other_names_show_other_names_in_the_launcher(tmp_path):
    """Two names once made two identical "Python 3 (sandbox)" tiles (#32 item 5)."""
    system = tmp_path / "system"
    for argv in (["--name", "sandbox"], ["--name", "data", "--grant-cwd"],
                 ["--name", "mine", "--display-name", "Mine"]):
        said = cli(system, "install", *argv)
        assert said.splitlines()[1].endswith("in the launcher (--display-name TEXT to change it)")
    listed = subprocess.run([sys.executable, "-m", "jupyter", "kernelspec", "list", "--json"],
                            env={**os.environ, "JUPYTER_DATA_DIR": str(system)},
                            capture_output=True, text=True, timeout=60, check=True)
    shown = {name: spec["spec"]["display_name"]
             for name, spec in json.loads(listed.stdout)["kernelspecs"].items()
             if name in ("sandbox", "data", "mine")}
    assert shown == {"sandbox": "Python 3 (sandbox)", "data": "Python 3 (sandbox: data)",
                     "mine": "Mine"}


# The CLI with this environment's prefix and the system-wide directory moved to temporary ones
# (jupyter_core reads sys.prefix on import), so that --sys-prefix and a bare install write
# nowhere real and Jupyter's search path has them. Jupyter puts an environment's kernelspecs
# before the user's and the system's (as it does in a virtualenv unless told otherwise).
CLI_WITH_PREFIX = """
import sys
sys.prefix = sys.argv[1]
from jupyter_core import paths
paths.SYSTEM_JUPYTER_PATH[:] = [sys.argv[1] + "-system"]
from sandbox_kernel.cli import main
sys.exit(main(sys.argv[2:]))
"""


def cli_in_prefix(prefix, *argv):
    done = subprocess.run([sys.executable, "-c", CLI_WITH_PREFIX, str(prefix), *argv],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "JUPYTER_PREFER_ENV_PATH": "1"})
    assert done.returncode == 0, done.stderr
    return done


def warnings_of(done):
    return [line for line in done.stderr.splitlines() if "warning:" in line]


def test_install_warns_when_its_kernelspec_is_shadowed_or_shadows_another(tmp_path):
    """After the README's --sys-prefix set-up, `install --grant-cwd` as the kernel's hint once
    said wrote a system-wide kernelspec Jupyter never starts: the venv's comes first (#45
    item 3). Each install says which one Jupyter starts."""
    prefix = tmp_path / "env"
    prefix_dir = prefix / "share" / "jupyter" / "kernels" / "twice"
    system_dir = tmp_path / "env-system" / "kernels" / "twice"
    user_dir = os.path.join(os.environ["JUPYTER_DATA_DIR"], "kernels", "twice")
    shadowed = ("sandbox-kernel install: warning: Jupyter starts kernelspec twice from "
                f"{prefix_dir}, which comes first in its search path: this one changes nothing "
                "until that one is removed (`sandbox-kernel uninstall` with that one's scope) or "
                "replaced by installing with its scope")
    try:
        assert warnings_of(cli_in_prefix(prefix, "install", "--sys-prefix", "--name",
                                         "twice")) == []
        assert warnings_of(cli_in_prefix(prefix, "install", "--name", "twice",
                                         "--grant-cwd")) == [shadowed]
        assert warnings_of(cli_in_prefix(prefix, "install", "--user", "--name", "twice")) == [
            shadowed, "sandbox-kernel install: warning: this kernelspec twice shadows the one in "
            f"{system_dir}, later in Jupyter's search path: Jupyter no longer starts that one"]
        assert warnings_of(cli_in_prefix(prefix, "install", "--sys-prefix", "--name",
                                         "twice", "--grant-cwd")) == [
            f"sandbox-kernel install: warning: this kernelspec twice shadows the one in {path}, "
            "later in Jupyter's search path: Jupyter no longer starts that one"
            for path in (user_dir, system_dir)]
    finally:
        cli_in_prefix(prefix, "uninstall", "--user", "--name", "twice")


def test_a_prefix_off_the_search_path_is_said(tmp_path):
    done = cli_in_prefix(tmp_path / "env", "install", "--prefix", str(tmp_path / "elsewhere"),
                         "--name", "lost")
    assert warnings_of(done) == [
        f"sandbox-kernel install: warning: {tmp_path / 'elsewhere/share/jupyter/kernels/lost'} "
        "is not on Jupyter's kernel search path (`jupyter --paths`): Jupyter does not list it; "
        f"install with --user or --sys-prefix, or add {tmp_path / 'elsewhere/share/jupyter'} "
        "to JUPYTER_PATH"]


def test_a_kernel_names_the_scope_its_kernelspec_was_installed_with(tmp_path):
    """The hint after a relative open names `install --sys-prefix --name N`, as installed."""
    import nbformat

    prefix = tmp_path / "env"
    cli_in_prefix(prefix, "install", "--sys-prefix", "--name", "prefixed")
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "data.csv").write_text("a,b\n")
    nb = nbformat.v4.new_notebook(metadata={"language_info": {"name": "python"}})
    nb.cells = [nbformat.v4.new_code_cell("open('data.csv')",
                                          metadata={"tags": ["raises-exception"]})]
    nbformat.write(nb, folder / "report.ipynb")
    done = subprocess.run(["jupyter", "execute", "--kernel_name=prefixed", "--output=done",
                           "report.ipynb"], cwd=folder, capture_output=True, text=True,
                          timeout=120, env={**os.environ,
                                            "JUPYTER_PATH": str(prefix / "share" / "jupyter")})
    # jupyter execute takes the kernel from the prefix, as Jupyter in that environment would
    assert done.returncode == 0, done.stderr
    [error] = nbformat.read(folder / "done.ipynb", as_version=4).cells[0].outputs
    assert error.ename == "FileNotFoundError"
    assert error.evalue.endswith(
        "to read it by this name, reinstall the kernelspec with `sandbox-kernel install "
        "--sys-prefix --name prefixed --grant-cwd` (--grant-cwd=rw to write there too), its "
        "other flags as before, and restart the kernel: it then starts in that folder"), \
        error.evalue
