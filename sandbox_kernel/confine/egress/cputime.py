"""The CPU the egress proxy spends on one kernel's connections, measured step by step.

The proxy runs in the kernel's unconfined companion, outside --cpu-limit, and the one-shots'
companion serves many kernels' proxies on one event loop in one thread: the thread's CPU is
not one kernel's. What is one kernel's is the work of its connections' coroutines (reading and
judging request heads, checking TLS hellos, splicing bytes), so each step of such a coroutine
(from one resumption to its next suspension) is timed with the thread's CPU clock and charged to
that kernel (confine/tally.py carries the figure to the kernel's usage). The event loop's own
work between steps (polling, the transports' reads into the streams' buffers) is no one kernel's
and is not charged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


async def metered(coro: Coroutine[Any, Any, T], charge: Callable[[float], None]) -> T:
    """Run coro, charging the CPU of each of its steps (this thread's) to charge."""
    return await _Steps(coro, charge)


class _Steps:
    """An awaitable that drives a coroutine one step at a time, timing each step."""

    def __init__(self, coro: Coroutine[Any, Any, Any], charge: Callable[[float], None]) -> None:
        self.coro, self.charge = coro, charge

    def __await__(self) -> Generator[Any, Any, Any]:
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            started = time.thread_time()
            try:
                waited = self.coro.send(sent) if thrown is None else self.coro.throw(thrown)
            except StopIteration as done:
                return done.value
            finally:
                self.charge(time.thread_time() - started)
            try:
                sent, thrown = (yield waited), None
            except GeneratorExit:  # closed while suspended: close the coroutine too
                self.coro.close()
                raise
            except BaseException as exc:  # a cancellation or an error delivered by the task
                sent, thrown = None, exc
