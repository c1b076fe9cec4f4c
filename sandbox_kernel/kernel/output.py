"""The ZMQ kernel's output streams: ipykernel's OutStream, spending the output cap (budget.py)."""

from __future__ import annotations

from typing import Any

from ipykernel.iostream import OutStream

from .budget import BUDGET


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
