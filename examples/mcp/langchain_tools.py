"""The sandbox's MCP tools as LangChain tools, through langchain-mcp-adapters.

    pip install 'sandbox-kernel[mcp]' langchain-mcp-adapters
    python examples/mcp/langchain_tools.py

Starts `sandbox-kernel mcp` over stdio, loads its tools as LangChain tools and calls run_python
the way an agent's tool node would. Hand `tools` to any LangChain/LangGraph agent, e.g.
`langgraph.prebuilt.create_react_agent(model, tools)`.
"""

import asyncio
import sys

from langchain_mcp_adapters.client import MultiServerMCPClient


async def main() -> None:
    client = MultiServerMCPClient({
        "sandbox": {"transport": "stdio", "command": sys.executable,
                    "args": ["-m", "sandbox_kernel", "mcp"]},
    })
    tools = {tool.name: tool for tool in await client.get_tools()}
    print("tools:", ", ".join(sorted(tools)))
    answer = await tools["run_python"].ainvoke({
        "code": "def main(n):\n    return {'squares': [i * i for i in range(n)]}\n",
        "inputs": {"n": 5}})
    print("run_python ->", answer)
    refused = await tools["run_python"].ainvoke({"code": "import os\nos.system('ls')"})
    print("refused ->", refused)


if __name__ == "__main__":
    asyncio.run(main())
