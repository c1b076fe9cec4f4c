"""The kernel's log on its way to the launcher: bounded lines, a rate limit, a writer thread.

The reaper reads what the kernel writes to its fds 1 and 2 (a pipe) and relays it here; the
audit records of denied calls go out through the same LauncherLog. Nothing here may let the
kernel make the reaper, which runs unconfined, do unbounded work or write unbounded output.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import unicodedata

LOG_LINE_LIMIT = 2048  # bytes of one relayed log line; the rest is cut
LOG_BURST = 64 * 1024  # bytes the kernel may log at once ...
LOG_RATE = 8 * 1024  # ... and per second after that
_WRITER_QUEUE = 512  # lines waiting for a slow launcher; beyond it lines are dropped
AUDIT_PREFIX = b"sandbox-kernel audit:"


class LauncherLog:
    """Lines to the launcher's stderr from a thread, so a stalled reader never stalls us."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lines: queue.Queue[bytes | None] = queue.Queue(_WRITER_QUEUE)
        self.dropped = 0
        self.thread = threading.Thread(target=self._write_all, daemon=True)
        self.thread.start()

    def write(self, line: bytes) -> None:
        """Queue one line (ending in a newline), or count it as dropped when the queue is full."""
        try:
            self.lines.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def _write_all(self) -> None:
        while (line := self.lines.get()) is not None:
            try:
                os.write(self.fd, line)
            except OSError:
                pass  # the launcher closed its stderr: nobody to tell

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (waiting at most timeout seconds), then stop."""
        if self.dropped:
            self.write(f"sandbox-kernel: {self.dropped} log lines dropped (launcher too "
                       "slow)\n".encode())
        try:
            self.lines.put(None, timeout=timeout)
        except queue.Full:
            return
        self.thread.join(timeout)


class TokenBucket:
    """At most `burst` units at once and `rate` per second after that."""

    def __init__(self, burst: float, rate: float) -> None:
        self.burst, self.rate = burst, rate
        self.tokens, self.stamp = burst, time.monotonic()

    def take(self, amount: float = 1) -> bool:
        """Spend amount units if there are enough; False (and nothing spent) otherwise."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < amount:
            return False
        self.tokens -= amount
        return True


class LogRelay:
    """The kernel's own log, line by line, bounded in line length and in rate."""

    def __init__(self, out: LauncherLog) -> None:
        self.out = out
        self.pending = b""
        self.budget = TokenBucket(LOG_BURST, LOG_RATE)
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        """Relay the complete lines in data; keep a partial one for later."""
        self.pending += data
        while True:
            end = self.pending.find(b"\n")
            if 0 <= end <= LOG_LINE_LIMIT:
                line, self.pending = self.pending[:end], self.pending[end + 1:]
            elif len(self.pending) > LOG_LINE_LIMIT:
                line = self.pending[:LOG_LINE_LIMIT] + b" [cut]"
                self.pending = self.pending[LOG_LINE_LIMIT:]
            else:
                return
            self._relay(line)

    def flush(self) -> None:
        """Relay a last partial line (the kernel is gone)."""
        if self.pending:
            self._relay(self.pending)
            self.pending = b""
        if self.dropped:
            self.out.write(f"sandbox-kernel: {self.dropped} bytes of kernel log dropped "
                           "(rate limit)\n".encode())
            self.dropped = 0

    def _relay(self, line: bytes) -> None:
        if not self.budget.take(len(line) + 1):
            self.dropped += len(line) + 1
            return
        if self.dropped:
            self.out.write(f"sandbox-kernel: {self.dropped} bytes of kernel log dropped "
                           "(rate limit)\n".encode())
            self.dropped = 0
        if line.startswith(AUDIT_PREFIX):  # only the reaper writes audit lines
            line = b"(from the kernel) " + line
        self.out.write(printable(line) + b"\n")


def printable(line: bytes) -> bytes:
    """line with control characters shown as '?': no escape sequences reach the terminal."""
    text = line.decode("utf-8", errors="replace")
    return "".join(c if c == "\t" or unicodedata.category(c) != "Cc" else "?"
                   for c in text).encode()
