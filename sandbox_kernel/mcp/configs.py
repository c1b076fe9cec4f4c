"""The MCP configs of the desktop agents and IDEs (examples/mcp/ holds each one as a file).

A desktop app starts its servers with its own PATH, which never holds a checkout's .venv: the
command is the full path of this install's `sandbox-kernel` (`mcp --print-config NAME`), or in
the examples a placeholder for it. The examples preload what agents' code imports most
(`PRELOADS`); the printed config preloads only those this install can import, since the server
refuses to start with a module it cannot preload ([mcp] alone installs none of them).
tests/test_mcp_configs.py keeps the files equal to the configs with every preload.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

PLACEHOLDER = "/path/to/sandbox-kernel/.venv/bin/sandbox-kernel"
SERVER = "python-sandbox"
# --print-config NAME -> the file of examples/mcp/ it prints.
FILES = {"claude_desktop": "claude_desktop_config.json", "claude_code": "claude_code.mcp.json",
         "cursor": "cursor.mcp.json", "vscode": "vscode.mcp.json"}
# What each config preloads in examples/mcp/: a desktop chat draws charts too.
PRELOADS = {"claude_desktop": ("numpy", "pandas", "matplotlib"),
            "claude_code": ("numpy", "pandas"), "cursor": ("numpy", "pandas"),
            "vscode": ("numpy", "pandas")}


def this_command() -> list[str]:
    """The full argv prefix that starts this install's `sandbox-kernel`, whatever the PATH."""
    script = Path(sys.executable).parent / "sandbox-kernel"  # the venv's path, not resolved
    return [str(script)] if script.is_file() else [sys.executable, "-m", "sandbox_kernel"]


def _stdio(command: list[str], args: list[str], typed: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "stdio"} if typed else {}
    entry.update(command=command[0], args=[*command[1:], "mcp", *args])
    return entry


def _preload(modules: tuple[str, ...] | list[str]) -> list[str]:
    return ["--preload", ",".join(modules)] if modules else []


def config(name: str, command: list[str] | None = None,
           preload: tuple[str, ...] | list[str] | None = None) -> dict[str, Any]:
    """The config of client `name` (a key of FILES) starting command (default: this install),
    preloading `preload` (default: PRELOADS[name], as examples/mcp/ does)."""
    if name not in FILES:
        raise ValueError(f"no MCP config named {name!r}; choose one of {', '.join(FILES)}")
    command = command or this_command()
    args = _preload(PRELOADS[name] if preload is None else preload)
    if name == "claude_desktop":
        return {"mcpServers": {SERVER: _stdio(command, [*args, "--memory-limit", "2G"], False)}}
    if name in ("claude_code", "cursor"):
        return {"mcpServers": {SERVER: _stdio(command, args, name == "claude_code")}}
    return {
        "inputs": [{"type": "promptString", "id": "sandbox-key",
                    "description": "API key of the shared Python sandbox",
                    "password": True}],
        "servers": {
            SERVER: _stdio(command, args, True),
            "team-sandbox": {"type": "http", "url": "http://sandbox.internal:8765/mcp",
                             "headers": {"Authorization": "Bearer ${input:sandbox-key}"}},
        }}


def for_this_install(name: str) -> tuple[dict[str, Any], list[str]]:
    """Client `name`'s config for this install: its preloads those this Python can import; and
    the preloads left out."""
    missing = [module for module in PRELOADS[name] if importlib.util.find_spec(module) is None]
    kept = [module for module in PRELOADS[name] if module not in missing]
    return config(name, preload=kept), missing
