"""OpenAI function calling with the sandbox's tools: definitions from the same schemas, calls
carried out by the MCP server.

    sandbox-kernel mcp --print-tools openai > tools.json        # Responses API form
    sandbox-kernel mcp --print-tools openai-chat > tools.json   # Chat Completions form
    python examples/mcp/openai_tools.py

Pass `tools` to `client.responses.create(model=..., input=..., tools=tools)`; for each
`function_call` item of the response, `await dispatch(session, item.name, item.arguments)` and
send the text back as a `function_call_output` with the item's call_id. The demonstration
below plays the model's part with a fixed function call, so it runs without an API key.
"""

import asyncio
import json
import os
import sys

from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from sandbox_kernel.mcp.config import McpConfig
from sandbox_kernel.mcp.openai import tool_definitions


async def dispatch(client: Client, name: str, arguments: str) -> str:
    """Carry out one function call of the model; the text to hand back as its output."""
    answer = await client.call_tool(name, json.loads(arguments or "{}"))
    return "\n".join(block.text for block in answer.content if block.type == "text")


async def main() -> None:
    """List the tools as the Responses API wants them and carry out one function call."""
    tools = await tool_definitions(McpConfig(), "openai")
    print(f"{len(tools)} tools for the Responses API:", ", ".join(t["name"] for t in tools))
    server = StdioServerParameters(command=sys.executable, args=["-m", "sandbox_kernel", "mcp"],
                                   env=dict(os.environ))
    async with Client(stdio_client(server)) as client:
        # What a model's function_call item carries: a name and its arguments as JSON text.
        call = {"name": "run_python", "arguments": json.dumps(
            {"code": "import statistics\nstatistics.mean([3, 5, 10])"})}
        print("function_call_output:", await dispatch(client, **call))


if __name__ == "__main__":
    asyncio.run(main())
