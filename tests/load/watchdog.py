"""Notice a service that stopped answering at all, and keep the evidence of where it stands."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import httpx

from tests.load.service import Service

T = TypeVar("T")


def stacks(pid: int) -> str:
    """The Python stacks of every thread of pid (py-spy, when installed)."""
    spy = Path(sys.executable).with_name("py-spy")
    found = str(spy) if spy.exists() else shutil.which("py-spy")
    if not found:
        return "(py-spy is not installed: no stacks)"
    try:
        dump = subprocess.run([found, "dump", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(py-spy failed: {exc})"
    # The main thread first: it runs the event loop.
    return dump.stdout.split("\nThread ", 2)[0][:3000] if dump.stdout else dump.stderr[:500]


async def unresponsive(service: Service, patience: float = 30.0, every: float = 2.0) -> str:
    """Return the evidence once /health has gone unanswered for `patience` seconds."""
    last_ok = time.monotonic()
    while True:
        try:
            async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
                ok = (await http.get(f"{service.url}/health")).status_code == 200
        except httpx.HTTPError:
            ok = False
        now = time.monotonic()
        if ok:
            last_ok = now
        elif now - last_ok > patience:
            return (f"/health unanswered for {now - last_ok:.0f} s.\nService stacks:\n"
                    f"{await asyncio.to_thread(stacks, service.pid)}\nService log:\n"
                    f"{service.log_tail(30)}")
        await asyncio.sleep(every)


async def guarded(service: Service, work: Awaitable[T]) -> tuple[T | None, str]:
    """Run work unless the service stops answering: (its result, "") or (None, evidence)."""
    task = asyncio.ensure_future(work)
    guard = asyncio.ensure_future(unresponsive(service))
    try:
        await asyncio.wait({task, guard}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, guard):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, guard, return_exceptions=True)
    if task.done() and not task.cancelled():
        return task.result(), ""
    return None, guard.result()
