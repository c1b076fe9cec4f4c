"""What the service's tests share: the real server in a subprocess, and ways to talk to it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

DIFY_KEY = "test-dify-key-0123456789"
KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
RUN = "/v1/sandbox/run"
# Generous: on a loaded 2-core machine a fresh kernel can take seconds to start. Tests that time
# a response (503 at once) or need a client to give up (disconnects) set their own.
http = httpx.Client(timeout=60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children(pid: int) -> set[int]:
    """Live child processes of pid (the service's kernels)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether pid is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    """`python -m sandbox_kernel serve` in a subprocess, stopped with SIGTERM."""

    def __init__(self, tmp: Path, *flags: str, env: dict[str, str] | None = None,
                 launcher: tuple[str, ...] = ("-m", "sandbox_kernel"),
                 unset: tuple[str, ...] = (), ready: bool = True,
                 python: str = sys.executable) -> None:
        """ready: wait until /ready is 200 (else only until it answers); python: whose
        sandbox-kernel serves (tests/test_extras.py: a venv of one extra)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        environ = {**os.environ, "API_KEY": DIFY_KEY, "SANDBOX_PORT": str(self.port),
                   **(env or {})}
        for name in unset:
            environ.pop(name, None)
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [python, *launcher, "serve", "--host", "127.0.0.1", *flags],
                env=environ, stdout=log, stderr=subprocess.STDOUT)
        self.wait_ready() if ready else self.wait_answering()

    def wait_answering(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                http.get(f"{self.url}/ready", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError(f"the server did not answer:\n{self.log.read_text()}")

    def wait_ready(self, timeout: float = 60) -> dict:
        deadline, said = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                answer = http.get(f"{self.url}/ready", timeout=2)
                if answer.status_code == 200:
                    return answer.json()
                said = answer.text
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the server did not become ready ({said}):\n"
                             f"{self.log.read_text()}")

    def ready(self) -> dict:
        return http.get(f"{self.url}/ready", timeout=5).json()

    def wait_until(self, check, timeout: float = 20) -> dict:
        deadline = time.monotonic() + timeout
        state = self.ready()
        while not check(state) and time.monotonic() < deadline:
            time.sleep(0.1)
            state = self.ready()
        return state

    def stop(self) -> None:
        """SIGTERM; the service must shut down in order (uvicorn re-raises the signal after)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)  # grace 10 s, then kernels shut down in parallel
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        log = self.log.read_text()
        assert self.process.returncode in (0, -signal.SIGTERM), log
        assert '"event":"stopped"' in log, log


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sse_events(response) -> list[tuple[float, str, object]]:
    """(arrival time, event name, data) of a server-sent event stream."""
    events, name, started = [], None, time.monotonic()
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and name:
            events.append((time.monotonic() - started, name, json.loads(line[5:])))
            name = None
    return events


def idle(session_url: str, timeout: float = 30) -> dict:
    return idle_as(session_url, KEY_B, timeout)


def idle_as(session_url: str, key: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while (state := http.get(session_url, headers=auth(key)).json())["busy"]:
        assert time.monotonic() < deadline, f"the session stayed busy: {state}"
        time.sleep(0.05)
    return state


# When the caller leaves: while the kernel dies, while the client restarts it, or after. Each used
# to be able to leave the session's client with closed sockets (ZMQError "Socket operation on


def fork_served(pid: int | None) -> set[int]:
    """Kernels forked by the fork server at pid (none without one)."""
    return children(pid) if pid else set()
