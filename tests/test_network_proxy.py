"""The egress proxy on its own, served in this process: rules, CONNECT, SNI, chaining, records.

(The proxy runs unconfined in a kernel's reaper, so testing it outside a kernel loses nothing;
tests/test_network.py drives it from real sandboxed kernels.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import threading
import time

import pytest
import requests

from sandbox_kernel.confine.egress import tls
from sandbox_kernel.confine.egress.proxy import Connection, EgressProxy
from sandbox_kernel.confine.egress.rules import EgressRules, RuleError, Upstream, parse_host_entry

from .network_servers import BODY, Catcher, Listener, Origin, self_signed


class Records:
    """A recorder keeping what the proxy writes: each connection's last record, the opens."""

    def __init__(self) -> None:
        self.ended: list[Connection] = []
        self.opened: list[Connection] = []
        self.flushes = 0

        self.secrets: list[Connection] = []  # "egress-secret": a request a secret was added to

    def __call__(self, entry: Connection) -> None:
        {"egress-open": self.opened, "egress-secret": self.secrets}.get(
            entry.event, self.ended).append(entry)

    def flush(self) -> None:
        self.flushes += 1


class Served:
    """An EgressProxy on 127.0.0.1 in a thread of its own, and the records it wrote."""

    def __init__(self, rules: EgressRules, upstream: Upstream | None = None,
                 record: object = None, **options: object) -> None:
        self.recorder = Records()
        self.records = self.recorder.ended
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.proxy = EgressProxy(rules, "k1", record or self.recorder, upstream,
                                 **options)  # type: ignore[arg-type]
        self.errors: list[dict[str, object]] = []  # what escaped a handler (nothing may)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        async def serve() -> None:
            asyncio.get_running_loop().set_exception_handler(
                lambda loop, context: self.errors.append(context))
            await self.proxy.serve(self.sock)

        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(serve())

    def get(self, url: str, **kwargs: object) -> requests.Response:
        return requests.get(url, proxies={"http": self.url, "https": self.url}, timeout=10,
                            **kwargs)  # type: ignore[arg-type]

    def wait(self, count: int) -> list[Connection]:
        """The records, once count of them are written (each is written as its connection ends)."""
        for _ in range(500):
            if len(self.records) >= count:
                break
            threading.Event().wait(0.01)
        return self.records

    def close(self) -> None:
        """Stop the proxy as the reaper does at the kernel's end, and wait for it to finish."""
        self.proxy.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()
        assert self.errors == []


@pytest.fixture(scope="module")
def origins(tmp_path_factory):
    directory = tmp_path_factory.mktemp("origin")
    cert = self_signed(directory, ["localhost", "other.test"])
    http_origin, https_origin = Origin(directory), Origin(directory, cert)
    yield http_origin, https_origin, str(cert[0])
    http_origin.close()
    https_origin.close()


def _rules(mode: str, hosts: list[str], grants: list[str]) -> EgressRules:
    return EgressRules.parse(mode, hosts, grants)


@pytest.fixture
def proxy(origins):
    http_origin, https_origin, _ = origins
    ports = (http_origin.port, https_origin.port)
    served = Served(_rules("hosts", [f"localhost:{port}" for port in ports],
                           [f"127.0.0.1:{port}" for port in ports]))
    yield served
    served.close()


def test_allowed_name_over_http_and_https(proxy, origins):
    http_origin, https_origin, ca = origins
    plain = proxy.get(f"http://localhost:{http_origin.port}/")
    assert (plain.status_code, plain.content) == (200, BODY + f" host=localhost:{http_origin.port}"
                                                  .encode())
    secure = proxy.get(f"https://localhost:{https_origin.port}/", verify=ca)
    assert secure.status_code == 200 and secure.content.startswith(BODY)
    first, second = proxy.wait(2)
    assert (first.method, first.host, first.port, first.address, first.allowed) == (
        "GET", "localhost", http_origin.port, "127.0.0.1", True)
    assert first.received > len(BODY) and first.sent > 0
    assert (second.method, second.allowed, second.sni) == ("CONNECT", True, "localhost")
    entry = second.as_dict()
    assert set(entry) >= {"kernel", "host", "port", "allowed", "sent", "received", "duration"}
    assert entry["kernel"] == "k1" and entry["received"] > 0


@pytest.mark.parametrize(("url", "said"), [
    ("http://example.com/", "example.com:80 is not on the allowlist; allow it with "
                            "--allow-host example.com"),
    ("https://example.com/", "example.com:443 is not on the allowlist"),
    ("http://8.8.8.8/", "8.8.8.8:80 is not on the allowlist"),
    ("http://127.0.0.2/", "127.0.0.2, a loopback address the sandbox never reaches"),
    ("http://[::1]:80/", "[::1], a loopback address the sandbox never reaches; grant it with "
                         "--allow-address [::1]:80"),
    ("http://[2606:4700::1]:80/", "2606:4700::1:80 is not on the allowlist; allow it with "
                                "--allow-host [2606:4700::1]"),
])
def test_names_off_the_list_are_refused_with_the_setting_that_allows_them(proxy, url, said):
    if url.startswith("https"):
        with pytest.raises(requests.exceptions.ProxyError, match="403 " + said):
            proxy.get(url)
    else:
        answer = proxy.get(url)
        assert answer.status_code == 403 and said in answer.reason
        assert said in answer.text
    (record,) = proxy.wait(1)
    assert not record.allowed and said in record.reason


