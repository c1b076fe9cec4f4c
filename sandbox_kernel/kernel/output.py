"""The per-execution output cap: a print flood cannot swamp the frontend or the caller."""

from __future__ import annotations

import threading
from typing import Any

from ipykernel.iostream import OutStream


class OutputBudget:
    """Bytes of stream output one execution may still send, shared by stdout and stderr."""

    def __init__(self) -> None:
        self.limit = 0  # 0: no cap
        self.used = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def reset(self, limit: int) -> None:
        """Start a new execution with this cap."""
        with self._lock:
            self.limit, self.used, self.dropped = limit, 0, 0

    def take(self, text: str) -> str:
        """The part of text that still fits; what does not fit is counted as dropped."""
        if not self.limit:
            return text
        data = text.encode("utf-8", "surrogatepass")
        with self._lock:
            room = max(self.limit - self.used, 0)
            kept = data[:room]
            self.used += len(kept)
            self.dropped += len(data) - len(kept)
        return kept.decode("utf-8", "ignore")  # never split a character in two

    def marker(self) -> str | None:
        """The one line that says how much was dropped, if anything was."""
        if not self.dropped:
            return None
        return (f"\n[sandbox-kernel: output limit of {self.limit:,} bytes per execution reached; "
                f"{self.dropped:,} more bytes were dropped (--max-output raises the limit)]\n")


BUDGET = OutputBudget()


class _LastWriter:
    """The stream written to last, so that a switch of streams keeps the order of writes."""

    stream: OutStream | None = None


class CappedOutStream(OutStream):
    """ipykernel's OutStream, spending the shared budget on every write, in write order.

    ipykernel gives stdout and stderr a buffer each, and each sends its buffer on its own timer:
    a print, a log line and a print went out as "print print" then "log". So when the code
    switches streams, the other stream's pending text is sent first (flush() waits until the
    IOPub thread has sent it); runs of writes to one stream stay batched.
    """

    def write(self, string: str) -> Any:
        """Write what the output budget still allows, the other stream's pending text first."""
        kept = BUDGET.take(string) if isinstance(string, str) else string
        if kept:
            self._send_the_other_stream_first()
            super().write(kept)
        return len(string) if isinstance(string, str) else None

    def flush(self) -> None:
        """Flush, unless nothing was written since the last flush.

        ipykernel flushes both streams several times per execution, and each flush waits for
        a round trip through the IOPub thread: with nothing pending that is pure cost (about a
        tenth of a warm main() call's CPU). Messages already queued keep their IOPub order.
        """
        if self._flush_pending or self._subprocess_flush_pending:
            super().flush()

    def _send_the_other_stream_first(self) -> None:
        previous, _LastWriter.stream = _LastWriter.stream, self
        if previous is not None and previous is not self and previous._flush_pending \
                and not previous.closed:
            previous.flush()

    def write_uncapped(self, string: str) -> None:
        """Write past the cap (for the sandbox's own marker)."""
        super().write(string)
