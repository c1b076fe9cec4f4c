"""Notebooks run in the sandbox kernel with `jupyter execute`, nbclient and papermill."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

RUN_TIMEOUT = 120  # seconds a whole notebook run may take, kernel start included
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

CELLS = {  # id: (source, tags)
    "parameters": ("greeting = 'hello'\nn = 3", ["parameters"]),
    "greet": ("print(f'{greeting} from the sandbox')", []),
    "chart": ("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()", []),
    "define-main": ("def main(x):\n    print('main got', x)\n    return {'doubled': x * 2, 'n': n}",
                    []),
    "call-main": ('%main {"x": 21}', []),
    "denied": ("import subprocess\nsubprocess.run(['ls'])", ["raises-exception"]),
    "after": ("print('still running')", []),
    "order": ("import logging\nlogging.basicConfig(format='%(message)s', force=True)\n"
              "for i in range(2):\n    print(f'print {i}')\n    logging.warning(f'log {i}')", []),
    "nearby-data": ("open('data.csv')", ["raises-exception"]),
}


def write_notebook(path: Path) -> Path:
    """The test notebook: print, chart, %main, a sandbox denial, and a cell after it."""
    nb = nbformat.v4.new_notebook(metadata={
        "kernelspec": {"name": "sandbox", "display_name": "Python 3 (sandbox)",
                       "language": "python"},
        "language_info": {"name": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(source, id=cell_id, metadata={"tags": tags})
                for cell_id, (source, tags) in CELLS.items()]
    nbformat.write(nb, path)
    return path


@pytest.fixture
def notebook(kernelspecs, tmp_path) -> Path:
    """The test notebook, written to a fresh directory, with a data file next to it."""
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    return write_notebook(tmp_path / "sandboxed.ipynb")


def outputs_by_cell(nb: nbformat.NotebookNode) -> dict[str, list]:
    """Each of the test notebook's cells' outputs, by cell id, streams merged."""
    return {cell.id: merged_streams(cell.outputs) for cell in nb.cells if cell.get("id") in CELLS}


def merged_streams(outputs: list) -> list:
    """Outputs with consecutive chunks of one stream joined, as JupyterLab shows them.

    ipykernel flushes stdout on a 0.2 s timer, so now and then one print() arrives in two chunks.
    """
    merged: list = []
    for output in outputs:
        last = merged[-1] if merged else {}
        if output["output_type"] == "stream" and last.get("output_type") == "stream" \
                and last["name"] == output["name"]:
            merged[-1] = {**last, "text": last["text"] + output["text"]}
        else:
            merged.append(output)
    return merged


def assert_sandboxed_outputs(nb: nbformat.NotebookNode, greeting: str, n: int,
                             folder: Path) -> None:
    """The saved notebook holds every cell's expected output, the denial included."""
    outputs = outputs_by_cell(nb)
    assert outputs["order"] == [  # in the order written, not all prints before all logs
        {"output_type": "stream", "name": name, "text": text}
        for name, text in [("stdout", "print 0\n"), ("stderr", "log 0\n"),
                           ("stdout", "print 1\n"), ("stderr", "log 1\n")]]
    assert_points_at_the_notebooks_folder(outputs["nearby-data"], folder)
    assert outputs["greet"] == [{"output_type": "stream", "name": "stdout",
                                 "text": f"{greeting} from the sandbox\n"}]
    assert_one_png(outputs["chart"])
    assert outputs["define-main"] == []
    assert_main_result(outputs["call-main"], {"doubled": 42, "n": n})
    assert_denied(outputs["denied"])
    assert outputs["after"] == [{"output_type": "stream", "name": "stdout",
                                 "text": "still running\n"}]


def assert_one_png(outputs: list) -> None:
    """One display_data holding a real PNG image."""
    assert [output["output_type"] for output in outputs] == ["display_data"]
    data = outputs[0]["data"]
    assert base64.b64decode(data["image/png"])[:8] == PNG_SIGNATURE
    assert data["text/plain"] == "<Figure size 640x480 with 1 Axes>"


def assert_main_result(outputs: list, expected: dict) -> None:
    """What main printed, then its dict as one JSON execute_result."""
    assert outputs[0] == {"output_type": "stream", "name": "stdout", "text": "main got 21\n"}
    assert [output["output_type"] for output in outputs[1:]] == ["execute_result"]
    data = outputs[1]["data"]
    assert set(data) == {"application/json", "text/plain"}
    assert data["application/json"] == expected
    assert json.loads(data["text/plain"]) == expected
    assert outputs[1]["metadata"] == {"sandbox": {"entrypoint": "main"}}


