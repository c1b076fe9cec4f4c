"""Per-execution usage: what each run cost, measured from outside a real sandboxed kernel."""

import asyncio
import json
import os
import time

from sandbox_kernel.client import AsyncSandbox, Sandbox
from sandbox_kernel.client.meter import KernelProcess
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import evaluate, ok

MiB = 2**20
HOST = {"cpu_user_seconds": "host", "cpu_system_seconds": "host", "peak_memory_bytes": "host",
        "wall_seconds": "caller", "output_bytes": "caller", "result_bytes": "caller",
        "refused_syscalls": "kernel", "egress_cpu_seconds": "kernel",
        "companion_cpu_seconds": "kernel"}
# Spins until the kernel process has used `cpu` seconds of CPU, whatever else the machine runs
# (two cores shared by many processes: its wall time may be longer, never shorter).
# It looks at the clock every 10^5 iterations: a CPU clock read is a system call.
BUSY = ("import time\nstart = time.process_time()\n"
        "while time.process_time() - start < {cpu}:\n    for _ in range(10**5): pass")
TICK = 0.01  # /proc/<pid>/stat counts CPU in clock ticks


def cpu(usage):
    return usage.cpu_user_seconds + usage.cpu_system_seconds


def test_a_busy_loop_costs_its_cpu_time_measured_by_the_host(sandbox):
    usage = ok(sandbox.run(BUSY.format(cpu=0.5))).usage
    assert usage.source == HOST
    assert 0.5 - 2 * TICK <= cpu(usage) <= 0.5 + 0.15
    assert cpu(usage) <= usage.wall_seconds + 2 * TICK  # one thread: CPU never exceeds wall
    # A Python loop runs in user space (the split is sampled at each tick: not exact).
    assert usage.cpu_user_seconds > usage.cpu_system_seconds
    idle = ok(sandbox.run("pass")).usage
    assert cpu(idle) <= 0.05


def test_peak_memory_is_reset_for_each_execution(sandbox):
    # The kernel runs as a uid of its own; the caller (root here) resets its high-water mark.
    assert evaluate(sandbox, "__import__('os').getuid()") != os.getuid()
    baseline = ok(sandbox.run("pass")).usage.peak_memory_bytes
    big = ok(sandbox.run("x = b'1' * (200 * 2**20)\ndel x")).usage
    assert big.peak_memory_bytes >= 200 * MiB + baseline // 2
    after = ok(sandbox.run("y = 1 + 1")).usage
    assert after.peak_memory_bytes < baseline + 20 * MiB
    assert after.source["peak_memory_bytes"] == "host"


def test_output_and_result_bytes_are_exact(sandbox):
    code = "def main(n):\n    print('é' * n)\n    return {'s': 'x' * 1000, 'n': n}\n"
    usage = ok(sandbox.run(code, inputs={"n": 10})).usage
    assert usage.output_bytes == len(("é" * 10 + "\n").encode())
    assert usage.result_bytes == len(json.dumps({"s": "x" * 1000, "n": 10},
                                                separators=(",", ":")))
    expression = ok(sandbox.run("import sys\nsys.stderr.write('ab')\n'hello'")).usage
    assert (expression.output_bytes, expression.result_bytes) == (2, len("'hello'"))


def test_refused_calls_are_counted_per_execution(sandbox):
    code = ("import errno, os, socket\nfor attempt in (os.fork, socket.socket):\n"
            "    try:\n        attempt()\n    except PermissionError as exc:\n"
            "        assert exc.errno == errno.EPERM\n")
    assert ok(sandbox.run(code)).usage.refused_syscalls == 2
    assert ok(sandbox.run("pass")).usage.refused_syscalls == 0
    assert evaluate(sandbox, "1 + 1") == 2  # the kernel lives on


def test_host_figures_ignore_what_user_code_makes_the_kernel_report(fresh_sandbox):
    ok(fresh_sandbox.run(
        "k = get_ipython().kernel\n"
        "k.usage.report = lambda: {'cpu_user_seconds': 999.0, 'cpu_system_seconds': 999.0,"
        " 'peak_memory_bytes': 1, 'refused_syscalls': 7}"))
    usage = ok(fresh_sandbox.run("pass")).usage
    assert cpu(usage) < 1 and usage.peak_memory_bytes > 10 * MiB  # the host's, not the lie
    assert (usage.refused_syscalls, usage.source["refused_syscalls"]) == (7, "kernel")


def test_a_kernel_without_a_local_process_reports_its_own(sandbox, monkeypatch):
    monkeypatch.setattr(sandbox, "_kernel_process", lambda: None)  # as a remote kernel
    usage = ok(sandbox.run(BUSY.format(cpu=0.3))).usage
    assert {usage.source[name] for name in ("cpu_user_seconds", "peak_memory_bytes")} \
        == {"kernel"}
    assert 0.3 <= cpu(usage) <= 0.3 + 0.15  # getrusage: microseconds, no ticks
    assert usage.peak_memory_bytes > 10 * MiB  # the process's high-water mark so far


