"""The MCP tools as OpenAI function-calling definitions, from the same schemas.

`sandbox-kernel mcp --print-tools openai` prints the Responses API form (a flat
{"type": "function", "name", "description", "parameters"}); `openai-chat` the Chat Completions
form ({"type": "function", "function": {...}}). The application then runs each call the model
makes through an MCP client (or this server's tools) and hands back the result's text.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .config import McpConfig
from .server import build

FORMATS = ("openai", "openai-chat", "mcp")


async def tool_definitions(config: McpConfig, form: str = "openai") -> list[dict[str, Any]]:
    """The tool definitions in the given form (mcp: the MCP Tool objects as JSON)."""
    server, state = build(config)
    async with state.bridged():  # the --tools-from servers' stubs, in run_python's description
        listed = await server.list_tools()
    if form == "mcp":
        return [tool.model_dump(mode="json", by_alias=True, exclude_none=True)
                for tool in listed]
    tools = []
    for tool in listed:
        function = {"name": tool.name, "description": tool.description or tool.title or "",
                    "parameters": tool.input_schema}
        tools.append({"type": "function", **function} if form == "openai"
                     else {"type": "function", "function": function})
    return tools


def definitions(config: McpConfig, form: str = "openai") -> list[dict[str, Any]]:
    """tool_definitions, from code that is not in an event loop."""
    return asyncio.run(tool_definitions(config, form))
