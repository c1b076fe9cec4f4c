"""No secret of the launcher in any kernel: user code scans all of its memory and /proc/self.

A declared secret (--secret NAME=HOST) is the same: its value reaches the kernel's companion in
a sealed vault the kernel never reads, and user code finds only a placeholder in os.environ.

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
from sandbox_kernel.hosting.pool import KernelPool
from sandbox_kernel.launch import forkserver
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import evaluate, ok, write_keys

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

def _descriptors(head, tail):
    import stat as _stat
    found = []
    for name in _os.listdir('/proc/self/fd'):
        try:
            if _stat.S_ISREG(_os.fstat(int(name)).st_mode) \
                    and _holds(_os.pread(int(name), 1 << 22, 0), head, tail):
                found.append('/proc/self/fd/' + name)
        except OSError:
            continue
    return found

def _scratch(head, tail):
    found = []
    for folder, _, files in _os.walk(_os.environ['HOME']):
        for name in files:
            try:
                with open(_os.path.join(folder, name), 'rb') as handle:
                    if _holds(handle.read(1 << 24), head, tail):
                        found.append(_os.path.join(folder, name))
            except OSError:
                continue
    return found

def scan(head, reversed_tail):
    head, tail = head.encode(), reversed_tail[::-1].encode()
    environ = [name for name, value in _os.environ.items()
               if _holds(value.encode(), head, tail)]
    return (environ + _proc_files(head, tail) + _descriptors(head, tail)
            + _scratch(head, tail) + _memory(head, tail))
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
    async def scan_pooled() -> tuple[str | None, str | None]:
        async with KernelPool(1, kernel_name=None, policy=SandboxPolicy(**DECLARED)) as pool:
            sandbox = await pool.get()
            try:
                return (ok(await sandbox.run(scan_code(secret))).text,
                        ok(await sandbox.run("__import__('os').environ['OPENAI_API_KEY']")).text)
            finally:
                await sandbox.close()

    scanned, shown = asyncio.run(scan_pooled())
    assert_clean(scanned, "pooled")
    assert shown is not None and shown.startswith("'sk-sandbox-OPENAI_API_KEY-")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_service_kernels_hold_no_secret(tmp_path):
    """`sandbox-kernel serve` under uvicorn: its API key and environment stay out of kernels."""
    secret, api_key, bearer = new_secret(), new_secret(), new_secret()
    keys = tmp_path / "keys.json"
    write_keys(keys, [{"id": "team", "key": bearer}])
    port = _free_port()
    env = {**os.environ, "OPENAI_API_KEY": secret, "API_KEY": api_key}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        service = subprocess.Popen(
            [sys.executable, "-m", "sandbox_kernel", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--api-keys-file", str(keys), "--pool-size", "1",
             # OPENAI_API_KEY is a declared secret too: its network kernels get a placeholder.
             "--enable-network", "--secret", "OPENAI_API_KEY=api.example.com"],
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
        # Network kernels: the declared secret as a placeholder, its value nowhere in them.
        answer = httpx.post(f"{url}/v1/sandbox/run", headers={"X-Api-Key": api_key},
                            json={"language": "python3", "enable_network": True,
                                  "code": scan_code(secret, printed=True)}, timeout=120)
        assert answer.status_code == 200 and answer.json()["code"] == 0, answer.text
        assert_clean(answer.json()["data"]["stdout"].strip(), "service's dify-route network")
        shown = "str(__import__('os').environ.get('OPENAI_API_KEY'))"
        for code, network in ((scan_code(secret), True), (shown, True), (shown, False)):
            answer = httpx.post(f"{url}/api/v1/execute",
                                headers={"Authorization": f"Bearer {bearer}"},
                                json={"code": code, "network": network}, timeout=120)
            assert answer.status_code == 200, answer.text
            execution = answer.json()
            assert execution["error"] is None, execution
            if code != shown:
                assert_clean(execution["text"], "service's native-API network")
            elif network:
                assert execution["text"].startswith("'sk-sandbox-OPENAI_API_KEY-"), execution
            else:  # the operator's secrets are for network kernels only
                assert execution["text"] == "'None'", execution
        # A session with a secret of the caller's own: never echoed back, never in the kernel.
        mine, auth = new_secret(), {"Authorization": f"Bearer {bearer}"}
        answer = httpx.post(f"{url}/api/v1/sessions", headers=auth, timeout=120, json={
            "network": {"mode": "hosts", "allow_hosts": ["api.example.com"]},
            "secrets": {"MY_KEY": {"value": mine, "hosts": ["evil.example"]}}})
        assert answer.status_code == 400, answer.text
        assert "secret MY_KEY is for evil.example" in answer.text and mine not in answer.text
        answer = httpx.post(f"{url}/api/v1/sessions", headers=auth, timeout=120, json={
            "network": True, "secrets": {"MY_KEY": {"value": mine, "hosts": ["api.example.com"]}}})
        assert answer.status_code == 201, answer.text
        assert mine not in answer.text
        session = answer.json()["id"]
        scanning = scan_code(mine)
        for code in (scanning, "__import__('os').environ['MY_KEY']"):
            answer = httpx.post(f"{url}/api/v1/sessions/{session}/execute", headers=auth,
                                json={"code": code}, timeout=120)
            assert answer.status_code == 200 and mine not in answer.text, answer.text
            execution = answer.json()
            if code == scanning:
                assert_clean(execution["text"], "service's session")
            else:
                assert execution["text"].startswith("'sk-sandbox-MY_KEY-"), execution
        assert mine not in log.read_text()
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
    declared = ("--SandboxPolicy.timeout=30", "--SandboxPolicy.network=hosts",
                "--SandboxPolicy.allow_hosts=api.example.com",
                "--SandboxPolicy.secrets=OPENAI_API_KEY=api.example.com")
    with eg.launch_with_eg(eg_python, tmp_path / "launcher.log", policy=declared,
                           extra_env={"OPENAI_API_KEY": secret}) as launch:
        kc = eg.connect_client(launch["info"])
        try:
            out = eg.execute(kc, scan_code(secret), timeout=120)
            assert out["error"] is None, out
            assert_clean(out["text"], "eg-launched")
            out = eg.execute(kc, "__import__('os').environ['OPENAI_API_KEY']", timeout=60)
            assert out["text"].startswith("'sk-sandbox-OPENAI_API_KEY-"), out
            eg.send_request(launch["info"]["comm_port"], {"shutdown": 1})
            launch["launcher"].wait(timeout=60)
        finally:
            kc.stop_channels()


# A declared secret: its value is the launcher's OPENAI_API_KEY (the `secret` fixture).
DECLARED = {"network": "hosts", "allow_hosts": ["api.example.com"],
            "secrets": ["OPENAI_API_KEY=api.example.com"]}


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and \
                    int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _memory_holds(pid: int, value: bytes) -> bool:
    """Whether process pid's readable memory holds value (read from outside, as root)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps.read().splitlines():
            span, perms = line.split()[:2]
            if perms[0] != "r":
                continue
            start, end = (int(part, 16) for part in span.split("-"))
            try:
                mem.seek(start)
                if value in mem.read(end - start):
                    return True
            except (OSError, OverflowError, ValueError):
                continue
    return False


