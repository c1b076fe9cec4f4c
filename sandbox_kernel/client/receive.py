"""The caller's side of a run: receive a kernel's IOPub messages within the caller's own limits.

Whatever protects the process that talks to a kernel is enforced here, on what arrives, because
user code can switch off every check inside the kernel (``sys.stdout.write_uncapped``,
``BUDGET.limit = 0``, ``session.send`` on IOPub). The kernel's own caps are a courtesy.

- **Memory while receiving**: the client's sockets refuse any frame larger than the largest
  message the limits allow (``ZMQ_MAXMSGSIZE``: libzmq drops the connection instead of
  allocating it; the run then ends with ``MessageTooLarge`` and a restarted kernel) and queue
  at most a few messages (``ZMQ_RCVHWM``), so a flood waits in the kernel, not in the caller.
  Messages of other requests are dropped before their content is parsed.
- **Output**: at most ``max_output`` bytes (UTF-8) of stream text per run, plus the kernel's
  own one-line marker; past it, one marker of the caller's says how much was dropped.
- **Result**: an ``execute_result`` over ``max_result`` bytes of JSON becomes the error
  ``ResultTooLarge``; one far over it is refused before it is parsed. Displays share that
  budget; past it they are dropped with a marker on stderr.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import monitor

from .. import jsonwire
from ..errors import MessageTooLarge
from ..policy import SandboxPolicy

MESSAGE_ROOM = 1 << 20  # a message's envelope: header, text/plain copy or summary, metadata
# An honest result message is its JSON plus a text/plain copy (only up to 256 KiB, escaped at
# most to twice that) and a small envelope: anything further past the limit is not parsed.
RESULT_ROOM = 640 * 1024
SMALL_PART = 64 * 1024  # header, parent header and metadata of every message we use fit in this
RECEIVE_QUEUE = 8  # messages libzmq may hold for the caller: memory <= this x the largest one
# The marker a kernel adds once when its own cap cut the output (sandbox_kernel.kernel.output).
CHUNK_COST = 512  # bytes of the output cap one stream message uses at least
KERNEL_MARKER = re.compile(r"\n\[sandbox-kernel: output limit of [\d,]+ bytes per execution "
                           r"reached; [\d,]+ more bytes were dropped \(--max-output raises "
                           r"the limit\)\]\n\Z")
_MARKER_ROOM = 256


@dataclass(frozen=True)
class CallerLimits:
    """What the caller accepts from one run, whatever the kernel sends (0: no limit)."""

    max_output: int = SandboxPolicy.max_output_bytes.default_value
    max_result: int = SandboxPolicy.max_result_bytes.default_value

    @classmethod
    def from_policy(cls, policy: dict[str, Any], max_output: int | None = None,
                    max_result: int | None = None) -> CallerLimits:
        """The limits of a policy (as_dict() or a kernelspec's), explicit values first."""
        default = cls()
        return cls(
            max_output=_first(max_output, policy.get("max_output_bytes"), default.max_output),
            max_result=_first(max_result, policy.get("max_result_bytes"), default.max_result))

    @property
    def max_message(self) -> int:
        """Largest frame the client's sockets accept (-1: any)."""
        if not self.max_output or not self.max_result:
            return -1
        return max(self.max_output, self.max_result) + MESSAGE_ROOM


def _first(*values: Any) -> int:
    return int(next(value for value in values if value is not None))


def bounded_context(limits: CallerLimits, context_class: type = zmq.Context) -> Any:
    """A ZMQ context whose sockets refuse oversize frames and queue only a few messages."""
    context = context_class()
    context.setsockopt(zmq.MAXMSGSIZE, limits.max_message)
    context.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
    return context


_SHARED: dict[tuple[int, type, int], Any] = {}
_SHARED_LOCK = threading.Lock()


def shared_context(limits: CallerLimits, context_class: type = zmq.Context) -> Any:
    """The bounded context every sandbox of this process with these limits shares.

    A context is an I/O thread: one per sandbox meant a thread started and joined (context
    term) for every fresh kernel, a tenth of what a one-shot request cost its caller. The
    options are the context's defaults for new sockets, the same for every sandbox of these
    limits; each sandbox closes only its own sockets. A forked child gets its own (a context
    does not survive a fork), and so does whoever closed the shared one.
    """
    key = (os.getpid(), context_class, limits.max_message)
    with _SHARED_LOCK:
        context = _SHARED.get(key)
        if context is None or context.closed:
            context = _SHARED[key] = bounded_context(limits, context_class)
        return context


_MONITORS = itertools.count()


def watch_connection(socket: Any) -> Any:
    """A monitor socket that reports when this socket's connection drops or is tried again.

    Its inproc address is unique in the process: pyzmq's default names it after the socket's
    file descriptor, which a later socket of the shared context reuses (see shared_context).
    """
    return socket.get_monitor_socket(
        zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CONNECT_RETRIED,
        addr=f"inproc://sandbox-kernel-monitor-{os.getpid()}-{next(_MONITORS)}")


class Refusals:
    """Whether libzmq refused a frame past the size limit, told from the connection's events.

    libzmq drops a connection that brings a frame over MAXMSGSIZE and does not try it again. A
    kernel that closed its sockets (or is dying) drops the connection too, but then libzmq tries
    to connect again (within the context's RECONNECT_IVL): a drop alone proves nothing.
    """

    def __init__(self) -> None:
        self.dropped = False
        self.reconnecting = False

    def note(self, event_frames: list[bytes]) -> None:
        """Take one event from the monitor socket."""
        if monitor.parse_monitor_message(event_frames)["event"] == zmq.EVENT_DISCONNECTED:
            self.dropped = True
        elif self.dropped:
            self.reconnecting = True

    @property
    def refused(self) -> bool:
        """Dropped, and (so far) not tried again."""
        return self.dropped and not self.reconnecting


def oversize_error(limits: CallerLimits) -> tuple[str, str]:
    """The error of a run whose kernel sent a frame the sockets refused."""
    return (MessageTooLarge.code,
            f"the kernel sent a message larger than the caller accepts "
            f"({limits.max_message:,} bytes: --max-result or --max-output plus "
            f"{MESSAGE_ROOM:,}); the connection refused it")


@dataclass
class Budget:
    """What one run may still deliver to the caller, and what was dropped."""

    limits: CallerLimits
    output_used: int = 0
    output_dropped: int = 0
    output_received: int = 0  # bytes of stream text that arrived, before the cap
    kernel_marker_seen: bool = False
    rich_used: int = 0
    displays_dropped: int = 0
    notes: list[str] = field(default_factory=list)

    def take_output(self, text: str) -> str:
        """The part of a stream chunk that still fits (the kernel's own marker passes once)."""
        data = text.encode("utf-8", "surrogatepass")
        self.output_received += len(data)
        limit = self.limits.max_output
        if not limit:
            return text
        room = max(limit - self.output_used, 0)
        if len(data) <= room:
            # A message costs the caller ~550 bytes whatever it carries: 1-byte messages
            # count as CHUNK_COST, so the cap bounds memory, not just text.
            self.output_used += max(len(data), CHUNK_COST)
            return text
        kept = data[:room].decode("utf-8", "ignore")  # never half a character
        self.output_used += len(kept.encode("utf-8", "surrogatepass"))
        rest = text[len(kept):]
        marker = KERNEL_MARKER.search(rest) if not self.kernel_marker_seen else None
        if marker and len(marker.group()) <= _MARKER_ROOM:
            self.kernel_marker_seen = True
            rest = rest[:marker.start()]
            kept += marker.group()
        self.output_dropped += len(rest.encode("utf-8", "surrogatepass"))
        return kept

    def output_marker(self) -> str | None:
        """The caller's marker for output it dropped, if it dropped any."""
        if not self.output_dropped:
            return None
        return (f"\n[sandbox-kernel client: output limit of {self.limits.max_output:,} bytes "
                f"per run reached; {self.output_dropped:,} more bytes were dropped "
                "(--max-output, or Sandbox(max_output=...), raises the limit)]\n")

    def take_display(self, size: int) -> bool:
        """Whether a display of this many bytes still fits the rich-output budget."""
        limit = self.limits.max_result
        if limit and self.rich_used + size > limit:
            self.displays_dropped += 1
            return False
        self.rich_used += size
        return True

    def display_marker(self) -> str | None:
        """The caller's marker for displays it dropped, if it dropped any."""
        if not self.displays_dropped:
            return None
        return (f"\n[sandbox-kernel client: {self.displays_dropped:,} displays dropped: "
                f"displays and the result may carry {self.limits.max_result:,} bytes per run "
                "(--max-result raises the limit)]\n")

    def result_problem(self, frame_size: int, parsed: Any = None) -> str | None:
        """Why a result of this content size (and, near the limit, this value) is refused."""
        limit = self.limits.max_result
        if not limit or frame_size <= limit:
            return None
        if parsed is None:  # far over: refused without parsing
            return self._too_large(f"a {frame_size:,}-byte result message")
        return self.json_problem(len(jsonwire.dumps(parsed)))

    def json_problem(self, size: int) -> str | None:
        """Why a result of this many bytes of JSON is refused, if it is."""
        limit = self.limits.max_result
        return self._too_large(f"{size:,} bytes of JSON") if limit and size > limit else None

    def _too_large(self, what: str) -> str:
        return (f"the kernel sent {what}, more than the caller's result limit of "
                f"{self.limits.max_result:,} bytes (--max-result, or Sandbox(max_result=...), "
                "raises it)")

    def near_limit(self, frame_size: int) -> bool:
        """Whether a result frame is worth parsing to measure it exactly."""
        limit = self.limits.max_result
        return not limit or frame_size <= limit + RESULT_ROOM


def unpack_frames(session: Any, frames: list[Any], msg_id: str) -> dict[str, Any] | None:
    """The message in these frames if it answers msg_id (content still packed), else None.

    Frames of other requests, unsigned or forged ones, and ones whose small parts are not small
    are dropped without their content being parsed.
    """
    try:
        _idents, parts = session.feed_identities(frames, copy=False)
    except ValueError:  # not a Jupyter message at all
        return None
    if len(parts) < 5 or any(len(part) > SMALL_PART for part in parts[1:4]):
        return None
    try:
        msg = session.deserialize(parts, content=False, copy=False)
    except (ValueError, TypeError, KeyError):
        return None
    if msg.get("parent_header", {}).get("msg_id") != msg_id:
        return None
    content = msg["content"]
    msg["content_size"] = len(content)
    return msg
