"""Network by host (#21), from real sandboxed kernels: a namespace of each kernel's own, egress
only through the policy proxy, never the host's loopback or another kernel's channels.

The origins are test servers on the host's 127.0.0.1 (no other address may be used here); the
kernels are told to treat exactly their ports as public with --allow-address 127.0.0.1:PORT.
"""

from __future__ import annotations

import ast
import json
import os
import time

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.policy import SandboxPolicy

from .helpers import ok
from .network_servers import BODY, Listener, Origin, self_signed, wheel_index

PROXY = "http://127.0.0.1:3128"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An HTTP origin (also a wheel index), an HTTPS origin, a host listener, the CA file."""
    directory = tmp_path_factory.mktemp("origin")
    os.chmod(directory, 0o755)
    cert, _ = self_signed(directory, ["localhost", "other.test"])
    os.chmod(cert, 0o644)
    wheel_index(directory)
    http_origin, https_origin, listener = Origin(directory), Origin(directory, (cert, _)), \
        Listener()
    yield {"http": http_origin.port, "https": https_origin.port, "listener": listener,
           "ca": str(cert), "dir": str(directory)}
    http_origin.close()
    https_origin.close()
    listener.close()


@pytest.fixture(scope="module")
def hosts_kernel(served, tmp_path_factory):
    """--network hosts: the name localhost (any port), the origins' two ports granted."""
    audit = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    policy = SandboxPolicy(
        network="hosts", allow_hosts=["localhost"],
        allow_addresses=[f"127.0.0.1:{served['http']}", f"127.0.0.1:{served['https']}"],
        read_paths=_pip_reads(served), audit_log=str(audit))
    with Sandbox(None, policy=policy) as sb:
        sb.audit = audit
        yield sb


@pytest.fixture(scope="module")
def off_kernel(served):
    """--network off, with the same file grants as hosts_kernel."""
    with Sandbox(None, policy=SandboxPolicy(read_paths=_pip_reads(served))) as sb:
        yield sb


def _pip_reads(served):
    # distro (pip's User-Agent) reads /etc/debian_version where there is one
    return [served["dir"], *[p for p in ["/etc/debian_version"] if os.path.exists(p)]]


def _value(sandbox, code):
    execution = ok(sandbox.run(code))
    return ast.literal_eval(execution.text)


def _egress_records(path, count, timeout=10.0):
    """The audit file's egress records, once there are count of them."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        records = [entry for entry in map(json.loads, lines) if entry.get("event") == "egress"]
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def test_allowed_name_over_http_and_https_with_requests_and_urllib(hosts_kernel, served):
    before = len(_egress_records(hosts_kernel.audit, 0, 0))
    code = f"""
import requests, ssl, urllib.request
ca = {served['ca']!r}
got = [requests.get('http://localhost:{served['http']}/', timeout=10).text,
       requests.get('https://localhost:{served['https']}/', verify=ca, timeout=10).text,
       urllib.request.urlopen('http://localhost:{served['http']}/', timeout=10).read().decode(),
       urllib.request.urlopen('https://localhost:{served['https']}/', timeout=10,
                              context=ssl.create_default_context(cafile=ca)).read().decode()]