def assert_delivered(sb: Sandbox, secret: str, where: str) -> str:
    """The kernel holds no value and shows the placeholder; its companion holds the value.

    Returns the placeholder."""
    assert_clean(ok(sb.run(scan_code(secret))).text, where)
    shown = evaluate(sb, "__import__('os').environ['OPENAI_API_KEY']")
    assert shown.startswith("sk-sandbox-OPENAI_API_KEY-") and secret not in shown
    kernel = sb.manager.provisioner.pid
    companions = [pid for pid in _children(kernel) if _memory_holds(pid, secret.encode())]
    assert companions, f"no companion of the {where} kernel holds the secret's value"
    return str(shown)


def test_declared_secret_reaches_only_the_companion_cold(secret):
    with Sandbox(None, policy=SandboxPolicy(**DECLARED), cold_start=True) as sb:
        assert not sb.manager.provisioner.fork_served
        placeholder = assert_delivered(sb, secret, "cold")
        sb.restart()  # the same session: the same placeholder, delivered again
        assert assert_delivered(sb, secret, "restarted cold") == placeholder
    with Sandbox(None, policy=SandboxPolicy(**DECLARED), cold_start=True) as other:
        assert assert_delivered(other, secret, "other cold") != placeholder


def test_declared_secret_reaches_only_the_companion_fork_served(secret):
    client = forkserver.ForkServerClient(preload=["colorsys"])
    client.stop_server()
    try:
        with Sandbox(None, policy=SandboxPolicy(**DECLARED), preload=["colorsys"]) as sb:
            assert sb.manager.provisioner.fork_served
            assert_delivered(sb, secret, "fork-served")
            server = client.server_pid()
            assert server is not None and not _memory_holds(server, secret.encode())
    finally:
        client.stop_server()


