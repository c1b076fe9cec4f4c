"""Run in the [llamaindex] venv: SandboxCodeSession.execute's answers (as CodeActAgent's
FunctionTool takes them), printed as one JSON object for tests/test_frameworks.py."""

import asyncio
import json
import os

from llama_index.core.tools import FunctionTool

from sandbox_kernel.frameworks.llamaindex import SandboxCodeSession


def pid() -> int:
    """The host process's id."""
    return os.getpid()


async def main():
    seen = {}
    tools = [FunctionTool.from_defaults(pid, name="host_pid")]
    async with SandboxCodeSession(tools=tools, timeout=3) as session:
        execute = FunctionTool.from_defaults(session.execute, name="execute")
        seen["description"] = execute.metadata.description
        seen["step"] = await session.execute("x = 5\nprint('x is', x)\nhost_pid()")
        seen["host_pid"] = os.getpid()
        seen["error"] = await session.execute("1 / 0")
        seen["timeout"] = await session.execute("while True:\n    pass")
        seen["subprocess"] = await session.execute("import os\nos.system('ls')")
        seen["kept"] = await session.execute("x * 2")
        seen["as_the_agent_reads_it"] = (await execute.acall(code="x + 1")).content
    print(json.dumps(seen))


asyncio.run(main())
