"""A request whose client went away: its work is cancelled (the HTTP face's part of a run).

Starlette tells a route its client left only through `receive()`; these watch it beside the
run, so a run no one waits for frees its worker and kernel (hosting/fresh.py's `bounded` and
the runner's finally blocks do the freeing).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    """Return when the client has gone away (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def client_left(request: Request, task: asyncio.Future[Any]) -> bool:
    """Wait until task is done or the client has gone away; True if the client left first
    (the task is left running: the caller decides whether to cancel it)."""
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    return not task.done()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run work; cancel it (its finally blocks free the kernel) if the client disconnects.

    Only for work whose kernel is thrown away after: cancelling a kernel's client half-way
    (e.g. through a restart) leaves it unusable.
    """
    task = asyncio.ensure_future(work)
    try:
        if not await client_left(request, task):
            return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None