def _cli(*args: str, env: dict[str, str] | None = None, stdin: str = "1\n"
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", *args], input=stdin,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("flags", "says"), [
    # The value typed where a host goes: refused without repeating it.
    (["--network", "hosts", "--allow-host", "api.example.com", "--secret", "KEY={value}"],
     "the right-hand side is not a host name"),
    (["--secret", "KEY=api.example.com"], "the network is off (--network off)"),
    (["--network", "hosts", "--allow-host", "other.example.com", "--secret",
      "KEY=api.example.com"], "which the network policy does not reach (--network hosts, "
     "--allow-host other.example.com)"),
    # A host granted on one port: the narrower fix is the secret's port, not a wider grant
    # (#45 item 7).
    (["--network", "hosts", "--allow-host", "localhost:8443", "--allow-address",
      "127.0.0.1:8443", "--secret", "KEY=localhost"],
     "which the network policy does not reach (--network hosts, --allow-host localhost:8443): "
     "localhost without a port is every port of it, and --allow-host grants one: name that "
     "port, --secret KEY=localhost:8443\n"),
    (["--network", "hosts", "--allow-host", "api.example.com", "--secret",
      "LD_PRELOAD=api.example.com"], "not a name a secret can have"),
    (["--network", "hosts", "--allow-host", "api.example.com", "--secret",
      "HTTPS_PROXY=api.example.com"], "not one the sandbox sets"),
    # The index's token typed into its URL (or expanded there by the shell).
    (["--network", "hosts", "--allow-host", "index.example", "--package-index",
      "https://user:{value}@index.example/simple"],
     "--package-index: its credentials would be readable by user code; declare the token as "
     "a secret"),
])
@pytest.mark.parametrize("command", ["run", "install"])
def test_unusable_secrets_are_refused_before_any_kernel(tmp_path, command, flags, says):
    value = "sk-" + secrets.token_hex(8) + "/+=="
    where = ["-"] if command == "run" else ["--prefix", str(tmp_path)]
    done = _cli(command, *where, *[flag.format(value=value) for flag in flags])
    assert done.returncode == 2, done
    assert says in done.stderr
    assert value not in done.stderr + done.stdout
    assert not list(tmp_path.rglob("kernel.json"))


def test_secrets_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "secrets.json"
    value = new_secret()
    path.write_text(json.dumps({"KEY": {"value": value, "hosts": ["api.example.com"]}}))
    path.chmod(0o644)
    done = _cli("run", "-", "--network", "hosts", "--allow-host", "api.example.com",
                "--secrets-file", str(path))
    assert done.returncode == 2, done
    assert f"--secrets-file {path}: mode 0644 lets others read it; make it readable by its " \
           f"owner only (chmod 600 {path})" in done.stderr
    assert value not in done.stderr


def test_install_writes_names_and_hosts_only(tmp_path):
    value, password = new_secret(), secrets.token_hex(8)
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps({"GH": {"value": value, "hosts": ["api.github.com"]}}))
    path.chmod(0o600)
    done = _cli("install", "--prefix", str(tmp_path / "prefix"), "--network", "hosts",
                "--allow-host", "api.example.com", "--allow-host", "api.github.com",
                "--secret", "OPENAI_API_KEY=api.example.com", "--secrets-file", str(path),
                "--upstream-proxy", f"http://proxyuser:{password}@proxy.example:3128",
                env={"OPENAI_API_KEY": value})
    assert done.returncode == 0, done.stderr
    (spec,) = (tmp_path / "prefix").rglob("kernel.json")
    text = spec.read_text()
    assert value not in text and password not in text and "proxyuser" not in text
    argv = json.loads(text)["argv"]
    assert "--SandboxPolicy.secrets=OPENAI_API_KEY=api.example.com" in argv
    assert f"--SandboxPolicy.secrets_file={path}" in argv
    assert "--SandboxPolicy.upstream_proxy=http://proxy.example:3128" in argv


