"""Servers on the host's 127.0.0.1 for the network tests: an HTTP and an HTTPS origin, a wheel
index, and a plain listener that nothing in a sandbox may ever reach."""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import socket
import ssl
import threading
from pathlib import Path

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


class _Handler(http.server.SimpleHTTPRequestHandler):
    """GET /: BODY and the Host header it saw; other paths: files of the served directory."""

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/":
            return super().do_GET()
        body = BODY + b" host=" + (self.headers.get("Host") or "").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return None

    def log_message(self, *args: object) -> None:
        pass


class Origin:
    """An HTTP (or, with a certificate, HTTPS) server on 127.0.0.1 in a thread of the test."""

    def __init__(self, directory: Path, cert: tuple[Path, Path] | None = None) -> None:
        def handler(*args: object) -> _Handler:
            return _Handler(*args, directory=str(directory))  # type: ignore[arg-type]

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
