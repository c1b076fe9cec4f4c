"""The egress proxy's CPU beside its kernel's, for request heads user code sends to refuse.

The proxy runs in the kernel's unconfined companion (its reaper), outside --cpu-limit, so what
a kernel sends it must cost it little beside what sending it cost the kernel. A `--network on`
kernel sends N heads of each kind on fresh connections (as an attacker would: a proxy answers
one request per connection) and reads each answer; the figures are the kernel's own CPU for
that execution (its execute_reply's usage) and the companion's, from /proc/<reaper>/stat
before and after (utime + stime), in the same run; and what the execution was charged for the
proxy's work (its usage's egress_cpu_seconds: each step of a connection's coroutines, the event
loop's own polling left out).

    python -m bench.egress_heads [--count N]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from sandbox_kernel.client import Sandbox
from sandbox_kernel.policy import SandboxPolicy

TICK = os.sysconf("SC_CLK_TCK")
HEADS = {
    # 6,000 one-letter headers (59 KB): the head of round 4's finding 5.
    "6,000 one-letter headers": "b'GET http://10.0.0.1/ HTTP/1.1\\r\\nHost: 10.0.0.1\\r\\n' + "
                                "b'a: bbbbb\\r\\n' * 6000 + b'\\r\\n'",
    # 100 headers (the most a head may have), to a refused private address: parsed and judged.
    "100 headers, parsed": "b'GET http://10.0.0.1/ HTTP/1.1\\r\\nHost: 10.0.0.1\\r\\n' + "
                           "b'a: b\\r\\n' * 99 + b'\\r\\n'",
    "a short refused head": "b'GET http://10.0.0.1/ HTTP/1.1\\r\\nHost: 10.0.0.1\\r\\n\\r\\n'",
}
SEND = """
import socket
head = {head}
for _ in range({count}):
    with socket.create_connection(("127.0.0.1", 3128)) as raw:
        try:
            raw.sendall(head)
        except OSError:
            pass
        raw.recv(4096)
"""


def reaper_seconds(kernel_pid: int) -> float:
    """The reaper's (the kernel's only child's) CPU so far, user and system."""
    children = Path(f"/proc/{kernel_pid}/task/{kernel_pid}/children").read_text().split()
    fields = Path(f"/proc/{children[0]}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    """Print, per kind of head, the kernel's CPU, the companion's and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300, help="heads of each kind")
    count = parser.parse_args().count
    with Sandbox(None, policy=SandboxPolicy(network="on")) as sb:
        pid = sb.manager.provisioner.pid
        sb.run(SEND.format(head=HEADS["a short refused head"], count=1))  # the proxy's start
        print(f"{count} heads of each kind, each on its own connection; CPU seconds")
        print(f"{'head':28} {'kernel':>8} {'companion':>10} {'ratio':>6} {'charged':>8}")
        for name, head in HEADS.items():
            before = reaper_seconds(pid)
            execution = sb.run(SEND.format(head=head, count=count))
            assert execution.error is None, execution.error
            companion = reaper_seconds(pid) - before
            usage = execution.usage
            kernel = (usage.cpu_user_seconds or 0) + (usage.cpu_system_seconds or 0)
            print(f"{name:28} {kernel:8.3f} {companion:10.3f} {companion / kernel:6.2f} "
                  f"{usage.egress_cpu_seconds or 0:8.3f}")


if __name__ == "__main__":
    main()
