"""The egress proxy on its own, served in this process: rules, CONNECT, SNI, chaining, records.

(The proxy runs unconfined in a kernel's reaper, so testing it outside a kernel loses nothing;
tests/test_network.py drives it from real sandboxed kernels.)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import threading

import pytest
import requests

from sandbox_kernel.confine.egress import tls
from sandbox_kernel.confine.egress.proxy import Connection, EgressProxy
from sandbox_kernel.confine.egress.rules import EgressRules, RuleError, Upstream, parse_host_entry

from .network_servers import BODY, Listener, Origin, self_signed


class Served:
    """An EgressProxy on 127.0.0.1 in a thread of its own, and the records it wrote."""

    def __init__(self, rules: EgressRules, upstream: Upstream | None = None) -> None:
        self.records: list[Connection] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.loop = asyncio.new_event_loop()
        proxy = EgressProxy(rules, "k1", self.records.append, upstream)
        self.task = self.loop.create_task(proxy.serve(self.sock))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

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
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


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


def test_audit_sink_writes_json_lines_and_log_lines(tmp_path):
    from sandbox_kernel.confine.egress.proxy import AuditSink

    class Log:
        def __init__(self) -> None:
            self.lines: list[bytes] = []

        def write(self, line: bytes) -> None:
            self.lines.append(line)

    path = tmp_path / "audit.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        log = Log()
        sink = AuditSink(fd, log)
        sink(Connection("k9", method="CONNECT", host="ix.example.org", port=443,
                        reason="refused x"))
    finally:
        os.close(fd)
    (entry,) = map(json.loads, path.read_text().splitlines())
    assert (entry["kernel"], entry["event"], entry["host"], entry["allowed"]) == (
        "k9", "egress", "ix.example.org", False)
    assert log.lines == [b"sandbox-kernel audit: kernel k9: egress refused CONNECT "
                         b"ix.example.org:443: refused x\n"]
