"""JupyterLab in a real browser (Debian's chromium, driven by playwright) runs the sandbox kernel.

The launcher shows the kernel's tile; a notebook on it prints, draws a matplotlib PNG, shows a
`%main` JSON result and a refusal's message; interrupt and restart work. A notebook in a folder
of its own, on a kernelspec installed with --grant-cwd, reads the CSV beside it and plots it.
Screenshots of each step go to test-artifacts/jupyterlab/ (git-ignored), for a person to look at.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from sandbox_kernel.install import install
from sandbox_kernel.policy import SandboxPolicy

from .ci_tools import unavailable

CHROMIUM = "/usr/bin/chromium"  # Debian's; playwright's own browser download cannot work here
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "jupyterlab"
STEP = 30_000  # ms any one step may take in the browser (a kernel start on a loaded host)

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the [test] extra")
sync_api.expect.set_options(timeout=STEP)

CELLS = [
    "print('hello from the sandbox')",
    "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('sandboxed')\n"
    "plt.show()",
    "def main(x):\n    return {'doubled': x * 2, 'kernel': 'sandbox'}",
    '%main {"x": 21}',
    "print('main defined:', 'main' in globals())",
    "open('/etc/shadow')",
    "import time\nprint('sleeping', flush=True)\ntime.sleep(600)",
]
PRINT, CHART, DEFINE, MAIN, DEFINED, REFUSED, SLEEP = range(len(CELLS))


# A notebook beside its data, on a kernelspec installed with --grant-cwd: it reads the CSV by its
# relative name and plots it.
DATA_KERNEL, DATA_DISPLAY = "sandbox-data", "Python 3 (sandbox, notebook folder)"
DATA_CELLS = [
    "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint('total sales:', df.sales.sum())",
    "import matplotlib.pyplot as plt\ndf.plot(x='month', y='sales', title='sales.csv')\n"
    "plt.show()",
]


def write_project(folder: Path) -> None:
    """project/sales.csv and project/report.ipynb, which reads it as 'sales.csv'."""
    folder.mkdir()
    (folder / "sales.csv").write_text("month,sales\n1,10\n2,14\n3,9\n")
    nb = nbformat.v4.new_notebook(metadata={
        "kernelspec": {"name": DATA_KERNEL, "display_name": DATA_DISPLAY, "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(source) for source in DATA_CELLS]
    nbformat.write(nb, folder / "report.ipynb")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def lab(kernelspecs, tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 whose Jupyter data dir holds the sandbox kernelspec."""
    root = tmp_path_factory.mktemp("lab")
    nb = nbformat.v4.new_notebook(metadata={
        "kernelspec": {"name": "sandbox", "display_name": "Python 3 (sandbox)",
                       "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    nbformat.write(nb, root / "sandboxed.ipynb")
    write_project(root / "project")
    install(SandboxPolicy(grant_cwd="ro"), name=DATA_KERNEL, display_name=DATA_DISPLAY, user=True)
    port, token = free_port(), secrets.token_hex(16)
    log = (root / "lab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(base, token, server)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def wait_for_server(base: str, token: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("jupyter lab did not answer within 60 s")


@pytest.fixture(scope="module")
def page(lab):
    """A headless chromium page, logged in to the server."""
    if not os.access(CHROMIUM, os.X_OK):
        unavailable(f"{CHROMIUM} is missing: `apt-get install chromium`")
    base, token = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        tab.set_default_timeout(STEP)
        tab.goto(f"{base}/lab?token={token}")
        try:
            yield tab
        finally:
            screenshot(tab, "last")  # where it stopped, should a step fail
            browser.close()
    print(f"\nJupyterLab screenshots: {ARTIFACTS}")


def screenshot(tab, name: str) -> None:
    tab.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def output_of(tab, index: int):
    return tab.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell") \
        .nth(index).locator(".jp-OutputArea")


def run_cell(tab, index: int) -> None:
    """Select a cell by its prompt and run it with Shift+Enter, as a user would."""
    cell = tab.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputArea-prompt").click()
    tab.keyboard.press("Shift+Enter")


def wait_idle(tab) -> None:
    tab.locator(".jp-NotebookPanel:visible "
                ".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()


def test_jupyterlab_runs_the_sandbox_kernel(page):
    expect = sync_api.expect

    # The launcher offers the kernel; its tile opens a notebook on it.
    tile = page.locator(".jp-LauncherCard", has_text="Python 3 (sandbox)").first
    expect(tile).to_be_visible()
    screenshot(page, "1-launcher")
    tile.click()
    expect(page.locator(".jp-NotebookPanel:visible .jp-KernelName")) \
        .to_have_text("Python 3 (sandbox)")
    wait_idle(page)

    # A notebook on the kernel, opened from the file browser: print, chart, %main, a refusal.
    no_news = page.locator(".jp-toast-button", has_text="No")
    if no_news.is_visible():
        no_news.click()
    page.locator(".jp-DirListing-item", has_text="sandboxed.ipynb").dblclick()
    expect(page.locator(".lm-TabBar-tab.lm-mod-current", has_text="sandboxed.ipynb")) \
        .to_be_visible()
    expect(page.locator(".jp-NotebookPanel:visible .jp-KernelName")) \
        .to_have_text("Python 3 (sandbox)")
    wait_idle(page)
    for index in range(REFUSED + 1):
        run_cell(page, index)
    expect(output_of(page, REFUSED)).to_contain_text("PermissionError")
    expect(output_of(page, PRINT)).to_have_text("hello from the sandbox")
    image = output_of(page, CHART).locator("img")
    expect(image).to_be_visible()
    assert image.get_attribute("src").startswith("data:image/png;base64,")
    assert image.evaluate("img => img.naturalWidth") > 100
    result = output_of(page, MAIN)
    expect(result.locator(".jp-RenderedJSON")).to_be_visible()  # the JSON tree viewer
    expect(result).to_contain_text("doubled")
    expect(result).to_contain_text("42")
    expect(output_of(page, DEFINED)).to_have_text("main defined: True")
    refusal = output_of(page, REFUSED)
    expect(refusal).to_contain_text("the sandbox refused it: the path is outside what this "
                                    "kernel was granted")
    expect(refusal).to_contain_text("--read-path /etc")
    expect(refusal).not_to_contain_text("denials.py")
    output_of(page, MAIN).scroll_into_view_if_needed()
    screenshot(page, "2-notebook")
    refusal.scroll_into_view_if_needed()
    screenshot(page, "3-refusal")

    # Interrupt a running cell from the toolbar.
    run_cell(page, SLEEP)
    expect(output_of(page, SLEEP)).to_contain_text("sleeping")
    page.locator(".jp-NotebookPanel:visible "
                 "[data-command='notebook:interrupt-kernel']").click()
    expect(output_of(page, SLEEP)).to_contain_text("KeyboardInterrupt")
    wait_idle(page)
    screenshot(page, "4-interrupted")

    # Restart from the toolbar: the state is gone, the kernel runs code again.
    page.locator(".jp-NotebookPanel:visible "
                 "[data-command='notebook:restart-kernel']").click()
    page.locator(".jp-Dialog .jp-mod-accept").click()
    wait_idle(page)
    run_cell(page, DEFINED)
    expect(output_of(page, DEFINED)).to_have_text("main defined: False")
    output_of(page, DEFINED).scroll_into_view_if_needed()
    screenshot(page, "5-restarted")


def test_a_notebook_reads_the_csv_next_to_it_and_plots_it(page):
    expect = sync_api.expect
    page.locator(".jp-DirListing-item[title^='Name: project']").dblclick()
    page.locator(".jp-DirListing-item", has_text="report.ipynb").dblclick()
    expect(page.locator(".lm-TabBar-tab.lm-mod-current", has_text="report.ipynb")) \
        .to_be_visible()
    expect(page.locator(".jp-NotebookPanel:visible .jp-KernelName")).to_have_text(DATA_DISPLAY)
    wait_idle(page)
    for index in range(len(DATA_CELLS)):
        run_cell(page, index)
    expect(output_of(page, 0)).to_have_text("total sales: 33")
    image = output_of(page, 1).locator("img")
    expect(image).to_be_visible()
    assert image.get_attribute("src").startswith("data:image/png;base64,")
    assert image.evaluate("img => img.naturalWidth") > 100
    image.scroll_into_view_if_needed()
    screenshot(page, "6-notebook-beside-its-data")
