"""smolagents: a `PythonExecutor` that runs a `CodeAgent`'s code in a sandbox kernel.

    from smolagents import CodeAgent
    from sandbox_kernel.frameworks.smolagents import SandboxExecutor

    agent = CodeAgent(tools=[lookup], model=model, executor=SandboxExecutor())
    agent.run("...")

smolagents' own remote executors serialise each tool's source into the sandbox and run it
there: a tool holding a key would carry it in. Here every tool (and managed agent) stays in the
caller's process: the kernel gets a stub of the same name, signature and description that
sends each call as JSON through the tool bridge (docs/tools.md), so the tool's secrets, clients
and files never enter the sandbox. Variables persist between the agent's steps (one kernel,
one Sandbox); `final_answer` ends a step as in smolagents' executors.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from ..client import Execution, Sandbox, ToolLimits
from .common import Session, error_text, host_function, need, schema_signature

_smolagents = need("smolagents", "smolagents")
from smolagents.local_python_executor import CodeOutput, PythonExecutor  # noqa: E402
from smolagents.monitoring import AgentLogger, LogLevel  # noqa: E402
from smolagents.utils import AgentExecutionError  # noqa: E402

FINAL = "final_answer"
# Raised in the kernel by final_answer(): a BaseException, so the agent's `except Exception`
# does not swallow the end of its step.
FINAL_EXCEPTION = "SandboxFinalAnswer"
_FINAL_CODE = f"""\
class {FINAL_EXCEPTION}(BaseException):
    "The step ended with final_answer()."

def {FINAL}(answer):
    "Provides a final answer to the given problem."
    import json, sys
    try:
        json.dumps(answer)
    except (TypeError, ValueError):
        answer = str(answer)
    getattr(sys.modules["sandbox_tools"], "{FINAL}")(answer)
    raise {FINAL_EXCEPTION}()
"""


def _signature(tool: Any) -> inspect.Signature:
    """The tool's own forward() signature (its real defaults), else one from its `inputs`."""
    inputs = getattr(tool, "inputs", None) or {}
    forward = getattr(tool, "forward", None)
    if forward is not None:
        try:
            signature = inspect.signature(forward)
        except (TypeError, ValueError):
            pass
        else:
            if list(signature.parameters) == list(inputs):
                return signature
    return schema_signature(inputs)


def _description(tool: Any) -> str:
    lines = [str(getattr(tool, "description", "") or "")]
    for name, spec in (getattr(tool, "inputs", None) or {}).items():
        lines.append(f"{name} ({spec.get('type', 'any')}): {spec.get('description', '')}")
    return "\n".join(line for line in lines if line)


class SandboxExecutor(PythonExecutor):  # type: ignore[misc]
    """Runs a CodeAgent's code in a sandbox kernel; its tools run here, called as data.

    sandbox: a Sandbox to run in (not started, or started; closed by cleanup() only when this
    executor made it), else `Sandbox(**sandbox_options)` with `kernel_name=None`, this
    package's own kernel with the default policy (no network, no processes).
    timeout: seconds per step (the run is stopped and the agent told; variables are kept).
    tool_limits: the bridge's limits for the tools' calls per step (calls, seconds, bytes).
    """

    def __init__(self, sandbox: Sandbox | None = None, *, timeout: float | None = 60.0,
                 tool_limits: ToolLimits | None = None, logger: Any = None,
                 **sandbox_options: Any) -> None:
        self.session = Session(sandbox, {}, timeout, tool_limits, sandbox_options, _FINAL_CODE)
        self.sandbox, self.timeout = self.session.sandbox, timeout
        self.executions = self.session.executions  # every run, for the caller's audit
        self.logger = logger or AgentLogger(level=LogLevel.OFF)
        self._answer: list[Any] = []

    def _final(self, answer: Any) -> Any:
        self._answer.append(answer)
        return answer

    def _run(self, code: str, inputs: dict | None = None, entrypoint: str = "main") -> Execution:
        self.session.start()
        self._answer.clear()
        execution = self.session.run(code, inputs=inputs, entrypoint=entrypoint)
        self.executions.append(execution)
        return execution

    def send_tools(self, tools: dict[str, Any]) -> None:
        """Grant the agent's tools and managed agents to the kernel as stubs calling them here."""
        granted: dict[str, Callable[..., Any]] = {}
        for name, tool in tools.items():
            if name == FINAL:
                # The agent's own final_answer tool (it may check or convert the answer).
                granted[name] = host_function(
                    name, lambda answer, _tool=tool: self._final(_tool(answer)),
                    "Provides a final answer.", schema_signature({"answer": {"type": "any"}}))
                continue
            granted[name] = host_function(name, tool, _description(tool), _signature(tool))
        granted.setdefault(FINAL, host_function(
            FINAL, self._final, "Provides a final answer.",
            schema_signature({"answer": {"type": "any"}})))
        self.session.tools = granted
        try:
            if self.session.started:
                self.session.bind_tools()
            else:
                self.session.start()
        except RuntimeError as exc:
            raise AgentExecutionError(str(exc), self.logger) from exc

    def send_variables(self, variables: dict[str, Any]) -> None:
        """Set the agent's state variables in the kernel (JSON values only: nothing is pickled)."""
        if not variables:
            return
        try:
            json.dumps(variables)
        except (TypeError, ValueError) as exc:
            raise AgentExecutionError(
                f"the sandbox takes only JSON values as variables ({exc}): pass data, or a "
                "tool that returns it", self.logger) from exc
        done = self._run("def __sandbox_variables(**values):\n"
                         "    globals().update(values)\n    return {}\n",
                         inputs=variables, entrypoint="__sandbox_variables")
        if done.error is not None:
            raise AgentExecutionError(error_text(done), self.logger)

    def __call__(self, code_action: str) -> CodeOutput:
        """Run one step's code; its printed output as the logs, its last value as the output."""
        execution = self._run(code_action)
        logs = execution.stdout + execution.stderr
        if execution.error is not None and execution.error.name == FINAL_EXCEPTION \
                and self._answer:
            return CodeOutput(output=self._answer[-1], logs=logs, is_final_answer=True)
        if execution.error is not None:
            raise AgentExecutionError(
                (f"Execution logs:\n{logs}\n" if logs else "") + error_text(execution),
                self.logger)
        return CodeOutput(output=execution.text, logs=logs, is_final_answer=False)

    def cleanup(self) -> None:
        """Close the sandbox if this executor made it."""
        self.session.close()
