"""Agent frameworks' own executor interfaces over a sandbox (docs/agents.md).

One module per framework, each importable only with its extra (`pip install -e '.[smolagents]'`):
`smolagents` (a `PythonExecutor` for `CodeAgent`), `autogen` (a `CodeExecutor`), `llamaindex`
(`code_execute_fn` for `CodeActAgent`), `langchain` (a tool over a session), `pydantic_ai` (a
code toolset; the MCP server, as a subprocess, as a toolset) and `openai_agents` (a
`FunctionTool` over a session, for the OpenAI Agents SDK). Each is a face above
`sandbox_kernel.client`: code runs in a sandbox kernel, the framework's own tools run in
the caller's process through the tool bridge (docs/tools.md), and what ran comes back as the
framework's own result type.
"""
