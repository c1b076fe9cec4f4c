"""Start the real `sandbox-kernel serve` on 127.0.0.1 for a load run, and stop it.

Each instance lives in a private run directory: its TMPDIR (so every kernel's scratch directory
lands under it and can be counted), its Jupyter runtime dir (so every kernel's command line names
it) and its log. Whatever process mentions the run directory belongs to this instance, even after
it has been orphaned, so nothing it leaves behind goes unseen.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

API_KEY = "load-test-key-0123456789"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve_command() -> list[str]:
    """How to start the service from this interpreter's environment."""
    script = Path(sys.executable).with_name("sandbox-kernel")
    if script.exists():
        return [str(script), "serve"]
    found = shutil.which("sandbox-kernel")
    if not found:
        raise RuntimeError("sandbox-kernel is not installed here: pip install -e '.[server]'")
    return [found, "serve"]


@dataclass
class Settings:
    """What the harness sets on the service (each becomes a `serve` flag)."""

    max_workers: int = 16
    max_requests: int = 64
    worker_timeout: float = 5.0
    pool_size: int = 2
    extra: list[str] = field(default_factory=list)  # more flags, e.g. ["--scratch-size", "64M"]

    def flags(self) -> list[str]:
        return ["--max-workers", str(self.max_workers), "--max-requests", str(self.max_requests),
                "--worker-timeout", f"{self.worker_timeout:g}", "--pool-size",
                str(self.pool_size), *self.extra]


class Service:
    """One running `sandbox-kernel serve`; a context manager that always stops it."""

    def __init__(self, settings: Settings, run_dir: Path | None = None,
                 environ: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.own_dir = run_dir is None
        self.run_dir = run_dir or Path(tempfile.mkdtemp(prefix="sk-load-"))
        self.tmp = self.run_dir / "tmp"
        self.runtime = self.run_dir / "runtime"
        self.log_path = self.run_dir / "service.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = API_KEY
        self.environ = environ or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.command: list[str] = []

    @property
    def marker(self) -> str:
        """The string every process of this instance carries in its command line or environ."""
        return str(self.run_dir)

    @property
    def scratch_root(self) -> Path:
        """Where the kernels' scratch directories of this instance appear."""
        return self.tmp / f"sandbox-kernel-{os.geteuid()}"

    def start(self, ready_timeout: float = 120.0) -> None:
        """Start the service and wait until /health answers."""
        for path in (self.tmp, self.runtime):
            path.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TMPDIR": str(self.tmp), "JUPYTER_RUNTIME_DIR": str(self.runtime),
               "SANDBOX_LOAD_RUN": self.marker, **self.environ}
        for name in ("API_KEY", "SANDBOX_PORT", "MAX_WORKERS", "MAX_REQUESTS", "WORKER_TIMEOUT"):
            env.pop(name, None)  # flags only: the caller's shell must not change the run
        self.command = [*serve_command(), "--host", "127.0.0.1", "--port", str(self.port),
                        "--api-key", self.api_key, *self.settings.flags()]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the service exited with {self.process.returncode} at start: "
                                   f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the service did not answer /health in {ready_timeout:g} s: "
                           f"{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the service's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def log_errors(self, limit: int = 8) -> str:
        """The last `limit` tracebacks the service logged (uncaught exceptions in requests)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        blocks = []
        for block in text.split("Traceback (most recent call last):")[1:]:
            lines = []
            for line in block.splitlines()[1:]:
                lines.append(line)
                if line and not line.startswith((" ", "\t")) and not line.startswith("During"):
                    break  # the exception line ends the traceback
            blocks.append("Traceback (last frames):\n" + "\n".join(lines[-8:]))
        return "\n".join(blocks[-limit:])

    def terminate(self, timeout: float) -> float | None:
        """SIGTERM; seconds until it exited, or None if it was still running after timeout."""
        if self.process is None or self.process.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return time.monotonic() - started

    def stop(self) -> None:
        """Stop the service, then any process of this instance still alive; remove the dir."""
        from tests.load.resources import instance_processes  # psutil only where needed

        if self.process is not None and self.process.poll() is None:
            if self.terminate(self.settings_grace() + 15) is None:
                self.process.kill()
                self.process.wait()
        for leftover in instance_processes(None, self.marker):
            with contextlib.suppress(Exception):
                leftover.kill()
        if self.own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def settings_grace(self) -> float:
        flags = self.settings.extra
        if "--shutdown-grace" in flags:
            return float(flags[flags.index("--shutdown-grace") + 1])
        return 10.0

    def __enter__(self) -> Service:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