got
"""
    body = BODY.decode()
    assert _value(hosts_kernel, code) == [
        f"{body} host=localhost:{served['http']}", f"{body} host=localhost:{served['https']}",
        f"{body} host=localhost:{served['http']}", f"{body} host=localhost:{served['https']}"]
    records = _egress_records(hosts_kernel.audit, before + 4)[before:]
    assert [(r["method"], r["host"], r["port"], r["allowed"]) for r in records] == [
        ("GET", "localhost", served["http"], True), ("CONNECT", "localhost", served["https"], True),
        ("GET", "localhost", served["http"], True), ("CONNECT", "localhost", served["https"], True)]
    assert all(r["received"] > len(BODY) and r["sent"] > 0 and r["address"] == "127.0.0.1"
               and r["kernel"] and r["duration"] >= 0 for r in records)
    assert records[1]["sni"] == "localhost"


REFUSED = [
    ("http://example.com/", "example.com:80 is not on the allowlist; allow it with --allow-host "
                            "example.com (or example.com:80)"),
    ("https://example.com/", "example.com:443 is not on the allowlist; allow it with "
                             "--allow-host example.com (or example.com:443)"),
    ("http://8.8.8.8/", "8.8.8.8:80 is not on the allowlist; allow it with --allow-host "
                            "8.8.8.8"),
    ("http://127.0.0.2/", "127.0.0.2, a loopback address the sandbox never reaches; grant it "
                          "with --allow-address 127.0.0.2:80"),
    ("http://[::1]/", "[::1], a loopback address the sandbox never reaches"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254, a link-local (cloud "
                                                 "metadata) address the sandbox never reaches"),
    ("http://localhost:{listener}/", "localhost resolves to 127.0.0.1, a loopback address the "
                                     "sandbox never reaches; grant it with --allow-address "
                                     "127.0.0.1:{listener}"),
    ("https://localhost:{listener}/", "localhost resolves to 127.0.0.1, a loopback address"),
]


def test_refused_destinations_are_explained_and_recorded(hosts_kernel, served):
    listener = served["listener"]
    urls = [url.format(listener=listener.port) for url, _ in REFUSED]
    code = f"""
import requests
said = []
for url in {urls!r}:
    try:
        answer = requests.get(url, timeout=10)
        said.append(f"{{answer.status_code}} {{answer.reason}}")
    except requests.exceptions.ProxyError as exc:
        said.append(str(exc))
said
"""
    before = len(_egress_records(hosts_kernel.audit, 0, 0))
    said = _value(hosts_kernel, code)
    for (url, expected), answer in zip(REFUSED, said, strict=True):
        expected = expected.format(listener=listener.port)
        if url.startswith("https"):  # requests: "Tunnel connection failed: 403 <reason>"
            assert f"Tunnel connection failed: 403 {expected}" in answer, answer
        else:
            assert answer.startswith(f"403 {expected}"), answer
    records = _egress_records(hosts_kernel.audit, before + len(REFUSED))[before:]
    assert [r["allowed"] for r in records] == [False] * len(REFUSED)
    assert all(r["reason"] for r in records)
    assert not listener.was_reached()


def test_a_tunnel_whose_tls_names_another_host_is_refused(hosts_kernel, served):
    code = f"""
import socket, ssl
raw = socket.create_connection(('127.0.0.1', 3128), timeout=10)
raw.sendall(b'CONNECT localhost:{served['https']} HTTP/1.1\\r\\nHost: localhost\\r\\n\\r\\n')
status = raw.recv(4096).split(b'\\r\\n')[0].decode()
try:
    ssl.create_default_context(cafile={served['ca']!r}).wrap_socket(
        raw, server_hostname='other.test')
    outcome = 'handshake completed'
except ssl.SSLError as exc:
    outcome = exc.reason
(status, outcome)
"""
    before = len(_egress_records(hosts_kernel.audit, 0, 0))
    assert _value(hosts_kernel, code) == ("HTTP/1.1 200 Connection established",
                                          "TLSV1_ALERT_ACCESS_DENIED")
    (record,) = _egress_records(hosts_kernel.audit, before + 1)[before:]
    assert (record["allowed"], record["sni"]) == (False, "other.test")
    assert record["reason"].startswith("TLS server name other.test differs from the CONNECT "
                                       "target localhost")


def test_udp_raw_sockets_and_direct_connections_go_nowhere(hosts_kernel, served):
    code = f"""
import errno, socket
def attempt(call):
    try:
        call()
        return 'done'
    except OSError as exc:
        return (type(exc).__name__, errno.errorcode.get(exc.errno, exc.errno), str(exc))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