def test_a_listed_name_that_resolves_to_loopback_is_refused(origins):
    listener = Listener()
    served = Served(_rules("hosts", ["localhost", "*.localhost"], []))
    try:
        answer = served.get(f"http://localhost:{listener.port}/")
        assert answer.status_code == 403
        assert answer.reason == (
            f"localhost resolves to 127.0.0.1, a loopback address the sandbox never reaches; "
            f"grant it with --allow-address 127.0.0.1:{listener.port} (only for a service meant "
            "for user code)")
        assert not listener.was_reached()
    finally:
        served.close()
        listener.close()


@pytest.mark.parametrize(("host", "kind"), [
    ("169.254.169.254", "link-local (cloud metadata)"), ("10.1.2.3", "private or reserved"),
    ("127.0.0.1", "loopback"), ("[::1]", "loopback"), ("[::ffff:127.0.0.1]", "loopback"),
    ("0.0.0.0", "private or reserved"), ("192.168.1.1", "private or reserved"),
])
def test_network_on_still_refuses_private_addresses(host, kind):
    served = Served(_rules("on", [], []))
    try:
        answer = served.get(f"http://{host}:8080/")
        assert answer.status_code == 403 and f"a {kind} address the sandbox never reaches" \
            in answer.reason
    finally:
        served.close()


def test_sni_naming_another_host_is_refused(proxy, origins):
    _, https_origin, ca = origins
    with socket.create_connection(proxy.url.removeprefix("http://").split(":")) as raw:
        raw.sendall(f"CONNECT localhost:{https_origin.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        context = ssl.create_default_context(cafile=ca)
        with pytest.raises(ssl.SSLError, match="ACCESS_DENIED"):
            context.wrap_socket(raw, server_hostname="other.test")
    (record,) = proxy.wait(1)
    assert (record.allowed, record.sni) == (False, "other.test")
    assert record.reason.startswith("TLS server name other.test differs from the CONNECT "
                                    "target localhost")


def test_a_tunnel_without_tls_is_refused_in_hosts_mode(proxy, origins):
    http_origin, _, _ = origins
    with socket.create_connection(proxy.url.removeprefix("http://").split(":")) as raw:
        raw.sendall(f"CONNECT localhost:{http_origin.port} HTTP/1.1\r\nHost: x\r\n\r\n"
                    "GET / HTTP/1.0\r\n\r\n".encode())
        answer = b""
        while chunk := raw.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and BODY not in answer
    (record,) = proxy.wait(1)
    assert not record.allowed and "does not carry TLS" in record.reason


def test_chained_through_an_upstream_proxy(origins):
    http_origin, https_origin, ca = origins
    grants = [f"127.0.0.1:{http_origin.port}", f"127.0.0.1:{https_origin.port}"]
    upstream = Served(_rules("on", [], grants))
    host, port = upstream.url.removeprefix("http://").split(":")
    served = Served(_rules("hosts", ["localhost"], grants), Upstream(host, int(port)))
    try:
        assert served.get(f"http://localhost:{http_origin.port}/").content.startswith(BODY)
        assert served.get(f"https://localhost:{https_origin.port}/", verify=ca).status_code == 200
        assert [r.allowed for r in upstream.wait(2)] == [True, True]
        assert [r.address for r in served.wait(2)] == [f"upstream {host}:{port}"] * 2
        refused = served.get("http://example.com/")
        assert refused.status_code == 403 and len(upstream.records) == 2
    finally:
        served.close()
        upstream.close()


def test_upstream_urls():
    assert Upstream.parse("http://proxy.corp:8080") == Upstream("proxy.corp", 8080)
    assert Upstream.parse("ssrf_proxy:3128") == Upstream("ssrf_proxy", 3128)
    assert Upstream.parse("http://u%40x:p@h:1").authorization == "Basic dUB4OnA="
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        Upstream.parse("socks5://h:1")


def test_allowlist_entries():
    rules = _rules("hosts", ["api.openai.com", "*.files.example.org:443", "1.1.1.0/24",
                             "[2606:4700::1111]:443"], [])
    assert rules.check_name("api.openai.com", 8443) is None
    assert rules.check_name("a.files.example.org", 443) is None
    assert rules.check_name("a.b.files.example.org", 443) is None
    assert rules.check_name("files.example.org", 443) is not None  # the apex is not a subdomain
    assert rules.check_name("a.files.example.org", 80) is not None
    assert rules.check_name("evilfiles.example.org", 443) is not None
    assert rules.check_name("1.1.1.77", 22) is None
    assert rules.check_name("2606:4700::1111", 443) is None
    assert rules.check_name("2606:4700::1111", 80) is not None
    for bad in ("exa mple.com", "http://x", "a:0", "[::1", "-a.com"):
        with pytest.raises(RuleError):
            parse_host_entry(bad)
    with pytest.raises(RuleError, match="choose one of off, hosts, on"):
        EgressRules.parse("some", [], [])


def test_server_name_of_a_real_client_hello():
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname="a.files.example.org")
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    hello = outgoing.read()
    assert tls.hello_length(hello[:10]) is None
    assert tls.hello_length(hello) == len(hello)
    assert tls.server_name(hello) == "a.files.example.org"
    with pytest.raises(tls.NotTLS):
        tls.hello_length(b"GET / HTTP/1.1\r\n")


