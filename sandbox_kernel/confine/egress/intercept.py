"""Secrets on the way out: the placeholder user code holds becomes the value, for its hosts only.

For a CONNECT to one of a secret's hosts the proxy terminates TLS with a leaf of the kernel's
own CA (ca.py) and connects upstream with full verification; then each HTTP/1.1 exchange is
read by h11 on both sides. In the request the placeholder is replaced by the value in the
target (the query string), in every header, and inside `Authorization: Basic` (a URL's
userinfo); a placeholder of a secret that does not belong to the host is refused (403, naming
the secret and its hosts), wherever the proxy can read the request: here and in plain HTTP.
The response comes back with the value (and the forms of it the proxy made) replaced by the
placeholder in its headers and body, the body asked for uncompressed (gzip or deflate sent
anyway is undone; any other encoding is refused) and re-framed by h11, scrubbed as it streams
with only the longest value's length held back (constant memory).

What the proxy cannot read it cannot scrub: a value the host reflects compressed, encrypted or
re-encoded by the application reaches user code (docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ssl
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import quote

import h11

from .rules import NameRule, NetRule, Refusal, parse_address, parse_host_entry
from .secret import Secret

CHUNK = 65536  # bytes read at a time from either side
IDLE_TIMEOUT = 300.0  # seconds an intercepted connection may wait for the next bytes
_DROPPED = {b"proxy-connection", b"proxy-authorization", b"keep-alive", b"upgrade", b"te",
            b"trailer", b"accept-encoding", b"expect"}
_RESPONSE_FRAMING = {b"content-length", b"transfer-encoding"}
_UNDONE = {b"gzip", b"x-gzip", b"deflate"}  # encodings the proxy undoes to scrub a body


class ExchangeError(Exception):
    """An exchange the proxy turns down, with the status user code gets (0: none can be sent)."""

    def __init__(self, status: int, reason: Refusal | str) -> None:
        super().__init__(str(reason))
        self.status = status


@dataclass(frozen=True)
class _Owned:
    secret: Secret
    rules: tuple[NameRule | NetRule, ...]

    def owns(self, host: str, port: int) -> bool:
        address = parse_address(host)
        for rule in self.rules:
            if isinstance(rule, NameRule) and address is None and rule.matches(host, port):
                return True
            if isinstance(rule, NetRule) and address is not None and rule.matches(address, port):
                return True
        return False


class Secrets:
    """One kernel's secrets, by the hosts they belong to."""

    def __init__(self, secrets: Sequence[Secret]) -> None:
        for secret in secrets:
            if not secret.placeholder or any(c in secret.value for c in "\r\n\0"):
                raise ValueError(f"secret {secret.name}: no placeholder, or a value that cannot "
                                 "be sent in an HTTP header")
        self.owned = [_Owned(secret, tuple(parse_host_entry(host) for host in secret.hosts))
                      for secret in secrets]

    def __bool__(self) -> bool:
        return bool(self.owned)

    def of(self, host: str, port: int) -> list[Secret]:
        """The secrets that belong to host:port (those the proxy intercepts it for)."""
        return [owned.secret for owned in self.owned if owned.owns(host, port)]

    def check(self, host: str, port: int, texts: Sequence[bytes]) -> None:
        """Refuse (403) a placeholder, anywhere in texts, of a secret not belonging to host."""
        for owned in self.owned:
            placeholder = owned.secret.placeholder.encode()
            if not owned.owns(host, port) and any(placeholder in text for text in texts):
                name, hosts = owned.secret.name, ", ".join(owned.secret.hosts)
                raise ExchangeError(403, Refusal(
                    f"the placeholder of secret {name} was sent to {host}:{port}, which is "
                    f"not its host ({hosts})",
                    f"send {name} only to {hosts} (or declare it for this host too with "
                    f"--secret {name}={host})"))


