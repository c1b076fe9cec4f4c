"""The kernel's log on its way to the launcher: bounded lines, a rate limit, a writer thread.

The reaper reads what the kernel writes to its fds 1 and 2 (a pipe) and relays it here; the
audit records of denied calls go out through the same LauncherLog. Nothing here may let the
kernel make the reaper, which runs unconfined, do unbounded work or write unbounded output.

Nor forge the launcher's own lines: the launcher's stderr is often a log that others read
(the service's JSON lines, a notebook server's log, the reaper's audit lines). Every line the
kernel wrote starts with KERNEL_MARK and the kernel's id, which no line of ours starts with, and
every character that is not printable (controls, tabs, invisible format characters such as
U+200B or U+2066, line separators, bytes that are not UTF-8) is shown escaped, so a line can
neither hide its mark nor pass for two lines in a terminal or a log viewer.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import Protocol

LOG_LINE_LIMIT = 2048  # bytes of one relayed log line; the rest is cut
LOG_BURST = 64 * 1024  # bytes the kernel may log at once ...
LOG_RATE = 8 * 1024  # ... and per second after that
_WRITER_QUEUE = 512  # lines waiting for a slow launcher; beyond it lines are dropped
KERNEL_MARK = "[kernel "  # "[kernel <id>] <what it wrote>": no launcher line starts so
ESCAPED_GROWTH = 4  # an escaped byte is at most 4 bytes shown ("\\x1b"; "\\u200b" for 3 in)


class LineSink(Protocol):
    """Where relayed lines go (a LauncherLog)."""

    def write(self, line: bytes) -> None:
        """Send one line on (or drop it when the sink is full)."""


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
    """At most `burst` units at once and `rate` per second after that (per second of `clock`:
    the monotonic one, or another, such as a process's CPU time)."""

    def __init__(self, burst: float, rate: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.rate, self.clock = burst, rate, clock
        self.tokens, self.stamp = burst, clock()

    def available(self) -> float:
        """The units that could be spent now."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.tokens

    def take(self, amount: float = 1) -> bool:
        """Spend amount units if there are enough; False (and nothing spent) otherwise."""
        if self.available() < amount:
            return False
        self.tokens -= amount
        return True

    def spend(self, amount: float) -> None:
        """Spend amount units already used, going into debt if need be (paid back first)."""
        self.tokens -= amount


class LogRelay:
    """The kernel's own log, line by line, bounded in line length and in rate.

    Bounded in the reaper's work too (it runs unconfined): each byte is searched once by
    bytes.find, at most one line per read is refused, and once the budget cannot pay for a line
    the rest of that read is counted as dropped in one step, so a flood of empty lines costs
    per read, not per line. What reaches the launcher is charged as written: the marks, the
    replacement characters and every "dropped" notice (only the last one, at the end, is free).
    """

    def __init__(self, out: LineSink, budget: TokenBucket | None = None,
                 kernel: str = "") -> None:
        self.out = out
        self.mark = kernel_mark(kernel)
        self.budget = budget or TokenBucket(LOG_BURST, LOG_RATE)
        self.pending = bytearray()  # the start of an unfinished line, at most LOG_LINE_LIMIT
        self.skipping = False  # inside a line whose start was dropped: drop up to its end
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        """Relay the complete lines in data; keep a partial one for later."""
        start = self._skip(data)
        while start < len(data):
            room = LOG_LINE_LIMIT - len(self.pending)
            end = data.find(b"\n", start, start + room + 1)
            if end >= 0:
                line, cut, start = self._take_line(data[start:end]), False, end + 1
            elif len(data) - start <= room:  # unfinished: wait for the rest
                self.pending += data[start:]
                return
            else:  # too long: cut here, the rest follows as another line
                line, cut, start = self._take_line(data[start:start + room]), True, start + room
            if not self._relay(line, cut):
                self.dropped += len(data) - start
                self.skipping = start < len(data) and not data.endswith(b"\n")
                return

    def _skip(self, data: bytes) -> int:
        """Where the next line starts in data, after the end of a line being dropped."""
        if not self.skipping:
            return 0
        end = data.find(b"\n")
        if end < 0:
            self.dropped += len(data)
            return len(data)
        self.skipping = False
        self.dropped += end + 1
        return end + 1

    def _take_line(self, tail: bytes) -> bytes:
        line = bytes(self.pending) + tail
        self.pending.clear()
        return line

    def flush(self) -> None:
        """Relay a last partial line (the kernel is gone), then say what was dropped."""
        if self.pending:
            self._relay(self._take_line(b""), cut=False)
        if self.dropped:
            self.out.write(self._notice())
            self.dropped = 0

    def _notice(self) -> bytes:
        return f"sandbox-kernel: {self.dropped} bytes of kernel log dropped (rate limit)\n".encode()

    def _relay(self, line: bytes, cut: bool) -> bool:
        """Write one line, with the notice of what was dropped before it, if the budget pays."""
        notice = self._notice() if self.dropped else b""
        end = b" [cut]\n" if cut else b"\n"
        # Shown, a line grows at most ESCAPED_GROWTH times: a line the budget could not pay for
        # at that size is dropped before any work is spent on showing it, and one it can pay
        # for is charged what it costs.
        largest = ESCAPED_GROWTH * len(line)
        if self.budget.available() < len(notice) + len(self.mark) + largest + len(end):
            self.dropped += len(line) + (0 if cut else 1)
            return False
        shown = self.mark + printable(line) + end
        self.budget.take(len(notice) + len(shown))
        if notice:
            self.out.write(notice)
            self.dropped = 0
        self.out.write(shown)
        return True


def kernel_mark(kernel: str) -> bytes:
    """The start of every line the kernel wrote: its id, itself shown printable and bounded."""
    return f"{KERNEL_MARK}{escaped(kernel[:128]) or '?'}] ".encode()


def printable(line: bytes) -> bytes:
    """line as UTF-8 text whose every character is printable; the others shown escaped.

    Invalid bytes become \\xNN, and controls (tab and escape sequences included), invisible
    format characters, separators other than the space and unassigned code points become
    Python-style escapes. decode, isprintable and the regular expression are C loops: the
    reaper's cost per byte stays far below the kernel's cost of writing it.
    """
    return escaped(line.decode("utf-8", errors="backslashreplace")).encode()


_UNSAFE = re.compile(r"[^\x20-\x7e]+")


def escaped(text: str) -> str:
    """text with each character str.isprintable refuses shown as a Python escape."""
    if text.isprintable():
        return text
    return _UNSAFE.sub(_escape_run, text)


def _escape_run(match: re.Match[str]) -> str:
    return "".join(char if char.isprintable() else _escape(char) for char in match.group())


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class PrintableFormatter(logging.Formatter):
    """A log formatter whose messages show non-printable characters escaped.

    For the launchers' own logs (the service's, the MCP server's), whose messages may carry
    text from user code (a file name, an error's text): one message stays one line.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The record formatted, its message escaped."""
        record.message = escaped(record.message)
        return super().formatMessage(record)
