"""MCP `run_python` round trips, as an agent makes them: the SDK's client over stdio.

`sandbox-kernel mcp` runs as a subprocess (as Claude Desktop or an IDE starts it); each round
trip is one tools/call of run_python with a small main() call, from the client's send to its
parsed answer. A fresh call runs on a one-shot kernel of its own (confined before the call,
gone after it); a session call runs in the kernel of one session. Both beside `Sandbox.run`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from bench import calls


async def _round_trips(count: int, warmups: int) -> dict[str, list[float]]:
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(
        command=sys.executable, args=["-m", "sandbox_kernel", "mcp", "--pool-size", "2"],
        env=dict(os.environ))
    call = {"code": calls.SMALL_CODE, "inputs": calls.SMALL_INPUTS}
    timings: dict[str, list[float]] = {"mcp.fresh": [], "mcp.session": []}
    with open(os.devnull, "w") as quiet:
        async with Client(stdio_client(params, errlog=quiet)) as client:
            opened = await client.call_tool("create_session", {})
            session = opened.structured_content["session"]
            for repetition in range(warmups + count):
                for row, arguments in (("mcp.fresh", call),
                                       ("mcp.session", {**call, "session": session})):
                    started = time.perf_counter()
                    answer = await client.call_tool("run_python", arguments)
                    elapsed = time.perf_counter() - started
                    if answer.structured_content.get("result") != calls.SMALL_RESULT:
                        raise RuntimeError(f"run_python answered {answer.content}")
                    if repetition >= warmups:
                        timings[row].append(elapsed)
                    # A fresh call's pool refills in the background: let it, as an agent's
                    # think time between calls would.
                    await asyncio.sleep(0.05)
    return timings


def round_trips(count: int, warmups: int = 2) -> dict[str, list[float]]:
    """Seconds of each fresh and session run_python round trip, by row id."""
    return asyncio.run(_round_trips(count, warmups))
