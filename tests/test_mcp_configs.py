"""`sandbox-kernel mcp --print-config NAME`: a desktop app's config that starts with the app's
own PATH, and examples/mcp/ equal to it where this install has every preload (#32 item 11); what
it preloads is what this install can import, and a preload it cannot is refused (#45 item 5)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from sandbox_kernel import cli
from sandbox_kernel.mcp import configs

from .mcp_clients import Connected

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "mcp"
DESKTOP_PATH = "/usr/bin:/bin"  # what a desktop app's servers get: no checkout's .venv on it


def printed(name, capsys):
    assert cli.main(["mcp", "--print-config", name]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(configs.FILES))
def test_each_example_is_the_printed_config_with_a_placeholder_path(name, capsys):
    # The test venv has numpy, pandas and matplotlib: the printed config preloads them all.
    example = json.loads((EXAMPLES / configs.FILES[name]).read_text())
    assert example == configs.config(name, [configs.PLACEHOLDER])
    this = Path(sys.executable).parent / "sandbox-kernel"
    text = json.dumps(printed(name, capsys))
    assert text == json.dumps(example).replace(configs.PLACEHOLDER, str(this))


def test_the_printed_config_preloads_only_what_this_install_imports(monkeypatch, capsys):
    # An install without pandas (tests/test_extras.py: [mcp] alone, which has none of them).
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "pandas" else find_spec(name, *rest))
    assert cli.main(["mcp", "--print-config", "claude_desktop"]) == 0
    out, err = capsys.readouterr()
    args = json.loads(out)["mcpServers"][configs.SERVER]["args"]
    assert args == ["mcp", "--preload", "numpy,matplotlib", "--memory-limit", "2G"]
    assert err == (f"sandbox-kernel mcp: this config preloads no pandas (examples/mcp/'s does): "
                   f"this install cannot import it; to have it preloaded, run {sys.executable} "
                   "-m pip install pandas and print the config again\n")


def test_a_preload_that_does_not_import_is_one_error_before_the_server_starts():
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "mcp", "--preload",
                           "numpy,no_such_module_45"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == (
        f"sandbox-kernel mcp: --preload names no_such_module_45, which {sys.executable} cannot "
        "import (kernels would start cold and their code fail on the import): install it into "
        f"that environment ({sys.executable} -m pip install no_such_module_45, or the package "
        "that provides it), or drop no_such_module_45 from --preload\n")


def test_the_printed_config_starts_the_server_without_the_venv_on_path(tmp_path, capsys):
    server = printed("claude_desktop", capsys)["mcpServers"][configs.SERVER]
    assert server["args"][0] == "mcp"
    # The printed command as the app starts it; no --preload (the test's time, not its point).
    params = StdioServerParameters(command=server["command"], args=["mcp", "--pool-size", "0"],
                                   env={"PATH": DESKTOP_PATH, **{  # the session's Jupyter dirs
                                       name: value for name, value in os.environ.items()
                                       if name == "HOME" or name.startswith("JUPYTER_")}})
    with (tmp_path / "server.log").open("w") as log:
        client = Connected(lambda: Client(stdio_client(params, errlog=log)))
        try:
            answer = client.tool("run_python", {"code": "6 * 7"})
        finally:
            client.close()
    assert (answer.is_error, answer.structured_content["value"]) == (False, "42")


def test_an_unknown_client_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as refused:
        cli.main(["mcp", "--print-config", "emacs"])
    assert refused.value.code == 2
    assert "choose from 'claude_desktop', 'claude_code', 'cursor', 'vscode'" in \
        capsys.readouterr().err
