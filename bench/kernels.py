"""Plain and sandboxed kernels driven by the same raw jupyter_client loop.

Both kinds start through a KernelManager and are timed by identical client code, so whatever the
client costs is the same on both sides of every ratio.
"""

from __future__ import annotations

import os
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager

from sandbox_kernel.install import kernel_json
from sandbox_kernel.policy import SandboxPolicy

PLAIN = "plain"
SANDBOX = "sandbox"  # started cold: a new interpreter that re-executes itself clean
FORK = "fork"  # the same kernel, forked from the fork server (launch/forkserver/)
KINDS = (PLAIN, SANDBOX)
START_KINDS = (PLAIN, SANDBOX, FORK)
READY_TIMEOUT = 60.0
REPLY_TIMEOUT = 30.0
_POLL = 0.005  # short, so polling adds at most a few ms to a start that takes hundreds
_RESEND = 1.0  # a kernel_info request sent before the kernel bound its socket is resent


def kernel_argv(kind: str) -> list[str]:
    """The command line each kind of kernel is started with."""
    if kind == PLAIN:
        return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    return kernel_json(SandboxPolicy(), "sandbox (bench)")["argv"]


def kernel_metadata(kind: str) -> dict[str, Any]:
    """The fork kind names the fork-server provisioner; the others start through Popen."""
    if kind == FORK:
        return {"kernel_provisioner": kernel_json(SandboxPolicy(), "")["metadata"][
            "kernel_provisioner"]}
    return {}


class _Specs(KernelSpecManager):
    """Serves kernelspecs built here, so the benchmark needs nothing installed."""

    def __init__(self, argv: list[str], metadata: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = KernelSpec(argv=argv, display_name="bench", language="python",
                               interrupt_mode="signal", metadata=metadata or {})

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return self.spec


class Kernel:
    """One kernel process and its blocking client."""

    def __init__(self, kind: str, argv: list[str] | None = None) -> None:
        self.kind = kind
        specs = _Specs(argv or kernel_argv(kind), kernel_metadata(kind))
        self.manager = KernelManager(kernel_name=f"bench-{kind}", kernel_spec_manager=specs)
        self.client: Any = None
        self.log: Any = None

    def start(self, stderr: Any = None) -> float:
        """Start the kernel; return seconds from start_kernel() to the kernel_info reply.

        The kernel's stderr goes to `stderr` if given, else to a log kept for error messages.
        """
        if stderr is None:
            stderr = self.log = tempfile.TemporaryFile()
        started = time.perf_counter()
        self.manager.start_kernel(stderr=stderr)
        self.client = self.manager.client()
        # As Sandbox does (client._fast_reconnecting), for every kind alike.
        self.client.context.setsockopt(zmq.RECONNECT_IVL, 10)
        self.client.start_channels()
        try:
            self._await_kernel_info()
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; its stderr ends:\n{self._log_tail()}") from None
        return time.perf_counter() - started

    def _log_tail(self) -> str:
        if self.log is None:
            return "(not kept)"
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def _await_kernel_info(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            self.client.kernel_info()
            resend_at = time.monotonic() + _RESEND
            while time.monotonic() < resend_at:
                try:
                    reply = self.client.get_shell_msg(timeout=_POLL)
                except queue.Empty:
                    if not self.manager.is_alive():
                        raise RuntimeError(f"the {self.kind} kernel died while starting") from None
                    continue
                if reply["msg_type"] == "kernel_info_reply":
                    return
        raise RuntimeError(f"the {self.kind} kernel did not answer in {READY_TIMEOUT:.0f} s")

    def execute(self, code: str) -> float:
        """Run code; return seconds from sending the request to the kernel's idle status."""
        started = time.perf_counter()
        msg_id = self.client.execute(code)
        self._await_idle(msg_id)
        elapsed = time.perf_counter() - started
        reply = self.await_reply(msg_id)  # drained outside the timing: it came before idle
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{code!r} failed in the {self.kind} kernel: {reply['content']}")
        return elapsed

    def warm_up(self) -> None:
        """Execute until IOPub is connected, so no later idle status can be lost."""
        for _ in range(10):
            msg_id = self.client.execute("pass")
            self.await_reply(msg_id)
            try:
                self._await_idle(msg_id, timeout=2.0)
                return
            except TimeoutError:
                continue  # IOPub subscribed only after that request's messages went out
        raise RuntimeError(f"IOPub of the {self.kind} kernel never connected")

    def evaluate(self, code: str) -> str:
        """Run code; return the text/plain of its last expression's value."""
        msg_id = self.client.execute(code)
        while True:
            msg = self.client.get_iopub_msg(timeout=REPLY_TIMEOUT)
            if (msg["parent_header"].get("msg_id") == msg_id
                    and msg["msg_type"] == "execute_result"):
                self.await_reply(msg_id)
                return msg["content"]["data"]["text/plain"]

    def _await_idle(self, msg_id: str, timeout: float = REPLY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                break
            if (msg["parent_header"].get("msg_id") == msg_id
                    and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                return
        raise TimeoutError(f"the {self.kind} kernel did not go idle in {timeout:.0f} s")

    def await_reply(self, msg_id: str) -> dict[str, Any]:
        """The shell reply to this request (earlier replies are dropped)."""
        while True:
            reply = self.client.get_shell_msg(timeout=REPLY_TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    @property
    def pid(self) -> int:
        """The kernel's process id."""
        return self.manager.provisioner.process.pid  # type: ignore[union-attr]

    def peak_rss(self) -> int:
        """The kernel process's peak resident set size (VmHWM), in bytes."""
        return peak_rss(self.pid)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the kernel process has used so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def pss(self) -> int:
        """The kernel's proportional set size: pages shared with others count in part."""
        for line in Path(f"/proc/{self.pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no Pss in /proc/{self.pid}/smaps_rollup")

    def close(self) -> None:
        """Stop the client and kill the kernel."""
        if self.client is not None:
            self.client.stop_channels()
        if self.manager.has_kernel:
            self.manager.shutdown_kernel(now=True)
        if self.log is not None:
            self.log.close()


def peak_rss(pid: int) -> int:
    """VmHWM of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")
