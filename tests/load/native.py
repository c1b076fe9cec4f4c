"""The faults that go through the service's native API (`/api/v1`): bearer key, sessions,
server-sent events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psutil

from tests.load.resources import alive
from tests.load.service import Service

FindKernel = Callable[[Service, str], Awaitable[psutil.Process | None]]
TAGGED_SLEEP = '''
open({tag!r}, "w").close()
print("started", flush=True)
import time
time.sleep({seconds})
print("finished")
'''


@dataclass
class Outcome:
    value: str
    met: bool | None
    evidence: str = ""


def bearer(service: Service) -> dict[str, str]:
    """Without --api-keys-file the service's one key is its --api-key."""
    return {"Authorization": f"Bearer {service.api_key}"}


async def kill_kernel_mid_run(service: Service, http: Any, find: FindKernel) -> Outcome:
    """A session's execution whose kernel is killed: state_lost, then the session works."""
    tag = f"native-{time.monotonic_ns()}"
    created = await http.post("/api/v1/sessions", json={}, headers=bearer(service))
    if created.status_code != 201:
        return Outcome(f"could not open a session: HTTP {created.status_code}", False,
                       created.text[:300])
    session = created.json()["id"]
    try:
        await http.post(f"/api/v1/sessions/{session}/execute", json={"code": "kept = 41"},
                        headers=bearer(service))
        run = asyncio.create_task(http.post(
            f"/api/v1/sessions/{session}/execute",
            json={"code": TAGGED_SLEEP.format(tag=tag, seconds=30), "timeout": 60},
            headers=bearer(service), timeout=90))
        kernel = await find(service, tag)
        if kernel is None:
            run.cancel()
            return Outcome("the session's kernel was not found", False)
        killed = time.monotonic()
        kernel.kill()
        answer = await run
        after_kill = time.monotonic() - killed
        body = answer.json() if answer.headers.get("content-type", "").startswith(
            "application/json") else {}
        nxt = await http.post(f"/api/v1/sessions/{session}/execute",
                              json={"code": "def main():\n    return {'kept': 'kept' in globals()}",
                                    "inputs": {}}, headers=bearer(service))
        next_body = nxt.json() if nxt.status_code == 200 else {}
        one_shot = await http.post("/api/v1/execute", json={
            "code": "def main(x):\n    return {'y': x + 1}", "inputs": {"x": 1}},
            headers=bearer(service))
        error = (body.get("error") or {}).get("name"), (body.get("error") or {}).get("value", "")
        met = (answer.status_code == 200 and body.get("state_lost") is True
               and body.get("error") is not None and after_kill < 15
               and ((nxt.status_code == 200 and next_body.get("result") == {"kept": False})
                    or nxt.status_code == 410)
               and one_shot.status_code == 200 and one_shot.json().get("result") == {"y": 2})
        return Outcome(
            f"HTTP {answer.status_code} {after_kill:.1f} s after the kill, state_lost "
            f"{body.get('state_lost')}, error {error[0]}: {error[1][:90]!r}; next call in the "
            f"session: HTTP {nxt.status_code} {next_body.get('result') or nxt.text[:80]}; "
            f"one-shot: HTTP {one_shot.status_code} {one_shot.json().get('result')}", met)
    finally:
        await http.delete(f"/api/v1/sessions/{session}", headers=bearer(service))


async def client_leaves_stream(service: Service, http: Any, find: FindKernel) -> Outcome:
    """Read the first SSE event of a long one-shot run, hang up; its kernel must go."""
    tag = f"sse-{time.monotonic_ns()}"
    headers = {**bearer(service), "Accept": "text/event-stream"}
    first_event = ""
    kernel = None
    async with http.stream("POST", "/api/v1/execute", headers=headers, timeout=60, json={
            "code": TAGGED_SLEEP.format(tag=tag, seconds=30), "timeout": 60}) as response:
        if response.status_code != 200:
            return Outcome(f"HTTP {response.status_code}", False, (await response.aread())[:300])
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                first_event = line.split(":", 1)[1].strip()
                kernel = await find(service, tag)
                break
    left = time.monotonic()  # leaving the block closed the connection
    if kernel is None:
        return Outcome(f"first event {first_event!r}; the run's kernel was not found", False)
    gone = None
    while time.monotonic() - left < 25:
        if not alive(kernel):
            gone = time.monotonic() - left
            break
        await asyncio.sleep(0.2)
    return Outcome(f"first event {first_event!r}, then hung up; kernel "
                   + (f"gone {gone:.1f} s later" if gone is not None else "alive after 25 s"),
                   gone is not None and gone < 10)


