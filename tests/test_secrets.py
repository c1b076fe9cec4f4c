"""No secret of the launcher in any kernel: user code scans all of its memory and /proc/self.

Each way to get a kernel (fork-served, cold, pooled, the HTTP service's two APIs, eg-launch) is
started with a fresh random secret in the launcher's environment; the kernel's user code reads
every readable mapping of its own address space through /proc/self/mem, and every file of
/proc/self, and must not find it. The secret is sent to the kernel as two halves, never side by
side, so the code looking for it does not plant it; a canary built the same way at run time
proves that the scan finds what is there.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.launch import forkserver
from sandbox_kernel.launch.pool import KernelPool
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import ok

# Defines scan(head, reversed_tail) -> [where the secret head+tail was found]. The tail arrives
# reversed, so that the secret never stands whole in the code (or the request that carries it).
SCANNER = r'''
import os as _os

def _holds(data, head, tail):
    at = data.find(head)
    while at >= 0:
        if data[at + len(head):at + len(head) + len(tail)] == tail:
            return True
        at = data.find(head, at + 1)
    return False

def _proc_files(head, tail):
    found = []
    for name in sorted(_os.listdir('/proc/self')):
        path = '/proc/self/' + name
        if name in ('mem', 'pagemap') or _os.path.isdir(path):
            continue
        try:
            with open(path, 'rb') as handle:
                data = handle.read()
        except OSError:  # write-only, refused by Landlock, or not for this process
            continue
        if _holds(data, head, tail):
            found.append(path)
    return found

def _memory(head, tail):
    found, chunk, overlap = [], 1 << 24, len(head) + len(tail)
    with open('/proc/self/maps') as handle:
        regions = handle.read().splitlines()
    with open('/proc/self/mem', 'rb', buffering=0) as mem:
        for line in regions:
            span, perms = line.split()[:2]
            if perms[0] != 'r':
                continue
            start, end = (int(value, 16) for value in span.split('-'))
            position = start
            while position < end:
                size = min(end - position, chunk)
                try:
                    mem.seek(position)
                    data = mem.read(size)
                except (OSError, OverflowError, ValueError):  # [vvar], [vsyscall]
                    break
                if _holds(data, head, tail):
                    found.append(line)
                    break
                position += size if position + size >= end else size - overlap
    return found

def scan(head, reversed_tail):
    head, tail = head.encode(), reversed_tail[::-1].encode()
    return _proc_files(head, tail) + _memory(head, tail)
'''


def new_secret() -> str:
    return "sk-" + secrets.token_hex(20)


def scan_code(secret: str, printed: bool = False) -> str:
    """Code whose last value (or printed repr) is (where the secret was found, whether the
    canary was found)."""
    half = len(secret) // 2
    canary = secrets.token_hex(12)
    outcome = (f"(scan({secret[:half]!r}, {secret[half:][::-1]!r}), "
               f"bool(scan({canary[:12]!r}, {canary[12:][::-1]!r})))")
    return (SCANNER + f"_canary = {canary[:12]!r} + {canary[12:]!r}\n"
            + (f"print(repr({outcome}))" if printed else outcome))


def assert_clean(text: str | None, where: str) -> None:
    """text: the kernel's repr of scan_code's value."""
    assert text is not None, f"no scan result from the {where} kernel"
    found, canary_found = eval(text)  # a repr of a list of str and a bool
    assert canary_found, f"the scan found nothing in the {where} kernel: it cannot be trusted"
    assert found == [], f"the launcher's secret is in the {where} kernel: {found}"


@pytest.fixture
def secret(monkeypatch):
    """A random secret in this process's (the launcher's) environment."""
    value = new_secret()
    monkeypatch.setenv("OPENAI_API_KEY", value)
    return value


def test_fork_served_kernel_holds_no_secret(secret):
    # A preload set of its own: this launcher starts the server, with the secret around.
    client = forkserver.ForkServerClient(preload=["colorsys"])
    client.stop_server()
    other_tenant = new_secret()  # in the first kernel's request (its argv), for it alone
    try:
        policy = SandboxPolicy(env={"TENANT_TOKEN": other_tenant})
        with Sandbox(None, policy=policy, preload=["colorsys"]) as sb:
            assert sb.manager.provisioner.fork_served
            assert_clean(ok(sb.run(scan_code(secret))).text, "fork-served")
        # The next kernel of the same server: nothing of the first request either (the
        # server never reads a request; the child it forked for it does).
        with Sandbox(None, policy=SandboxPolicy(), preload=["colorsys"]) as sb:
            assert_clean(ok(sb.run(scan_code(secret))).text, "second fork-served")
            assert_clean(ok(sb.run(scan_code(other_tenant))).text, "next tenant's")
    finally:
        client.stop_server()


def test_cold_kernel_holds_no_secret(secret):
    with Sandbox(None, policy=SandboxPolicy(), cold_start=True) as sb:
        assert not sb.manager.provisioner.fork_served
        assert_clean(ok(sb.run(scan_code(secret))).text, "cold")


def test_pooled_kernel_holds_no_secret(secret):
    async def scan_pooled() -> str | None:
        async with KernelPool(1, kernel_name=None, policy=SandboxPolicy()) as pool:
            sandbox = await pool.get()
            try:
                return ok(await sandbox.run(scan_code(secret))).text
            finally:
                await sandbox.close()

    assert_clean(asyncio.run(scan_pooled()), "pooled")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_service_kernels_hold_no_secret(tmp_path):
    """`sandbox-kernel serve` under uvicorn: its API key and environment stay out of kernels."""
    secret, api_key, bearer = new_secret(), new_secret(), new_secret()
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"id": "team", "key": bearer}]}))
    port = _free_port()
    env = {**os.environ, "OPENAI_API_KEY": secret, "API_KEY": api_key}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        service = subprocess.Popen(
            [sys.executable, "-m", "sandbox_kernel", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--api-keys-file", str(keys), "--pool-size", "1"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, service, log)
        for name in (secret, api_key, bearer):
            answer = httpx.post(f"{url}/v1/sandbox/run", headers={"X-Api-Key": api_key},
                                json={"language": "python3",
                                      "code": scan_code(name, printed=True)},
                                timeout=120)
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["code"] == 0, body
            assert_clean(body["data"]["stdout"].strip(), "service's dify-route")
            answer = httpx.post(f"{url}/api/v1/execute",
                                headers={"Authorization": f"Bearer {bearer}"},
                                json={"code": scan_code(name)}, timeout=120)
            assert answer.status_code == 200, answer.text
            execution = answer.json()
            assert execution["error"] is None, execution
            assert_clean(execution["text"], "service's native-API")
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=120)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()


def _wait_ready(url: str, service: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert service.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the service did not become ready:\n{log.read_text()}")


def test_eg_launched_kernel_holds_no_secret(tmp_path, eg_python):
    from tests import test_enterprise_gateway_launcher as eg

    secret = new_secret()
    with eg.launch_with_eg(eg_python, tmp_path / "launcher.log",
                           extra_env={"OPENAI_API_KEY": secret}) as launch:
        kc = eg.connect_client(launch["info"])
        try:
            out = eg.execute(kc, scan_code(secret), timeout=120)
            assert out["error"] is None, out
            assert_clean(out["text"], "eg-launched")
            eg.send_request(launch["info"]["comm_port"], {"shutdown": 1})
            launch["launcher"].wait(timeout=60)
        finally:
            kc.stop_channels()
