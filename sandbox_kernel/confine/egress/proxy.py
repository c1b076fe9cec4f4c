"""The egress proxy: HTTP CONNECT and plain HTTP, on a listener inside the kernel's namespace.

The kernel makes the listening socket in its private network namespace (where user code's
HTTP_PROXY points) and hands it to its reaper, which serves it from outside: connections are
accepted from the kernel's namespace and made out of the launcher's. Every request is checked
against the rules (the name, then every address the proxy itself resolved), CONNECT tunnels
against the TLS server name the client sends, and each connection is one audit record.

Request heads are parsed by h11 (maintained, strict, already under httpx and uvicorn); the
rest is asyncio streams. A maintained proxy (proxy.py, mitmproxy, pproxy) was not taken: each
brings its own process model, configuration and plugins for what is here ~300 lines, and none
resolves names under a policy of our own before connecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11

from ..logrelay import LineSink, TokenBucket, escaped
from . import tls
from .rules import EgressRules, IPAddress, Refusal, Upstream, normal_name, parse_address

HEAD_LIMIT = 64 * 1024  # bytes of a request head
HEAD_TIMEOUT = 30.0  # seconds to send a request head, or a ClientHello into a tunnel
CONNECT_TIMEOUT = 15.0  # seconds to reach the destination (or the upstream proxy)
MAX_CONNECTIONS = 128  # open at once per kernel; more are answered 503
PROXY_PORT = 3128  # in the kernel's own namespace: nothing else listens there
_HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization",
               b"proxy-authenticate", b"te", b"trailer", b"upgrade", b"host"}


class Refused(Exception):
    """A request the policy (or the destination) turns down, with the answer user code sees."""

    def __init__(self, status: int, refusal: Refusal | str) -> None:
        super().__init__(str(refusal))
        self.status = status


@dataclass
class Connection:
    """One client connection's audit record, filled in as it goes."""

    kernel: str
    method: str = ""
    host: str = ""
    port: int = 0
    address: str | None = None
    sni: str | None = None
    allowed: bool = False
    reason: str | None = None
    sent: int = 0  # bytes from user code to the destination
    received: int = 0  # bytes from the destination to user code
    started: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict[str, Any]:
        """The JSON line of the audit record."""
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "kernel": self.kernel[:128], "event": "egress", "method": self.method,
                 "host": self.host[:255], "port": self.port, "address": self.address,
                 "allowed": self.allowed, "sent": self.sent, "received": self.received,
                 "duration": round(time.monotonic() - self.started, 3)}
        if self.sni is not None:
            entry["sni"] = self.sni[:255]
        if self.reason:
            entry["reason"] = self.reason
        return entry

    def summary(self) -> str:
        """The same, as one line of the launcher's log."""
        target = f"{self.method} {self.host}:{self.port}"
        if not self.allowed:
            return f"egress refused {target}: {self.reason}"
        return (f"egress {target} ({self.address}) sent {self.sent} received {self.received} "
                f"bytes in {time.monotonic() - self.started:.2f} s")


Recorder = Callable[[Connection], None]