outcomes = [
    attempt(lambda: udp.sendto(b'x', ('192.0.2.1', 53))),
    attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
    attempt(lambda: socket.create_connection(('192.0.2.1', 80), timeout=5)),
    attempt(lambda: socket.getaddrinfo('example.com', 80)),
    errno.errorcode[socket.socket().connect_ex(('127.0.0.1', {served['listener'].port}))],
]
outcomes
"""
    udp, raw, direct, lookup, host_loopback = _value(hosts_kernel, code)
    explained = "do not leave the kernel's own network namespace; use an HTTP client"
    assert udp[:2] == direct[:2] == ("OSError", "ENETUNREACH")
    assert udp[2].startswith("[Errno 101] Network is unreachable: the sandbox blocked "
                             "socket.sendto(): user code's network reaches only the sandbox's "
                             "egress proxy (HTTP_PROXY)") and explained in udp[2]
    assert "the sandbox blocked socket.connect()" in direct[2] and explained in direct[2]
    assert raw[:2] == ("PermissionError", "EPERM") and "creating a socket" in raw[2]
    assert lookup[0] == "gaierror" and "the sandbox resolves no names itself" in lookup[2]
    assert host_loopback == "ECONNREFUSED"  # 127.0.0.1 is the namespace's own loopback
    assert not served["listener"].was_reached()


PER_THREAD = """
import concurrent.futures, errno, os, socket, threading
from IPython import get_ipython

def probe():
    # A socket made on this thread: where does it land?
    to_host = socket.socket()
    host = errno.errorcode.get(to_host.connect_ex(('127.0.0.1', {port})), 'connected')
    to_proxy = socket.socket()
    proxy = errno.errorcode.get(to_proxy.connect_ex(('127.0.0.1', 3128)), 'connected')
    to_host.close(); to_proxy.close()
    own = os.readlink(f'/proc/self/task/{{threading.get_native_id()}}/ns/net')
    return threading.current_thread().name, own, host, proxy

kernel = get_ipython().kernel
loops = {{'IOPub': kernel.iopub_thread.io_loop, 'Control': kernel.control_thread.io_loop,
         'Shell channel': kernel.shell_channel_thread.io_loop}}
probes = [probe()]
for loop in loops.values():
    done = concurrent.futures.Future()
    loop.add_callback(lambda done=done: done.set_result(probe()))
    probes.append(done.result(10))
tasks = {{os.readlink(f'/proc/self/task/{{tid}}/ns/net') for tid in os.listdir('/proc/self/task')}}
names = sorted(t.name for t in threading.enumerate())
(probes, sorted(tasks), names, len(os.listdir('/proc/self/task')))
"""


def test_every_thread_of_the_kernel_is_in_its_private_namespace(hosts_kernel, served):
    probes, tasks, names, count = _value(hosts_kernel, PER_THREAD.format(
        port=served["listener"].port))
    launcher = os.readlink("/proc/self/ns/net")
    (private,) = tasks  # every task (ipykernel's, libzmq's I/O threads, Heartbeat) in one
    assert private != launcher and count > len(probes)
    assert {"MainThread", "IOPub", "Control", "Shell channel", "Heartbeat"} <= set(names)
    assert [name for name, *_ in probes] == ["MainThread", "IOPub", "Control", "Shell channel"]
    # each thread's socket: the host listener is not there, the egress listener is
    assert {tuple(rest) for _, *rest in probes} == {(private, "ECONNREFUSED", "connected")}
    assert not served["listener"].was_reached()


def test_a_cold_kernel_and_each_fork_served_kernel_have_namespaces_of_their_own(
        hosts_kernel, net_sandbox, served):
    """The same order holds for a kernel that is not fork-served; no two kernels share one."""
    policy = SandboxPolicy(network="hosts", allow_hosts=["localhost"])
    with Sandbox(None, policy=policy, cold_start=True) as cold:
        probes, tasks, names, _ = _value(cold, PER_THREAD.format(port=served["listener"].port))
    (private,) = tasks
    assert {tuple(rest) for _, *rest in probes} == {(private, "ECONNREFUSED", "connected")}
    assert "Heartbeat" in names
    spaces = {private, *(_value(kernel, "__import__('os').readlink('/proc/self/ns/net')")
                         for kernel in (hosts_kernel, net_sandbox))}
    assert len(spaces) == 3 and os.readlink("/proc/self/ns/net") not in spaces


OTHER_KERNEL = """
import errno, socket, time, zmq
ports = {ports!r}
direct = {{}}
for name, port in ports.items():
    s = socket.socket()
    s.settimeout(5)
    direct[name] = errno.errorcode.get(s.connect_ex(('127.0.0.1', port)), 'connected')
    s.close()
