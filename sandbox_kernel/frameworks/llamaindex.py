"""LlamaIndex: `code_execute_fn` for `CodeActAgent`, over a sandbox session.

    from llama_index.core.agent.workflow import CodeActAgent
    from sandbox_kernel.frameworks.llamaindex import SandboxCodeSession

    session = SandboxCodeSession(tools=[lookup])
    agent = CodeActAgent(code_execute_fn=session.execute, tools=[lookup], llm=llm)
    ...
    await session.aclose()

CodeActAgent describes its tools to the model and expects the code it writes to call them by
name; LlamaIndex's own SimpleCodeExecutor runs that code in the agent's process. Here it runs
in one sandbox kernel, stateful across the agent's steps (and across `agent.run` calls of one
session), and the tools stay in the caller's process: each call crosses the tool bridge as
JSON (docs/tools.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..client import AsyncSandbox, ToolLimits
from .common import AsyncSession, Named, error_text, granted_tools, need

need("llama_index.core", "llamaindex")


def _llamaindex_tool(tool: Any) -> Named | None:
    """A FunctionTool as its own function, by its name."""
    function = getattr(tool, "real_fn", None)
    metadata = getattr(tool, "metadata", None)
    if function is None or metadata is None:
        return None
    return metadata.name or function.__name__, function


def host_tools(tools: Iterable[Any] | Mapping[str, Callable[..., Any]]) -> dict[str, Callable]:
    """LlamaIndex FunctionTools or plain functions, as the bridge's {name: callable}."""
    return granted_tools(tools, _llamaindex_tool, "a FunctionTool")


class SandboxCodeSession:
    """A sandbox kernel that keeps its variables between CodeActAgent steps; `execute` is the
    agent's `code_execute_fn`.

    sandbox: an AsyncSandbox (started on first use, closed by aclose() only when this session
    made it), else `AsyncSandbox(**sandbox_options)` with `kernel_name=None`.
    tools: the FunctionTools or functions also given to the agent. timeout: seconds per step.
    """

    def __init__(self, sandbox: AsyncSandbox | None = None, *,
                 tools: Iterable[Any] | Mapping[str, Callable[..., Any]] = (),
                 timeout: float = 60.0, tool_limits: ToolLimits | None = None,
                 **sandbox_options: Any) -> None:
        self.session = AsyncSession(sandbox, host_tools(tools), timeout, tool_limits,
                                    sandbox_options)
        self.sandbox = self.session.sandbox
        self.executions = self.session.executions  # every run, for the caller's audit

    async def execute(self, code: str) -> dict[str, Any]:
        """Execute Python code in the sandbox, whose variables persist between calls; returns
        what it printed (stdout, stderr), its last expression's value (output) and its error."""
        await self.session.start()
        execution = await self.session.run(code)
        self.executions.append(execution)
        value = execution.text if execution.result is None else execution.result
        return {"stdout": execution.stdout, "stderr": execution.stderr, "output": value,
                "error": error_text(execution) or None}

    async def aclose(self) -> None:
        """Close the sandbox if this session made it."""
        await self.session.close()

    async def __aenter__(self) -> SandboxCodeSession:
        await self.session.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