class EgressProxy:
    """Serves one kernel's egress listener under its rules."""

    def __init__(self, rules: EgressRules, kernel_id: str, record: Recorder,
                 upstream: Upstream | None = None) -> None:
        self.rules, self.kernel_id, self.record = rules, kernel_id, record
        self.upstream = upstream
        self.slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def serve(self, listener: socket.socket) -> None:
        """Accept and serve connections on listener until cancelled."""
        listener.setblocking(False)
        server = await asyncio.start_server(self.handle, sock=listener, limit=HEAD_LIMIT)
        async with server:
            await server.serve_forever()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection: a request, then a tunnel or one forwarded exchange."""
        entry = Connection(self.kernel_id)
        try:
            if self.slots.locked():
                raise Refused(503, f"more than {MAX_CONNECTIONS} connections open at once")
            async with self.slots:
                await self._serve(reader, writer, entry)
        except Refused as exc:
            entry.allowed, entry.reason = False, str(exc)
            if exc.status:
                await _answer(writer, exc.status, str(exc))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            if not entry.allowed:
                entry.reason = entry.reason or f"client: {exc!r}"
        finally:
            writer.close()
            if entry.method:
                self.record(entry)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     entry: Connection) -> None:
        request, rest = await _read_head(reader)
        entry.method = request.method.decode("ascii", "replace")
        if entry.method == "CONNECT":
            entry.host, entry.port = _authority(request.target.decode("ascii", "replace"))
        else:
            entry.host, entry.port, path = _absolute(request.target.decode("ascii", "replace"))
        refusal = self.rules.check_name(entry.host, entry.port)
        if refusal is not None:
            raise Refused(403, refusal)
        if entry.method == "CONNECT":
            await self._tunnel(reader, writer, entry, rest)
        else:
            head = _forwarded_head(request, entry, path if self.upstream is None else None)
            far_reader, far_writer = await self._open(entry, tunnel=False)
            entry.allowed = True
            far_writer.write(head + rest)
            entry.sent += len(head) + len(rest)
            await _splice(reader, writer, far_reader, far_writer, entry)

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      entry: Connection, rest: bytes) -> None:
        far_reader, far_writer = await self._open(entry, tunnel=True)
        try:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            hello = await asyncio.wait_for(_client_hello(reader, rest), HEAD_TIMEOUT)
            self._check_hello(entry, hello)
        except Refused:
            far_writer.close()
            writer.write(tls.ACCESS_DENIED_ALERT)
            raise
        entry.allowed = True
        far_writer.write(hello)
        entry.sent += len(hello)
        await _splice(reader, writer, far_reader, far_writer, entry)

    def _check_hello(self, entry: Connection, hello: bytes) -> None:
        """The tunnel must carry TLS for the name it was allowed for (no domain fronting)."""
        target_is_address = parse_address(entry.host) is not None
        try:
            name = tls.server_name(hello) if tls.hello_length(hello) else None
        except tls.NotTLS:
            if target_is_address or self.rules.mode == "on":
                return
            raise Refused(0, Refusal(f"{entry.host}:{entry.port}: the tunnel does not carry "
                                     "TLS, so the server name cannot be checked",
                                     "use https:// through the proxy")) from None
        entry.sni = name
        if name is not None and not target_is_address and normal_name(name) != entry.host:
            raise Refused(0, Refusal(f"TLS server name {name} differs from the CONNECT "
                                     f"target {entry.host}", f"connect to {name} itself "
                                     "(and allow it with --allow-host if it is not)"))

    async def _open(self, entry: Connection, tunnel: bool
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to the destination (checked), or to the upstream proxy for it."""
        addresses = await self._allowed_addresses(entry)
        if self.upstream is not None:
            return await self._via_upstream(entry, tunnel)
        last: OSError | None = None
        for address in addresses:
            try:
                far = await asyncio.wait_for(
                    asyncio.open_connection(str(address), entry.port), CONNECT_TIMEOUT)
            except (OSError, asyncio.TimeoutError) as exc:
                last = exc if isinstance(exc, OSError) else OSError("timed out")
                continue
            entry.address = str(address)
            return far
        raise Refused(502, f"{entry.host}:{entry.port} could not be reached: "
                           f"{getattr(last, 'strerror', None) or last}")

    async def _allowed_addresses(self, entry: Connection) -> list[IPAddress]:
        """What the destination resolves to, without any address the rules refuse."""
        literal = parse_address(entry.host)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    entry.host, entry.port, type=socket.SOCK_STREAM)
            except OSError:
                if self.upstream is not None:
                    return []  # the upstream proxy resolves it (and applies its own rules)
                raise Refused(502, f"{entry.host} does not resolve") from None
            found = (parse_address(str(info[4][0])) for info in infos)  # numeric: never None
            addresses = list(dict.fromkeys(address for address in found if address is not None))
        refusals = [self.rules.check_address(entry.host, address, entry.port)
                    for address in addresses if address is not None]
        if any(refusals) and (self.upstream is not None or all(refusals)):
            # Behind an upstream the proxy cannot choose the address: any bad one refuses.
            raise Refused(403, next(refusal for refusal in refusals if refusal))
        return [address for address, refusal in zip(addresses, refusals, strict=True)
                if address is not None and refusal is None]

    async def _via_upstream(self, entry: Connection, tunnel: bool
                            ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        upstream = self.upstream
        assert upstream is not None
        try:
            far_reader, far_writer = await asyncio.wait_for(
                asyncio.open_connection(upstream.host, upstream.port, limit=HEAD_LIMIT),
                CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as exc:
            raise Refused(502, f"the upstream proxy {upstream.host}:{upstream.port} could not "
                               f"be reached: {exc!r}") from None
        entry.address = f"upstream {upstream.host}:{upstream.port}"
        if not tunnel:
            return far_reader, far_writer
        authority = _host_port(entry.host, entry.port)
        head = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
        if upstream.authorization:
            head += f"Proxy-Authorization: {upstream.authorization}\r\n"
        far_writer.write(head.encode() + b"\r\n")
        answer = await asyncio.wait_for(far_reader.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT)
        status_line = answer.split(b"\r\n", 1)[0].decode("latin-1")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or parts[1] != "200":
            far_writer.close()
            raise Refused(502, f"the upstream proxy refused {authority}: {status_line}")
        return far_reader, far_writer


async def _read_head(reader: asyncio.StreamReader) -> tuple[h11.Request, bytes]:
    """The request head, and the bytes after it that were already read."""
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
    deadline = time.monotonic() + HEAD_TIMEOUT
    while True:
        try:
            event = parser.next_event()
        except h11.RemoteProtocolError as exc:
            raise Refused(400, f"not an HTTP proxy request: {exc}") from None
        if event is h11.NEED_DATA:
            remaining = deadline - time.monotonic()
            data = await asyncio.wait_for(reader.read(16384), max(remaining, 0.001))
            parser.receive_data(data)
            if not data:
                raise Refused(0, "the client closed before sending a request")
            continue
        if isinstance(event, h11.Request):
            return event, parser.trailing_data[0]
        raise Refused(400, "not an HTTP proxy request")


def _authority(target: str) -> tuple[str, int]:
    """CONNECT's 'host:port' (IPv6 in brackets) as a checked, normalised (host, port)."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise Refused(400, f"CONNECT {target}: expected HOST:PORT")
    return _host(host), int(port)


def _absolute(target: str) -> tuple[str, int, str]:
    """An absolute http:// request target as (host, port, origin-form path)."""
    try:
        parts = urlsplit(target)
        port = parts.port or 80
    except ValueError:
        raise Refused(400, f"bad request target {target[:200]}") from None
    if parts.scheme != "http" or not parts.hostname:
        raise Refused(400, f"{target[:200]}: this is a proxy; send http:// URLs in full, and "
                           "https:// through CONNECT")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return _host(parts.hostname), port, path


def _host(text: str) -> str:
    address = parse_address(text)
    if address is not None:
        return str(address)
    try:
        return normal_name(text)
    except ValueError:
        raise Refused(400, f"{text[:200]!r} is not a host name") from None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _forwarded_head(request: h11.Request, entry: Connection, path: str | None) -> bytes:
    """The request head sent on: origin-form (or absolute for an upstream), one exchange only."""
    target = path.encode() if path is not None else request.target
    lines = [request.method + b" " + target + b" HTTP/1.1",
             b"Host: " + _host_port(entry.host, entry.port).removesuffix(":80").encode()]
    lines += [name + b": " + value for name, value in request.headers
              if name.lower() not in _HOP_BY_HOP]
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _client_hello(reader: asyncio.StreamReader, data: bytes) -> bytes:
    """Read until the whole ClientHello is in; on NotTLS, what was read (to decide on)."""
    while True:
        try:
            if tls.hello_length(data) is not None:
                return data
        except tls.NotTLS:
            return data
        more = await reader.read(16384)
        if not more:
            return data
        data += more


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                count: Callable[[int], None]) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            count(len(data))
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(OSError):
            if writer.can_write_eof():
                writer.write_eof()


async def _splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  far_reader: asyncio.StreamReader, far_writer: asyncio.StreamWriter,
                  entry: Connection) -> None:
    """Copy both ways until both sides are done, counting the bytes."""
    def sent(n: int) -> None:
        entry.sent += n

    def received(n: int) -> None:
        entry.received += n

    try:
        await asyncio.gather(_pump(reader, far_writer, sent), _pump(far_reader, writer, received))
    finally:
        far_writer.close()