def test_pip_and_jupyter_configuration_is_unreadable(sandbox):
    """Where operators put index tokens (pip.conf) and what only launchers read (kernelspecs,
    Jupyter config): EACCES from Landlock, while their neighbours stay readable."""
    hidden = [path for path in (
        "/etc/xdg/pip/pip.conf", "/usr/local/etc/npmrc",
        os.path.join(sys.prefix, "share", "jupyter", "kernels", "python3", "kernel.json"),
        os.path.join(sys.prefix, "pip.conf")) if os.path.exists(path)]
    assert hidden, "none of the configuration files exists on this host: nothing is shown"
    readable = [path for path in ("/etc/xdg/user-dirs.conf", os.path.join(
        sys.prefix, "pyvenv.cfg")) if os.path.exists(path)]
    outcome = evaluate(sandbox, f"""
import errno as _errno
def _try(path):
    try:
        open(path, 'rb').close()
        return 'read'
    except OSError as exc:
        return type(exc).__name__, _errno.errorcode[exc.errno]
{{path: _try(path) for path in {hidden + readable!r}}}
""")
    assert outcome == {**dict.fromkeys(hidden, ("PermissionError", "EACCES")),
                       **dict.fromkeys(readable, "read")}


class _Upstream:
    """A stand-in upstream proxy on 127.0.0.1 that records each request head."""

    def __init__(self) -> None:
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.heads: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                self.heads.append(head)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n"
                             b"\r\nok")


def test_upstream_proxy_credentials_only_in_the_companion():
    import base64

    password = new_secret()
    upstream = _Upstream()
    url = f"http://relay:{password}@127.0.0.1:{upstream.port}"
    try:
        with Sandbox(None, policy=SandboxPolicy(network="on", upstream_proxy=url)) as sb:
            assert_clean(ok(sb.run(scan_code(password))).text, "upstream-proxied")
            # A tunnel, as every HTTPS client asks for one: its CONNECT reaches the upstream.
            answer = evaluate(sb, """
import socket as _socket
with _socket.create_connection(('127.0.0.1', 3128), timeout=30) as _proxy:
    _proxy.sendall(b'CONNECT origin.example:443 HTTP/1.1\\r\\nHost: origin.example:443\\r\\n\\r\\n')
    _answer = _proxy.recv(65536)
_answer.split(b'\\r\\n')[0]
""")
            assert answer.startswith(b"HTTP/1.1 200"), answer
            # Plain HTTP goes to the upstream as a request of its own, with the credentials too.
            answer = evaluate(sb, """
import urllib.request as _request
_request.urlopen('http://origin.example/plain', timeout=30).read()
""")
            assert answer == b"ok", answer
            info = sb.kernel_info()["sandbox"]["policy"]
            assert info["upstream_proxy"] == f"http://127.0.0.1:{upstream.port}"
    finally:
        upstream.listener.close()
    credential = base64.b64encode(f"relay:{password}".encode()).decode()
    sent = f"Proxy-Authorization: Basic {credential}".lower().encode()
    for start in (b"CONNECT origin.example:443 ", b"GET http://origin.example/plain "):
        assert any(head.startswith(start) and sent in head.lower()
                   for head in upstream.heads), upstream.heads


def test_run_with_a_declared_secret(secret):
    """`sandbox-kernel run` (a stateless run: on a ZMQ kernel when it has credentials)."""
    code = scan_code(secret, printed=True) + "\nprint(__import__('os').environ['OPENAI_API_KEY'])\n"
    done = _cli("run", "-", "--network", "hosts", "--allow-host", "api.example.com",
                "--secret", "OPENAI_API_KEY=api.example.com", stdin=code)
    assert done.returncode == 0, done.stderr
    printed = [line for line in done.stderr.splitlines() if line.strip()]
    assert_clean(printed[-2], "run")
    assert printed[-1].startswith("sk-sandbox-OPENAI_API_KEY-")
    assert secret not in done.stdout + done.stderr


