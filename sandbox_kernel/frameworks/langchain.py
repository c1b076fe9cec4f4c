"""LangChain and LangGraph: a Python tool over a sandbox session.

    from langchain.agents import create_agent
    from sandbox_kernel.frameworks.langchain import SandboxPythonTool

    python = SandboxPythonTool(tools=[lookup])
    agent = create_agent(model, tools=[python])
    ...
    python.close()

The model calls the tool with code; the code runs in one sandbox kernel whose variables persist
from call to call (a session), and `tools` (LangChain tools or functions) run in the caller's
process: the code calls them by name and each call crosses the tool bridge as JSON
(docs/tools.md). The tool's answer is what the code printed, its last value and its error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..client import Execution, Sandbox, ToolLimits
from .common import (
    Named,
    Session,
    granted_tools,
    host_function,
    need,
    output_text,
    schema_signature,
)

need("langchain_core", "langchain")
from langchain_core.tools import BaseTool  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr  # noqa: E402

DESCRIPTION = (
    "Runs Python code in a sandbox whose variables and imports persist between calls; returns "
    "what the code printed and the value of its last line. No shell commands or subprocesses, "
    "no network: do the work in Python. These functions are defined in it: {tools}.")


def _langchain_tool(tool: Any) -> Named | None:
    """A LangChain tool as a host function: its own function when it has one, else its invoke()
    with its schema's signature."""
    if not isinstance(tool, BaseTool):
        return None
    function = getattr(tool, "func", None) or getattr(tool, "coroutine", None)
    if callable(function):
        return tool.name, function
    schema = tool.get_input_schema().model_json_schema()
    signature = schema_signature(schema.get("properties") or {}, schema.get("required") or [])
    return tool.name, host_function(tool.name, tool.invoke, tool.description or "", signature)


def host_tools(tools: Iterable[Any] | Mapping[str, Callable[..., Any]]) -> dict[str, Callable]:
    """LangChain tools or plain functions, as the bridge's {name: callable}."""
    return granted_tools(tools, _langchain_tool, "a LangChain tool")


class PythonCode(BaseModel):
    """The tool's one argument."""

    code: str = Field(description="Python code to run; the value of its last line is returned")


class SandboxPythonTool(BaseTool):  # type: ignore[misc]
    """A LangChain tool that runs Python in a sandbox session; `tools` run on the host.

    sandbox: a Sandbox (started on first use, closed by close() only when this tool made it),
    else `Sandbox(**sandbox_options)` with `kernel_name=None`. timeout: seconds per call.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    name: str = "python"
    description: str = ""
    args_schema: type[BaseModel] = PythonCode
    _session: Session = PrivateAttr()

    def __init__(self, sandbox: Sandbox | None = None, *,
                 tools: Iterable[Any] | Mapping[str, Callable[..., Any]] = (),
                 timeout: float = 60.0, tool_limits: ToolLimits | None = None,
                 name: str = "python", **sandbox_options: Any) -> None:
        granted = host_tools(tools)
        super().__init__(name=name, description=DESCRIPTION.format(
            tools=", ".join(f"{tool}()" for tool in granted) or "none"))
        self._session = Session(sandbox, granted, timeout, tool_limits, sandbox_options)

    @property
    def executions(self) -> list[Execution]:
        """Every run this tool made, for the caller's audit."""
        return self._session.executions

    @property
    def sandbox(self) -> Sandbox:
        """The sandbox the code runs in."""
        return self._session.sandbox

    def _run(self, code: str, run_manager: Any = None) -> str:
        """Run the code in the session; what it printed, its value and its error, as text."""
        self._session.start()
        execution = self._session.run(code)
        self._session.executions.append(execution)
        return output_text(execution) or "(no output)"

    def close(self) -> None:
        """Close the sandbox if this tool made it."""
        self._session.close()

    def __enter__(self) -> SandboxPythonTool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
