"""Run in the [smolagents] venv: SandboxExecutor's steps, errors, refusals, timeouts and tools,
printed as one JSON object for tests/test_frameworks.py."""

import json
import os

from smolagents import Tool, tool
from smolagents.utils import AgentExecutionError

from sandbox_kernel.client import ToolLimits
from sandbox_kernel.frameworks.smolagents import SandboxExecutor


@tool
def lookup(key: str, default: str = "none") -> str:
    """Look a key up on the host.

    Args:
        key: what to look up
        default: the answer when it is missing
    """
    if key == "boom":
        raise ValueError("the host's lookup failed")
    return {"pid": str(os.getpid())}.get(key, default)


class Doubler(Tool):
    """A class-style tool."""

    name = "double"
    description = "Doubles a number."
    inputs = {"number": {"type": "integer", "description": "the number"}}  # noqa: RUF012 (smolagents reads it)
    output_type = "integer"

    def forward(self, number: int) -> int:
        return number * 2


def failure(executor, code):
    try:
        executor(code)
    except AgentExecutionError as exc:
        return str(exc)
    return None


os.environ["BANK_API_KEY"] = "sk-live-do-not-leak"  # the host has it; the kernel must not
seen = {}
executor = SandboxExecutor(timeout=3, tool_limits=ToolLimits(max_calls=5))
try:
    executor.send_tools({"lookup": lookup, "double": Doubler()})
    executor.send_variables({"numbers": [1, 2, 3]})
    step = executor("total = sum(numbers)\nprint('sum', total)\ndouble(number=total)")
    seen["step"] = [step.output, step.logs, step.is_final_answer]
    seen["host_pid"] = [executor("lookup('pid')").output, str(os.getpid())]
    seen["default_applied"] = executor("lookup(key='missing')").output
    seen["signature"] = executor("import inspect\nstr(inspect.signature(lookup))").output
    seen["tool_error"] = failure(executor, "lookup('boom')")
    seen["zero"] = failure(executor, "x = 1\n1 / 0")
    seen["subprocess"] = failure(executor, "import subprocess\nsubprocess.run(['ls'])")
    seen["budget"] = failure(executor, "for _ in range(6):\n    double(number=1)")
    seen["timeout"] = failure(executor, "kept = 7\nwhile True:\n    pass")
    seen["kept_after_timeout"] = executor("kept * total").output
    seen["secret_visible"] = executor("import os\n'BANK_API_KEY' in os.environ").output
    final = executor("final_answer({'total': total, 'set': {1}})")
    seen["final"] = [final.output, final.is_final_answer]
    try:
        executor.send_variables({"handle": object()})
    except AgentExecutionError as exc:
        seen["non_json_variable"] = str(exc)
finally:
    executor.cleanup()
print(json.dumps(seen))
