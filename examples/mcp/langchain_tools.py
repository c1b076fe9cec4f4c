"""The sandbox's MCP tools as LangChain tools, through langchain-mcp-adapters.

langchain-mcp-adapters (0.3.2) still needs the 1.x MCP SDK, the sandbox's server the 2.x one:
give each its own environment; they talk over stdio, which both speak.

    python -m venv agent && agent/bin/pip install langchain-mcp-adapters
    SANDBOX_KERNEL_PYTHON=/path/to/sandbox-venv/bin/python agent/bin/python langchain_tools.py

Starts `sandbox-kernel mcp` over stdio, loads its tools as LangChain tools and calls run_python
the way an agent's tool node would. Hand `tools` to any LangChain/LangGraph agent, e.g.
`langgraph.prebuilt.create_react_agent(model, tools)`.
"""

import asyncio
import json
import os
import sys

from langchain_mcp_adapters.client import MultiServerMCPClient
from langchain_mcp_adapters.tools import load_mcp_tools


async def main() -> None:
    """Give the MCP server's tools to a LangChain agent and run one task through them."""
    client = MultiServerMCPClient({
        "sandbox": {"transport": "stdio",
                    "command": os.environ.get("SANDBOX_KERNEL_PYTHON", sys.executable),
                    "args": ["-m", "sandbox_kernel", "mcp"]},
    })
    # One MCP session for all the calls: without it the adapters start a server per call, and
    # a sandbox session (create_session) would not outlive the call that made it.
    async with client.session("sandbox") as mcp_session:
        tools = {tool.name: tool for tool in await load_mcp_tools(mcp_session)}
        print("tools:", ", ".join(sorted(tools)))
        answer = await tools["run_python"].ainvoke({
            "code": "def main(n):\n    return {'squares': [i * i for i in range(n)]}\n",
            "inputs": {"n": 5}})
        print("run_python ->", answer)
        opened = await tools["create_session"].ainvoke({})
        session = json.loads(opened[0]["text"])["session"] if isinstance(opened, list) \
            else json.loads(opened)["session"]
        await tools["run_python"].ainvoke({"code": "total = 40", "session": session})
        kept = await tools["run_python"].ainvoke({"code": "total + 2", "session": session})
        print("state kept ->", kept)
        refused = await tools["run_python"].ainvoke({"code": "import os\nos.system('ls')"})
        print("refused ->", refused)


if __name__ == "__main__":
    asyncio.run(main())
