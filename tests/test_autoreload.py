"""%load_ext autoreload in a sandboxed kernel: silent, and it reloads (#45 item 8).

Debian's python3 has /usr/lib/python3.X/sitecustomize.py, a link into /etc/python3.X: the
interpreter runs it at start, but the kernel's grants once left the link's target out, and
autoreload, which reads the source of every loaded module, printed a PermissionError
traceback for it. Here a venv of this interpreter has such a link on its import path.
"""

import shutil
import subprocess
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import pytest

from sandbox_kernel.client import Sandbox
from tests.helpers import evaluate


@pytest.fixture(scope="module")
def linked_hook_python():
    """A venv whose sitecustomize.py, on its import path, links to a file outside it that
    every uid may read, as /etc/python3.X is (pytest's 0700 tmp dirs would hide it)."""
    root = Path(tempfile.mkdtemp(prefix="sandbox-autoreload-"))
    root.chmod(0o755)
    venv = root / "venv"
    subprocess.run(["python", "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c",
                              "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    hooks = venv / "lib" / "hooks"  # a stdlib-like folder: not site-packages
    hooks.mkdir()
    etc = root / "etc-python"
    etc.mkdir()
    (etc / "sitecustomize.py").write_text("HOOKED = True\n")
    (hooks / "sitecustomize.py").symlink_to(etc / "sitecustomize.py")
    Path(purelib.strip(), "host.pth").write_text(
        f"{hooks}\nimport site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    assert subprocess.run([str(python), "-I", "-c", "import sitecustomize as s; print(s.HOOKED)"],
                          capture_output=True, text=True, timeout=60).stdout == "True\n"
    yield python
    shutil.rmtree(root)


def test_autoreload_loads_silently_and_reloads(linked_hook_python):
    with Sandbox(None, python=str(linked_hook_python)) as sb:
        assert evaluate(sb, "import sitecustomize\nsitecustomize.HOOKED") is True
        for line in ("%load_ext autoreload", "%autoreload 2"):
            done = sb.run(line)
            assert (done.error, done.stdout, done.stderr, done.displays) == \
                (None, "", "", []), done.to_dict()
        module = textwrap.dedent("""\
            def answer():
                return {}
            """)
        done = sb.run(f"import sys, os\nsys.path.insert(0, os.getcwd())\n"
                      f"open('mymod.py', 'w').write({module.format(1)!r})\n"
                      "import mymod\nmymod.answer()")
        assert (done.error, done.stderr, done.text) == (None, "", "1"), done.to_dict()
        # a later mtime, as an editor's save gives it
        done = sb.run(f"open('mymod.py', 'w').write({module.format(2)!r})\n"
                      "os.utime('mymod.py', (0, os.path.getmtime('mymod.py') + 5))")
        done = sb.run("mymod.answer()")
        assert (done.error, done.stderr, done.text) == (None, "", "2"), done.to_dict()
