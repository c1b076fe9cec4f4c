"""A bounded asyncio load client on httpx: a fixed number of requests, at a fixed concurrency or
rate, each with its own deadline, against a loopback URL only.

Written here rather than taken from a load tool because every request carries its own expected
answer (checked per request, not just counted) and the run must interleave with resource samples
and fault injection in the same process; httpx does the HTTP.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from tests.load.check import Answer

API_KEY_HEADER = "X-Api-Key"
Http = httpx.AsyncClient


def loopback_only(url: str) -> str:
    """url, after checking that it points at this machine's loopback."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"load runs target loopback only, not {host!r}")
    return url


def client(base_url: str, connections: int, timeout: float) -> httpx.AsyncClient:
    """An HTTP client for one run: pooled like Dify's (it keeps connections open)."""
    return httpx.AsyncClient(
        base_url=loopback_only(base_url), timeout=httpx.Timeout(timeout, connect=10.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        trust_env=False)


async def post_run(http: httpx.AsyncClient, body: dict[str, Any], api_key: str,
                   timeout: float | None = None) -> Answer:
    """POST /v1/sandbox/run; the answer, or the transport failure, with its latency."""
    started = time.monotonic()
    try:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        response = await http.post("/v1/sandbox/run", json=body,
                                   headers={API_KEY_HEADER: api_key}, **kwargs)
    except httpx.HTTPError as exc:
        return Answer(None, failure=type(exc).__name__ + (f": {exc}" if str(exc) else ""),
                      started=started, latency=time.monotonic() - started)
    return Answer(response.status_code, response.content, started=started,
                  latency=time.monotonic() - started)


Send = Callable[[int], Awaitable[Answer]]


async def closed_loop(count: int, concurrency: int, send: Send,
                      deadline: float) -> list[Answer | None]:
    """Send requests 0..count-1 with at most `concurrency` in flight; stop starting new ones
    after `deadline` seconds (their slots stay None)."""
    answers: list[Answer | None] = [None] * count
    stop_at = time.monotonic() + deadline
    next_index = iter(range(count))

    async def worker() -> None:
        for index in next_index:
            if time.monotonic() > stop_at:
                return
            answers[index] = await send(index)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers


async def open_loop(rate: float, duration: float, send: Send, max_in_flight: int,
                    on_overflow: Callable[[int], None] | None = None) -> list[Answer | None]:
    """Start one request every 1/rate seconds for `duration` seconds (a bounded count), never
    more than max_in_flight at once: an arrival that finds all slots busy is skipped and
    reported to on_overflow, so a slow service shows up as skipped requests, not a growing
    queue in the client."""
    count = int(rate * duration)
    answers: list[Answer | None] = [None] * count
    slots = asyncio.Semaphore(max_in_flight)
    tasks: list[asyncio.Task[None]] = []
    start = time.monotonic()

    async def one(index: int) -> None:
        try:
            answers[index] = await send(index)
        finally:
            slots.release()

    for index in range(count):
        delay = start + index / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots.locked():
            if on_overflow:
                on_overflow(index)
            continue
        await slots.acquire()
        tasks.append(asyncio.create_task(one(index)))
    await asyncio.gather(*tasks)
    return answers


def percentile(values: Sequence[float], fraction: float) -> float:
    """The value below which `fraction` of values lie (nearest rank); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[rank]
