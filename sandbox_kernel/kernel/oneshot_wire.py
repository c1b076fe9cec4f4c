"""The one-shot kernel's socket: records, each a kind byte and a payload, in both directions.

One unix stream connection carries a one-shot run: the caller's request (an `execute_request`
as the frames Session.serialize makes), then the process's records: its pid (with a pidfd, so
the caller can kill exactly this process), every Jupyter message it sends (the same frames a
ZMQ kernel puts on IOPub and shell), the files the run wrote if the request asked, and `done`.
During the run the caller may write one more kind: the answers to the run's tool calls.
A length prefix frames each record: no delimiter scanning, and a reader refuses a record larger
than it takes before reading it.

Imported by the one-shot process (kernel/oneshot.py) and by its callers (launch/oneshot.py):
it imports nothing heavy.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

HEADER = struct.Struct("!IB")  # payload length, kind
_LENGTH = struct.Struct("!I")

REQUEST = ord("r")  # caller -> process: the execute_request's frames
PID = ord("p")  # process -> caller: its pid (ASCII), with its pidfd
MESSAGE = ord("m")  # process -> caller: one Jupyter message's frames
REFUSED = ord("e")  # process -> caller: why it cannot run the request (UTF-8 text)
FILES = ord("f")  # process -> caller: the files the run wrote, if asked (JSON), before done
DONE = ord("d")  # process -> caller: the reply was the last message; it exits now
# caller -> process, during the run: the answer to a tool call (a `sandbox_tool_request` the
# process sent as a message record), as the frames of a `sandbox_tool_reply` (kernel/tools.py)
TOOL_REPLY = ord("a")

MAX_REQUEST = 256 * 2**20  # the largest request a one-shot process reads


class WireError(ValueError):
    """A record that is not well formed, or larger than the reader takes."""


def record(kind: int, payload: bytes = b"") -> bytes:
    """One record, ready to write."""
    return HEADER.pack(len(payload), kind) + payload


def pack_frames(frames: Sequence[bytes | memoryview]) -> bytes:
    """A message's frames as one payload: their count, then each with its length."""
    parts = [_LENGTH.pack(len(frames))]
    for frame in frames:
        data = bytes(frame) if not isinstance(frame, bytes) else frame
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


def unpack_frames(payload: bytes | memoryview) -> list[memoryview]:
    """The frames of a payload made by pack_frames (views into it, not copies)."""
    view = memoryview(payload)
    try:
        (count,), offset = _LENGTH.unpack_from(view, 0), _LENGTH.size
        frames = []
        for _ in range(count):
            (size,) = _LENGTH.unpack_from(view, offset)
            offset += _LENGTH.size
            if offset + size > len(view):
                raise WireError("a frame runs past the end of its record")
            frames.append(view[offset:offset + size])
            offset += size
    except struct.error as exc:
        raise WireError(f"a message record is cut short: {exc}") from None
    if offset != len(view):
        raise WireError("a message record has bytes after its last frame")
    return frames


class Records:
    """Splits a byte stream into records; refuses one larger than `limit` bytes (0: any).

    drop_larger: kinds whose records above a size of their own are dropped as they arrive
    (never kept whole, never yielded), not refused; `dropped` lists each as (kind, size).
    """

    def __init__(self, limit: int = 0, drop_larger: dict[int, int] | None = None) -> None:
        self.limit = limit
        self.drop_larger = drop_larger or {}
        self.dropped: list[tuple[int, int]] = []
        self.buffer = bytearray()
        self.skipping = 0  # bytes of a dropped record still to come

    def unfinished(self) -> str:
        """A record begun but not complete, said in words ("" when none is)."""
        if self.skipping:
            return f"a record said to be of {self.dropped[-1][1]:,} bytes"
        if len(self.buffer) >= HEADER.size:
            return f"a record said to be of {HEADER.unpack_from(self.buffer, 0)[0]:,} bytes"
        return f"a record's {len(self.buffer)}-byte header" if self.buffer else ""

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        """Take data; yield each record it completes, as (kind, payload)."""
        if self.skipping:
            skipped = min(self.skipping, len(data))
            self.skipping -= skipped
            data = data[skipped:]
        self.buffer += data
        while len(self.buffer) >= HEADER.size:
            size, kind = HEADER.unpack_from(self.buffer, 0)
            if kind in self.drop_larger and size > self.drop_larger[kind]:
                self.dropped.append((kind, size))
                end = HEADER.size + size
                self.skipping = max(0, end - len(self.buffer))
                del self.buffer[:end]
                continue
            if self.limit and size > self.limit:
                raise WireError(f"a record of {size:,} bytes is larger than the "
                                f"{self.limit:,} this reader takes")
            end = HEADER.size + size
            if len(self.buffer) < end:
                return
            payload = bytes(self.buffer[HEADER.size:end])
            del self.buffer[:end]
            yield kind, payload