def test_a_callers_own_secret_for_one_sandbox():
    """Sandbox(secrets=...): the caller's value, not the launcher's environment's."""
    from sandbox_kernel.secrets import SecretError

    value = new_secret()
    policy = SandboxPolicy(network="hosts", allow_hosts=["api.example.com"])
    given = {"OPENAI_API_KEY": {"value": value, "hosts": ["api.example.com"]}}
    with Sandbox(None, policy=policy, secrets=given) as sb:
        assert_delivered(sb, value, "caller's")
    with pytest.raises(SecretError, match="which the network policy does not reach") as refused:
        Sandbox(None, policy=policy,
                secrets={"OPENAI_API_KEY": {"value": value, "hosts": ["evil.example"]}})
    assert value not in str(refused.value)


def test_mcp_runs_and_sessions_with_secrets(secret, tmp_path):
    """The MCP server: the operator's declared secret in a fresh run, the caller's own in a
    session, each a placeholder in the kernel and its value only in the companion."""
    from tests.mcp_clients import stdio

    mcp = stdio(tmp_path / "mcp.log", "--network", "hosts", "--allow-host", "api.example.com",
                "--secret", "OPENAI_API_KEY=api.example.com")
    try:
        def printed(code: str, **arguments: str) -> list[str]:
            answers = [mcp.tool("run_python", {"code": code, **arguments})]
            while answers[-1].structured_content.get("status") == "running":  # past patience
                answers.append(mcp.tool("wait_run", {"run": answers[0].structured_content["run"]}))
            assert not any(answer.is_error for answer in answers), answers[-1].content
            return "".join(answer.structured_content["stdout"] for answer in answers).split()

        shown = "print(__import__('os').environ['{}'])"
        found = printed(scan_code(secret, printed=True) + "\n" + shown.format("OPENAI_API_KEY"))
        assert_clean(found[0] + " " + found[1], "MCP fresh run")
        assert found[2].startswith("sk-sandbox-OPENAI_API_KEY-")
        mine = new_secret()
        answer = mcp.tool("create_session", {"secrets": {
            "MY_KEY": {"value": mine, "hosts": ["evil.example"]}}})
        assert answer.is_error and mine not in str(answer.content)
        assert "secret MY_KEY is for evil.example" in str(answer.content)
        answer = mcp.tool("create_session", {"secrets": {
            "MY_KEY": {"value": mine, "hosts": ["api.example.com"]}}})
        assert not answer.is_error and mine not in str(answer.content), answer.content
        session = answer.structured_content["session"]
        found = printed(scan_code(mine, printed=True) + "\n" + shown.format("MY_KEY"),
                        session=session)
        assert_clean(found[0] + " " + found[1], "MCP session")
        assert found[2].startswith("sk-sandbox-MY_KEY-")
    finally:
        mcp.close()
    assert mine not in (tmp_path / "mcp.log").read_text()
# The proxy adds a declared secret (#33): a real kernel's clients reach an HTTPS origin of their
# own CA (--upstream-ca) with the value; user code sees only the placeholder, even in an echo.

