"""The MCP server (`sandbox-kernel mcp`): the agents' face, on the official `mcp` SDK.

command (the subcommand's flags), config (its settings), server (transports and keys), state
(what the tools share), kernels (fresh kernels and sessions), runs (a run in the background,
collected in parts), files (scratch files through the kernel), tools and resources (what an
agent calls and reads), shapes (their output schemas), render (a run as MCP content), messages
(what a model is told), openai (the same tools as OpenAI function definitions).
"""
