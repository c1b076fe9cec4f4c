"""The per-execution time limit: interrupt user code that runs too long, keep the kernel."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

# Once the limit has passed, the interruption repeats at this interval, so that code which
# swallows one exception is interrupted again (the client restarts a kernel that never yields).
REPEAT_SECONDS = 1.0


class ExecutionTimeout(BaseException):
    """The execution ran past its time limit.

    A BaseException, like KeyboardInterrupt, so that `except Exception:` in user code does not
    swallow it. Raised in user code, so not errors.py's class; its name is that class's code.
    """


def message(seconds: float, source: str) -> str:
    """What the user is told when the limit strikes, naming what set the limit."""
    # Nothing about the kernel's state: a notebook sees its kernel carry on, while a one-shot
    # `sandbox-kernel run` ends it right after.
    return f"the execution ran longer than its {seconds:g} s limit (set by {source}) and was " \
        "interrupted"


def _running_user_code(frame: FrameType | None, is_user_frame: Callable[[FrameType], bool]) -> bool:
    while frame is not None:
        if is_user_frame(frame):
            return True
        frame = frame.f_back
    return False


class Deadline:
    """Arms SIGALRM for one execution and remembers whether it struck."""

    def __init__(self, seconds: float, source: str,
                 is_user_frame: Callable[[FrameType], bool]) -> None:
        self.seconds, self.source, self.is_user_frame = seconds, source, is_user_frame
        self.expired = False
        self.task: asyncio.Task[object] | None = None

    def error(self) -> ExecutionTimeout:
        """The exception that tells the user the limit struck."""
        return ExecutionTimeout(message(self.seconds, self.source))

    def strike(self, signum: int, frame: FrameType | None) -> None:
        """The SIGALRM handler: interrupt the user code, wherever it is waiting."""
        __tracebackhide__ = True  # IPython leaves this frame out of the user's traceback
        self.expired = True
        if _running_user_code(frame, self.is_user_frame):
            raise self.error()
        # Not in user code. While ipykernel runs an async cell (or an async main) it has its own
        # SIGINT handler in place, and the cell waits in the event loop: cancel the execution's
        # task, which cancels what it awaits. Otherwise this is the kernel's own code just after
        # the cell, which must not be hit.
        async_in_flight = signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        if self.task is not None and async_in_flight:
            self.task.get_loop().call_soon_threadsafe(self.task.cancel)

    @contextlib.contextmanager
    def armed(self) -> Iterator[Deadline]:
        """Run the block under the limit (a no-op for no limit or outside the main thread)."""
        # Signals reach only the main thread; code in subshell threads gets the client's deadline.
        if self.seconds <= 0 or threading.current_thread() is not threading.main_thread():
            yield self
            return
        try:
            self.task = asyncio.current_task()
        except RuntimeError:  # no event loop: nothing async to cancel
            self.task = None
        previous = signal.signal(signal.SIGALRM, self.strike)
        signal.setitimer(signal.ITIMER_REAL, self.seconds, REPEAT_SECONDS)
        try:
            yield self
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if self.expired and self.task is not None:
                # Python 3.11+ counts cancellations; this one was ours, and it is handled.
                while getattr(self.task, "cancelling", lambda: 0)():
                    self.task.uncancel()  # type: ignore[attr-defined]
