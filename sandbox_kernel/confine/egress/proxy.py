"""The egress proxy: HTTP CONNECT and plain HTTP, on a listener inside the kernel's namespace.

The kernel makes the listening socket in its private network namespace (where user code's
HTTP_PROXY points) and hands it to its reaper, which serves it from outside: connections are
accepted from the kernel's namespace and made out of the launcher's. Every request is checked
against the rules (the name, then every address the proxy itself resolved), CONNECT tunnels
of `hosts` mode against the TLS server name the client sends (nothing is forwarded before a
whole ClientHello naming the allowed host has arrived).

The record: an allowed connection is written when it opens (`egress-open`) and when it ends
(`egress`), also when the kernel's end cuts it (`stop`); refusals are rate-limited, and what
the limit left out is counted in a `suppressed` record written within a second and at the end.

Request heads are parsed by h11 (maintained, strict, already under httpx and uvicorn), once a
whole head within HEAD_LIMIT bytes and MAX_HEADERS lines has arrived (found by bytes.find and
counted by bytes.count, C loops): the companion runs unconfined, so what the kernel sends may
cost it only a small, bounded amount per connection. The rest is asyncio streams. A
maintained proxy (proxy.py, mitmproxy, pproxy) was not taken: each brings its own process
model, configuration and plugins for what is here ~400 lines, and none resolves names under a
policy of our own before connecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import h11

from ..logrelay import LineSink, TokenBucket, escaped
from . import intercept, tls
from .ca import KernelCA
from .cputime import metered
from .intercept import ExchangeError, Secrets
from .rules import EgressRules, IPAddress, Refusal, Upstream, normal_name, parse_address
from .secret import Secret

HEAD_LIMIT = 16 * 1024  # bytes of a request head (nginx's default is 8 KiB a line)
MAX_HEADERS = 100  # header lines of a request head (h11's cost grows with their number)
HEAD_TIMEOUT = 30.0  # seconds to send a request head, or a ClientHello into a tunnel
CONNECT_TIMEOUT = 15.0  # seconds to reach the destination (or the upstream proxy)
MAX_CONNECTIONS = 128  # open at once per kernel; more are answered 503
CONNECTION_BURST, CONNECTION_RATE = 200, 100.0  # connections accepted at once, then per second
REFUSAL_BURST, REFUSAL_RATE = 100, 10.0  # refusals recorded at once, and per second after
FLUSH_AFTER = 1.0  # seconds after a refusal left out of the record, its count is written
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
    event: str = "egress"  # "egress-open" while an allowed connection is being opened
    method: str = ""
    host: str = ""
    port: int = 0
    address: str | None = None
    sni: str | None = None
    allowed: bool = False
    reason: str | None = None
    secret: str | None = None  # the secret added to one request ("egress-secret" records)
    sent: int = 0  # bytes from user code to the destination
    received: int = 0  # bytes from the destination to user code
    started: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict[str, Any]:
        """The JSON line of the audit record."""
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "kernel": self.kernel[:128], "event": self.event, "method": self.method,
                 "host": self.host[:255], "port": self.port, "address": self.address,
                 "allowed": self.allowed, "sent": self.sent, "received": self.received,
                 "duration": round(time.monotonic() - self.started, 3)}
        if self.sni is not None:
            entry["sni"] = self.sni[:255]
        if self.reason:
            entry["reason"] = self.reason
        if self.secret is not None:
            entry["secret"] = self.secret
        return entry

    def summary(self) -> str:
        """The same, as one line of the launcher's log."""
        target = f"{self.method} {self.host}:{self.port}"
        if not self.allowed:
            return f"egress refused {target}: {self.reason}"
        if self.event == "egress-open":
            return f"egress opened {target} ({self.address})"
        if self.event == "egress-secret":
            return f"egress secret {self.secret} added to a request to {target}"
        ended = f" ({self.reason})" if self.reason else ""
        return (f"egress {target} ({self.address}) sent {self.sent} received {self.received} "
                f"bytes in {time.monotonic() - self.started:.2f} s{ended}")


