"""Resources an agent reads to plan: the sandbox's policy, and files in its sessions."""

from __future__ import annotations

import importlib.metadata
import json
import re
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError

from ..hosting.sessions import SessionError
from . import files
from .problems import for_model
from .state import State

POLICY_URI = "sandbox://policy"


def _installed(runtime: str) -> list[str]:
    """The distributions kernels can import: the runtime's, else this server's interpreter's."""
    if runtime:
        from ..runtimes import find

        lines = find(runtime).frozen()
        names = {re.split(r"[=<>~!; \[]", line, maxsplit=1)[0] for line in lines
                 if line and not line.startswith("-")}
    else:
        names = {dist.metadata["Name"] for dist in importlib.metadata.distributions()
                 if dist.metadata["Name"]}
    return sorted(names, key=str.lower)


def policy(state: State) -> dict[str, Any]:
    """What code in this sandbox may and may not do, and which packages it can import."""
    config, rules = state.config, state.config.policy
    return {
        "summary": (
            "Python runs in a sandbox: no subprocesses or shell commands; "
            + ("network access allowed; " if rules.allow_network else "no network access; ")
            + "files only in the working directory (plus any granted folders); "
            f"each run may take up to {config.default_timeout:g} s by default "
            f"(at most {config.max_timeout:g} s)."),
        "network": rules.allow_network,
        "subprocesses": False,
        "memory_limit_bytes": rules.memory_limit or None,
        "timeout_seconds": {"default": config.default_timeout, "max": config.max_timeout},
        "output_limit_bytes": rules.max_output_bytes or None,
        "result_limit_bytes": rules.max_result_bytes or None,
        "file_size_limit_bytes": rules.file_size_limit or None,
        "readable_folders": list(rules.read_paths) + list(rules.write_paths),
        "writable_folders": ["the working directory", *rules.write_paths],
        "sessions": {"max_open": config.max_sessions,
                     "idle_timeout_seconds": config.session_idle_timeout or None},
        "runtime": config.runtime or None,
        "preloaded_modules": state.preload,
        "packages": _installed(config.runtime),
        "installing_packages": (
            "create_session(packages=[...]) installs wheels from the package index into the "
            "session" if rules.allow_network else "not possible: the network is off; use the "
            "packages listed here"),
    }


def register(server: MCPServer, state: State) -> None:
    """Add the policy resource and the template of session files."""

    @server.resource(POLICY_URI, name="policy", title="What this sandbox allows",
                     mime_type="application/json",
                     description="Limits, what is refused, and the installed packages.")
    def read_policy() -> str:
        return json.dumps(policy(state), indent=1)

    @server.resource("sandbox://sessions/{session}/files/{+path}", name="session-file",
                     title="A file in a session's working directory",
                     description="Files that run_python results link to.")
    async def read_session_file(session: str, path: str) -> str | bytes:
        try:
            held = state.sessions.get(state.key(state.owner()), session)
            if held.busy:
                raise ResourceError(f"session {held.id} is busy: read the file after its run")
            async with held.lock:
                content = await files.read(held.sandbox, path, state.config.max_file_bytes)
        except files.FileError as exc:
            raise ResourceError(str(exc)) from None
        except SessionError as exc:
            raise ResourceError(for_model(exc)) from None
        try:
            return content.decode("utf-8")
        except UnicodeDecodeError:
            return content