ECHOED = """
import json, os, ssl, urllib.request
import httpx, requests
url = 'https://localhost:{port}/echo'
bearer = {{'Authorization': 'Bearer ' + os.environ['API_KEY']}}
with urllib.request.urlopen(urllib.request.Request(url, headers=bearer), timeout=10) as answer:
    got = [answer.read().decode()]
got.append(requests.get(url, headers=bearer, timeout=10).text)
got.append(httpx.get(url, headers=bearer, timeout=10).text)
import asyncio, concurrent.futures, aiohttp, openai
async def fetch():
    async with aiohttp.ClientSession(trust_env=True) as session, \
            session.get(url, headers=bearer) as answer:
        return await answer.text()
with concurrent.futures.ThreadPoolExecutor(1) as thread:  # the kernel's own loop is running
    got.append(thread.submit(asyncio.run, fetch()).result(timeout=20))
sdk = openai.OpenAI(api_key=os.environ['API_KEY'], base_url='https://localhost:{port}/v1',
                    max_retries=0, timeout=10)
(model,) = sdk.models.list().data  # the origin names its one model after what it was sent
got.append(json.dumps({{'authorization': model.id}}))
trust = {{name: os.environ.get(name) for name in
         ('SSL_CERT_FILE', 'REQUESTS_CA_BUNDLE', 'PIP_CERT', 'CURL_CA_BUNDLE')}}
bundle = open(trust['SSL_CERT_FILE']).read()
reaper = int(open('/proc/self/task/%d/children' % os.getpid()).read().split()[0])
reads = []
for part in ('mem', 'environ', 'maps', 'fd'):
    try:
        (os.listdir if part == 'fd' else lambda p: open(p, 'rb').read(64))(
            '/proc/%d/%s' % (reaper, part))
        reads.append(part + ': read')
    except OSError as exc:
        reads.append(part + ': ' + type(exc).__name__)
keys = [os.path.join(top, name)
        for top, _, names in os.walk(os.path.dirname(trust['SSL_CERT_FILE'])) for name in names
        if b'PRIVATE KEY' in open(os.path.join(top, name), 'rb').read()]
(os.environ['API_KEY'], got, trust, bundle.count('BEGIN CERTIFICATE'), 'PRIVATE' in bundle,
 reads, keys)
"""


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "fork-served"])
def test_a_kernel_uses_a_secret_it_never_holds(tmp_path, monkeypatch, cold):
    import ast

    from .network_servers import Origin, self_signed, wheel_index

    value = new_secret()
    monkeypatch.setenv("API_KEY", value)
    os.chmod(tmp_path, 0o755)
    cert, key = self_signed(tmp_path, ["localhost"])
    wheel_index(tmp_path)
    origin = Origin(tmp_path, (cert, key), echo=True, token=value)
    policy = SandboxPolicy(network="hosts", allow_hosts=["localhost", "127.0.0.1"],
                           allow_addresses=[f"127.0.0.1:{origin.port}"],
                           secrets=["API_KEY=localhost"], upstream_ca=str(cert),
                           package_index=f"https://${{API_KEY}}@localhost:{origin.port}/simple/")
    try:
        with Sandbox(None, policy=policy, cold_start=cold) as sb:
            assert sb.manager.provisioner.fork_served is not cold
            echoed = ok(sb.run(ECHOED.format(port=origin.port)))
            shown, got, trust, certificates, private, reads, keys = ast.literal_eval(echoed.text)
            # The five requests the proxy added the secret to, counted in the run's usage.
            assert echoed.usage.secret_uses == {"API_KEY": 5}, echoed.usage
            assert echoed.usage.source["secret_uses"] == "kernel"
            assert shown.startswith("sk-sandbox-API_KEY-") and value not in shown
            assert len(got) == 5
            for text in got:  # urllib, requests, httpx, aiohttp, openai: each gets the placeholder
                assert value not in text and json.loads(text)["authorization"] == \
                    f"Bearer {shown}"
            assert [seen["authorization"] for seen in origin.seen[-5:]] == \
                [f"Bearer {value}"] * 5
            assert len(set(trust.values())) == 1 and None not in trust.values()
            assert certificates > 1 and not private and keys == []  # the store and the CA
            assert reads == ["mem: PermissionError", "environ: PermissionError",
                             "maps: PermissionError", "fd: PermissionError"], reads

            refused = sb.run(f"requests.get('http://127.0.0.1:{origin.port}/echo', "
                             "headers=bearer, timeout=10).raise_for_status()")
            assert refused.error is not None and refused.error.name == "HTTPError"
            assert refused.error.value.startswith(
                f"403 Client Error: the placeholder of secret API_KEY was sent to "
                f"127.0.0.1:{origin.port}, which is not its host (localhost); send API_KEY "
                "only to localhost"), refused.error.value
            if not cold:
                return  # the index's token once is enough: the proxy is the same
            installed = sb.run("%pip install -q tinypkg\nimport tinypkg\ntinypkg.VALUE")
            assert ok(installed).text == "42", installed
            assert any(seen["path"].startswith("/simple/tinypkg") and "authorization" in seen
                       for seen in origin.seen)
    finally:
        origin.close()