class Recorder(Protocol):
    """Where the proxy's records go (an AuditSink)."""

    def __call__(self, entry: Connection) -> None:
        """Write (or count) one record."""

    def flush(self) -> None:
        """Write what is counted but not yet written."""


class EgressProxy:
    """Serves one kernel's egress listener under its rules."""

    def __init__(self, rules: EgressRules, kernel_id: str, record: Recorder,
                 upstream: Upstream | None = None,
                 charge: Callable[[float], None] | None = None, *,
                 count_use: Callable[[str], None] | None = None,
                 secrets: Sequence[Secret] = (),
                 ca: KernelCA | None = None, upstream_ca: bytes | None = None) -> None:
        """secrets: added for their hosts (whose TLS is terminated with ca, made here if not
        given); upstream_ca: PEM certificates trusted beside the system store upstream."""
        self.rules, self.kernel_id, self.record = rules, kernel_id, record
        self.upstream = upstream
        self.charge = charge  # takes the CPU each connection's work costs (cputime.py)
        self.count_use = count_use  # takes each secret's use, for the kernel's usage (tally.py)
        self.secrets = Secrets(secrets)
        self.ca = (ca or KernelCA(kernel_id)) if self.secrets else None
        self.upstream_tls = ssl.create_default_context()
        self.upstream_tls.set_alpn_protocols(["http/1.1"])
        if upstream_ca:
            self.upstream_tls.load_verify_locations(cadata=upstream_ca.decode("ascii"))
        self.substitutions: Counter[str] = Counter()  # requests each secret was added to
        self.slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self.open: set[asyncio.Task[Any]] = set()  # the connections being served
        self.pace = TokenBucket(CONNECTION_BURST, CONNECTION_RATE)
        self.flushing: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None
        self.stopped = False

    async def serve(self, listener: socket.socket) -> None:
        """Accept and serve connections on listener until cancelled (or stop() is called).

        On the way out every open connection is closed, and recorded as cut by the end.
        """
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        listener.setblocking(False)
        try:
            while not self.stopped:
                await self._paced()
                conn, _ = await self.loop.sock_accept(listener)
                work = self._connected(conn)
                self.loop.create_task(work if self.charge is None else metered(work, self.charge))
        finally:
            for task in self.open:
                task.cancel()
            await asyncio.gather(*self.open, return_exceptions=True)
            if self.flushing is not None:
                self.flushing.cancel()
            self.record.flush()

    async def _paced(self) -> None:
        """Wait for the next connection's turn: at most CONNECTION_RATE a second after a burst.

        Every connection costs the unconfined companion about a millisecond (accept, the event
        loop, an answer), whatever it carries; the kernel's further connects wait in the
        listener's backlog meanwhile, so the kernel waits, not the companion.
        """
        while not self.pace.take():
            await asyncio.sleep((1 - self.pace.available()) / CONNECTION_RATE)

    async def _connected(self, conn: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=conn, limit=HEAD_LIMIT)
        await self.handle(reader, writer)

    def stop(self) -> None:
        """End serve() from another thread (the kernel has ended): its connections are recorded."""
        self.stopped = True
        loop, task = self.loop, self.task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                loop.call_soon_threadsafe(task.cancel)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection: a request, then a tunnel or one forwarded exchange."""
        entry = Connection(self.kernel_id)
        task = asyncio.current_task()
        if task is not None:
            self.open.add(task)
        try:
            if self.slots.locked():
                raise Refused(503, f"more than {MAX_CONNECTIONS} connections open at once")
            async with self.slots:
                await self._serve(reader, writer, entry)
        except Refused as exc:
            entry.allowed, entry.reason = False, self.secrets.scrubbed(str(exc))
            if exc.status:
                await _answer(writer, exc.status, entry.reason)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            if not entry.allowed:
                entry.reason = entry.reason or f"client: {exc!r}"
        except asyncio.CancelledError:  # stop(): the kernel has ended
            entry.reason = "cut when the kernel ended"  # and the handler ends: not raised on
        finally:
            self.open.discard(task)  # type: ignore[arg-type]
            writer.close()
            if entry.method:
                self._write(entry)

    def _write(self, entry: Connection) -> None:
        """Record entry; a refusal the sink left out is counted, and the count written soon.

        Its reason is scrubbed of every secret's value, whatever wrote it."""
        if entry.reason:
            entry.reason = self.secrets.scrubbed(entry.reason)
        self.record(entry)
        if not entry.allowed and self.flushing is None and self.loop is not None:
            self.flushing = self.loop.call_later(FLUSH_AFTER, self._flush)

    def _flush(self) -> None:
        self.flushing = None
        self.record.flush()

    def _opened(self, entry: Connection) -> None:
        """An allowed connection is recorded before a byte of it is forwarded."""
        entry.allowed = True
        self.record(dataclasses.replace(entry, event="egress-open"))

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
            if self.secrets.of(entry.host, entry.port):
                await self._intercept(reader, writer, entry, rest)
            else:
                await self._tunnel(reader, writer, entry, rest)
        else:
            self._check_plain(request, entry)
            far_reader, far_writer = await self._open(entry, tunnel=False)
            head = _forwarded_head(request, entry, path if self.upstream is None else None,
                                   None if self.upstream is None else self.upstream.authorization)
            self._opened(entry)
            far_writer.write(head + rest)
            entry.sent += len(head) + len(rest)
            await _splice(reader, writer, far_reader, far_writer, entry)

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      entry: Connection, rest: bytes) -> None:
        far_reader, far_writer = await self._open(entry, tunnel=True)
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        # In hosts mode a name was allowed, not an address: the tunnel must carry TLS for that
        # name. With `on` (any public address) or an allowed address, anything may pass, at
        # once: a protocol whose server speaks first (SMTP, SSH) must not wait for a hello.
        if self.rules.mode == "hosts" and parse_address(entry.host) is None:
            try:
                rest = await self._checked_hello(reader, entry, rest)
            except Refused:
                far_writer.close()
                writer.write(tls.ACCESS_DENIED_ALERT)
                raise
        self._opened(entry)
        far_writer.write(rest)
        entry.sent += len(rest)
        await _splice(reader, writer, far_reader, far_writer, entry)

    def _check_plain(self, request: h11.Request, entry: Connection) -> None:
        """Plain HTTP carries no secret: refused to a secret's host, and with a placeholder."""
        own = self.secrets.of(entry.host, entry.port)
        if own:
            names = ", ".join(secret.name for secret in own)
            raise Refused(403, Refusal(
                f"plain HTTP to {entry.host}:{entry.port}, a host of secret {names}: secrets "
                "are added over HTTPS only", f"use https://{_host_port(entry.host, 443)}"
                .removesuffix(":443")))
        try:
            self.secrets.check(entry.host, entry.port, intercept.readable_forms(
                request.target, list(request.headers.raw_items())))
        except ExchangeError as exc:
            raise Refused(exc.status, str(exc)) from None

    async def _intercept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         entry: Connection, rest: bytes) -> None:
        """A CONNECT to a secret's host: TLS ends here, each request gets its secrets added."""
        assert self.ca is not None
        if rest:
            raise Refused(400, f"CONNECT {entry.host}:{entry.port}: bytes sent before the "
                               "proxy answered")
        raw = await self._open(entry, tunnel=True)  # kept: its writer's __del__ would close it
        try:
            far = await intercept.start_tls(raw, self.upstream_tls, entry.host, CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as exc:
            raw[1].close()
            verify = getattr(exc, "verify_message", None)
            raise Refused(502, Refusal(
                f"{entry.host}:{entry.port}: TLS to it failed"
                + (f": its certificate cannot be verified ({verify})" if verify else
                   f": {exc!r}"), "give its CA with --upstream-ca FILE if it is a private one"
            )) from None
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        self._opened(entry)
        near: intercept.Stream | None = None
        try:
            context = self.ca.server_context(entry.host)
            try:
                near = await intercept.start_tls((reader, writer), context, None, HEAD_TIMEOUT)
            except (OSError, asyncio.TimeoutError) as exc:
                raise Refused(0, f"TLS from user code failed ({exc!r}): the client does not "
                                 "trust the kernel's CA (SSL_CERT_FILE)") from None
            exchanges = intercept.Exchanges(self.secrets, entry.host, entry.port,
                                            lambda secret: self._used(entry, secret),
                                            MAX_HEADERS, HEAD_LIMIT)

            def counted(sent: int, received: int) -> None:
                entry.sent += sent
                entry.received += received

            try:
                await exchanges.serve(near, far, HEAD_TIMEOUT, counted)
            except ExchangeError as exc:
                text = self.secrets.scrubbed(str(exc))  # never quotes the host: and if it did
                if exc.status:
                    await _answer(near[1], exc.status, text)
                raise Refused(0, text) from None
        finally:
            far[1].close()
            raw[1].close()
            if near is not None:
                near[1].close()

    def _used(self, entry: Connection, secret: Secret) -> None:
        """A secret added to a request: counted, and recorded (its name, never its value)."""
        self.substitutions[secret.name] += 1
        if self.count_use is not None:
            self.count_use(secret.name)
        self.record(dataclasses.replace(entry, event="egress-secret", secret=secret.name,
                                        allowed=True))

    async def _checked_hello(self, reader: asyncio.StreamReader, entry: Connection,
                             data: bytes) -> bytes:
        """What the client sent, once it holds a whole ClientHello naming the CONNECT target.

        Refused otherwise: not TLS, a hello cut short (at its end or the time limit), one that
        cannot be read, one without a server name, one naming another host (domain fronting).
        """
        def refused(reason: str, fix: str = "use https:// through the proxy") -> Refused:
            return Refused(0, Refusal(f"{entry.host}:{entry.port}: {reason}", fix))

        deadline = time.monotonic() + HEAD_TIMEOUT
        while True:
            try:
                length = tls.hello_length(data)
                if length is not None and tls.whole_records(data, length):
                    break
            except tls.NotTLS:
                raise refused("the tunnel does not carry TLS, so the server name cannot be "
                              "checked") from None
            if len(data) > 2 * tls.MAX_HELLO:
                raise refused("more than a ClientHello before the server could answer")
            try:
                more = await asyncio.wait_for(reader.read(16384),
                                              max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise refused(f"no whole TLS ClientHello within {HEAD_TIMEOUT:g} s") from None
            if not more:
                raise refused("the tunnel ended before a whole TLS ClientHello (and the "
                              "records sent with it)")
            data += more
        try:
            name = tls.server_name(data[:length])
        except tls.NotTLS as exc:
            raise refused(f"the TLS ClientHello cannot be read ({exc})") from None
        if name is None:
            raise refused("the TLS ClientHello names no server (SNI), so it cannot be checked",
                          "send the host name in TLS (every https:// client does)")
        entry.sni = name
        try:
            same = normal_name(name) == entry.host
        except ValueError:  # not a DNS name at all
            same = False
        if not same:
            raise Refused(0, Refusal(f"TLS server name {name} differs from the CONNECT "
                                     f"target {entry.host}", f"connect to {name} itself "
                                     "(and allow it with --allow-host if it is not)"))
        return data

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
        try:
            answer = await asyncio.wait_for(far_reader.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT)
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            far_writer.close()  # an answer too long, cut short or too slow: not one to trust
            raise Refused(502, f"the upstream proxy {upstream.host}:{upstream.port} gave no "
                               f"answer to CONNECT {authority} within {HEAD_LIMIT} bytes and "
                               f"{CONNECT_TIMEOUT:g} s") from None
        status_line = answer.split(b"\r\n", 1)[0].decode("latin-1")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or parts[1] != "200":
            far_writer.close()
            raise Refused(502, f"the upstream proxy refused {authority}: {status_line}")
        return far_reader, far_writer


async def _read_head(reader: asyncio.StreamReader) -> tuple[h11.Request, bytes]:
    """The request head, and the bytes after it that were already read.

    The head is gathered and bounded first (size, lines), then parsed once by h11.
    """
    data = bytearray()
    searched = lines = 0  # each byte is searched and counted once
    deadline = time.monotonic() + HEAD_TIMEOUT
    while (end := data.find(b"\r\n\r\n", max(searched - 3, 0))) < 0:
        lines += data.count(b"\n", searched)
        if lines > MAX_HEADERS + 1:  # the request line's, and one per header but the last
            raise Refused(431, f"request head of more than {MAX_HEADERS} header lines")
        if len(data) > HEAD_LIMIT:
            raise Refused(431, f"request head longer than {HEAD_LIMIT} bytes")
        searched = len(data)
        remaining = deadline - time.monotonic()
        more = await asyncio.wait_for(reader.read(16384), max(remaining, 0.001))
        if not more:
            raise Refused(0, "the client closed before sending a request")
        data += more
    if data.count(b"\n", 0, end) > MAX_HEADERS:
        raise Refused(431, f"request head of more than {MAX_HEADERS} header lines")
    if end + 4 > HEAD_LIMIT:
        raise Refused(431, f"request head longer than {HEAD_LIMIT} bytes")
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
    parser.receive_data(bytes(data))
    try:
        event = parser.next_event()
    except h11.RemoteProtocolError as exc:
        raise Refused(400, f"not an HTTP proxy request: {exc}") from None
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


def _forwarded_head(request: h11.Request, entry: Connection, path: str | None,
                    proxy_authorization: str | None = None) -> bytes:
    """The request head sent on: origin-form (or absolute for an upstream, with the upstream's
    credentials, as its CONNECTs carry them), one exchange only."""
    target = path.encode() if path is not None else request.target
    lines = [request.method + b" " + target + b" HTTP/1.1",
             b"Host: " + _host_port(entry.host, entry.port).removesuffix(":80").encode()]
    lines += [name + b": " + value for name, value in request.headers
              if name.lower() not in _HOP_BY_HOP]  # the kernel's own Proxy-Authorization too
    if proxy_authorization:
        lines.append(b"Proxy-Authorization: " + proxy_authorization.encode())
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


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
    """Egress records, as JSON lines to the audit file (or, without one, the launcher's log).

    Allowed connections are always written; refusals at most REFUSAL_BURST at once and
    REFUSAL_RATE per second, the rest counted and written as one `suppressed` record at the
    next record or flush().
    """

    def __init__(self, audit_file: int | None, log: LineSink) -> None:
        self.audit_file, self.log = audit_file, log
        self.budget = TokenBucket(REFUSAL_BURST, REFUSAL_RATE)
        self.suppressed = 0
        self.kernel = ""

    def __call__(self, entry: Connection) -> None:
        """Write one connection's record (or count a refusal when over the rate)."""
        self.kernel = entry.kernel
        if not entry.allowed and not self.budget.take():
            self.suppressed += 1
            return
        self.flush()
        self._write(entry.as_dict(), entry.summary())

    def flush(self) -> None:
        """Write the count of refusals left out since the last record, if any."""
        if self.suppressed:
            self._write({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "kernel": self.kernel[:128], "event": "egress",
                         "suppressed": self.suppressed},
                        f"{self.suppressed} more egress refusals not written (rate limit)")
            self.suppressed = 0

    def _write(self, record: dict[str, Any], summary: str) -> None:
        if self.audit_file is not None:
            try:  # one write per line: O_APPEND keeps concurrent kernels' lines whole
                os.write(self.audit_file, json.dumps(record).encode() + b"\n")
                return
            except OSError as exc:
                self.log.write(f"sandbox-kernel audit: cannot write the audit log: {exc}\n"
                               .encode())
        kernel = str(record.get("kernel", ""))
        # Host names and request targets come from user code: shown escaped, as in audit.py.
        self.log.write(f"sandbox-kernel audit: kernel {escaped(kernel[:128])}: "
                       f"{escaped(summary)}\n".encode())
