"""The caller's side: start a sandboxed kernel and run code (or a `main()` call) in it.

    with Sandbox() as sb:
        ex = sb.run("def main(x):\n    print('hi')\n    return {'y': x * 2}", inputs={"x": 21})
        ex.result  # {'y': 42}; ex.stdout == 'hi\\n'; ex.usage.cpu_user_seconds
"""

from typing import Any

from . import execution as _execution
from .execution import ErrorInfo, Execution, Usage
from .receive import CallerLimits
from .sandbox import GRACE_SECONDS, AsyncSandbox, Sandbox
from .snapshot import Snapshot, SnapshotError
from .tools import ToolCall, ToolLimits

__all__ = ["GRACE_SECONDS", "AsyncSandbox", "CallerLimits", "ErrorInfo", "Execution", "Sandbox",
           "Snapshot", "SnapshotError", "ToolCall", "ToolLimits", "Usage"]


def __getattr__(name: str) -> Any:
    """Deprecated names, still importable (see execution.__getattr__)."""
    return getattr(_execution, name)
