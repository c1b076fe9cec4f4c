"""Run in the [autogen] venv: SandboxCodeExecutor's blocks, languages, errors, timeouts,
cancellation and restart, and CodeExecutorAgent with it, printed as one JSON object for
tests/test_frameworks.py."""

import asyncio
import json
import os

from autogen_agentchat.agents import CodeExecutorAgent
from autogen_agentchat.messages import TextMessage
from autogen_core import CancellationToken
from autogen_core.code_executor import CodeBlock

from sandbox_kernel.frameworks.autogen import SandboxCodeExecutor


def pid() -> int:
    """The host process's id."""
    return os.getpid()


async def main():
    seen = {}
    async with SandboxCodeExecutor(tools=[pid], timeout=3) as executor:
        async def run(*blocks):
            result = await executor.execute_code_blocks(
                [CodeBlock(code, language) for language, code in blocks], CancellationToken())
            return [result.exit_code, result.output]

        seen["two_blocks"] = await run(("python", "x = 20"), ("python", "print(x + 1)\nx * 2"))
        seen["host_pid"] = [await run(("python", "pid()")), os.getpid()]
        seen["shell"] = await run(("python", "print('before')"), ("bash", "ls -la"))
        seen["other_language"] = await run(("javascript", "1 + 1"))
        seen["error"] = await run(("python", "print('so far')\n1 / 0"), ("python", "print(9)"))
        seen["timeout"] = await run(("python", "while True:\n    pass"))
        seen["kept"] = await run(("python", "x"))
        token = CancellationToken()
        running = asyncio.ensure_future(executor.execute_code_blocks(
            [CodeBlock("import time\ny = 1\ntime.sleep(30)", "python")], token))
        await asyncio.sleep(1.5)
        token.cancel()
        try:
            await running
        except asyncio.CancelledError:
            seen["cancelled"] = True
        seen["after_cancel"] = await run(("python", "x, y"))
        await executor.restart()
        seen["after_restart"] = await run(("python", "'x' in globals(), pid() > 0"))
        agent = CodeExecutorAgent("runner", code_executor=executor)
        reply = await agent.on_messages(
            [TextMessage(content=f"```python\nprint(pid() == {os.getpid()})\n```",
                         source="user")], CancellationToken())
        seen["agent"] = reply.chat_message.content
    print(json.dumps(seen))


asyncio.run(main())