async def _answer(writer: asyncio.StreamWriter, status: int, text: str) -> None:
    """An error response whose reason phrase carries the explanation (clients show it)."""
    reason = "".join(c if 32 <= ord(c) < 127 else "?" for c in text)[:400]
    body = f"sandbox-kernel egress proxy: {reason}\n".encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with contextlib.suppress(OSError):
        writer.write(head + body)
        await writer.drain()


class AuditSink:
    """Egress records to the operator's audit file and the launcher's log, rate-limited."""

    def __init__(self, audit_file: int | None, log: LineSink) -> None:
        self.audit_file, self.log = audit_file, log
        self.budget = TokenBucket(100, 10.0)
        self.suppressed = 0

    def __call__(self, entry: Connection) -> None:
        """Write one connection's record (or count it when over the rate)."""
        if not self.budget.take():
            self.suppressed += 1
            return
        if self.suppressed:
            self._write({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "kernel": entry.kernel[:128], "event": "egress",
                         "suppressed": self.suppressed},
                        f"{self.suppressed} more egress records not written (rate limit)")
            self.suppressed = 0
        self._write(entry.as_dict(), entry.summary())

    def _write(self, record: dict[str, Any], summary: str) -> None:
        kernel = str(record.get("kernel", ""))
        # Host names and request targets come from user code: shown escaped, as in audit.py.
        self.log.write(f"sandbox-kernel audit: kernel {escaped(kernel[:128])}: "
                       f"{escaped(summary)}\n".encode())
        if self.audit_file is not None:
            with contextlib.suppress(OSError):
                os.write(self.audit_file, json.dumps(record).encode() + b"\n")