class Log:
    """A LineSink keeping its lines."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, line: bytes) -> None:
        self.lines.append(line)


def test_audit_sink_writes_json_lines_and_the_log_only_without_a_file(tmp_path):
    from sandbox_kernel.confine.egress.proxy import AuditSink

    path = tmp_path / "audit.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    refused = Connection("k9", method="CONNECT", host="ix.example.org", port=443,
                         reason="refused x")
    try:
        log = Log()
        AuditSink(fd, log)(refused)
    finally:
        os.close(fd)
    (entry,) = map(json.loads, path.read_text().splitlines())
    assert (entry["kernel"], entry["event"], entry["host"], entry["allowed"]) == (
        "k9", "egress", "ix.example.org", False)
    assert log.lines == []  # the launcher's terminal is the user's: nothing of the record
    AuditSink(None, log)(refused)  # no audit file could be opened: the log keeps the record
    assert log.lines == [b"sandbox-kernel audit: kernel k9: egress refused CONNECT "
                         b"ix.example.org:443: refused x\n"]


def _file_records(path, wanted, timeout=10.0):
    """The JSON records of path, once wanted(records) holds (or the time is up)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [json.loads(line) for line in path.read_text().splitlines()]
        if wanted(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _refused_requests(served: Served, count: int) -> None:
    for _ in range(count):
        with socket.create_connection(served.url.removeprefix("http://").split(":")) as raw:
            raw.sendall(b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n")
            assert raw.recv(4096).startswith(b"HTTP/1.1 403 example.com:80 is not on the")


def test_a_refusal_flood_never_hides_an_allowed_connection(origins, tmp_path):
    """300 refusals spend the refusals' budget; the allowed connection after them is written
    (at its open and its end), and every refusal is a record or in a `suppressed` count."""
    from sandbox_kernel.confine.egress.proxy import AuditSink

    http_origin, _, _ = origins
    path = tmp_path / "audit.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    served = Served(_rules("hosts", [f"localhost:{http_origin.port}"],
                           [f"127.0.0.1:{http_origin.port}"]), record=AuditSink(fd, Log()))
    try:
        _refused_requests(served, 300)
        assert served.get(f"http://localhost:{http_origin.port}/").content.startswith(BODY)
        found = _file_records(path, lambda found: any(
            r.get("allowed") and r["event"] == "egress" for r in found))
    finally:
        served.close()
        os.close(fd)
    allowed = [(r["event"], r["host"], r["port"]) for r in found if r.get("allowed")]
    assert allowed == [("egress-open", "localhost", http_origin.port),
                       ("egress", "localhost", http_origin.port)]
    refused = [r for r in found if r.get("allowed") is False]
    suppressed = sum(r.get("suppressed", 0) for r in found)
    assert len(refused) < 300 and len(refused) + suppressed == 300


def test_the_count_of_refusals_left_out_is_written_without_a_later_record(tmp_path):
    from sandbox_kernel.confine.egress.proxy import AuditSink

    path = tmp_path / "audit.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    served = Served(_rules("hosts", [], []), record=AuditSink(fd, Log()))
    try:
        _refused_requests(served, 150)

        def counted(found: list[dict[str, object]]) -> int:
            return sum(1 for r in found if r.get("allowed") is False) + sum(
                int(r.get("suppressed", 0)) for r in found)  # type: ignore[call-overload]

        found = _file_records(path, lambda found: counted(found) == 150, timeout=3.0)
        assert any("suppressed" in r for r in found) and counted(found) == 150  # within 1 s
    finally:
        served.close()
        os.close(fd)


def test_a_connection_open_at_the_end_is_recorded_at_open_and_at_the_end():
    listener = Catcher()
    served = Served(_rules("on", [], [f"127.0.0.1:{listener.port}"]))
    try:
        with socket.create_connection(served.url.removeprefix("http://").split(":")) as raw:
            raw.sendall(f"CONNECT 127.0.0.1:{listener.port} HTTP/1.1\r\nHost: x\r\n\r\n"
                        "held".encode())
            assert raw.recv(4096).startswith(b"HTTP/1.1 200")
            for _ in range(500):
                if served.recorder.opened:
                    break
                time.sleep(0.01)
            (opened,) = served.recorder.opened
            assert (opened.allowed, opened.host, opened.address) == (
                True, "127.0.0.1", "127.0.0.1")
            served.close()  # the kernel's end, while the tunnel is open
        (ended,) = served.records
        assert (ended.event, ended.allowed, ended.reason, ended.sent) == (
            "egress", True, "cut when the kernel ended", 4)
        assert served.recorder.flushes >= 1  # and the sink was flushed at the end
    finally:
        listener.close()


