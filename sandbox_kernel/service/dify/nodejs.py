"""`nodejs` on the dify route: forwarded to a dify-sandbox the operator keeps, or refused clearly.

This service runs Python only. Dify's executor shows any answer but a 200 as "likely a network
issue", and a 200 whose envelope code is not 0 as its message: so without an upstream the answer
is a 200 with code -400 and a message naming --nodejs-upstream. With one, the request goes on
unchanged (its body and X-Api-Key) and the upstream's answer comes back as it is, its size
bounded by the service's output cap.
"""

from __future__ import annotations

import logging

import httpx
from fastapi import Request
from starlette.responses import Response

from ..access import json_line
from ..core import Service
from .gin import error_answer

log = logging.getLogger("sandbox_kernel.service")

NO_NODEJS = ("nodejs is not available: sandbox-kernel runs python3 only. To run JavaScript code "
             "nodes, keep a dify-sandbox for them and start sandbox-kernel serve with "
             "--nodejs-upstream URL (or SANDBOX_NODEJS_UPSTREAM)")
CONNECT_TIMEOUT = 10.0  # seconds to reach the upstream
_KEPT_HEADERS = ("content-type",)  # of the upstream's answer; the rest is ours (length, date)


async def run_nodejs(request: Request, service: Service) -> Response:
    """The answer to a `nodejs` run: the upstream's, or a -400 Dify shows as the node's error."""
    upstream = service.config.nodejs_upstream
    if not upstream:
        service.metrics.denials.labels(reason="bad_input").inc()
        return error_answer(200, -400, NO_NODEJS)
    url = upstream.rstrip("/") + "/v1/sandbox/run"
    headers = {name: value for name, value in request.headers.items()
               if name in ("x-api-key", "content-type")}
    # The upstream's own WORKER_TIMEOUT ends the run; ours plus a grace bounds the wait.
    timeout = httpx.Timeout(service.config.worker_timeout + service.config.kernel_grace + 30,
                            connect=CONNECT_TIMEOUT)
    try:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client, \
                client.stream("POST", url, content=await request.body(),
                              headers=headers) as answer:
            body = await _bounded(answer, service.config.max_output_total)
    except httpx.HTTPError as exc:
        log.error(json_line(event="nodejs_upstream_failed", upstream=upstream, error=repr(exc)))
        return error_answer(200, -500, f"the nodejs upstream {upstream} could not answer: "
                                       f"{type(exc).__name__}; check --nodejs-upstream")
    if body is None:
        return error_answer(200, -500, "the nodejs upstream's answer was larger than "
                                       "--max-output-total")
    return Response(body, status_code=answer.status_code,
                    headers={name: answer.headers[name] for name in _KEPT_HEADERS
                             if name in answer.headers})


async def _bounded(answer: httpx.Response, limit: int) -> bytes | None:
    """The answer's body, or None once it passes limit bytes (read no further)."""
    body = bytearray()
    async for chunk in answer.aiter_bytes():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
