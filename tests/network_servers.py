"""Servers on the host's 127.0.0.1 for the network tests: an HTTP and an HTTPS origin, a wheel
index, and a plain listener that nothing in a sandbox may ever reach."""

from __future__ import annotations

import base64
import datetime
import gzip
import http.server
import ipaddress
import json
import socket
import ssl
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

BODY = b"served from the origin"


def self_signed(directory: Path, names: list[str]) -> tuple[Path, Path]:
    """A certificate (its own CA) for names and 127.0.0.1, and its key, written to directory."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.timezone.utc)
    alt = [x509.DNSName(name) for name in names] + [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "origin.pem", directory / "origin.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def wheel_index(directory: Path) -> None:
    """A PEP 503 index at /simple/ with one pure-Python wheel, tinypkg 1.0."""
    name = "tinypkg-1.0-py3-none-any.whl"
    files = {"tinypkg/__init__.py": "VALUE = 42\n",
             "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\n"
                                               "Version: 1.0\n",
             "tinypkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
                                            "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    files["tinypkg-1.0.dist-info/RECORD"] = "".join(f"{path},,\n" for path in files) + \
        "tinypkg-1.0.dist-info/RECORD,,\n"
    (directory / "simple" / "tinypkg").mkdir(parents=True)
    with zipfile.ZipFile(directory / "simple" / "tinypkg" / name, "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
    (directory / "simple" / "tinypkg" / "index.html").write_text(
        f'<html><body><a href="{name}">{name}</a></body></html>')
    (directory / "simple" / "index.html").write_text(
        '<html><body><a href="tinypkg/">tinypkg</a></body></html>')


class _Handler(http.server.SimpleHTTPRequestHandler):
    """GET /: BODY and the Host header it saw; other paths: files of the served directory."""

    seen: list[dict[str, str]]  # each request's headers, for the tests (EchoOrigin)
    token: str | None = None  # a Basic password every request needs, if set

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if hasattr(self, "seen"):
            self.seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
            if self.token is not None and not self._authorized():
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="index"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            if path == "/redirect":
                self.send_response(302)
                self.send_header("Location", query)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            if path in ("/echo", "/v1/models"):
                return self._echo(path, query)
        if path != "/":
            return super().do_GET()
        body = BODY + b" host=" + (self.headers.get("Host") or "").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return None

    def _authorized(self) -> bool:
        scheme, _, credentials = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer":
            return credentials == self.token
        if scheme.lower() != "basic":
            return False
        user, _, password = base64.b64decode(credentials).decode().partition(":")
        return self.token in (user, password)

    def _echo(self, path: str, query: str) -> None:
        """What the request carried, back: in a header, and in a body of `repeat` copies
        written in 7-byte pieces of a chunked body (so reads split what is echoed), or with
        `length` in the query in one piece framed by Content-Length; `early`: after a 103;
        `gzip` (or `br`, still gzip): compressed, whatever the request accepted."""
        seen = self.seen[-1]
        if path == "/v1/models":  # the shape of OpenAI's model list, for its SDK
            body = json.dumps({"object": "list", "data": [
                {"id": seen.get("authorization", ""), "object": "model", "created": 0,
                 "owned_by": seen.get("x-api-key", "")}]}).encode()
        else:
            repeat = int(parse_qs(query).get("repeat", ["1"])[0])
            body = json.dumps(seen).encode() * repeat
        if "early" in query:  # a 103 Early Hints first, echoing too
            self.send_response_only(103)
            self.send_header("X-Early", seen.get("authorization", ""))
            self.end_headers()
        self.send_response(200)
        self.send_header("X-Echo", seen.get("authorization", ""))
        self.send_header("Content-Type", "application/json")
        if "gzip" in query or "br" in query:  # compressed though asked for identity
            body = gzip.compress(body)
            self.send_header("Content-Encoding", "gzip" if "gzip" in query else "br")
        if "length" in query or "gzip" in query or "br" in query:  # framed by Content-Length
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for at in range(0, len(body), 7):
            piece = body[at:at + 7]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


class Origin:
    """An HTTP (or, with a certificate, HTTPS) server on 127.0.0.1 in a thread of the test."""

    def __init__(self, directory: Path, cert: tuple[Path, Path] | None = None,
                 echo: bool = False, token: str | None = None) -> None:
        """echo: /echo, /v1/models and /redirect?URL answer, and self.seen keeps each request's
        headers; token: every request needs it (a bearer token, or Basic auth's user or
        password)."""
        self.seen: list[dict[str, str]] = []
        attributes = {"seen": self.seen, "token": token, "protocol_version": "HTTP/1.1"} \
            if echo or token else {}
        served = type("Served", (_Handler,), attributes)

        def handler(*args: object) -> _Handler:
            return served(*args, directory=str(directory))  # type: ignore[no-any-return]

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        if cert is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(str(cert[0]), str(cert[1]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self.server.shutdown()
        self.server.server_close()


class Listener:
    """A TCP listener on the host's 127.0.0.1 that records whether anyone connected."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(0.2)

    def was_reached(self) -> bool:
        """Whether a connection is waiting (nothing in a sandbox may make one)."""
        try:
            conn, _ = self.sock.accept()
        except (TimeoutError, OSError):
            return False
        conn.close()
        return True

    def close(self) -> None:
        """Close the listener."""
        self.sock.close()