def _client_hello(name: str | None) -> bytes:
    context = ssl.create_default_context()
    if name is None:
        context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


def _through_tunnel(served: Served, target: str, payload: bytes) -> bytes:
    """What the client hears after CONNECT target and payload, then a half-close."""
    with socket.create_connection(served.url.removeprefix("http://").split(":"),
                                  timeout=10) as raw:
        raw.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode() + payload)
        raw.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := raw.recv(4096):
            answer += chunk
    return answer


ENDED = "the tunnel ended before a whole TLS ClientHello (and the records sent with it)"


@pytest.mark.parametrize(("payload", "reason"), [
    # A record header promising 16 KiB, then plain commands, then the half-close.
    (b"\x16\x03\x01\x40\x00PING\r\nSET key value\r\n", ENDED),
    (_client_hello(None), "the TLS ClientHello names no server (SNI), so it cannot be "
                          "checked; send the host name in TLS (every https:// client does)"),
    *[(_client_hello("localhost") + b"\x16" * extra, ENDED) for extra in (1, 2, 3, 4)],
    (_client_hello("localhost") + b"PING\r\n", "the tunnel does not carry TLS, so the server "
                                                "name cannot be checked"),
    (_client_hello("localhost")[:-1], ENDED),
])
def test_hosts_mode_tunnels_forward_nothing_but_a_whole_hello_naming_the_host(payload, reason):
    catcher = Catcher()
    served = Served(_rules("hosts", [f"localhost:{catcher.port}"],
                           [f"127.0.0.1:{catcher.port}"]))
    try:
        answer = _through_tunnel(served, f"localhost:{catcher.port}", payload)
        assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n" + \
            tls.ACCESS_DENIED_ALERT
        (record,) = served.wait(1)
        assert (record.allowed, record.reason) == (
            False, f"localhost:{catcher.port}: {reason}" + (
                "" if "; " in reason else "; use https:// through the proxy"))
        assert served.recorder.opened == []
        time.sleep(0.1)
        assert catcher.received == b""  # not a byte reached the destination
    finally:
        served.close()  # and nothing escaped a handler
        catcher.close()


def test_a_whole_hello_naming_the_host_is_forwarded_with_what_follows():
    catcher = Catcher()
    served = Served(_rules("hosts", [f"localhost:{catcher.port}"],
                           [f"127.0.0.1:{catcher.port}"]))
    hello = _client_hello("localhost")
    early = b"\x17\x03\x03\x00\x02hi"  # a whole record after it (TLS 1.3 early data)
    try:
        answer = _through_tunnel(served, f"localhost:{catcher.port}", hello + early)
        assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"
        (record,) = served.wait(1)
        assert (record.allowed, record.sni, record.sent) == (True, "localhost",
                                                             len(hello) + len(early))
        for _ in range(100):
            if len(catcher.received) == len(hello) + len(early):
                break
            time.sleep(0.02)
        assert bytes(catcher.received) == hello + early
    finally:
        served.close()
        catcher.close()


@pytest.mark.parametrize(("address", "carried", "kind"), [
    ("2002:7f00:1::1", "6to4 of 127.0.0.1", "loopback"),
    ("2002:a9fe:a9fe::1", "6to4 of 169.254.169.254", "link-local (cloud metadata)"),
    ("2002:a00:1::1", "6to4 of 10.0.0.1", "private or reserved"),
    ("64:ff9b::a9fe:a9fe", "NAT64 of 169.254.169.254", "link-local (cloud metadata)"),
    ("::7f00:1", "IPv4-compatible of 127.0.0.1", "loopback"),
    ("::ffff:a00:1", "IPv4-mapped of 10.0.0.1", "private or reserved"),
])
def test_ipv6_forms_that_carry_a_refused_ipv4_address_are_refused(address, carried, kind):
    served = Served(_rules("on", [], []))
    try:
        answer = served.get(f"http://[{address}]:8080/")
        assert (answer.status_code, answer.reason) == (
            403, f"[{address}] ({carried}), a {kind} address the sandbox never reaches; grant "
                 f"it with --allow-address [{address}]:8080 (only for a service meant for user "
                 "code)")
        with pytest.raises(requests.exceptions.ProxyError, match=f"403 \\[{address}\\]"):
            served.get(f"https://[{address}]:8443/")
    finally:
        served.close()