def assert_denied(outputs: list) -> None:
    """One error output: the sandbox's PermissionError."""
    assert [output["output_type"] for output in outputs] == ["error"]
    assert outputs[0]["ename"] == "PermissionError"
    assert "the sandbox blocked starting a subprocess" in outputs[0]["evalue"]


def assert_points_at_the_notebooks_folder(outputs: list, folder: Path) -> None:
    """open('data.csv') says the file is in the notebook's folder and how to grant it."""
    assert [output["output_type"] for output in outputs] == ["error"]
    assert outputs[0]["ename"] == "FileNotFoundError"
    assert outputs[0]["evalue"].startswith(
        "[Errno 2] No such file or directory: 'data.csv': the kernel's working directory is its "
        "private scratch (")
    # pytest's tmp_path is under /tmp/pytest-of-root (0700): a kernel root starts with a uid of
    # its own cannot look into the notebook's folder, so it cannot say whether data.csv is there.
    others_enter = all(path.stat().st_mode & 0o001 for path in [folder, *folder.parents])
    seen = ("which has 'data.csv';" if others_enter or os.geteuid() != 0 else
            "which this kernel's uid cannot look into; if 'data.csv' is there,")
    assert outputs[0]["evalue"].endswith(
        f"not the folder it was started in ({folder}: the notebook's folder under Jupyter), "
        f"{seen} to read it by this name, reinstall the kernelspec with `sandbox-kernel "
        "install --grant-cwd` (--grant-cwd=rw to write there too), its other flags as before, "
        "and restart the kernel: it then starts in that folder")


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run a Jupyter command line with this session's isolated environment."""
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT)


def test_jupyter_execute(notebook):
    executed = notebook.with_name("executed.ipynb")
    result = run(["jupyter", "execute", "--kernel_name=sandbox", f"--output={executed.name}",
                  notebook.name], cwd=notebook.parent)
    assert result.returncode == 0, result.stderr
    assert_sandboxed_outputs(nbformat.read(executed, as_version=4), "hello", 3, notebook.parent)


def test_nbclient(notebook):
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, kernel_name="sandbox", timeout=RUN_TIMEOUT,
                            resources={"metadata": {"path": str(notebook.parent)}})
    client.execute()
    nbformat.write(nb, notebook)
    assert_sandboxed_outputs(nbformat.read(notebook, as_version=4), "hello", 3, notebook.parent)


def test_papermill_with_parameters(notebook):
    executed = notebook.with_name("papermill.ipynb")
    result = run(["papermill", notebook.name, executed.name, "-k", "sandbox",
                  "-p", "greeting", "hi", "-p", "n", "5", "--no-progress-bar"],
                 cwd=notebook.parent)
    # papermill fails a run that has any error output, even in a raises-exception cell; it still
    # runs every cell and saves the notebook.
    assert result.returncode == 1
    assert "PapermillExecutionError" in result.stderr
    nb = nbformat.read(executed, as_version=4)
    injected = [cell.source for cell in nb.cells if "injected-parameters" in cell.metadata.tags]
    assert injected == ['# Parameters\ngreeting = "hi"\nn = 5\n']
    assert_sandboxed_outputs(nb, "hi", 5, notebook.parent)


def test_papermill_needs_language_for_a_notebook_without_language_metadata(kernelspecs, tmp_path):
    # docs/notebooks.md's note: papermill takes the language for its parameters cell from the
    # notebook, not from the kernelspec; `--language python` supplies it.
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("print(x * 2)")]
    nbformat.write(nb, tmp_path / "bare.ipynb")
    argv = ["papermill", "bare.ipynb", "out.ipynb", "-k", "sandbox", "-p", "x", "5",
            "--no-progress-bar"]
    without = run(argv, cwd=tmp_path)
    assert without.returncode == 1
    assert "No language found in notebook and no override provided" in without.stderr
    with_language = run([*argv, "--language", "python"], cwd=tmp_path)
    assert with_language.returncode == 0, with_language.stderr
    printed = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[-1].outputs
    assert printed == [{"output_type": "stream", "name": "stdout", "text": "10\n"}]


# --- a notebook beside its data: `install --grant-cwd`, then `jupyter execute` ------------------

SALES = "month,sales\n1,10\n2,14\n3,9\n"
DATA_CELLS = [
    "import os\nsorted(os.listdir(os.environ['MPLCONFIGDIR']))",  # the fork server's font list
    "import pandas as pd\nimport matplotlib.pyplot as plt\ndf = pd.read_csv('sales.csv')\n"
    "df.plot(x='month', y='sales')\nplt.show()\nprint(int(df.sales.sum()))",
]


