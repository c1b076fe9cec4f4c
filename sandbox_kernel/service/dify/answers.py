"""dify-sandbox's runner, as its answers report a run: exit codes and error text.

"process exited with code 255" and the traceback for an uncaught exception; "error: timeout"
and exit code -1 for a run past its time; SystemExit as the exit status Python would give.
"""

from __future__ import annotations

from typing import Any

from ...client import Execution
from ...errors import ExecutionTimeout, KernelDied, ServiceStopping
from .tracebacks import plain, user_lines

TIMEOUT_NAMES = {ExecutionTimeout.code}  # the kernel's own limit and the client's use the same name
# Python's exit status for an uncaught exception under dify-sandbox's excepthook (sys.exit(-1)).
UNCAUGHT_EXIT = 255
_EXIT_HINT = "To exit: use 'exit', 'quit', or Ctrl-D."  # IPython's warning after SystemExit


def _exit_status(value: str) -> tuple[int, str]:
    """Python's exit status for SystemExit(value), and what it prints on stderr."""
    if value in ("", "None"):
        return 0, ""
    try:
        return int(value) & 0xFF, ""
    except ValueError:
        return 1, value + "\n"


def _failure(exit_code: int, stderr: str, exec_error: str = "") -> str:
    """dify-sandbox's buildExecutionError."""
    text = f"process exited with code {exit_code}"
    for detail in (exec_error, stderr):
        if detail:
            if not text.endswith("\n"):
                text += "\n"
            text += detail
    return text


def run_data(execution: Execution, code: str = "") -> dict[str, Any]:
    """The `data` of a run's answer, as dify-sandbox reports the same outcome of a process."""
    stdout, stderr = execution.stdout, execution.stderr
    error = execution.error
    if error is None:
        return {"stdout": stdout, "stderr": stderr, "error": "", "exit_code": 0}
    if error.name in TIMEOUT_NAMES:
        return {"stdout": stdout, "stderr": stderr,
                "error": _failure(-1, stderr, "error: timeout\n"), "exit_code": -1}
    if error.name == KernelDied.code:  # killed by a signal: Go reports exit code -1
        # Only how it died: the client's note about restarting means nothing to a one-off run.
        died = error.value.split(";")[0]
        return {"stdout": stdout, "stderr": stderr,
                "error": _failure(-1, stderr, f"error: {died}\n"), "exit_code": -1}
    if error.name == ServiceStopping.code:  # its kernel was shut down: a killed process, for Go
        return {"stdout": stdout, "stderr": stderr,
                "error": _failure(-1, stderr, f"error: {error.value}\n"), "exit_code": -1}
    if error.name == "SystemExit":
        status, printed = _exit_status(error.value)
        stderr = "".join(chunk["text"] for chunk in execution.logs
                         if chunk["name"] == "stderr" and _EXIT_HINT not in chunk["text"])
        stderr += printed
        return {"stdout": stdout, "stderr": stderr,
                "error": _failure(status, stderr) if status else "", "exit_code": status}
    traceback = plain(error.traceback, user_lines(code)) if error.traceback \
        else f"{error.name}: {error.value}\n"
    stderr += traceback
    return {"stdout": stdout, "stderr": stderr, "error": _failure(UNCAUGHT_EXIT, stderr),
            "exit_code": UNCAUGHT_EXIT}
