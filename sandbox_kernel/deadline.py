"""The per-execution time limit: interrupt user code that runs too long, keep the kernel."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

# Once the limit has passed, the interruption repeats at this interval, so that code which
# swallows one exception is interrupted again (the client restarts a kernel that never yields).
REPEAT_SECONDS = 1.0


class ExecutionTimeout(BaseException):
    """The execution ran past its time limit.

    A BaseException, like KeyboardInterrupt, so that `except Exception:` in user code does not
    swallow it.
    """


def _message(seconds: float, source: str) -> str:
    return (f"the execution ran longer than its {seconds:g} s limit ({source}) and was "
            "interrupted; the kernel and its variables are still there")


@contextlib.contextmanager
def deadline(seconds: float, source: str) -> Iterator[None]:
    """Raise ExecutionTimeout in the main thread if the block runs longer than seconds."""
    # Signals reach only the main thread; code in subshell threads gets the client's deadline.
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise ExecutionTimeout(_message(seconds, source))

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, REPEAT_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