context = zmq.Context.instance()
sub = context.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b'')
sub.connect(f'tcp://127.0.0.1:{{ports["iopub"]}}')
flood = context.socket(zmq.DEALER)
flood.setsockopt(zmq.SNDHWM, 10)
flood.connect(f'tcp://127.0.0.1:{{ports["shell"]}}')
sent = 0
for _ in range(1000):
    try:
        flood.send(b'garbage' * 100, zmq.NOBLOCK)
        sent += 1
    except zmq.Again:
        break
heard = sub.poll(3000)
sub.close(0); flood.close(0)
(direct, heard, sent)
"""


@pytest.mark.parametrize("setting", ["hosts", "on"])
def test_another_kernels_channels_are_unreachable(setting, hosts_kernel, net_sandbox, sandbox):
    """A network kernel cannot connect to, subscribe to, or flood another kernel's ports."""
    attacker = hosts_kernel if setting == "hosts" else net_sandbox
    info = sandbox.manager.get_connection_info()
    ports = {name: info[f"{name}_port"] for name in ("shell", "iopub", "stdin", "control", "hb")}
    direct, heard, sent = _value(attacker, OTHER_KERNEL.format(ports=ports))
    assert direct == dict.fromkeys(ports, "ECONNREFUSED")
    # libzmq queues up to the high-water mark for a peer it never reaches, nothing more
    assert (heard, sent) == (0, 10)
    assert ok(sandbox.run("1 + 1")).text == "2"  # the victim is unharmed and still answers
    via_proxy = _value(attacker, f"import requests; r = requests.get("
                                 f"'http://localhost:{ports['shell']}/', timeout=10); "
                                 "(r.status_code, r.reason)")
    assert via_proxy[0] == 403 and "a loopback address the sandbox never reaches" in via_proxy[1]


def test_the_network_off_kernel_makes_no_socket_and_has_its_own_namespace(sandbox, served):
    code = """
import os, socket
try:
    socket.socket()
    outcome = 'made'
except PermissionError as exc:
    outcome = str(exc)
(outcome, os.readlink('/proc/self/ns/net'), [k for k in os.environ if 'proxy' in k.lower()])
"""
    outcome, namespace, proxies = _value(sandbox, code)
    assert outcome.startswith("[Errno 1] Operation not permitted: the sandbox blocked creating "
                              "a socket: the network is off")
    assert namespace != os.readlink("/proc/self/ns/net") and proxies == []


# pip copies the wheel with shutil.copy, whose chmod the sandbox refuses (the %pip of #20 deals
# with that); the copy's mode does not matter here, what came through the proxy does.
PIP_DOWNLOAD = """
import os, shutil
from pip._internal.cli.main import main as pip
shutil.copymode = lambda *args, **kwargs: None
status = pip(['download', '--no-deps', '--disable-pip-version-check', '--no-cache-dir',
              '--retries', '0', '--timeout', '10', '--index-url', {index!r},
              '--dest', 'wheels', '--log', 'pip.log', '--quiet', 'tinypkg'])
log = open('pip.log').read()
os.remove('pip.log')
(status, sorted(os.listdir('wheels')) if os.path.isdir('wheels') else [], log)
"""


def test_pip_download_through_hosts_and_explained_failure_with_off(hosts_kernel, off_kernel,
                                                                  served):
    index = f"http://localhost:{served['http']}/simple/"
    status, files, output = _value(hosts_kernel, PIP_DOWNLOAD.format(index=index))
    assert (status, files) == (0, ["tinypkg-1.0-py3-none-any.whl"]), output
    status, files, output = _value(off_kernel, PIP_DOWNLOAD.format(index=index))
    assert (status, files) != (0, ["tinypkg-1.0-py3-none-any.whl"])
    assert "the sandbox blocked creating a socket: the network is off" in output, output


def test_the_kernel_reports_its_network_layer(hosts_kernel):
    layer = hosts_kernel.kernel_info()["sandbox"]["layers"]["network"]
    assert layer["active"] is True and layer["mode"] == "hosts" and layer["owner"] == "root"
    assert layer["namespace"] != layer["launcher"]
    assert layer["egress"]["proxy"] == PROXY

