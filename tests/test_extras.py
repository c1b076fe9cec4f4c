"""Each extra works alone (#45): the checkout installed with one extra by itself into a venv of its
own (tests/extras_venv.py, cached), then that extra's command run to its first real step; and the
faces import nothing of an extra they do not name.

The test venv installs every extra, so an import of [server]'s packages from the MCP server, or a
command that names a package no extra installs, passes every other test.
"""

from __future__ import annotations

import subprocess
import sys

# What the [server] extra installs and [mcp] (with the MCP SDK's own dependencies) does not.
SERVER_ONLY = ("prometheus_client", "fastapi", "fastapi_offline")


def test_the_mcp_server_imports_nothing_of_the_server_extra():
    probe = ("import sys\n"
             "import sandbox_kernel.cli, sandbox_kernel.mcp.command, sandbox_kernel.mcp.server\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(SERVER_ONLY)!r}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
