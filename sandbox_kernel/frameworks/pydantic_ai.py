"""pydantic-ai: the MCP server as a toolset, and a code tool whose code calls the agent's
host tools.

    from pydantic_ai import Agent
    from sandbox_kernel.frameworks.pydantic_ai import SandboxToolset, mcp_toolset

    agent = Agent(model, toolsets=[mcp_toolset("--preload", "numpy")])  # sandbox-kernel mcp
    code = SandboxToolset(tools=[lookup])   # run_python(code): the code calls lookup() by name
    agent = Agent(model, toolsets=[code])
    ...
    await code.aclose()

`mcp_toolset` starts this install's `sandbox-kernel mcp` over stdio (docs/mcp.md: its tools,
sessions, files and limits; the flags are its own). Code run there cannot call the agent's
tools: the MCP server is the kernels' caller, not the agent. `SandboxToolset` is the other way
round: one `run_python` tool over a sandbox session of the agent's own process, whose code
calls `tools` by name through the tool bridge (docs/tools.md), so they run in the caller's
process with their keys. (pydantic-ai-harness's CodeMode interprets a Python subset in
pydantic-monty rather than running CPython, with no hook for another executor: this is the
CPython counterpart, with packages.)
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..client import AsyncSandbox, Execution, ToolLimits
from .common import AsyncSession, Named, granted_tools, need, output_text

need("pydantic_ai", "pydantic-ai")
from fastmcp.client.transports import StdioTransport  # noqa: E402
from pydantic_ai import Tool  # noqa: E402
from pydantic_ai.mcp import MCPToolset  # noqa: E402
from pydantic_ai.toolsets import FunctionToolset  # noqa: E402

DESCRIPTION = (
    "Runs Python code in a sandbox whose variables and imports persist between calls; returns "
    "what the code printed and the value of its last line. No shell commands or subprocesses, "
    "no network: do the work in Python. These functions are defined in it: {tools}.")


def command() -> str:
    """This install's `sandbox-kernel` console script (beside this Python, else on PATH)."""
    beside = Path(sys.executable).parent / "sandbox-kernel"
    found = str(beside) if beside.exists() else shutil.which("sandbox-kernel")
    if found is None:
        raise FileNotFoundError("no sandbox-kernel command beside this Python or on PATH: "
                                "install the package (README: Set up)")
    return found


def mcp_toolset(*flags: str, env: Mapping[str, str] | None = None,
                **toolset_options: Any) -> MCPToolset:
    """`sandbox-kernel mcp FLAGS...` over stdio as a pydantic-ai toolset (MCPToolset options
    in toolset_options). The server runs on the host with env (this process's by default);
    the kernels it starts never inherit it (a clean environment)."""
    transport = StdioTransport(command=command(), args=["mcp", *flags],
                               env=dict(os.environ if env is None else env))
    return MCPToolset(transport, **toolset_options)


def _pydantic_ai_tool(tool: Any) -> Named | None:
    """A pydantic-ai Tool as its own function (without RunContext: none reaches the sandbox)."""
    if not isinstance(tool, Tool):
        return None
    if tool.takes_ctx:
        raise TypeError(f"tool {tool.name!r} takes a RunContext, which cannot reach the "
                        "sandbox: give it a function of its arguments alone")
    return tool.name, tool.function


def host_tools(tools: Iterable[Any] | Mapping[str, Callable[..., Any]]) -> dict[str, Callable]:
    """pydantic-ai Tools or plain functions, as the bridge's {name: callable}."""
    return granted_tools(tools, _pydantic_ai_tool, "a pydantic-ai Tool")


class SandboxToolset(FunctionToolset):  # type: ignore[misc]
    """One tool, `run_python(code)`, over a sandbox session whose code calls `tools` by name.

    sandbox: an AsyncSandbox (started on first use, closed by aclose() only when this toolset
    made it), else `AsyncSandbox(**sandbox_options)` with `kernel_name=None`. The session (its
    variables) lasts across the agent's runs until aclose(). timeout: seconds per call.
    """

    def __init__(self, tools: Iterable[Any] | Mapping[str, Callable[..., Any]] = (), *,
                 sandbox: AsyncSandbox | None = None, timeout: float = 60.0,
                 tool_limits: ToolLimits | None = None, name: str = "run_python",
                 **sandbox_options: Any) -> None:
        granted = host_tools(tools)
        self.session = AsyncSession(sandbox, granted, timeout, tool_limits, sandbox_options)

        async def run_python(code: str) -> str:
            await self.session.start()
            execution = await self.session.run(code)
            self.session.executions.append(execution)
            return output_text(execution) or "(no output)"

        description = DESCRIPTION.format(
            tools=", ".join(f"{tool}()" for tool in granted) or "none")
        super().__init__([Tool(run_python, name=name, description=description)])

    @property
    def executions(self) -> list[Execution]:
        """Every run this toolset made, for the caller's audit."""
        return self.session.executions

    async def aclose(self) -> None:
        """Close the sandbox if this toolset made it."""
        await self.session.close()