def test_hostile_heads_are_refused_before_parsing():
    """6,000 one-letter headers (59 KB) and a head past HEAD_LIMIT: refused by size and line
    count, before h11 parses a byte (the companion's cost per head stays small)."""
    from sandbox_kernel.confine.egress.proxy import HEAD_LIMIT, MAX_HEADERS

    served = Served(_rules("on", [], []))
    heads = [b"GET http://example.com/ HTTP/1.1\r\n" + b"a: b\r\n" * 6000 + b"\r\n",
             b"GET http://example.com/ HTTP/1.1\r\nX: " + b"x" * HEAD_LIMIT + b"\r\n\r\n",
             b"GET http://example.com/ HTTP/1.1\r\n" + b"a: b\r\n" * (MAX_HEADERS + 1) + b"\r\n",
             b"GET http://10.0.0.1/ HTTP/1.1\r\nHost: 10.0.0.1\r\n"
             + b"a: b\r\n" * (MAX_HEADERS - 1) + b"\r\n"]
    said = []
    try:
        for head in heads:
            with socket.create_connection(served.url.removeprefix("http://").split(":"),
                                          timeout=10) as raw:
                with contextlib.suppress(OSError):  # the proxy may close before all is sent
                    raw.sendall(head)
                said.append(raw.recv(4096).split(b"\r\n")[0].decode())
    finally:
        served.close()
    assert said == [f"HTTP/1.1 431 request head of more than {MAX_HEADERS} header lines",
                    f"HTTP/1.1 431 request head longer than {HEAD_LIMIT} bytes",
                    f"HTTP/1.1 431 request head of more than {MAX_HEADERS} header lines",
                    "HTTP/1.1 403 10.0.0.1, a private or reserved address the sandbox never "
                    "reaches; grant it with --allow-address 10.0.0.1:80 (only for a service "
                    "meant for user code)"]  # as many as allowed: parsed and judged


# A host whose interface carries a global address: made in a network namespace of the test's
# own (a veth pair with no peer outside, so nothing leaves it), where the launcher, its
# kernels' reapers (and so the egress proxy) run. Servers listen on 0.0.0.0, as a host's
# services do. 11.0.0.0/24 and 2a0f::/16 stand in for a VM's public addresses.
HOST_ADDRESS, LATER_ADDRESS, HOST_ADDRESS6 = "11.0.0.7", "11.0.0.8", "2a0f::7"

HOST_SCRIPT = r'''
import json, os, socket, socketserver, subprocess, sys, threading
from sandbox_kernel.client import Sandbox
from sandbox_kernel.launch import forkserver
from sandbox_kernel.policy import SandboxPolicy

def ip(*args):
    subprocess.run(["ip", *args], check=True)

ip("link", "set", "lo", "up")
ip("link", "add", "sk-host", "type", "veth", "peer", "name", "sk-peer")
ip("link", "set", "sk-host", "up")
ip("link", "set", "sk-peer", "up")
ip("addr", "add", "HOST/24", "dev", "sk-host")
ip("-6", "addr", "add", "HOST6/64", "dev", "sk-host", "nodad")

class Web(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.recv(4096)
        self.request.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 12\r\n\r\nhost service")

class Banner(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(b"+OK host banner\r\n")

servers = []
for handler, family, any_address in ((Web, socket.AF_INET, "0.0.0.0"),
                                     (Banner, socket.AF_INET, "0.0.0.0"),
                                     (Web, socket.AF_INET6, "::")):
    server_class = type("S", (socketserver.ThreadingTCPServer,),
                        {"address_family": family, "allow_reuse_address": True})
    server = server_class((any_address, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers.append(server)
web, banner, web6 = (server.server_address[1] for server in servers)

ATTEMPTS = """
import socket, urllib.request, urllib.error
def http(url):
    try:
        return urllib.request.urlopen(url, timeout=10).read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.reason
def connect(authority):
    with socket.create_connection(("127.0.0.1", 3128), timeout=10) as raw:
        raw.sendall(f"CONNECT {authority} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n".encode())
        answer = b""
        while chunk := raw.recv(4096):
            answer += chunk
    return answer.decode().split("\\r\\n")[0] + " | " + answer.decode().split("\\r\\n\\r\\n", 1)[-1]
"""

def attempts(sandbox, host, six=True):
    code = ATTEMPTS + f"""
(http("http://{host}:{web}/"), connect("{host}:{banner}"),
 {'http("http://[HOST6]:%d/")' % web6 if six else 'None'})
"""
    execution = sandbox.run(code)
    assert execution.error is None, execution.error
    return execution.text

found = {}
try:
    with Sandbox(None, policy=SandboxPolicy(network="on"), cold_start=True) as sb:
        found["refused"] = attempts(sb, "HOST")
        ip("addr", "add", "LATER/24", "dev", "sk-host")  # after the proxy started
        found["later"] = attempts(sb, "LATER", six=False)
    grants = [f"HOST:{web}", f"HOST:{banner}", f"[HOST6]:{web6}"]
    with Sandbox(None, policy=SandboxPolicy(network="on", allow_addresses=grants),
                 cold_start=True) as sb:
        found["granted"] = attempts(sb, "HOST")
finally:
    forkserver.stop_servers()
found["ports"] = [web, banner, web6]
print(json.dumps(found))
'''


