"""`sandbox-kernel serve`, recording every ZMQ call that could block its event loop.

A synchronous send, receive or poll made on the thread that runs the event loop that libzmq may
hold (no zmq.DONTWAIT, a send or receive timeout other than 0, a poll timeout) stops every request
until the peer answers: that froze the service once (jupyter_client's Session.send, which sends
synchronously even on an asyncio socket, in KernelClient.kernel_info; see bench/results/load.md).
The record is written as JSON to $BLOCKING_ZMQ_RECORD as soon as one is found (uvicorn ends the
process with the signal it got, so nothing at exit would run).

Usage: python tests/blocking_zmq.py serve [flags]   (the arguments of `sandbox-kernel`)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import zmq

found: list[dict[str, Any]] = []


def _flags(position: int, timeout_option: int) -> Callable[[Any, tuple, dict], bool]:
    """Blocking unless the flags argument (at `position`, or by name) has DONTWAIT or the
    socket's timeout option (SNDTIMEO, RCVTIMEO) is 0, which makes libzmq raise EAGAIN."""
    def blocking(socket: Any, args: tuple, kwargs: dict) -> bool:
        flags = args[position] if len(args) > position else kwargs.get("flags", 0)
        return not flags & zmq.DONTWAIT and socket.getsockopt(timeout_option) != 0
    return blocking


def _timeout(socket: Any, args: tuple, kwargs: dict) -> bool:
    """Blocking unless the poll's timeout is 0."""
    timeout = args[0] if args else kwargs.get("timeout")
    return timeout != 0


def _guard(cls: type, name: str, blocking: Callable[[Any, tuple, dict], bool]) -> None:
    original = getattr(cls, name)

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if asyncio._get_running_loop() is not None and blocking(self, args, kwargs):
            found.append({"call": f"{cls.__name__}.{name}",
                          "stack": traceback.format_stack(limit=14)[:-1]})
            _write()
        return original(self, *args, **kwargs)

    setattr(cls, name, guarded)


def _write() -> None:
    with open(os.environ["BLOCKING_ZMQ_RECORD"], "w") as record:
        json.dump(found, record)


# send_multipart and recv_multipart go through these; zmq.asyncio's sockets override them all
# and call a plain socket's with DONTWAIT, which passes.
_guard(zmq.Socket, "send", _flags(1, zmq.SNDTIMEO))
_guard(zmq.Socket, "recv", _flags(0, zmq.RCVTIMEO))
_guard(zmq.Socket, "poll", _timeout)
_guard(zmq.Poller, "poll", _timeout)
_write()



async def _canary() -> None:
    """One blocking-style send on the loop (a PUB socket never waits), so the record proves
    the guard sees what it is meant to."""
    with zmq.Context() as context, context.socket(zmq.PUB) as socket:
        socket.send(b"canary")


if __name__ == "__main__":
    from sandbox_kernel.cli import main

    asyncio.run(_canary())

    sys.exit(main(sys.argv[1:]))
