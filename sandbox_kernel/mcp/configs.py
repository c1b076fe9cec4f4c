"""The MCP configs of the desktop agents and IDEs (examples/mcp/ holds each one as a file).

A desktop app starts its servers with its own PATH, which never holds a checkout's .venv: the
command is the full path of this install's `sandbox-kernel` (`mcp --print-config NAME`), or in
the examples a placeholder for it. tests/test_mcp_configs.py keeps the files equal to these.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

PLACEHOLDER = "/path/to/sandbox-kernel/.venv/bin/sandbox-kernel"
SERVER = "python-sandbox"
# --print-config NAME -> the file of examples/mcp/ it prints.
FILES = {"claude_desktop": "claude_desktop_config.json", "claude_code": "claude_code.mcp.json",
         "cursor": "cursor.mcp.json", "vscode": "vscode.mcp.json"}


def this_command() -> list[str]:
    """The full argv prefix that starts this install's `sandbox-kernel`, whatever the PATH."""
    script = Path(sys.executable).parent / "sandbox-kernel"  # the venv's path, not resolved
    return [str(script)] if script.is_file() else [sys.executable, "-m", "sandbox_kernel"]


def _stdio(command: list[str], args: list[str], typed: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "stdio"} if typed else {}
    entry.update(command=command[0], args=[*command[1:], "mcp", *args])
    return entry


def config(name: str, command: list[str] | None = None) -> dict[str, Any]:
    """The config of client `name` (a key of FILES) starting command (default: this install)."""
    command = command or this_command()
    if name == "claude_desktop":
        return {"mcpServers": {SERVER: _stdio(
            command, ["--preload", "numpy,pandas,matplotlib", "--memory-limit", "2G"], False)}}
    if name in ("claude_code", "cursor"):
        return {"mcpServers": {SERVER: _stdio(command, ["--preload", "numpy,pandas"],
                                              name == "claude_code")}}
    if name == "vscode":
        return {
            "inputs": [{"type": "promptString", "id": "sandbox-key",
                        "description": "API key of the shared Python sandbox",
                        "password": True}],
            "servers": {
                SERVER: _stdio(command, ["--preload", "numpy,pandas"], True),
                "team-sandbox": {"type": "http", "url": "http://sandbox.internal:8765/mcp",
                                 "headers": {"Authorization": "Bearer ${input:sandbox-key}"}},
            }}
    raise ValueError(f"no MCP config named {name!r}; choose one of {', '.join(FILES)}")