def test_the_hosts_own_addresses_are_refused_unless_granted(tmp_path):
    """A `--network on` kernel on a host whose interface has a global address: plain HTTP and
    a raw CONNECT tunnel to it (and to one added after the proxy started) are refused; the
    same connections pass once the address is granted."""
    import ast
    import subprocess
    import sys

    script = tmp_path / "host.py"
    script.write_text(HOST_SCRIPT.replace("HOST6", HOST_ADDRESS6).replace("LATER", LATER_ADDRESS)
                      .replace("HOST", HOST_ADDRESS))
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}  # no shared servers
    done = subprocess.run(["unshare", "--net", "--", sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    web, banner, web6 = found["ports"]

    def refusal(shown: str, port: int) -> str:
        return (f"{shown}, an address of this host the sandbox never reaches; grant it with "
                f"--allow-address {shown}:{port} (only for a service meant for user code)")

    assert ast.literal_eval(found["refused"]) == (
        (403, refusal(HOST_ADDRESS, web)),
        f"HTTP/1.1 403 {refusal(HOST_ADDRESS, banner)} | sandbox-kernel egress proxy: "
        f"{refusal(HOST_ADDRESS, banner)}\n",
        (403, refusal(f"[{HOST_ADDRESS6}]", web6)))
    later_http, later_tunnel, _ = ast.literal_eval(found["later"])
    assert later_http == (403, refusal(LATER_ADDRESS, web))
    assert later_tunnel.startswith(f"HTTP/1.1 403 {refusal(LATER_ADDRESS, banner)}")
    assert ast.literal_eval(found["granted"]) == (
        "host service", "HTTP/1.1 200 Connection established | +OK host banner\r\n",
        "host service")


def test_connections_are_paced_so_the_companion_cost_is_bounded():
    """Whatever each connection carries, it costs the unconfined companion about a millisecond:
    past a burst the proxy accepts at most CONNECTION_RATE a second (the rest wait in the
    listener's backlog, costing the kernel its waiting). An upper bound only: a loaded machine
    answers fewer."""
    from sandbox_kernel.confine.egress.proxy import CONNECTION_BURST, CONNECTION_RATE

    served = Served(_rules("hosts", [], []))
    answered, started = 0, time.monotonic()
    try:
        while time.monotonic() - started < 1.5 + CONNECTION_BURST / 1000:
            with socket.create_connection(served.url.removeprefix("http://").split(":"),
                                          timeout=10) as raw:
                raw.sendall(b"GET http://10.0.0.1/ HTTP/1.1\r\nHost: 10.0.0.1\r\n\r\n")
                assert raw.recv(4096).startswith(b"HTTP/1.1 403 ")
            answered += 1
        elapsed = time.monotonic() - started
    finally:
        served.close()
    assert answered <= CONNECTION_BURST + CONNECTION_RATE * elapsed + 2, (answered, elapsed)


def test_an_upstream_answer_past_the_head_limit_is_refused_cleanly():
    """The upstream proxy's answer to CONNECT is read within HEAD_LIMIT: a longer one is a 502,
    not an exception out of the handler."""
    from sandbox_kernel.confine.egress.proxy import HEAD_LIMIT

    upstream = socket.create_server(("127.0.0.1", 0))

    def answer_forever() -> None:
        conn, _ = upstream.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX: " + b"x" * (HEAD_LIMIT + 10))
            time.sleep(5)

    threading.Thread(target=answer_forever, daemon=True).start()
    served = Served(_rules("on", [], []), Upstream("127.0.0.1", upstream.getsockname()[1]))
    try:
        with pytest.raises(requests.exceptions.ProxyError, match="502 the upstream proxy "
                           f"127.0.0.1:{upstream.getsockname()[1]} gave no answer"):
            served.get("https://8.8.8.8/")
    finally:
        served.close()  # asserts that nothing escaped a handler
        upstream.close()


# Secrets: the proxy adds a secret's value for its hosts, over TLS it terminates with the
# kernel's CA; user code holds the placeholder only, and never gets the value back.

PLACEHOLDER = "sk-sandbox-API_KEY-" + "p" * 20


@pytest.fixture(scope="module")
def secret_origin(tmp_path_factory):
    """An echoing HTTPS origin (own CA) for localhost, a plain one, a token index, and a Secret."""
    from sandbox_kernel.confine.egress.secret import Secret

    directory = tmp_path_factory.mktemp("secret-origin")
    cert = self_signed(directory, ["localhost"])
    value = "sk-real-" + os.urandom(12).hex()
    secure, plain = Origin(directory, cert, echo=True), Origin(directory, echo=True)
    yield secure, plain, cert[0].read_bytes(), Secret("API_KEY", value, ("localhost",),
                                                      PLACEHOLDER)
    secure.close()
    plain.close()


@pytest.fixture
def secret_proxy(secret_origin, tmp_path):
    secure, plain, upstream_ca, secret = secret_origin
    served = Served(_rules("hosts", ["localhost", "127.0.0.1"],
                           [f"127.0.0.1:{secure.port}", f"127.0.0.1:{plain.port}"]),
                    secrets=[secret], upstream_ca=upstream_ca)
    trusted = tmp_path / "kernel-ca.pem"  # what the kernel trusts: only the kernel's CA here
    trusted.write_bytes(served.proxy.ca.certificate_pem())
    served.trusted = str(trusted)
    yield served
    served.close()


def _seen_and_echoed(origin, answer_text: str, secret) -> dict[str, str]:
    seen = origin.seen[-1]
    assert secret.value not in answer_text and PLACEHOLDER in answer_text
    return seen


def test_a_secret_reaches_its_host_in_every_client_and_never_comes_back(secret_proxy,
                                                                        secret_origin):
    secure, _, _, secret = secret_origin
    url = f"https://localhost:{secure.port}/echo?repeat=50"
    bearer = {"Authorization": f"Bearer {PLACEHOLDER}"}

    for framed in (url, url + "&length"):  # chunked in 7-byte pieces; by Content-Length
        answer = secret_proxy.get(framed, headers=bearer, verify=secret_proxy.trusted)
        assert answer.status_code == 200 and answer.headers["X-Echo"] == f"Bearer {PLACEHOLDER}"
        assert secure.seen[-1]["authorization"] == f"Bearer {secret.value}"
        assert answer.text.count(PLACEHOLDER) == 50 and secret.value not in answer.text
        assert json.loads(answer.text[:len(answer.text) // 50])["accept-encoding"] == "identity"

    import urllib.request
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"https": secret_proxy.url}),
        urllib.request.HTTPSHandler(context=ssl.create_default_context(
            cafile=secret_proxy.trusted)))
    with opener.open(urllib.request.Request(url, headers=bearer), timeout=10) as response:
        _seen_and_echoed(secure, response.read().decode(), secret)
    assert secure.seen[-1]["authorization"] == f"Bearer {secret.value}"

    import httpx
    with httpx.Client(proxy=secret_proxy.url, verify=ssl.create_default_context(
            cafile=secret_proxy.trusted)) as client:
        for _ in range(2):  # the second request on the same (kept-alive) connection
            text = client.get(url, headers={"X-Api-Key": PLACEHOLDER}).text
            _seen_and_echoed(secure, text, secret)
            assert secure.seen[-1]["x-api-key"] == secret.value

    import aiohttp

    async def fetch() -> str:
        connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(
            cafile=secret_proxy.trusted))
        async with aiohttp.ClientSession(connector=connector) as session, \
                session.get(f"https://localhost:{secure.port}/echo?q={PLACEHOLDER}",
                            proxy=secret_proxy.url) as response:
            return await response.text()

    _seen_and_echoed(secure, asyncio.run(fetch()), secret)
    assert secure.seen[-1]["path"] == f"/echo?q={secret.value}"  # the query string

    import openai
    client = openai.OpenAI(api_key=PLACEHOLDER, base_url=f"https://localhost:{secure.port}/v1",
                           http_client=httpx.Client(proxy=secret_proxy.url, verify=ssl
                                                    .create_default_context(
                                                        cafile=secret_proxy.trusted)),
                           max_retries=0)
    (model,) = client.models.list().data
    assert model.id == f"Bearer {PLACEHOLDER}"  # the SDK got the placeholder back, not the value
    assert secure.seen[-1]["authorization"] == f"Bearer {secret.value}"

    basic = secret_proxy.get(f"https://user:{PLACEHOLDER}@localhost:{secure.port}/echo",
                             verify=secret_proxy.trusted)
    import base64
    assert secure.seen[-1]["authorization"] == "Basic " + base64.b64encode(
        f"user:{secret.value}".encode()).decode()
    sent_form = "Basic " + base64.b64encode(f"user:{PLACEHOLDER}".encode()).decode()
    assert basic.headers["X-Echo"] == sent_form and sent_form in basic.text

    uses = secret_proxy.recorder.secrets
    assert len(uses) == secret_proxy.proxy.substitutions["API_KEY"] == 8  # one per request
    assert {(use.secret, use.host, use.port) for use in uses} == {
        ("API_KEY", "localhost", secure.port)}
    assert all(secret.value not in json.dumps(use.as_dict()) for use in uses)
    assert "egress secret API_KEY added to a request to CONNECT localhost" in uses[0].summary()


