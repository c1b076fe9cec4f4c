"""The check of a main() result the caller keeps as JSON bytes, in place or in a process of its own.

`raw_result` checks an execute_result's content (well-formed UTF-8 JSON, the result one object)
with msgspec, which skips a value without making Python objects of it: a 13 MB result of nested
empty lists takes ~70 ms and its own size in memory, against seconds and ~30 times its size
parsed. msgspec holds the GIL all that while, so on a service's event loop every other request
(its /health too) waits as long. Over CHECK_ELSEWHERE bytes the caller runs the same check in a
child process (`check_elsewhere`): the child says where the values lie in the content, and the
caller slices its own copy. The verdict is the same function's either way.

The child is `python -I -m sandbox_kernel.resultcheck`: the content on stdin, one JSON line
out. It imports nothing of the project but this module.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import msgspec

CHECK_ELSEWHERE = 1 << 20  # bytes of content past which the check leaves the event loop
CHECK_TIMEOUT = 60.0  # seconds the child may take (13 MB: ~0.1 s)
_KEYS = ("application/json", "text/plain")


class _ResultContent(msgspec.Struct):
    """What is read of an execute_result's content: each data value left unparsed."""

    data: dict[str, msgspec.Raw]


_RESULT_DECODER = msgspec.json.Decoder(_ResultContent)


def raw_result(content: bytes | memoryview) -> tuple[bytes | None, Any]:
    """An execute_result's (application/json as bytes, text/plain), never building the result.

    Raises ValueError for content that is not such a message.
    """
    data = _values(content)
    return _result_of(*(data.get(key) for key in _KEYS))


def _values(content: bytes | memoryview) -> dict[str, msgspec.Raw]:
    try:
        return _RESULT_DECODER.decode(content).data
    except msgspec.DecodeError as exc:
        raise ValueError(f"the kernel's result message is not valid: {exc}") from None


def _result_of(raw: Any, text: Any) -> tuple[bytes | None, Any]:
    """raw_result's answer from the checked JSON of application/json and text/plain."""
    if raw is not None and not bytes(raw).lstrip(b" \t\r\n").startswith(b"{"):
        raw = None  # a main() result is an object; anything else is no result
    return (None if raw is None else bytes(raw),
            None if text is None else msgspec.json.decode(text))


async def check_elsewhere(content: bytes) -> tuple[bytes | None, Any]:
    """raw_result(content), its check run in a child process; ValueError as raw_result's.
    A host that cannot start the child (no process or descriptor left) gets the check in
    place: the loop waits, the result is not lost."""
    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-m", __name__, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    except OSError:
        return raw_result(content)
    try:
        out, _ = await asyncio.wait_for(child.communicate(content), CHECK_TIMEOUT)
    except asyncio.TimeoutError:
        raise ValueError(f"the check of a {len(content):,}-byte result took more than "
                         f"{CHECK_TIMEOUT:g} s") from None
    finally:
        if child.returncode is None:  # timed out, or this caller was cancelled
            child.kill()
            await asyncio.shield(child.wait())
    try:
        answer = json.loads(out)
        refused, spans = answer.get("error"), [answer.get(key) for key in _KEYS]
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"the result check failed (exit code {child.returncode}): "
                         f"{exc}") from None
    if refused is not None:
        raise ValueError(str(refused))
    return _result_of(*(None if span is None else content[span[0]:span[1]] for span in spans))


async def checked_elsewhere(content: bytes | memoryview) -> Any:
    """check_elsewhere's outcome as a collector takes it (collect.py): the tuple, or the
    ValueError that refuses the result."""
    try:
        return await check_elsewhere(bytes(content))
    except ValueError as exc:
        return exc


def _spans(content: bytes) -> dict[str, Any]:
    """In the child: where each checked value lies in content (the first run of its bytes:
    any run of the same bytes is the same value), or why the content is refused."""
    try:
        data = _values(content)
    except ValueError as exc:
        return {"error": str(exc)}
    spans: dict[str, Any] = {}
    for key in _KEYS:
        value = data.get(key)
        if value is None:
            spans[key] = None
        else:
            start = content.find(bytes(value))
            spans[key] = [start, start + len(value)]
    return spans


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_spans(sys.stdin.buffer.read())) + "\n")