class Catcher:
    """A TCP server on the host's 127.0.0.1 that keeps every byte it is sent (a Redis, say)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._keep, args=(conn,), daemon=True).start()

    def _keep(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.received += data

    def close(self) -> None:
        """Stop accepting."""
        self.sock.close()


class Asked:
    """One request as a Scripted origin read it: its head (raw), the parts, its body."""

    def __init__(self, head: bytes, body: bytes, trailers: bytes) -> None:
        self.head, self.body, self.trailers = head, body, trailers
        line, *fields = head.decode("utf-8", "replace").split("\r\n")
        self.method, self.target = line.split(" ")[:2]
        self.path = "/" + self.target.split("/", 3)[3] if "://" in self.target else self.target
        self.headers = {name.strip().lower(): value.strip() for name, _, value in
                        (field.partition(":") for field in fields if field)}

    @property
    def auth(self) -> str:
        """The Authorization header the origin got (the secret's value, from the proxy)."""
        return self.headers.get("authorization", "")


class Scripted:
    """An HTTPS origin on 127.0.0.1 whose answers are raw bytes, to misbehave as a test needs.

    Each request (its head read to the blank line, its body by Content-Length or chunked, with
    any trailers) is kept in self.asked and answered by answer(request): the bytes to send, in
    one write, or a list of them, each one write; None closes the connection. A `b""` in the
    list waits for self.release (set by a test once the client has what came before)."""

    def __init__(self, directory: Path, cert: tuple[Path, Path],
                 answer: Callable[[Asked], bytes | list[bytes] | None]) -> None:
        self.answer = answer
        self.asked: list[Asked] = []
        self.release = threading.Event()
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(str(cert[0]), str(cert[1]))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        try:
            with self.context.wrap_socket(conn, server_side=True) as tls:
                tls.settimeout(30)
                buffered = b""
                while True:
                    asked, buffered = _read_request(tls, buffered)
                    if asked is None:
                        return
                    self.asked.append(asked)
                    answer = self.answer(asked)
                    if answer is None:
                        return
                    for piece in [answer] if isinstance(answer, bytes) else answer:
                        if not piece:
                            self.release.wait(30)
                        tls.sendall(piece)
        except (OSError, ValueError):
            return

    def close(self) -> None:
        """Stop accepting."""
        self.sock.close()


def _read_request(tls: ssl.SSLSocket, data: bytes) -> tuple[Asked | None, bytes]:
    """The next request on tls (and what was read past it); None at the end of the stream."""
    def more() -> bool:
        nonlocal data
        piece = tls.recv(65536)
        data += piece
        return bool(piece)

    while b"\r\n\r\n" not in data:
        if not more():
            return None, b""
    head, data = data.split(b"\r\n\r\n", 1)
    asked = Asked(head, b"", b"")
    if "chunked" in asked.headers.get("transfer-encoding", ""):
        body = b""
        while True:
            while b"\r\n" not in data:
                if not more():
                    return None, b""
            size, data = data.split(b"\r\n", 1)
            length = int(size.split(b";")[0], 16)
            if not length:
                while b"\r\n\r\n" not in b"\r\n" + data:
                    if not more():
                        return None, b""
                trailers, data = (b"\r\n" + data).split(b"\r\n\r\n", 1)
                return Asked(head, body, trailers.strip()), data
            while len(data) < length + 2:
                if not more():
                    return None, b""
            body, data = body + data[:length], data[length + 2:]
    length = int(asked.headers.get("content-length", "0"))
    while len(data) < length:
        if not more():
            return None, b""
    return Asked(head, data[:length], b""), data[length:]
