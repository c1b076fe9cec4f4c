"""Run in the [openai-agents] venv: SandboxPython's answers to errors, timeouts and refusals,
a hand-made FunctionTool and a context-taking one as host tools, and one session across two
`Runner.run_sync` calls (two event loops), printed as one JSON object for
tests/test_frameworks.py."""

import json
import os

from agents import (
    Agent,
    FunctionTool,
    RunContextWrapper,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.testing import ScriptedModel, assistant_message, function_call

from sandbox_kernel.frameworks.openai_agents import SandboxPython

set_tracing_disabled(True)


async def _tripled(context, arguments):
    """A FunctionTool's invoker, as the SDK calls it: a context and the arguments as JSON."""
    return json.dumps({"tripled": json.loads(arguments)["n"] * 3, "context": context.context,
                       "pid": os.getpid()})


tripled = FunctionTool(
    name="tripled", description="Three times n.", on_invoke_tool=_tripled,
    params_json_schema={"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": False})


@function_tool
def who(context: RunContextWrapper, name: str) -> str:
    """A tool that reads the run's context."""
    return f"{name} in {context.context}"


def answers(python, *codes):
    """The tool's answer to each code, as the model reads it, from one Runner.run_sync."""
    steps = [[function_call(python.tool.name, {"code": code}, call_id=str(n))]
             for n, code in enumerate(codes)]
    model = ScriptedModel([*steps, [assistant_message("done")]])
    result = Runner.run_sync(Agent(name="a", model=model, tools=[python.tool]), "go")
    return [item.output for item in result.new_items if item.type == "tool_call_output_item"]


def main():
    seen = {}
    try:
        SandboxPython(tools=[who])
    except TypeError as exc:
        seen["context_tool"] = str(exc)
    with SandboxPython(tools=[tripled], timeout=3) as python:
        seen["schema"] = python.tool.params_json_schema
        [seen["hand_made"]] = answers(python, "x = 5\nanswer = tripled(n=x)\nanswer")
        seen["host_pid"] = os.getpid()
        (seen["error"], seen["timeout"], seen["subprocess"]) = answers(
            python, "print('so far')\n1 / 0", "while True:\n    pass",
            "import subprocess\nsubprocess.run(['ls'])")
        [seen["kept"]] = answers(python, "x * 2")  # a second run_sync: another event loop
        model = ScriptedModel([[function_call(python.tool.name, {"source": "1"}, call_id="b")],
                               [assistant_message("done")]])
        result = Runner.run_sync(Agent(name="a", model=model, tools=[python.tool]), "go")
        seen["bad_arguments"] = result.new_items[1].output
        seen["runs"] = len(python.executions)
    print(json.dumps(seen))


main()