def test_the_placeholder_anywhere_else_and_plain_http_to_its_host_are_refused(secret_proxy,
                                                                               secret_origin):
    secure, plain, _, secret = secret_origin
    seen = len(plain.seen)
    other = secret_proxy.get(f"http://127.0.0.1:{plain.port}/echo",
                             headers={"Authorization": f"Bearer {PLACEHOLDER}"})
    said = (f"the placeholder of secret API_KEY was sent to 127.0.0.1:{plain.port}, which is "
            "not its host (localhost); send API_KEY only to localhost (or declare it for this "
            "host too with --secret API_KEY=127.0.0.1)")
    assert (other.status_code, other.reason) == (403, said)

    # A redirect from the secret's host to another carries only the placeholder: refused too.
    redirect = f"http://127.0.0.1:{plain.port}/echo?key={PLACEHOLDER}"
    answer = secret_proxy.get(f"https://localhost:{secure.port}/redirect?{redirect}",
                              headers={"Authorization": f"Bearer {PLACEHOLDER}"},
                              verify=secret_proxy.trusted)
    assert (answer.status_code, answer.reason) == (403, said)
    assert answer.history[0].status_code == 302
    assert len(plain.seen) == seen  # nothing reached the other host

    cleartext = secret_proxy.get(f"http://localhost:{plain.port}/echo",
                                 headers={"Authorization": f"Bearer {PLACEHOLDER}"})
    assert (cleartext.status_code, cleartext.reason) == (
        403, f"plain HTTP to localhost:{plain.port}, a host of secret API_KEY: secrets are "
             "added over HTTPS only; use https://localhost")
    refused = [record for record in secret_proxy.wait(4) if not record.allowed]
    assert [record.reason for record in refused] == [said, said, cleartext.reason]
    assert all(secret.value not in json.dumps(record.as_dict()) for record in
               secret_proxy.records)