def install_cli(*flags: str) -> subprocess.CompletedProcess:
    """`sandbox-kernel install --user ...` as a user types it (into the session's data dir)."""
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "install", "--user", *flags],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr
    return done


def notebook_beside_csv(folder: Path, kernel_name: str, extra_cells: list[str] = ()) -> Path:
    """sales.csv and a notebook that reads it by its relative name and plots it."""
    folder.mkdir()
    (folder / "sales.csv").write_text(SALES)
    nb = nbformat.v4.new_notebook(metadata={
        "kernelspec": {"name": kernel_name, "display_name": kernel_name, "language": "python"},
        "language_info": {"name": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(source, metadata={"tags": tags})
                for source, tags in [*((cell, []) for cell in DATA_CELLS), *extra_cells]]
    nbformat.write(nb, folder / "report.ipynb")
    return folder / "report.ipynb"


def sandbox_lines(stderr: str) -> list[str]:
    """What `jupyter execute` printed on stderr besides its own [NbClientApp] log."""
    return [line for line in stderr.splitlines() if not line.startswith("[NbClientApp]")]


def test_a_notebook_reads_the_csv_next_to_it_after_one_install_flag(kernelspecs, tmp_path):
    install_cli("--name", "beside-data", "--grant-cwd")
    notebook = notebook_beside_csv(tmp_path / "project", "beside-data")
    result = run(["jupyter", "execute", "--output=done.ipynb", notebook.name],
                 cwd=notebook.parent)
    assert result.returncode == 0, result.stderr
    assert sandbox_lines(result.stderr) == []  # no audit lines from numpy or matplotlib
    fonts, plotted = nbformat.read(notebook.with_name("done.ipynb"), as_version=4).cells
    [listing] = fonts.outputs
    assert listing["data"]["text/plain"].startswith("['fontlist-v")
    assert [output["output_type"] for output in plotted.outputs] == ["display_data", "stream"]
    assert base64.b64decode(plotted.outputs[0]["data"]["image/png"])[:8] == PNG_SIGNATURE
    assert plotted.outputs[1]["text"] == "33\n"
    assert sorted(path.name for path in notebook.parent.iterdir()) == [
        "done.ipynb", "report.ipynb", "sales.csv"]  # read-only: nothing written beside it


def test_refusals_libraries_cope_with_stay_in_the_audit_record(kernelspecs, tmp_path):
    audit_log = tmp_path / "audit.jsonl"
    install_cli("--name", "audited-data", "--grant-cwd", "--audit-log", str(audit_log))
    probe = ("import subprocess\ntry:  # as matplotlib runs fc-list, and copes without it\n"
             "    subprocess.check_output(['fc-list'])\nexcept OSError:\n    print('coped')")
    denied = ("import socket\nsocket.socket()", ["raises-exception"])
    notebook = notebook_beside_csv(tmp_path / "project", "audited-data", [(probe, []), denied])
    result = run(["jupyter", "execute", "--output=done.ipynb", notebook.name],
                 cwd=notebook.parent)
    assert result.returncode == 0, result.stderr
    # The terminal is the user's: the refused socket is its cell's error and in the audit file,
    # as is the process the code probed for and did without (marked a probe).
    assert sandbox_lines(result.stderr) == []
    cells = nbformat.read(notebook.with_name("done.ipynb"), as_version=4).cells
    assert cells[2].outputs == [{"output_type": "stream", "name": "stdout", "text": "coped\n"}]
    assert cells[3].outputs[0]["ename"] == "PermissionError"
    records = [json.loads(line) for line in audit_log.read_text().splitlines()]
    processes = [r for r in records if r.get("syscall") in ("clone", "vfork", "fork")]
    assert processes and all(r["probe"].startswith("starting a process") for r in processes)
    [socket_record] = [r for r in records if r.get("syscall") == "socket"]
    assert "probe" not in socket_record


# --- what a data scientist and a model see of warnings and Agg charts (#32 items 7, 12) -------

SEEN = {
    "warn": "import warnings\nwarnings.warn('check the units')",
    "fail": "x = 1\n1 / 0",
    "agg": "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
           "plt.plot([1, 3, 2])\nplt.show()",
    "saved": "import io\nfig = plt.figure()\nplt.plot([2, 1])\nfig.savefig(io.BytesIO())\n"
             "plt.close(fig)",
}


def test_warnings_name_the_cell_as_tracebacks_do_and_agg_charts_are_shown(kernelspecs, tmp_path):
    nb = nbformat.v4.new_notebook(metadata={"language_info": {"name": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(source, id=cell_id, metadata={"tags": [
        "raises-exception"] if cell_id == "fail" else []}) for cell_id, source in SEEN.items()]
    NotebookClient(nb, kernel_name="sandbox", timeout=RUN_TIMEOUT,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = {cell.id: cell.outputs for cell in nb.cells}
    [warned] = outputs["warn"]
    assert (warned.name, warned.text) == (
        "stderr", "Cell In[1], line 2: UserWarning: check the units\n"
        "  warnings.warn('check the units')\n")
    [failed] = outputs["fail"]
    assert "Cell In[2], line 2" in re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(failed.traceback))
    [chart] = outputs["agg"]  # the figure, and no "non-interactive" warning
    assert chart.output_type == "display_data"
    assert base64.b64decode(chart.data["image/png"]).startswith(PNG_SIGNATURE)
    assert outputs["saved"] == []  # a figure the code closed is not shown


@contextlib.contextmanager
def write_in_a_root_owned_folder(kernel_name: str):
    """A notebook in a root-owned 0755 folder whose one cell writes summary.csv, run with
    `jupyter execute` on kernel_name: the folder and the cell's error output."""
    base = Path(tempfile.mkdtemp(prefix=f"sandbox-{kernel_name}-"))
    try:
        base.chmod(0o755)
        folder = base / "project"
        folder.mkdir(mode=0o755)
        nb = nbformat.v4.new_notebook(metadata={"language_info": {"name": "python"}})
        nb.cells = [nbformat.v4.new_code_cell("open('summary.csv', 'w').write('a,b')",
                                              metadata={"tags": ["raises-exception"]})]
        nbformat.write(nb, folder / "report.ipynb")
        result = run(["jupyter", "execute", f"--kernel_name={kernel_name}", "--output=done",
                      "report.ipynb"], cwd=folder)
        assert result.returncode == 0, result.stderr
        [error] = nbformat.read(folder / "done.ipynb", as_version=4).cells[0].outputs
        assert error.ename == "PermissionError"
        yield folder, error
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="started by root, user code has a uid of its own")
def test_a_write_into_a_root_owned_folder_granted_read_only_is_explained(kernelspecs):
    """As root in a root-owned 0755 folder with --grant-cwd, a write once gave a bare
    "Permission denied" (a 0777 folder got the explanation): it says the folder is granted
    read-only, how to grant write, and that the host keeps the kernel's uid out too (#45
    item 4)."""
    install_cli("--name", "ro-root-folder", "--grant-cwd")
    with write_in_a_root_owned_folder("ro-root-folder") as (folder, error):
        install = "sandbox-kernel install --user --name ro-root-folder"
        assert error.evalue.startswith(
            "[Errno 13] Permission denied: 'summary.csv': the sandbox refused it: this kernel "
            "was granted the folder it started in read-only (--grant-cwd); to let user code "
            f"write there, reinstall the kernelspec with `{install} --grant-cwd=rw`, its other "
            "flags as before, and restart the kernel; but the host would refuse it too: user "
            "code runs as a uid of its own ("), error.evalue
        assert f"which {folder} (owner uid 0, mode 0755) does not let write; to let it write " \
            f"there, have user code run as a user (not root) who may write in {folder}: " \
            f"reinstall the kernelspec with `{install} --run-as USER`" in error.evalue
        assert f"`chmod o+w {folder}`" in error.evalue


@pytest.mark.skipif(os.geteuid() != 0, reason="started by root, user code has a uid of its own")
def test_a_folder_the_host_keeps_the_kernels_uid_out_of_is_said_so_with_what_helps(kernelspecs):
    """As root in a root-owned 0755 folder, --grant-cwd=rw still cannot write: install, check
    and the cell's error say the host refuses the kernel's uid, and what helps (#32 item 2)."""
    said = "the host refuses it, not the sandbox: user code runs as a uid of its own ("
    installed = install_cli("--name", "root-folder", "--grant-cwd=rw")
    assert "sandbox-kernel install: warning: --grant-cwd=rw: user code runs as a uid of its own" \
        in installed.stderr
    with write_in_a_root_owned_folder("root-folder") as (folder, error):
        assert said in error.evalue, error.evalue
        assert error.evalue.startswith("[Errno 13] Permission denied: 'summary.csv': ")
        assert f"which {folder} (owner uid 0, mode 0755) does not let write" in error.evalue
        assert "`sandbox-kernel install --user --name root-folder --run-as USER`" in \
            error.evalue and f"`chmod o+w {folder}`" in error.evalue
        checked = run(["sandbox_kernel", "check", "--grant-cwd=rw"], cwd=folder)
        assert f"  but --grant-cwd=rw here ({folder}): {said}" in checked.stdout
        assert "sandbox-kernel check: warning: --grant-cwd=rw here" in checked.stderr