def test_peak_memory_is_sampled_where_it_cannot_be_reset(sandbox, monkeypatch):
    monkeypatch.setattr(KernelProcess, "reset_peak", lambda self: False)
    usage = ok(sandbox.run("import time\nx = b'1' * (200 * 2**20)\ntime.sleep(0.6)\ndel x")).usage
    assert usage.source["peak_memory_bytes"] == "sampled"
    assert usage.peak_memory_bytes >= 200 * MiB


def test_the_async_sandbox_measures_the_same_way(kernelspecs):
    async def scenario():
        async with AsyncSandbox("sandbox") as sandbox:
            return (await sandbox.run(BUSY.format(cpu=0.2))).usage

    usage = asyncio.run(scenario())
    assert usage.source == HOST
    assert 0.2 - 2 * TICK <= cpu(usage) <= 0.2 + 0.15


def test_a_timed_out_run_still_reports_what_it_cost(sandbox):
    execution = sandbox.run("while True: pass", timeout=0.3)
    assert (execution.error.name, execution.state_lost) == ("ExecutionTimeout", False)
    assert execution.usage.source == HOST
    # Stopped by wall time: on a busy machine it got less CPU than that, never more.
    assert 0 < cpu(execution.usage) <= execution.usage.wall_seconds + 2 * TICK


