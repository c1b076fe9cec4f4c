"""How a run can end other than with its code's own answer: one vocabulary, one class each.

Beside policy.py and jsonwire.py, below every layer that names one of these: the kernel names a
timeout (kernel/kernel.py), the caller a kernel that died, a message or result too large, a
kernel that refused to start (client/), the hosting layer its own deadline, its output cap, its
shutdown and a kernel it could not have (hosting/). Each class's `code` is the `name` of the
`ErrorInfo` an `Execution` carries, a promise callers match on: the faces map codes to their
protocol (dify's exit codes and messages, an MCP message for a model, an HTTP status) and
nothing reads a message to recover its kind (snekbox's `EvalError`, turned into its answer at
one place).

A run whose kernel was lost (it died, was killed at the deadline, or sent what the caller
refuses) raises nothing: the caller sets the error on the Execution with `state_lost`; the
classes are what it names. `KernelUnavailable` is raised: no kernel could be had, nothing ran.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "CODES", "ExecutionAborted", "ExecutionTimeout", "KernelDied", "KernelRefused",
    "KernelUnavailable", "MessageTooLarge", "OutputLimitExceeded", "ResultTooLarge",
    "SandboxError", "ServiceStopping",
]


class SandboxError(Exception):
    """An end of a run the sandbox (not the user's code) caused; `code` names it."""

    code: ClassVar[str] = "SandboxError"

    @property
    def message(self) -> str:
        """What happened and, where there is one, what to do about it."""
        return str(self)

    def traceback(self) -> list[str]:
        """The one traceback line an Execution's error gets (user code raised nothing)."""
        return [f"{self.code}: {self}"]


class ExecutionTimeout(SandboxError):
    """The code ran past its time limit (stopped by the kernel, the caller or the host)."""

    code = "ExecutionTimeout"


class KernelDied(SandboxError):
    """The kernel process ended under the run (a signal, an exit, a limit)."""

    code = "KernelDied"


class MessageTooLarge(SandboxError):
    """The kernel sent a message larger than the caller accepts."""

    code = "MessageTooLarge"


class ResultTooLarge(SandboxError):
    """`main()`'s result is larger than the caller accepts (the kernel and its state stay)."""

    code = "ResultTooLarge"


class OutputLimitExceeded(SandboxError):
    """The code sent more output than the host takes from one execution (--max-output-total)."""

    code = "OutputLimitExceeded"


class ServiceStopping(SandboxError):
    """The host shut down before the run ended, within its grace period."""

    code = "ServiceStopping"


class KernelRefused(SandboxError):
    """The kernel refused to start the run (a layer it could not put in place)."""

    code = "KernelRefused"


class ExecutionAborted(SandboxError):
    """The kernel did not run the code: it aborted the request (a Jupyter kernel aborts what
    is queued behind a cell that failed with stop_on_error, and everything at shutdown)."""

    code = "ExecutionAborted"


class KernelUnavailable(SandboxError, RuntimeError):
    """No kernel could be had: it did not start, or not in time; nothing ran."""

    code = "KernelUnavailable"


CODES: dict[str, type[SandboxError]] = {cls.code: cls for cls in (
    ExecutionTimeout, KernelDied, MessageTooLarge, ResultTooLarge, OutputLimitExceeded,
    ServiceStopping, KernelRefused, KernelUnavailable, ExecutionAborted)}
