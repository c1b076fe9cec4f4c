"""AutoGen: a `CodeExecutor` (autogen_core) that runs code blocks in a sandbox kernel.

    from autogen_agentchat.agents import AssistantAgent, CodeExecutorAgent
    from autogen_ext.tools.code_execution import PythonCodeExecutionTool
    from sandbox_kernel.frameworks.autogen import SandboxCodeExecutor

    async with SandboxCodeExecutor(tools=[lookup]) as executor:
        agent = AssistantAgent("coder", model_client, tools=[PythonCodeExecutionTool(executor)])
        # or CodeExecutorAgent("runner", code_executor=executor)

Blocks run in one kernel, statefully, as AutoGen's Jupyter executors run them. `tools` (AutoGen
tools or plain functions) run in the caller's process: the code calls them by name and each
call crosses the tool bridge as JSON (docs/tools.md). Shell blocks are answered, not run: the
sandbox creates no processes (docs/agents.md says what to use instead).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..client import AsyncSandbox, Execution, ToolLimits
from ..errors import ExecutionTimeout
from .common import (
    AsyncSession,
    Named,
    granted_tools,
    host_function,
    need,
    output_text,
    schema_signature,
)

need("autogen_core", "autogen")
from autogen_core import CancellationToken  # noqa: E402
from autogen_core.code_executor import CodeBlock, CodeExecutor, CodeResult  # noqa: E402

PYTHON = ("python", "py", "python3", "ipython", "")
SHELL = ("bash", "sh", "shell", "zsh", "console", "powershell", "ps1", "pwsh", "cmd")
NO_SHELL = ("this sandbox runs Python only and creates no processes, so `{language}` blocks "
            "cannot run: do the work in Python (os, pathlib and shutil for files; the "
            "library itself, not its command-line tool; the granted tools for what needs "
            "the host)")
TIMEOUT_EXIT = 124  # as AutoGen's command-line executors report a timeout


def _autogen_tool(tool: Any) -> Named | None:
    """An AutoGen tool (`BaseTool`: name, description, JSON schema, run_json) as a host function."""
    if not (hasattr(tool, "run_json") and hasattr(tool, "schema")):
        return None
    schema = tool.schema
    parameters = schema.get("parameters") or {}

    async def call(**kwargs: Any) -> Any:
        result = await tool.run_json(kwargs, CancellationToken())
        return result.model_dump() if hasattr(result, "model_dump") else result

    signature = schema_signature(parameters.get("properties") or {},
                                 parameters.get("required") or [])
    return tool.name, host_function(tool.name, call, schema.get("description") or "", signature)


def host_tools(tools: Iterable[Any] | Mapping[str, Callable[..., Any]]) -> dict[str, Callable]:
    """AutoGen tools, plain functions, or {name: function}, as the bridge's {name: callable}."""
    return granted_tools(tools, _autogen_tool, "an AutoGen tool")


class SandboxCodeExecutor(CodeExecutor):  # type: ignore[misc]
    """Executes AutoGen code blocks in a sandbox kernel, statefully; tools run on the host.

    sandbox: an AsyncSandbox to run in (started by start(), closed by stop() only when this
    executor made it), else `AsyncSandbox(**sandbox_options)` with `kernel_name=None`.
    tools: AutoGen tools or functions the code may call by name. timeout: seconds per block.
    """

    def __init__(self, sandbox: AsyncSandbox | None = None, *,
                 tools: Iterable[Any] | Mapping[str, Callable[..., Any]] = (),
                 timeout: float = 60.0, tool_limits: ToolLimits | None = None,
                 **sandbox_options: Any) -> None:
        self.session = AsyncSession(sandbox, host_tools(tools), timeout, tool_limits,
                                    sandbox_options)
        self.sandbox, self.timeout = self.session.sandbox, timeout
        self.executions = self.session.executions  # every run, for the caller's audit

    async def start(self) -> None:
        """Start the kernel and bind the tools' names in it."""
        await self.session.start()

    async def stop(self) -> None:
        """Close the sandbox if this executor made it."""
        await self.session.close()

    async def restart(self) -> None:
        """A fresh kernel: variables and imports are gone; the tools are bound again."""
        if not self.session.started:
            return await self.session.start()
        await self.sandbox.restart()
        await self.session.bind_tools()

    async def _run(self, code: str, cancellation_token: CancellationToken) -> Execution:
        """One block's run; when the token is cancelled (or this call is), the code is
        interrupted and the run collected to its end (the kernel keeps its variables), then
        CancelledError is raised. The run itself is never cancelled half-read."""
        task = asyncio.ensure_future(self.session.run(code))
        cancelled: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def cancel() -> None:
            if not cancelled.done():
                cancelled.set_result(None)

        cancellation_token.add_callback(cancel)
        try:
            await asyncio.wait([task, cancelled], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await self._interrupt(task)
            raise
        if not task.done():
            await self._interrupt(task)
            raise asyncio.CancelledError("the cancellation token was cancelled")
        return task.result()

    async def _interrupt(self, task: asyncio.Future[Execution]) -> None:
        await self.sandbox.interrupt()
        await asyncio.wait([task], timeout=self.sandbox.grace + self.timeout)

    async def execute_code_blocks(self, code_blocks: list[CodeBlock],
                                  cancellation_token: CancellationToken) -> CodeResult:
        """Run the blocks in order in the kernel; stop at the first that fails."""
        await self.start()
        outputs: list[str] = []
        for block in code_blocks:
            language = (block.language or "").strip().lower()
            if language in SHELL or language not in PYTHON:
                outputs.append(NO_SHELL.format(language=block.language or "?")
                               if language in SHELL else
                               f"this sandbox runs Python only: not {block.language}")
                return CodeResult(exit_code=1, output="\n".join(outputs))
            execution = await self._run(block.code, cancellation_token)
            self.executions.append(execution)
            outputs.append(output_text(execution))
            if execution.error is not None:
                timed_out = execution.error.name == ExecutionTimeout.code
                return CodeResult(exit_code=TIMEOUT_EXIT if timed_out else 1,
                                  output="\n".join(part for part in outputs if part))
        return CodeResult(exit_code=0, output="\n".join(part for part in outputs if part))


__all__ = ["SandboxCodeExecutor", "host_tools"]
