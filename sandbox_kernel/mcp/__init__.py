"""The MCP server (`sandbox-kernel mcp`): the agents' face, on the official `mcp` SDK.

config (settings and flags), messages (what a model is told), files (scratch files through the
kernel), kernels (fresh and session kernels), runs (a run in the background, collected in parts),
render (an execution as MCP content), tools, resources, server (transports and keys), openai
(the same tools as OpenAI function definitions), command (the `mcp` subcommand).
"""
