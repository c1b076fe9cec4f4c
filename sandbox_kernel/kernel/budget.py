"""The per-execution output cap: a print flood cannot swamp the frontend or the caller.

One budget per process, spent by whatever carries user code's output (kernel/output.py's
streams in a ZMQ kernel, kernel/oneshot.py's in a one-shot) and reset by the runner for each
execution (kernel/runner.py). Imports nothing of Jupyter's.
"""

from __future__ import annotations

import threading


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