def readable_forms(target: bytes, headers: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
    """The parts of a request head a placeholder may hide in, decoded where a client encodes."""
    forms = [target, *(value for _, value in headers)]
    forms += [decoded for name, value in headers if name.lower() == b"authorization"
              if (decoded := _basic(value)) is not None]
    return forms


def _basic(value: bytes) -> bytes | None:
    scheme, _, credentials = value.partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        return base64.b64decode(credentials.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None


@dataclass
class Substituted:
    """A request head with the values in place, and what the response must be scrubbed of."""

    target: bytes
    headers: list[tuple[bytes, bytes]]
    used: list[Secret]
    forms: list[tuple[bytes, bytes]]  # (what the proxy sent, what user code had sent)


def substitute(target: bytes, headers: Sequence[tuple[bytes, bytes]],
               secrets: Sequence[Secret]) -> Substituted:
    """Each secret's placeholder replaced by its value in target, the headers and Basic auth."""
    used: list[Secret] = []
    forms: list[tuple[bytes, bytes]] = []
    for secret in secrets:
        placeholder, value = secret.placeholder.encode(), secret.value.encode()
        forms.append((value, placeholder))
        quoted = quote(secret.value, safe="").encode()
        if quoted != value:
            forms.append((quoted, placeholder))
        replaced = False
        if placeholder in target:
            target, replaced = target.replace(placeholder, quoted), True
        sent = []
        for name, header in headers:
            basic = _basic(header) if name.lower() == b"authorization" else None
            if basic is not None and placeholder in basic:
                encoded = base64.b64encode(basic.replace(placeholder, value))
                forms.append((encoded, header.partition(b" ")[2].strip()))
                header, replaced = b"Basic " + encoded, True
            elif placeholder in header:
                header, replaced = header.replace(placeholder, value), True
            sent.append((name, header))
        headers = sent
        if replaced:
            used.append(secret)
    return Substituted(target, list(headers), used, forms)


class Scrubber:
    """Replaces each value by its placeholder in a stream, whatever the reads split it into.

    Holds back the longest value's length less one byte: a value cut by a read is whole in the
    next one's bytes, and nothing is kept longer than that.
    """

    def __init__(self, forms: Sequence[tuple[bytes, bytes]]) -> None:
        self.forms = sorted({pair for pair in forms if pair[0]}, key=lambda pair: -len(pair[0]))
        self.keep = max((len(value) for value, _ in self.forms), default=1) - 1
        self.held = b""

    def scrub(self, data: bytes) -> bytes:
        """A whole piece (a header value): every form replaced."""
        for value, placeholder in self.forms:
            data = data.replace(value, placeholder)
        return data

    def feed(self, data: bytes) -> bytes:
        """What of the stream can be passed on now."""
        data = self.scrub(self.held + data)
        cut = max(len(data) - self.keep, 0)
        self.held = data[cut:]
        return data[:cut]

    def end(self) -> bytes:
        """The rest of the stream, at its end."""
        rest, self.held = self.held, b""
        return rest


class Decoded:
    """A body its host compressed although asked not to: gzip or deflate undone, CHUNK bytes
    of output at a time (a small body that inflates to much costs no memory)."""

    def __init__(self) -> None:
        self.zlib = zlib.decompressobj(zlib.MAX_WBITS | 32)  # a gzip or a zlib header

    def pieces(self, data: bytes) -> Iterator[bytes]:
        """The decoded bytes of data, in pieces; ExchangeError when it is not what it says."""
        try:
            while data:
                yield self.zlib.decompress(data, CHUNK)
                data = self.zlib.unconsumed_tail
        except zlib.error as exc:
            raise ExchangeError(0, f"a compressed response body that cannot be read: {exc}"
                                ) from None


def encoding_of(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """The response's Content-Encoding, lower-cased (b"identity" when there is none)."""
    codings = [value.strip().lower() for name, value in headers
               if name.lower() == b"content-encoding"]
    return b", ".join(codings) or b"identity"


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def start_tls(stream: Stream, context: ssl.SSLContext, server_hostname: str | None = None,
                    timeout: float = 30.0) -> Stream:
    """stream with TLS on top, as client (server_hostname given) or server.

    Written with loop.start_tls and fresh stream objects: StreamWriter.start_tls is 3.11+
    and takes the side from how the stream was opened. The caller keeps the old writer until
    it closes the new one: a StreamWriter's __del__ closes its transport (3.11+).
    """
    writer = stream[1]
    await writer.drain()
    loop = asyncio.get_running_loop()
    tls_reader = asyncio.StreamReader(limit=CHUNK)
    protocol = asyncio.StreamReaderProtocol(tls_reader)
    transport = await loop.start_tls(writer.transport, protocol, context,
                                     server_side=server_hostname is None,
                                     server_hostname=server_hostname,
                                     ssl_handshake_timeout=timeout)
    assert transport is not None
    protocol.connection_made(transport)
    return tls_reader, asyncio.StreamWriter(transport, protocol, tls_reader, loop)


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader, timeout: float,
                      status: int) -> object:
    """The next h11 event, reading CHUNK bytes at a time; bad HTTP is an ExchangeError."""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise ExchangeError(status, f"bad HTTP from the "
                                        f"{'client' if status == 400 else 'destination'}: "
                                        f"{exc}") from None
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await asyncio.wait_for(reader.read(CHUNK), timeout))


class Exchanges:
    """HTTP/1.1 exchanges between user code and one secret host, over two TLS streams."""

    def __init__(self, secrets: Secrets, host: str, port: int,
                 used: Callable[[Secret], None], max_headers: int, head_limit: int) -> None:
        self.secrets, self.host, self.port, self.used = secrets, host, port, used
        self.own = secrets.of(host, port)
        self.max_headers = max_headers
        self.client = h11.Connection(h11.SERVER, max_incomplete_event_size=head_limit)
        self.server = h11.Connection(h11.CLIENT, max_incomplete_event_size=head_limit)

    async def serve(self, near: Stream, far: Stream, head_timeout: float,
                    counted: Callable[[int, int], None]) -> None:
        """Exchange after exchange until either side ends; counted(sent, received) as it goes."""
        while True:
            request = await _next_event(self.client, near[0], head_timeout, 400)
            if not isinstance(request, h11.Request):
                return  # the client closed (or sent nothing more)
            scrubber = await self._send_request(request, near, far, counted)
            await self._send_response(near, far, scrubber, request.method == b"HEAD", counted)
            if self.client.our_state is not h11.DONE or self.server.our_state is not h11.DONE \
                    or self.server.their_state is not h11.DONE:
                return
            self.client.start_next_cycle()
            self.server.start_next_cycle()

    async def _send_request(self, request: h11.Request, near: Stream, far: Stream,
                            counted: Callable[[int, int], None]) -> Scrubber:
        if len(request.headers) > self.max_headers:
            raise ExchangeError(431, f"request head of more than {self.max_headers} headers")
        headers = [(name, value) for name, value in request.headers.raw_items()]
        self.secrets.check(self.host, self.port, readable_forms(request.target, headers))
        done = substitute(request.target, headers, self.own)
        for secret in done.used:
            self.used(secret)
        sent = [(name, value) for name, value in done.headers if name.lower() not in _DROPPED]
        sent.append((b"Accept-Encoding", b"identity"))  # a body the proxy can scrub
        if self.client.they_are_waiting_for_100_continue:
            near[1].write(self.client.send(h11.InformationalResponse(status_code=100,
                                                                     headers=[])))
        data = self.server.send(h11.Request(method=request.method, target=done.target,
                                            headers=sent))
        while True:
            event = await _next_event(self.client, near[0], IDLE_TIMEOUT, 400)
            if isinstance(event, h11.Data):
                data += self.server.send(event)
            elif isinstance(event, h11.EndOfMessage):
                data += self.server.send(h11.EndOfMessage())
                break
            else:
                raise ExchangeError(0, "the client closed in the middle of its request")
            far[1].write(data)
            counted(len(data), 0)
            data = b""
            await far[1].drain()
        far[1].write(data)
        counted(len(data), 0)
        await far[1].drain()
        return Scrubber(done.forms)

    async def _send_response(self, near: Stream, far: Stream, scrubber: Scrubber, head: bool,
                             counted: Callable[[int, int], None]) -> None:
        while True:
            event = await _next_event(self.server, far[0], IDLE_TIMEOUT, 502)
            if isinstance(event, h11.InformationalResponse):
                if event.status_code == 100:
                    continue  # the proxy answered the client's Expect itself
                self._write(near, self.client.send(h11.InformationalResponse(
                    status_code=event.status_code, reason=scrubber.scrub(event.reason),
                    headers=[(name, scrubber.scrub(value))
                             for name, value in event.headers.raw_items()])), counted)
            elif isinstance(event, h11.Response):
                break
            else:
                raise ExchangeError(502, f"{self.host}:{self.port} closed without a response")
        # A scrubbed body may change its length: h11 frames it anew (chunked, or to the close
        # for an HTTP/1.0 client), except where there is no body to frame.
        keep_framing = head or event.status_code in (204, 304)
        dropped = set() if keep_framing else set(_RESPONSE_FRAMING)
        decoded = None
        encoding = encoding_of(event.headers.raw_items())
        if not keep_framing and encoding != b"identity":
            if encoding not in _UNDONE:
                raise ExchangeError(502, Refusal(
                    f"{self.host}:{self.port} answered in Content-Encoding "
                    f"{encoding.decode('latin-1')[:40]} though asked for identity: the proxy "
                    "cannot scrub a secret's value from it, so the response is refused",
                    "ask the host for an uncompressed response (or for gzip)"))
            decoded, dropped = Decoded(), dropped | {b"content-encoding"}
        headers = [(name, scrubber.scrub(value)) for name, value in event.headers.raw_items()
                   if name.lower() not in dropped]
        self._write(near, self.client.send(h11.Response(status_code=event.status_code,
                                                         headers=headers,
                                                         reason=scrubber.scrub(event.reason))),
                    counted)
        while True:
            event = await _next_event(self.server, far[0], IDLE_TIMEOUT, 502)
            if isinstance(event, h11.Data):
                for piece in decoded.pieces(event.data) if decoded else (event.data,):
                    if data := scrubber.feed(piece):
                        self._write(near, self.client.send(h11.Data(data=data)), counted)
                        await near[1].drain()
            elif isinstance(event, h11.EndOfMessage):
                rest = scrubber.end()
                out = self.client.send(h11.Data(data=rest)) if rest else b""
                self._write(near, out + self.client.send(h11.EndOfMessage()), counted)
                await near[1].drain()
                return
            else:
                raise ExchangeError(0, f"{self.host}:{self.port} closed mid-response")

    @staticmethod
    def _write(near: Stream, data: bytes | None, counted: Callable[[int, int], None]) -> None:
        if data:
            near[1].write(data)
            counted(0, len(data))
