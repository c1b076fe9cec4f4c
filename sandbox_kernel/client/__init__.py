"""The caller's side: start a sandboxed kernel and run code (or a `main()` call) in it.

    with Sandbox() as sb:
        ex = sb.run("def main(x):\n    print('hi')\n    return {'y': x * 2}", inputs={"x": 21})
        ex.result  # {'y': 42}; ex.stdout == 'hi\\n'
"""

from .sandbox import AsyncSandbox, Execution, ExecutionError, Sandbox

__all__ = ["AsyncSandbox", "Execution", "ExecutionError", "Sandbox"]
