"""A hostile host, or hostile requests, inside a tunnel the proxy intercepts for a secret.

One real kernel declared with `--secret API_KEY=localhost` talks, through its egress proxy, to
a scripted HTTPS origin on 127.0.0.1 (tests/network_servers.py: Scripted) that answers with
whatever bytes a case needs: a HEAD answered with a body, responses h11 cannot parse holding
the value, Content-Length counted in characters, folded headers, trailers, a redirect, the
value encoded. User code writes raw requests on the tunnel (the placeholder in them) and
returns every byte that came back; each case asserts the exact outcome, that the value is in
none of it, and none of the egress audit record.

The promise (docs/SECURITY.md, "Secrets: credentials the proxy adds"): nothing the proxy sends
back or records from an intercepted exchange holds the value or a form of it, its own error
texts included; the destination's bytes are never quoted; bytes no request asked for close the
connection; a request goes to the tunnel's host only.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.policy import SandboxPolicy

from .helpers import evaluate, ok
from .network_servers import Asked, Scripted, self_signed

# Defines, in the kernel, exchange(port, data) -> the bytes that came back: CONNECT through the
# kernel's proxy to localhost:port, TLS trusting what the kernel trusts, data (with {P} for the
# placeholder) in one write, then everything read to the connection's end.
EXCHANGE = r'''
import os, socket, ssl, urllib.request
from urllib.parse import urlsplit

def opened(port, alpn=None):
    proxy = urlsplit(urllib.request.getproxies()['https'])
    raw = socket.create_connection((proxy.hostname, proxy.port), timeout=20)
    raw.sendall(b'CONNECT localhost:%d HTTP/1.1\r\nHost: localhost:%d\r\n\r\n' % (port, port))
    assert raw.recv(4096).startswith(b'HTTP/1.1 200 '), 'CONNECT refused'
    context = ssl.create_default_context()
    if alpn:
        context.set_alpn_protocols(alpn)
    return context.wrap_socket(raw, server_hostname='localhost')

def rest(tls, until=None):
    got = b''
    try:
        while (until is None or until not in got) and (data := tls.recv(65536)):
            got += data
    except (OSError, ssl.SSLError) as exc:
        got += b'<' + type(exc).__name__.encode() + b'>'
    return got

def exchange(port, data, alpn=None):
    with opened(port, alpn) as tls:
        tls.sendall(data.replace(b'{P}', os.environ['API_KEY'].encode()))
        return rest(tls)
'''


@dataclass
class Hostile:
    """The kernel, the origin, the value (only the launcher has it) and the audit record."""

    sandbox: Sandbox
    origin: Scripted
    value: str
    placeholder: str
    audit: Path

    def exchange(self, data: bytes, alpn: list[str] | None = None) -> bytes:
        got = evaluate(self.sandbox, f"exchange({self.origin.port}, {data!r}, {alpn!r})")
        assert isinstance(got, bytes)
        self.assert_clean(got)
        return got

    def assert_clean(self, got: bytes) -> None:
        """Neither what user code got nor the audit record holds the value, or its start."""
        for text in (got, self.audit.read_bytes()):
            assert self.value[:16].encode() not in text and \
                self.value.encode().hex().encode() not in text


def _echo(asked: Asked) -> bytes:
    return json.dumps({"auth": asked.auth, "target": asked.target}).encode()


def _value(asked: Asked) -> str:
    return asked.auth.removeprefix("Bearer ").strip()


def _forms(value: str) -> list[bytes]:
    """The value as a host may reflect it encoded (what the proxy must scrub)."""
    raw = value.encode()
    forms = [base64.b64encode(b"user:" + raw), quote(value + "/é", safe="").lower().encode(),
             raw.hex().encode(), json.dumps(value + "/").replace("/", "\\/").encode()]
    for prefix in (b"", b"a", b"ab"):
        forms += [base64.b64encode(prefix + raw + b"!"), base64.urlsafe_b64encode(prefix + raw)]
    return forms


def _length_in_characters(asked: Asked) -> bytes:
    # An echo counted in characters: each "é" of X-Note is two bytes, so the last bytes of the
    # body (the value) come after what Content-Length says.
    text = asked.headers["x-note"].encode("latin-1").decode() + " " + asked.auth
    return (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(text)) + text.encode()


def _answer(asked: Asked) -> bytes | list[bytes] | None:
    """The scripted origin's answer, by the request's path."""
    value = _value(asked).encode()
    body = _echo(asked)
    path = asked.path.partition("?")[0]
    if path == "/echo":
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    if path == "/head-body":  # do_HEAD = do_GET: the body, in the same write as the head
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    if path == "/late-body":  # the same, the body once the test releases it
        return [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), b"", body]
    if path == "/no-content":
        return b"HTTP/1.1 204 No Content\r\n\r\n" + body
    if path == "/bad-header":
        return b"HTTP/1.1 200 OK\r\n" + asked.auth.encode() + b"\r\nContent-Length: 0\r\n\r\n"
    if path == "/bad-chunk":
        return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + value + b"\r\n"
    if path == "/bad-status":
        return b"HTTP/1.1 " + value + b" OK\r\nContent-Length: 0\r\n\r\n"
    if path == "/characters":
        return _length_in_characters(asked)
    if path == "/encoding":
        return b"HTTP/1.1 200 OK\r\nContent-Encoding: " + value + b"\r\nContent-Length: 1\r\n\r\nx"
    if path == "/fold":  # obsolete line folding; the value as a header's name
        return (b"HTTP/1.1 200 OK\r\nX-Echo: Bearer\r\n " + value + b"\r\n" + value +
                b": named\r\nContent-Length: 0\r\n\r\n")
    if path == "/trailers":
        return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Echo\r\n\r\n"
                b"2\r\nok\r\n0\r\nX-Echo: " + value + b"\r\n\r\n")
    if path == "/continue":  # a 100 of its own, echoing, then the answer
        return [b"HTTP/1.1 100 Continue\r\nX-Echo: " + value + b"\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)]
    if path == "/redirect":
        location = b"https://other.test/?k=" + quote(value, safe="").encode() + b"&raw=" + value
        return b"HTTP/1.1 302 Found\r\nLocation: " + location + b"\r\nContent-Length: 0\r\n\r\n"
    if path == "/forms":  # in 5-byte writes: each form split across reads
        encoded = b" ".join(_forms(value.decode()))
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(encoded)
        return [head] + [encoded[at:at + 5] for at in range(0, len(encoded), 5)]
    return None


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    value = "sk-live-" + secrets.token_hex(20)
    saved = os.environ.get("API_KEY")
    os.environ["API_KEY"] = value  # the launcher's environment: only the companion gets it
    directory = tmp_path_factory.mktemp("hostile")
    os.chmod(directory, 0o755)
    cert = self_signed(directory, ["localhost"])
    origin = Scripted(directory, cert, _answer)
    audit = directory / "audit.jsonl"
    policy = SandboxPolicy(network="hosts", allow_hosts=["localhost"],
                           allow_addresses=[f"127.0.0.1:{origin.port}"],
                           secrets=["API_KEY=localhost"], upstream_ca=str(cert[0]),
                           audit_log=str(audit))
    try:
        with Sandbox(None, policy=policy) as sb:
            ok(sb.run(EXCHANGE))
            placeholder = evaluate(sb, "os.environ['API_KEY']")
            assert placeholder.startswith("sk-sandbox-API_KEY-")
            yield Hostile(sb, origin, value, placeholder, audit)
    finally:
        origin.close()
        if saved is None:
            os.environ.pop("API_KEY", None)
        else:
            os.environ["API_KEY"] = saved


def _get(path: str, *more: str, method: str = "GET", close: bool = True) -> bytes:
    """A request with the placeholder as a bearer token (and Connection: close if close)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", "Authorization: Bearer {P}",
             *more, *(["Connection: close"] if close else [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _refusal(status: int, text: str) -> bytes:
    """The proxy's own answer: the text as reason and body."""
    body = f"sandbox-kernel egress proxy: {text}\n".encode()
    return (f"HTTP/1.1 {status} {text}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def _text(got: bytes) -> bytes:
    """got without chunked framing (where a read cut the body is not the point here)."""
    return re.sub(rb"\r\n[0-9a-f]+\r\n", b"", got)


def _records(hostile: Hostile) -> list[dict[str, object]]:
    return [json.loads(line) for line in hostile.audit.read_text().splitlines()]


def test_a_head_answered_with_a_body_never_hands_back_the_value(hostile):
    """The issue's case: HEAD with the placeholder, then GET on the same connection; the host
    answers HEAD with the request echoed in a body (do_HEAD = do_GET). That body used to be
    parsed as the GET's status line and quoted, value and all, in the proxy's 502."""
    got = hostile.exchange(_get("/head-body", method="HEAD", close=False) + _get("/echo"))
    port = hostile.origin.port
    said = (f"localhost:{port} sent bytes after its answer to a request that has no body "
            "(HEAD, or answered 204 or 304): a protocol error, so the connection is closed; "
            "the host's server is at fault (a HEAD answered with a body, or a Content-Length "
            "that does not count the body's bytes)")
    assert got == _refusal(502, said)
    assert hostile.origin.asked[-1].auth == f"Bearer {hostile.value}"  # the HEAD went through
    assert [record["reason"] for record in _records(hostile)
            if record["event"] == "egress" and record.get("reason")][-1] == said


def _unreadable(hostile: Hostile) -> str:
    return (f"localhost:{hostile.origin.port} sent a response that is not valid HTTP/1.1, so it "
            "is refused (its bytes are not shown: they may hold a secret's value); the host's "
            "server is at fault; try the request without the proxy's secret to see what it "
            "answers")


def _last_reason(hostile: Hostile) -> object:
    return [record.get("reason") for record in _records(hostile)
            if record["event"] == "egress"][-1]


@pytest.mark.parametrize("path", ["/bad-header", "/bad-status"])
def test_a_response_h11_cannot_parse_is_refused_without_quoting_it(hostile, path):
    """A header line, or a status line, holding the value: h11 quotes the line it refuses."""
    got = hostile.exchange(_get(path))
    assert got == _refusal(502, _unreadable(hostile))
    assert _last_reason(hostile) == _unreadable(hostile)


def test_a_bad_chunk_after_the_head_cuts_the_response_without_quoting_it(hostile):
    got = hostile.exchange(_get("/bad-chunk"))
    # The head went before the bad chunk came: then the connection's end, no whole response.
    assert got == b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    assert _last_reason(hostile) == _unreadable(hostile)


def test_bytes_after_a_204_are_refused(hostile):
    got = hostile.exchange(_get("/no-content", close=False) + _get("/echo"))
    assert got == _refusal(502, (
        f"localhost:{hostile.origin.port} sent bytes after its answer to a request that has "
        "no body (HEAD, or answered 204 or 304): a protocol error, so the connection is "
        "closed; the host's server is at fault (a HEAD answered with a body, or a "
        "Content-Length that does not count the body's bytes)"))


def test_a_content_length_counted_in_characters_cuts_the_response(hostile):
    """The bytes past Content-Length (the echoed value) would be the next answer's head."""
    note = ("X-Note: " + "é" * 60).encode().decode("latin-1")
    got = hostile.exchange(_get("/characters", note, close=False) + _get("/echo"))
    head, _, body = got.partition(b"\r\n\r\n")
    assert head == b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked"
    assert not body.endswith(b"0\r\n\r\n")  # cut short: no answer a client takes as whole
    assert _last_reason(hostile) == (
        f"localhost:{hostile.origin.port} sent bytes past the end of its response's body: a "
        "protocol error, so the connection is closed; the host's server is at fault (a HEAD "
        "answered with a body, or a Content-Length that does not count the body's bytes)")


def test_a_late_body_to_head_closes_the_kept_alive_connection(hostile):
    """The HEAD's body comes after its head, in a later read: the proxy, waiting for the next
    request, sees bytes no request asked for and closes the connection."""
    hostile.origin.release.clear()
    port = hostile.origin.port
    head = evaluate(hostile.sandbox, f"late = opened({port})\n"
                    "late.sendall(" + repr(_get("/late-body", method="HEAD", close=False))
                    + ".replace(b'{P}', os.environ['API_KEY'].encode()))\n"
                    "rest(late, until=b'\\r\\n\\r\\n')")
    assert head.startswith(b"HTTP/1.1 200 OK\r\nContent-Length: ") and head.endswith(b"\r\n\r\n")
    hostile.origin.release.set()
    # Before the fix the connection stayed open, and the next request got the body as its
    # answer's head: user code waits for the end, then (if none came) asks again.
    after = evaluate(hostile.sandbox, "end = rest(late)\n"
                     "if end == b'<TimeoutError>':\n"
                     "    late.sendall(" + repr(_get("/echo")) + ")\n"
                     "    end += rest(late)\n"
                     "late.close()\nend")
    hostile.assert_clean(after)
    assert after == b""
    assert _last_reason(hostile) == (
        f"localhost:{port} sent bytes that no request asked for: a protocol error, so the "
        "connection is closed")


def test_folded_headers_and_a_value_as_a_header_name_are_scrubbed(hostile):
    got = hostile.exchange(b"GET /fold HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer\r\n"
                           b" {P}\r\nConnection: close\r\n\r\n")
    placeholder = hostile.placeholder.encode()
    assert got == (b"HTTP/1.1 200 OK\r\nX-Echo: Bearer " + placeholder + b"\r\n" + placeholder
                   + b": named\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                   b"0\r\n\r\n")
    assert hostile.origin.asked[-1].auth == f"Bearer {hostile.value}"  # unfolded, substituted


def test_trailers_are_not_forwarded_either_way(hostile):
    got = hostile.exchange(b"POST /trailers HTTP/1.1\r\nHost: localhost\r\nAuthorization: "
                           b"Bearer {P}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n"
                           b"\r\n2\r\nhi\r\n0\r\nX-Key: {P}\r\n\r\n")
    assert got == (b"HTTP/1.1 200 OK\r\nTrailer: X-Echo\r\nTransfer-Encoding: chunked\r\n"
                   b"Connection: close\r\n\r\n2\r\nok\r\n0\r\n\r\n")
    asked = hostile.origin.asked[-1]
    assert (asked.body, asked.trailers) == (b"hi", b"")


def test_expect_100_continue_is_answered_by_the_proxy_alone(hostile):
    got = hostile.exchange(_get("/continue", "Expect: 100-continue", "Content-Length: 3",
                                method="POST") + b"abc")
    interim, _, final = got.partition(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 100 "  # the proxy's own: not the host's, which echoed
    assert final.startswith(b"HTTP/1.1 200 OK\r\n")
    assert f'"auth": "Bearer {hostile.placeholder}"'.encode() in _text(final)
    assert hostile.origin.asked[-1].body == b"abc"


def test_a_redirect_carries_only_the_placeholder(hostile):
    got = hostile.exchange(_get("/redirect"))
    assert (b"\r\nLocation: https://other.test/?k=" + hostile.placeholder.encode() + b"&raw="
            + hostile.placeholder.encode() + b"\r\n") in got


def test_encoded_forms_split_across_reads_are_scrubbed(hostile):
    got = hostile.exchange(_get("/forms"))
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    for form in _forms(hostile.value):
        assert form[8:-8] not in got, form
    assert hostile.placeholder.encode().hex().encode() in got


def test_an_unknown_content_encoding_is_refused_without_naming_it(hostile):
    got = hostile.exchange(_get("/encoding"))
    assert got == _refusal(502, (
        f"localhost:{hostile.origin.port} answered in Content-Encoding of a name it made up "
        "though asked for identity: the proxy cannot scrub a secret's value from it, so the "
        "response is refused; ask the host for an uncompressed response (or for gzip)"))


def test_content_length_beside_transfer_encoding_is_not_forwarded(hostile):
    hostile.exchange(_get("/echo", "Content-Length: 5", "Transfer-Encoding: chunked",
                          method="POST") + b"3\r\nabc\r\n0\r\n\r\n")
    asked = hostile.origin.asked[-1]
    assert "content-length" not in asked.headers and asked.body == b"abc"


def _misdirected(hostile: Hostile, named: str) -> bytes:
    authority = f"localhost:{hostile.origin.port}"
    return _refusal(421, (
        f"the {named} names another host than the tunnel's, {authority}: a secret is added "
        f"only to requests to its host; send the request to {authority} only, or to the "
        "other host through its own CONNECT"))


@pytest.mark.parametrize("host", ["other.test", "localhost.other.test", "localhost:1",
                                  "other.test:{port}", "localhost@other.test", "127.0.0.1"])
def test_a_host_header_naming_another_host_is_refused(hostile, host):
    """A front end serving many hosts (a CDN) would hand the value to the one named."""
    host = host.format(port=hostile.origin.port)
    asked = len(hostile.origin.asked)
    got = hostile.exchange(f"GET /echo HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
                           "{P}\r\n\r\n".encode())
    assert got == _misdirected(hostile, f"Host header {host}")
    assert len(hostile.origin.asked) == asked  # nothing reached the host


@pytest.mark.parametrize("target", ["https://other.test/echo", "http://localhost:{port}/echo",
                                    "https://localhost.other.test:{port}/echo"])
def test_an_absolute_target_naming_another_host_is_refused(hostile, target):
    target = target.format(port=hostile.origin.port)
    asked = len(hostile.origin.asked)
    got = hostile.exchange(_get(target))
    assert got == _misdirected(hostile, "request target " + target.removesuffix("/echo"))
    assert len(hostile.origin.asked) == asked


def test_an_absolute_target_naming_the_tunnels_host_goes_in_origin_form(hostile):
    got = hostile.exchange(_get(f"https://localhost:{hostile.origin.port}/echo?q={{P}}"))
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert hostile.origin.asked[-1].target == f"/echo?q={hostile.value}"


def test_connect_inside_the_tunnel_is_refused(hostile):
    asked = len(hostile.origin.asked)
    got = hostile.exchange(b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n"
                           b"Authorization: Bearer {P}\r\n\r\n")
    assert got == _refusal(405, (
        f"CONNECT inside the tunnel to localhost:{hostile.origin.port}, a host a secret is "
        "added for; CONNECT to the other host through the proxy itself"))
    assert len(hostile.origin.asked) == asked


def test_an_http_1_0_request_without_host_gets_the_tunnels(hostile):
    got = hostile.exchange(b"GET /echo HTTP/1.0\r\nAuthorization: Bearer {P}\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert f'"auth": "Bearer {hostile.placeholder}"'.encode() in _text(got)
    assert hostile.origin.asked[-1].headers["host"] == f"localhost:{hostile.origin.port}"


def test_pipelined_requests_each_get_the_value_and_never_return_it(hostile):
    got = hostile.exchange(_get("/echo?1", close=False) + _get("/echo?2"))
    assert _text(got).count(f'"auth": "Bearer {hostile.placeholder}"'.encode()) == 2
    assert [asked.auth for asked in hostile.origin.asked[-2:]] == [f"Bearer {hostile.value}"] * 2


@pytest.mark.parametrize("alpn", [["h2", "http/1.1"], ["h2"]])
def test_h2_offered_by_alpn_is_answered_in_http_1_1(hostile, alpn):
    got = hostile.exchange(_get("/echo"), alpn)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    preface = hostile.exchange(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", alpn)
    assert preface == _refusal(505, (
        f"HTTP/2.0 inside the tunnel to localhost:{hostile.origin.port}: the proxy speaks "
        "HTTP/1.1 to a host a secret is added for; use HTTP/1.1 (the only protocol the proxy "
        "offers by ALPN)"))