def test_what_a_raw_client_gets_back_holds_no_value(secret_proxy, secret_origin):
    """Every byte back, informational responses (103) and the framing h11 made included."""
    secure, _, _, secret = secret_origin
    host, port = secret_proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(f"CONNECT localhost:{secure.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        context = ssl.create_default_context(cafile=secret_proxy.trusted)
        with context.wrap_socket(raw, server_hostname="localhost") as tls_socket:
            tls_socket.sendall(f"GET /echo?early&repeat=3 HTTP/1.1\r\nHost: localhost\r\n"
                               f"Authorization: Bearer {PLACEHOLDER}\r\n"
                               "Connection: close\r\n\r\n".encode())
            answer = b""
            while data := tls_socket.recv(65536):
                answer += data
    early = f"HTTP/1.1 103 Early Hints\r\nX-Early: Bearer {PLACEHOLDER}\r\n"
    assert answer.startswith(early.encode())
    head, _, chunked = answer.partition(b"\r\n\r\nHTTP/1.1 200 OK\r\n")[2].partition(b"\r\n\r\n")
    assert b"\r\nTransfer-Encoding: chunked" in b"\r\n" + head
    body = b""
    while True:  # the body h11 framed anew, unframed here
        size, _, chunked = chunked.partition(b"\r\n")
        body, chunked = body + chunked[:int(size, 16)], chunked[int(size, 16) + 2:]
        if not int(size, 16):
            break
    assert chunked == b"" and len(json.loads(body[:len(body) // 3])) > 3
    for text in (head, body):
        assert secret.value.encode() not in text and PLACEHOLDER.encode() in text
    assert secure.seen[-1]["authorization"] == f"Bearer {secret.value}"


def test_a_body_compressed_anyway_is_undone_and_scrubbed_or_refused(secret_proxy,
                                                                     secret_origin):
    secure, _, _, secret = secret_origin
    url = f"https://localhost:{secure.port}/echo?repeat=20&"
    bearer = {"Authorization": f"Bearer {PLACEHOLDER}"}
    answer = secret_proxy.get(url + "gzip", headers=bearer, verify=secret_proxy.trusted,
                              stream=True)
    raw = answer.raw.read()  # as the proxy sent it, undecoded by the client
    assert "Content-Encoding" not in answer.headers and raw.count(PLACEHOLDER.encode()) == 20
    assert secret.value.encode() not in raw
    refused = secret_proxy.get(url + "br", headers=bearer, verify=secret_proxy.trusted)
    assert (refused.status_code, refused.reason) == (
        502, f"localhost:{secure.port} answered in Content-Encoding br though asked for "
             "identity: the proxy cannot scrub a secret's value from it, so the response is "
             "refused; ask the host for an uncompressed response (or for gzip)")
    assert secret.value not in refused.text


def test_an_upstream_that_cannot_be_verified_is_refused(secret_origin):
    secure, _, _, secret = secret_origin
    served = Served(_rules("hosts", ["localhost"], [f"127.0.0.1:{secure.port}"]),
                    secrets=[secret])  # no --upstream-ca: the origin's own CA is unknown
    seen = len(secure.seen)
    try:
        with pytest.raises(requests.exceptions.ProxyError,
                           match=r"502 localhost:.*: TLS to it failed: its certificate cannot "
                                 r"be verified .*; give its CA with --upstream-ca FILE"):
            served.get(f"https://localhost:{secure.port}/echo",
                       headers={"Authorization": f"Bearer {PLACEHOLDER}"})
        assert len(secure.seen) == seen  # no request went to an origin not verified
    finally:
        served.close()


def test_the_scrubber_finds_values_split_across_reads():
    from sandbox_kernel.confine.egress.intercept import Scrubber

    stream = (b"x" * 5 + b"VALUE" + b"y" + b"VALUE") * 3
    for size in range(1, 12):
        scrubber = Scrubber([(b"VALUE", b"<placeholder>")])
        out = b"".join(scrubber.feed(stream[at:at + size])
                       for at in range(0, len(stream), size)) + scrubber.end()
        assert out == stream.replace(b"VALUE", b"<placeholder>")
        assert len(scrubber.held) == 0
