"""The OpenAI Agents SDK (`openai-agents`, imported as `agents`): a FunctionTool over a sandbox
session.

    from agents import Agent, Runner
    from sandbox_kernel.frameworks.openai_agents import SandboxPython

    with SandboxPython(tools=[lookup]) as python:
        agent = Agent(name="analyst", tools=[python.tool])
        result = await Runner.run(agent, "...")

`python.tool` is a `FunctionTool`, `run_python(code)`: the code runs in one sandbox kernel whose
variables persist from call to call (a session, until close()), and `tools` (the SDK's
`@function_tool`s, or plain functions) run in the caller's process: the code calls them by
name and each call crosses the tool bridge as JSON (docs/tools.md). The tool's answer is what
the code printed, its last value and its error, as text.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
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

need("agents", "openai-agents")
from agents import FunctionTool  # noqa: E402
from agents.function_schema import function_schema  # noqa: E402
from agents.tool_context import ToolContext  # noqa: E402

DESCRIPTION = (
    "Runs Python code in a sandbox whose variables and imports persist between calls; returns "
    "what the code printed and the value of its last line. No shell commands or subprocesses, "
    "no network: do the work in Python. These functions are defined in it: {tools}.")
PARAMETERS = {  # the tool's one argument, as the SDK's strict JSON schema wants it
    "type": "object",
    "properties": {"code": {"type": "string", "description": "Python code to run; the value "
                                                              "of its last line is returned"}},
    "required": ["code"],
    "additionalProperties": False,
}
_calls = itertools.count(1)  # ids for the ToolContexts of hand-made FunctionTools' calls


def _wrapped(tool: FunctionTool) -> Callable[..., Any] | None:
    """The function `@function_tool` made the tool from (None for a hand-made FunctionTool);
    TypeError when it takes the run's context, which cannot reach the sandbox."""
    try:
        function = tool.__wrapped__
    except AttributeError:
        return None
    if function_schema(function).takes_context:
        raise TypeError(f"tool {tool.name!r} takes the run's context, which cannot reach the "
                        "sandbox: give it a function of its arguments alone")
    return function  # type: ignore[no-any-return]


def _invoker(tool: FunctionTool) -> Callable[..., Any]:
    """A hand-made FunctionTool called as the SDK would (its on_invoke_tool with the arguments
    as JSON), with a context of None: no run's context reaches a call from the sandbox."""
    async def invoke(**arguments: Any) -> Any:
        text = json.dumps(arguments)
        context = ToolContext(None, tool_name=tool.name, tool_call_id=f"sandbox-{next(_calls)}",
                              tool_arguments=text)
        return await tool.on_invoke_tool(context, text)
    return invoke


def _agents_tool(tool: Any) -> Named | None:
    """An Agents SDK FunctionTool as a host function: its own function when it has one, else
    its on_invoke_tool with its schema's signature."""
    if not isinstance(tool, FunctionTool):
        return None
    function = _wrapped(tool)
    if function is not None:
        return tool.name, function
    schema = tool.params_json_schema
    signature = schema_signature(schema.get("properties") or {}, schema.get("required") or [])
    return tool.name, host_function(tool.name, _invoker(tool), tool.description, signature)


def host_tools(tools: Iterable[Any] | Mapping[str, Callable[..., Any]]) -> dict[str, Callable]:
    """Agents SDK FunctionTools or plain functions, as the bridge's {name: callable}."""
    return granted_tools(tools, _agents_tool, "an Agents SDK FunctionTool")


class SandboxPython:
    """`tool`, a FunctionTool that runs Python in a sandbox session; `tools` run on the host.

    sandbox: a Sandbox (started on first use, closed by close() only when this made it), else
    `Sandbox(**sandbox_options)` with `kernel_name=None`. timeout: seconds per call. The runs
    are made in a worker thread, so the session serves any event loop the Runner turns
    (`Runner.run`, each `Runner.run_sync`); the model's parallel calls run one at a time.
    """

    def __init__(self, tools: Iterable[Any] | Mapping[str, Callable[..., Any]] = (), *,
                 sandbox: Sandbox | None = None, timeout: float = 60.0,
                 tool_limits: ToolLimits | None = None, name: str = "run_python",
                 **sandbox_options: Any) -> None:
        granted = host_tools(tools)
        self._session = Session(sandbox, granted, timeout, tool_limits, sandbox_options)
        self._lock = threading.Lock()  # the session's start and runs, one call at a time
        self.tool = FunctionTool(
            name=name, description=DESCRIPTION.format(
                tools=", ".join(f"{tool}()" for tool in granted) or "none"),
            params_json_schema=PARAMETERS, on_invoke_tool=self._invoke)

    @property
    def executions(self) -> list[Execution]:
        """Every run this tool made, for the caller's audit."""
        return self._session.executions

    @property
    def sandbox(self) -> Sandbox:
        """The sandbox the code runs in."""
        return self._session.sandbox

    def run(self, code: str) -> str:
        """Run the code in the session; what it printed, its value and its error, as text."""
        with self._lock:
            self._session.start()
            execution = self._session.run(code)
            self._session.executions.append(execution)
        return output_text(execution) or "(no output)"

    async def _invoke(self, context: ToolContext[Any], arguments: str) -> str:
        try:
            code = json.loads(arguments)["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if not isinstance(code, str):  # told to the model, which may call again
            return f'{self.tool.name} takes {{"code": "<Python source>"}}, not {arguments[:200]}'
        # A cancelled call leaves its run to finish in the thread (bounded by `timeout`): the
        # kernel keeps its state either way.
        return await asyncio.to_thread(self.run, code)

    def close(self) -> None:
        """Close the sandbox if this made it."""
        with self._lock:
            self._session.close()

    def __enter__(self) -> SandboxPython:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
