"""The launcher's stdio stays outside the sandbox (finding 5).

The kernel is started with its stdout appended to a file and its stderr on a terminal (a pty),
as a launcher logging to a file from an operator's shell would. User code then tries every
descriptor it holds: write, truncate, read. The file must be intact, no descriptor of the file
or the terminal may be reachable, and the kernel's own log still reaches the terminal, bounded.
"""

import ast
import json
import os
import pty
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.connect import write_connection_file

from sandbox_kernel.confine import logrelay
from tests.helpers import wait_until_ready

HOSTILE = """
import os, json, errno
targets = {}
for fd in map(int, os.listdir('/proc/self/fd')):
    try:
        targets[fd] = os.readlink(f'/proc/self/fd/{fd}')
    except OSError:
        pass
done = []
for fd in sorted(targets):
    if targets[fd].startswith(('socket:', 'anon_inode:')):
        continue  # the kernel's own ZMQ sockets and event fds
    for attempt in ('write', 'truncate', 'read'):
        try:
            if attempt == 'write':
                os.write(fd, b'FORGED by user code\\n')
            elif attempt == 'truncate':
                os.ftruncate(fd, 0)
            else:
                os.set_blocking(fd, False)
                os.read(fd, 100)
            done.append((fd, attempt))
        except OSError:
            pass
json.dumps(targets)
"""


class Terminal:
    """A pty whose slave end is the kernel's stderr; everything written to it is collected."""

    def __init__(self):
        self.master, self.slave = pty.openpty()
        self.path = os.ttyname(self.slave)
        self.received = bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.received += data

    def wait_for(self, needle, timeout=30):
        deadline = time.monotonic() + timeout
        while needle not in self.received and time.monotonic() < deadline:
            time.sleep(0.1)
        return needle in self.received


@pytest.fixture
def launched(tmp_path):
    """A kernel started by hand with stdout on a log file and stderr on a terminal."""
    connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"))
    log = tmp_path / "launcher.log"
    log.write_text("the launcher's own log\n")
    terminal = Terminal()
    with open(log, "a") as stdout:
        process = subprocess.Popen(
            [sys.executable, "-I", "-m", "sandbox_kernel", "-f", connection_file],
            stdin=subprocess.DEVNULL, stdout=stdout, stderr=terminal.slave)
    os.close(terminal.slave)
    client = BlockingKernelClient(connection_file=connection_file)
    client.load_connection_file()
    client.start_channels()
    try:
        try:
            wait_until_ready(client, process)
        except RuntimeError:
            raise RuntimeError(f"the kernel did not start: {terminal.received!r}") from None
        yield client, process, log, terminal
    finally:
        client.stop_channels()
        process.kill()
        process.wait(30)


def evaluate(client, code):
    """The value of code's last expression, read from its execute_result."""
    results = []

    def hook(msg):
        if msg["msg_type"] == "execute_result":
            results.append(msg["content"]["data"]["text/plain"])

    reply = client.execute_interactive(code, timeout=60, output_hook=hook)
    assert reply["content"]["status"] == "ok", reply["content"]
    return results[-1]


def test_no_descriptor_reaches_the_launchers_file_or_terminal(launched):
    client, _, log, terminal = launched
    targets = json.loads(ast.literal_eval(evaluate(client, HOSTILE)))
    assert str(log) not in targets.values()
    assert terminal.path not in targets.values()
    assert not any(target.startswith(("/dev/pts", "/dev/tty")) for target in targets.values())
    assert targets["0"] == "/dev/null"
    assert evaluate(client, "1 + 1") == "2"  # the kernel is unharmed
    assert log.read_text() == "the launcher's own log\n"
    # What user code wrote to its fds 1 and 2 is the kernel's log: it reaches the terminal
    # through the reaper, not from user code's own descriptor.
    assert terminal.wait_for(b"FORGED by user code")


def test_kernel_log_reaches_the_terminal_bounded(launched):
    client, process, log, terminal = launched
    flood = "import os\nfor _ in range(1024):\n    os.write(2, b'x' * 1023 + b'\\n')\n'flooded'"
    assert evaluate(client, flood) == "'flooded'"
    process.kill()  # the reaper reports what it dropped at the latest when the kernel is gone
    assert terminal.wait_for(b"bytes of kernel log dropped (rate limit)", timeout=60)
    assert len(terminal.received) < logrelay.LOG_BURST + 64 * logrelay.LOG_RATE
    assert log.read_text() == "the launcher's own log\n"


def test_refused_call_is_recorded_in_the_audit_file_not_on_the_launchers_terminal(launched):
    """The launcher's terminal is where the user's own output goes: the record of a refused
    call goes to the default audit file (no --audit-log here), which `check` names."""
    import random

    from sandbox_kernel.confine import audit
    from tests.helpers import RAW_SYSCALL

    client, _, _, terminal = launched
    marker = random.getrandbits(48)
    evaluate(client, RAW_SYSCALL + f"raw(163, {marker})\n1")  # acct(2): refused
    path = Path(audit.default_path())
    deadline = time.monotonic() + 10
    while not (path.exists() and hex(marker).encode() in path.read_bytes()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    [record] = [json.loads(line) for line in path.read_text().splitlines()
                if hex(marker) in line]
    assert (record["kernel"], record["syscall"], record["errno"]) == ("kernel", "acct", "EPERM")
    # The reaper wrote the terminal's line (when it wrote one) before the file's.
    assert not terminal.wait_for(b"sandbox-kernel audit", timeout=0.5)


def test_run_json_is_one_object_whatever_user_code_prints(tmp_path):
    code = tmp_path / "forge.py"
    code.write_text("""
import os, sys
os.write(1, b'{"score": 100}\\n')
os.write(2, b'{"score": 100}\\n')
print('{"score": 100}')
sys.__stdout__.write('{"score": 100}\\n'); sys.__stdout__.flush()
sys.__stderr__.write('{"score": 100}\\n'); sys.__stderr__.flush()
for fd in map(int, os.listdir('/proc/self/fd')):
    try:  # every pipe and device (the launcher's stdio was one of those)
        if os.readlink(f'/proc/self/fd/{fd}').startswith(('pipe:', '/dev/')):
            os.write(fd, b'{"score": 100}\\n')
    except OSError:
        pass
def main():
    return {"score": 1}
""")
    result = subprocess.run([sys.executable, "-m", "sandbox_kernel", "run", "--json", str(code)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["result"] == {"score": 1}


def test_reaper_holds_the_launchers_stderr_and_nothing_else(launched):
    _, process, log, terminal = launched
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    assert len(children) == 1, children
    held = {os.readlink(f"/proc/{children[0]}/fd/{fd}")
            for fd in os.listdir(f"/proc/{children[0]}/fd")}
    assert terminal.path in held
    assert str(log) not in held


def test_no_escape_sequence_reaches_the_terminal(launched):
    client, _, _, terminal = launched
    # OSC 52 would set the operator's clipboard; OSC 0 the window title.
    escapes = "b'osc \\x1b]52;c;cm0gLXJm\\x07 \\x1b]0;owned\\x07 end\\n'"
    evaluate(client, f"import os\nos.write(2, {escapes})\n1")
    assert terminal.wait_for(b"] osc \\x1b]52;c;cm0gLXJm\\x07 \\x1b]0;owned\\x07 end")  # escaped
    assert b"\x1b]" not in terminal.received
