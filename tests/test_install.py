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