def test_a_lost_kernel_is_measured_before_it_is_replaced(kernelspecs):
    # Ignores the time limit and the interrupt: only a restart ends it.
    unstoppable = ("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                   "sum(range(10**18))")
    with Sandbox("sandbox", grace=0.3) as sandbox:
        first_pid = sandbox.manager.provisioner.pid
        execution = sandbox.run(unstoppable, timeout=0.3)
        assert (execution.error.name, execution.state_lost) == ("ExecutionTimeout", True)
        assert sandbox.manager.provisioner.pid != first_pid
        usage = execution.usage
        assert usage.source["cpu_user_seconds"] == "host"  # read before the restart
        assert 0 < cpu(usage) <= usage.wall_seconds + 2 * TICK
        assert "refused_syscalls" not in usage.source and usage.refused_syscalls is None
        after = ok(sandbox.run("pass")).usage  # the new kernel's process is the one measured
        assert after.source == HOST and cpu(after) <= 0.05


# Makes the kernel's read-only view of the refusal count writable and fills it with ones.
TAMPER = """
import ctypes, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
line = next(l for l in open('/proc/self/maps') if 'sandbox-kernel-tally' in l)
start = int(line.split('-')[0], 16)
assert libc.mprotect(start, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) == 0
ctypes.memmove(start, b'\\xff' * 8, 8)
"""


def test_a_forged_refusal_count_reaches_only_the_kernels_own_report(fresh_sandbox):
    ok(fresh_sandbox.run(TAMPER))
    code = ("import errno, os\ntry:\n    os.fork()\nexcept PermissionError as exc:\n"
            "    print(exc.errno == errno.EPERM)")
    # The reaper counts on its own (it never reads the page), answers EPERM and lives on. The
    # first report is 1 - (2**64 - 1), negative: the client drops it; the next is right again.
    for count in (None, 1):
        execution = ok(fresh_sandbox.run(code))
        assert execution.stdout == "True\n"
        assert execution.usage.refused_syscalls == count
    assert evaluate(fresh_sandbox, "1 + 1") == 2


def test_a_process_name_cannot_fake_the_peak_memory(sandbox):
    # The status file's first line is the name user code chooses (prctl PR_SET_NAME).
    rename = ("import ctypes\nctypes.CDLL(None).prctl(15, b'VmHWM: 1 kB', 0, 0, 0)\n"
              "open('/proc/self/comm').read()")
    assert evaluate(sandbox, rename) == "VmHWM: 1 kB\n"
    try:
        usage = ok(sandbox.run("x = b'1' * (50 * 2**20)\ndel x")).usage
        assert usage.peak_memory_bytes >= 50 * MiB
    finally:
        ok(sandbox.run("import ctypes\nctypes.CDLL(None).prctl(15, b'python', 0, 0, 0)"))


def test_a_librarys_numa_hints_are_audited_but_not_counted_as_the_codes(tmp_path):
    """A plain chart once reported 3 refused calls: numpy's BLAS hinting NUMA placement (#32
    item 13). The audit keeps each one; the run's count is of what the code ran into."""
    audit = tmp_path / "audit.jsonl"
    chart = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
    with Sandbox(None, policy=SandboxPolicy(audit_log=str(audit))) as sandbox:
        execution = ok(sandbox.run(chart))
        refused = ok(sandbox.run("import os\ntry:\n    os.fork()\nexcept OSError:\n    pass"))
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    hints = [entry for entry in records if entry.get("syscall") in ("mbind", "set_mempolicy")]
    assert len(execution.displays) == 1 and execution.usage.refused_syscalls == 0
    assert hints and all("NUMA placement hint" in entry["probe"] for entry in hints)
    assert refused.usage.refused_syscalls == 1  # the code's own refusals are counted


SPINNER = ("import threading, time\n"
           "def spin():\n    start = time.thread_time()\n"
           "    while time.thread_time() - start < 1.0:\n        for _ in range(10**5): pass\n"
           "spinner = threading.Thread(target=spin, name='spinner')\nspinner.start()\n")


def test_cpu_a_thread_spends_between_executions_is_in_the_next_ones_usage(fresh_sandbox):
    # The cell returns at once; its thread goes on spending 1 s of CPU with no execution
    # running. That CPU must be billed to the session's next execution, not to nobody.
    started = ok(fresh_sandbox.run(SPINNER)).usage
    assert cpu(started) < 0.5
    later = []
    while True:
        time.sleep(0.5)  # between executions: the thread spins on its own
        usage = ok(fresh_sandbox.run("spinner.is_alive()"))
        later.append(usage.usage)
        if usage.text == "False":
            break
        assert len(later) < 60, "the spinner did not end"
    # What the spinner spent before the first execution's figures closed is billed to it.
    billed = cpu(started) + sum(cpu(u) for u in later)
    assert billed >= 1.0 - 2 * TICK, (billed, started, later)
    assert all(u.source["cpu_user_seconds"] == "host" for u in later)
    # Nothing is billed twice: an execution after a quiet pause costs what it ran.
    time.sleep(0.3)
    assert cpu(ok(fresh_sandbox.run("pass")).usage) <= 0.05


def test_the_kernels_own_report_also_counts_from_the_previous_execution(fresh_sandbox,
                                                                         monkeypatch):
    monkeypatch.setattr(fresh_sandbox, "_kernel_process", lambda: None)  # as a remote kernel
    ok(fresh_sandbox.run(SPINNER))
    time.sleep(1.0)  # part of the spinner's CPU, at least, is spent with no execution running
    joined = ok(fresh_sandbox.run("spinner.join()")).usage
    assert joined.source["cpu_user_seconds"] == "kernel"
    assert cpu(joined) >= 1.0 - 2 * TICK, joined
    time.sleep(0.2)
    assert cpu(ok(fresh_sandbox.run("pass")).usage) <= 0.05


# User code sends request heads to the egress proxy, each on its own connection, and reads each
# answer: the proxy parses and refuses them in the kernel's companion, outside the kernel.
HEADS = ("import socket\n"
         "head = b'GET http://10.0.0.1/ HTTP/1.1\\r\\nHost: 10.0.0.1\\r\\n' + b'a: b\\r\\n' * 98"
         " + b'\\r\\n'\n"
         "for _ in range({count}):\n"
         "    with socket.create_connection(('127.0.0.1', 3128)) as raw:\n"
         "        raw.sendall(head)\n"
         "        assert raw.recv(4096).startswith(b'HTTP/1.1 403')\n")


def companion_seconds(kernel_pid):
    """The CPU of the kernel's reaper (its only child) so far, from /proc."""
    children = open(f"/proc/{kernel_pid}/task/{kernel_pid}/children").read().split()
    fields = open(f"/proc/{children[0]}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_egress_proxys_cpu_for_hostile_heads_is_charged_to_the_execution(net_sandbox):
    ok(net_sandbox.run(HEADS.format(count=1)))  # the proxy's start, and a step counted late
    pid = net_sandbox.manager.provisioner.pid
    before = companion_seconds(pid)
    usage = ok(net_sandbox.run(HEADS.format(count=300))).usage
    spent = companion_seconds(pid) - before
    charged = usage.egress_cpu_seconds
    assert usage.source["egress_cpu_seconds"] == "kernel"
    # Charged: what the proxy's work on these connections cost, within what the companion
    # spent in all (its event loop's own polling is no one connection's).
    assert 0.02 < charged <= spent + 2 * TICK, (charged, spent)
    assert charged >= spent / 4, (charged, spent)
    # An execution without connections is charged nothing (later steps were counted by now).
    time.sleep(0.2)
    ok(net_sandbox.run("pass"))
    assert ok(net_sandbox.run("pass")).usage.egress_cpu_seconds == 0.0


def test_a_kernel_without_the_network_is_charged_no_egress_cpu(sandbox):
    assert ok(sandbox.run("pass")).usage.egress_cpu_seconds == 0.0


def test_cpu_a_thread_spends_after_the_last_execution_is_in_the_sandboxs_total(fresh_sandbox):
    # The cell returns at once and no execution follows: the spinner's 1 s of CPU is in no
    # execution's figures, and must be in the sandbox's total.
    started = ok(fresh_sandbox.run(SPINNER)).usage
    assert cpu(started) < 0.5
    deadline = time.monotonic() + 60
    while cpu(total := fresh_sandbox.total_usage()) < 1.0 - 2 * TICK:
        assert time.monotonic() < deadline, total
        time.sleep(0.2)
    assert total.source["cpu_user_seconds"] == "host"
    # Nothing counted twice: once the spinner is done, a quiet execution adds only its own.
    time.sleep(0.3)
    before = cpu(fresh_sandbox.total_usage())
    quiet = ok(fresh_sandbox.run("pass")).usage
    assert cpu(fresh_sandbox.total_usage()) - before <= cpu(quiet) + 0.05
    assert before < 1.0 + cpu(started) + 0.3
