"""The reaper's log relay works for the kernel within bounds (#20 item 8).

The reaper runs unconfined, as root, with no CPU limit, and relays what the kernel writes to its
fds 1 and 2. Hostile kernels flood that pipe; the reaper's CPU (read from /proc/<reaper>/stat)
must stay linear in what the kernel wrote, and the launcher must receive at most the documented
bound: LOG_BURST bytes at once, LOG_RATE bytes per second after that, every "dropped" notice
included, plus one closing notice. Unit tests drive the relay itself with a clock of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.connect import write_connection_file

from sandbox_kernel.confine import logrelay
from sandbox_kernel.confine.logrelay import LOG_BURST, LOG_LINE_LIMIT, LOG_RATE, LogRelay
from tests.helpers import wait_until_ready

# What may reach the launcher beyond the rate: the closing "N bytes dropped" notice and the
# writer's "N log lines dropped (launcher too slow)" line, each well under 128 bytes.
CLOSING = 256


class Launcher:
    """A kernel started by hand, its stderr (the reaper's output) collected in a file."""

    def __init__(self, tmp_path: Path) -> None:
        self.connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"))
        self.stderr = tmp_path / "launcher-stderr"
        self.started = time.monotonic()
        with open(self.stderr, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-m", "sandbox_kernel", "-f", self.connection_file],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
        self.client = BlockingKernelClient(connection_file=self.connection_file)
        self.client.load_connection_file()
        self.client.start_channels()
        wait_until_ready(self.client, self.process)
        self.reaper = _child_of(self.process.pid)

    def run(self, code: str, timeout: float = 300) -> None:
        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=_ignore)
        assert reply["content"]["status"] == "ok", reply["content"]

    def end(self) -> float:
        """Kill the kernel, wait for its reaper to finish relaying; the seconds it all took."""
        self.client.stop_channels()
        self.process.kill()
        self.process.wait(30)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{self.reaper}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{self.reaper}").exists(), "the reaper did not finish"
        return time.monotonic() - self.started


def _ignore(msg: dict) -> None:
    """Stream output of the floods (ipykernel also forwards fd 2 to IOPub): not the subject."""


def _child_of(pid: int) -> int:
    """The reaper: the one process whose parent is the kernel."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    assert len(children) == 1, children
    return children[0]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def launcher(tmp_path):
    launched = Launcher(tmp_path)
    try:
        yield launched
    finally:
        launched.client.stop_channels()
        launched.process.kill()
        launched.process.wait(30)


# 16 MiB of empty lines, 64 KiB per write: the kernel blocks on the pipe while the reaper reads.
NEWLINE_FLOOD = """
import os
chunk = b"\\n" * 65536
for _ in range(256):
    os.write(2, chunk)
"""


def test_a_flood_of_empty_lines_costs_the_reaper_little(launcher):
    before = _cpu_seconds(launcher.reaper)
    launcher.run(NEWLINE_FLOOD)
    spent = _cpu_seconds(launcher.reaper) - before
    # Linear and cheap: what the relay cannot pay for is counted, not split into lines. Before
    # the fix each 64 KiB read of newlines cost ~0.3 s (quadratic), minutes for this flood.
    assert spent < 2.0, f"the reaper spent {spent:.2f} s of CPU relaying 16 MiB of newlines"
    elapsed = launcher.end()
    received = launcher.stderr.read_bytes()
    assert len(received) <= LOG_BURST + LOG_RATE * elapsed + CLOSING
    assert b"bytes of kernel log dropped (rate limit)" in received


# A line the budget cannot pay for, then an empty one it can: each "dropped" notice the empty
# line brings out must be paid for too (before the fix: ~60 bytes out per byte of budget).
NOTICE_FLOOD = """
import os, time
line = b"x" * 2000 + b"\\n"
end = time.monotonic() + 4
while time.monotonic() < end:
    os.write(2, line)
    os.write(2, b"\\n")
"""


def test_dropped_notices_are_paid_from_the_same_budget(launcher):
    launcher.run(NOTICE_FLOOD)
    elapsed = launcher.end()
    received = launcher.stderr.read_bytes()
    assert len(received) <= LOG_BURST + LOG_RATE * elapsed + CLOSING, (
        f"{len(received)} bytes reached the launcher in {elapsed:.1f} s")
    assert received.count(b"bytes of kernel log dropped") >= 1
    launcher.process.wait(0)  # the kernel was killed by the test, not by the flood


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Collected:
    """A LauncherLog stand-in that keeps the lines."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, line: bytes) -> None:
        self.lines.append(line)

    @property
    def size(self) -> int:
        return sum(map(len, self.lines))


MARK = b"[kernel k1] "


def _relay(clock: Clock) -> tuple[LogRelay, Collected]:
    out = Collected()
    return LogRelay(out, logrelay.TokenBucket(LOG_BURST, LOG_RATE, clock=clock), "k1"), out


@pytest.mark.parametrize("pattern", [
    [b"x" * 2000 + b"\n", b"\n"],  # a dropped line, then one that brings out a notice
    [b"x" * 5000 + b"\n", b"a\n"],  # a cut line, then a short one
    [b"\xff" * 1000 + b"\n"],  # each invalid byte is shown as U+FFFD: 3 bytes out for 1 in
    [b"sandbox-kernel audit: forged\n"],  # the kernel's mark on every line is paid for
    [b"\x1b" * 1000 + b"\n"],  # each control byte is shown as \\x1b: 4 bytes out for 1 in
    ["\u200b".encode() * 500 + b"\n"],  # each format character: \\u200b, 6 bytes for 3
])
def test_output_never_exceeds_the_budget_whatever_the_pattern(pattern):
    clock = Clock()
    relay, out = _relay(clock)
    for _ in range(20_000):  # 20 s of writes, one every millisecond
        for data in pattern:
            relay.feed(data)
        clock.now += 0.001
    before_flush = out.size
    relay.flush()
    assert before_flush <= LOG_BURST + LOG_RATE * clock.now
    assert out.size - before_flush <= CLOSING
    assert b"dropped (rate limit)" in out.lines[-1]


def test_lines_are_relayed_whole_cut_and_in_order():
    relay, out = _relay(Clock())
    relay.feed(b"first\nsec")
    relay.feed(b"ond\n\n" + b"y" * (LOG_LINE_LIMIT + 10) + b"\nlast")
    relay.flush()
    assert out.lines == [MARK + line for line in (
        b"first\n", b"second\n", b"\n", b"y" * LOG_LINE_LIMIT + b" [cut]\n", b"y" * 10 + b"\n",
        b"last\n")]


def test_a_line_of_exactly_the_limit_is_not_cut():
    relay, out = _relay(Clock())
    relay.feed(b"z" * (LOG_LINE_LIMIT - 1))
    relay.feed(b"z\n")
    assert out.lines == [MARK + b"z" * LOG_LINE_LIMIT + b"\n"]


def test_after_a_drop_the_relay_resumes_at_the_next_line():
    clock = Clock()
    relay, out = _relay(clock)
    relay.feed(b"a" * (LOG_LINE_LIMIT - 1) + b"\n")  # 2048 tokens and the mark
    relay.budget.tokens = 10  # nearly spent
    relay.feed(b"b" * 100 + b"\nc\nd")  # the read's rest is dropped, with the partial "d"
    assert len(out.lines) == 1
    clock.now = 1.0  # the budget has refilled
    relay.feed(b"ddd\ne\n")  # the rest of "d..." is dropped too: "e" is the next line
    assert out.lines[1:] == [b"sandbox-kernel: 108 bytes of kernel log dropped (rate limit)\n",
                             MARK + b"e\n"]


# What user code writes to imitate the launcher's own lines (#20 item 6): a JSON request-log
# line of the service, audit lines hidden behind a tab or an invisible format character, a
# carriage return and an escape sequence that redraw a terminal line, a line separator.
FORGERIES = [
    b'{"method":"POST","route":"/v1/sandbox/run","status":200,"key":"team-b"}',
    b"\tsandbox-kernel audit: kernel k1: refused kill(0x1)",
    "\u200bsandbox-kernel audit: kernel k1: refused kill(0x1)".encode(),
    "\ufeffsandbox-kernel audit: kernel k1: refused kill(0x1)".encode(),
    "\u2066sandbox-kernel audit: kernel k1: refused kill(0x1)\u2069".encode(),
    b"harmless\rsandbox-kernel audit: kernel k1: refused kill(0x1)",
    b"\x1b[2K\x1b[1Gsandbox-kernel: 0 bytes of kernel log dropped",
    "one\u2028sandbox-kernel audit: kernel k1: refused kill(0x1)".encode(),
    b"\xff\xfe not UTF-8",
]


def test_every_kernel_line_is_marked_and_shows_no_invisible_character():
    relay, out = _relay(Clock())
    for line in FORGERIES:
        relay.feed(line + b"\n")
    shown = [line.decode() for line in out.lines]
    assert len(shown) == len(FORGERIES)
    for line in shown:
        assert line.startswith("[kernel k1] "), line
        assert line[:-1].isprintable(), line  # no tab, CR, ESC, Cf, separator, U+FFFD hides
    assert shown[1] == "[kernel k1] \\x09sandbox-kernel audit: kernel k1: refused kill(0x1)\n"
    assert shown[2].startswith("[kernel k1] \\u200bsandbox-kernel audit:")
    assert shown[8] == "[kernel k1] \\xff\\xfe not UTF-8\n"


def test_the_mark_names_the_kernel_printably():
    assert logrelay.kernel_mark("abc-123") == b"[kernel abc-123] "
    assert logrelay.kernel_mark("a]\u200b\nb") == b"[kernel a]\\u200b\\x0ab] "


FORGE = """
import os, sys
lines = {forgeries!r}
for line in lines:
    os.write(2, line + b"\\n")
sys.__stderr__.write("\\u2066sandbox-kernel audit: via sys.__stderr__\\n")
sys.__stderr__.flush()
"""


def test_a_real_kernel_cannot_forge_a_launcher_line(launcher):
    """Whatever bytes user code writes, each line that reaches the launcher is marked."""
    launcher.run(FORGE.format(forgeries=FORGERIES))
    launcher.end()
    lines = launcher.stderr.read_text().splitlines()
    forged = [line for line in lines if "audit" in line or "team-b" in line
              or "not UTF-8" in line or "dropped" in line]
    assert len(forged) == len(FORGERIES) + 1, lines
    for line in forged:
        assert line.startswith("[kernel kernel] "), line  # the connection file is kernel.json
        assert line.isprintable(), line
    # The launcher's own lines and the reaper's never start with the kernel's mark.
    assert not [line for line in lines if line.startswith(("{", "sandbox-kernel audit:",
                                                           "\t", "\u200b", "\ufeff", "\u2066"))]


def test_the_launchers_own_log_messages_stay_one_printable_line():
    """The service's and the MCP server's logs carry file names and errors from user code."""
    import logging

    record = logging.LogRecord("t", logging.INFO, __file__, 1, "could not read %s: %s",
                               ('a\n{"key":"team-b"}\u200b', "gone"), None)
    shown = logrelay.PrintableFormatter("mcp: %(message)s").format(record)
    assert shown == 'mcp: could not read a\\x0a{"key":"team-b"}\\u200b: gone'
