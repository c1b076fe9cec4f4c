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

Nothing the destination sends is quoted into the proxy's own answers or records: a response it
cannot parse is refused in fixed words (its bytes may hold the value, which the proxy put in
the request). The destination may send only what a request asked for: bytes after a response
(past its Content-Length, a body to HEAD, 204 or 304) or between exchanges end the connection.
A request goes only where the tunnel goes (its Host, an absolute-form target; no CONNECT
inside). Every value is scrubbed in the forms a host plausibly reflects (value_forms).

What the proxy cannot read it cannot scrub: a value the host reflects compressed, encrypted or
re-encoded by the application in another way reaches user code (docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import ssl
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import quote, quote_plus, urlsplit

import h11

from .rules import (
    NameRule,
    NetRule,
    Refusal,
    RuleError,
    normal_name,
    parse_address,
    parse_host_entry,
)
from .secret import Secret

CHUNK = 65536  # bytes read at a time from either side
IDLE_TIMEOUT = 300.0  # seconds an intercepted connection may wait for the next bytes
_DROPPED = {b"proxy-connection", b"proxy-authorization", b"keep-alive", b"upgrade", b"te",
            b"trailer", b"accept-encoding", b"expect"}
_RESPONSE_FRAMING = {b"content-length", b"transfer-encoding"}
_UNDONE = {b"gzip", b"x-gzip", b"deflate"}  # encodings the proxy undoes to scrub a body
# Encodings the proxy names in a refusal; any other name is the destination's bytes, not shown.
_KNOWN = {b"br", b"zstd", b"compress", b"x-compress", b"exi", b"pack200-gzip", b"aes128gcm",
          b"dcb", b"dcz"}
_BODILESS = "HEAD, or answered 204 or 304"
MIN_FORM = 8  # bytes of an encoded form of a value, at least, for it to be scrubbed


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
        self.scrubber = Scrubber([form for secret in secrets for form in value_forms(secret)])

    def scrubbed(self, text: str) -> str:
        """text (an answer or a record the proxy writes) without any secret's value in it."""
        return self.scrubber.scrub(text.encode("utf-8", "surrogateescape")).decode(
            "utf-8", "replace")

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


def value_forms(secret: Secret) -> list[tuple[bytes, bytes]]:
    """The forms of secret's value a host may reflect, each with the placeholder's same form.

    The value itself; percent-encoded (upper and lower case hex, `+` for spaces, `/` kept),
    JSON-escaped (`/` as `\\/` too), hex; and inside base64 (standard and URL-safe) of any text
    holding it, which contains the base64 of the value's middle at one of three alignments.
    """
    value, placeholder = secret.value, secret.placeholder
    forms = [(value.encode(), placeholder.encode())]
    for encode in _TEXT_FORMS:
        forms.append((encode(value), encode(placeholder)))
    for b64 in (base64.b64encode, base64.urlsafe_b64encode):
        for shift in range(3):
            forms.append((_base64_core(b64, value.encode(), shift),
                          _base64_core(b64, placeholder.encode(), shift)))
    return forms[:1] + [(form, instead) for form, instead in dict(forms[1:]).items()
                        if len(form) >= MIN_FORM and form != forms[0][0]]


def _json_escaped(text: str) -> bytes:
    return json.dumps(text)[1:-1].encode()


_TEXT_FORMS: tuple[Callable[[str], bytes], ...] = (
    lambda text: quote(text, safe="").encode(),
    lambda text: re.sub("%[0-9A-F]{2}", lambda hexed: hexed.group().lower(),
                        quote(text, safe="")).encode(),
    lambda text: quote_plus(text, safe="").encode(),
    lambda text: quote(text).encode(),
    _json_escaped,
    lambda text: _json_escaped(text).replace(b"/", b"\\/"),
    lambda text: text.encode().hex().encode(),
    lambda text: text.encode().hex().upper().encode(),
)


def _base64_core(b64: Callable[[bytes], bytes], data: bytes, shift: int) -> bytes:
    """What b64(x + data + y) holds whatever x and y are, for len(x) % 3 == shift: the groups of
    four characters encoding data's bytes alone."""
    text = b64(b"\0" * shift + data)
    partial_end = (shift + len(data)) % 3 != 0
    return text[4 if shift else 0:len(text) - 4 if partial_end else len(text)]


@dataclass
class Substituted:
    """A request head with the values in place, and what the response must be scrubbed of."""

    target: bytes
    headers: list[tuple[bytes, bytes]]
    used: list[Secret]
    forms: list[tuple[bytes, bytes]]  # (a Basic credential the proxy made, what user code sent)


def substitute(target: bytes, headers: Sequence[tuple[bytes, bytes]],
               secrets: Sequence[Secret]) -> Substituted:
    """Each secret's placeholder replaced by its value in target, the headers and Basic auth.

    The forms of each value are scrubbed from responses by value_forms; forms the proxy made
    (a Basic credential holding the value) are returned with what user code had sent."""
    used: list[Secret] = []
    forms: list[tuple[bytes, bytes]] = []
    for secret in secrets:
        placeholder, value = secret.placeholder.encode(), secret.value.encode()
        quoted = quote(secret.value, safe="").encode()
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
    """Replaces each form of a value by the placeholder's, in a stream, whatever the reads split
    it into; where forms overlap (a base64 credential holds the base64 of the value) the
    longest starting first wins, as if the whole stream were scrubbed at once.

    Holds back the longest form's length less one byte, unscrubbed: a form cut by a read is
    whole in the next one's bytes, and nothing is kept longer than that.
    """

    def __init__(self, forms: Sequence[tuple[bytes, bytes]]) -> None:
        self.forms = dict(sorted(((form, instead) for form, instead in forms if form),
                                 key=lambda pair: -len(pair[0])))
        self.pattern = re.compile(b"|".join(re.escape(form) for form in self.forms)) \
            if self.forms else None
        self.keep = max((len(form) for form in self.forms), default=1) - 1
        self.held = b""

    def scrub(self, data: bytes) -> bytes:
        """A whole piece (a header value): every form replaced."""
        if self.pattern is None:
            return data
        return self.pattern.sub(lambda found: self.forms[found.group()], data)

    def feed(self, data: bytes) -> bytes:
        """What of the stream can be passed on now.

        A form starting before `final` lies whole in what is held: no later read can make a
        longer one start there or before.
        """
        data = self.held + data
        final = max(len(data) - self.keep, 0)
        out: list[bytes] = []
        at = 0
        for found in self.pattern.finditer(data) if self.pattern is not None else ():
            if found.start() >= final:
                break
            out += [data[at:found.start()], self.forms[found.group()]]
            at = found.end()
        cut = max(at, final)
        out.append(data[at:cut])
        self.held = data[cut:]
        return b"".join(out)

    def end(self) -> bytes:
        """The rest of the stream, at its end."""
        rest, self.held = self.scrub(self.held), b""
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
                      bad: ExchangeError) -> object:
    """The next h11 event, reading CHUNK bytes at a time; bad HTTP raises bad."""
    while True:
        event = _parsed(conn, bad)
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await asyncio.wait_for(reader.read(CHUNK), timeout))


def _parsed(conn: h11.Connection, bad: ExchangeError) -> object:
    """conn's next event (NEED_DATA too); bad when what it holds is not HTTP/1.1.

    h11's own message is never used: it quotes the peer's bytes, and the destination's may
    hold a secret's value (the proxy put it in the request they answer).
    """
    try:
        return conn.next_event()
    except h11.RemoteProtocolError:
        raise bad from None


class Exchanges:
    """HTTP/1.1 exchanges between user code and one secret host, over two TLS streams."""

    def __init__(self, secrets: Secrets, host: str, port: int,
                 used: Callable[[Secret], None], max_headers: int, head_limit: int) -> None:
        self.secrets, self.host, self.port, self.used = secrets, host, port, used
        self.own = secrets.of(host, port)
        self.forms = [form for secret in self.own for form in value_forms(secret)]
        self.max_headers = max_headers
        self.client = h11.Connection(h11.SERVER, max_incomplete_event_size=head_limit)
        self.server = h11.Connection(h11.CLIENT, max_incomplete_event_size=head_limit)
        self.authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.bad_request = ExchangeError(400, "bad HTTP from the client")
        self.bad_response = self._unreadable(502)
        self.bad_body = self._unreadable(0)  # once a head is sent, no other answer can follow

    def _unreadable(self, status: int) -> ExchangeError:
        return ExchangeError(status, Refusal(
            f"{self.authority} sent a response that is not valid HTTP/1.1, so it is refused "
            "(its bytes are not shown: they may hold a secret's value)",
            "the host's server is at fault; try the request without the proxy's secret to see "
            "what it answers"))

    async def serve(self, near: Stream, far: Stream, head_timeout: float,
                    counted: Callable[[int, int], None]) -> None:
        """Exchange after exchange until either side ends; counted(sent, received) as it goes."""
        try:
            await self._serve(near, far, head_timeout, counted)
        except h11.LocalProtocolError:  # what h11 will not send: its message may quote a value
            raise ExchangeError(502, f"the exchange with {self.authority} cannot be carried on "
                                     "as HTTP/1.1, so the connection is closed") from None

    async def _serve(self, near: Stream, far: Stream, head_timeout: float,
                     counted: Callable[[int, int], None]) -> None:
        while True:
            request = await self._next_request(near, far, head_timeout)
            if request is None:
                return  # the client closed (or sent nothing more), or the destination did
            target = self._checked_target(request)
            await self._send_request(request, target, near, far, counted)
            await self._send_response(near, far, request.method == b"HEAD", counted)
            if self.client.our_state is not h11.DONE or self.server.our_state is not h11.DONE \
                    or self.server.their_state is not h11.DONE:
                return
            self.client.start_next_cycle()
            self.server.start_next_cycle()

    async def _next_request(self, near: Stream, far: Stream,
                            timeout: float) -> h11.Request | None:
        """The client's next request, or None at its end or the destination's.

        The destination is watched meanwhile: it may send nothing no request asked for (the
        body of a HEAD's answer, bytes past a Content-Length), which would be read as the
        next request's answer.
        """
        while True:
            event = _parsed(self.client, self.bad_request)
            if event is not h11.NEED_DATA:
                return event if isinstance(event, h11.Request) else None
            reading = asyncio.ensure_future(near[0].read(CHUNK))
            watching = asyncio.ensure_future(far[0].read(CHUNK))
            try:
                done, _ = await asyncio.wait((reading, watching), timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                reading.cancel()
                watching.cancel()
            if watching in done and not watching.cancelled():
                if watching.result():
                    raise ExchangeError(0, f"{self.authority} sent bytes that no request asked "
                                           "for: a protocol error, so the connection is closed")
                return None  # the destination ended the kept-alive connection: so does the proxy
            if reading not in done:
                raise asyncio.TimeoutError
            self.client.receive_data(reading.result())

    def _checked_target(self, request: h11.Request) -> bytes:
        """The request's target in origin-form, once the request is seen to be HTTP/1 and to go
        to this host.

        A Host (or an absolute-form target) naming another host would have a server that
        serves many (a CDN, a shared front end) hand the value to that one; CONNECT would have
        the host, if it is a proxy too, tunnel it on.
        """
        if request.method == b"CONNECT":
            raise ExchangeError(405, Refusal(
                f"CONNECT inside the tunnel to {self.authority}, a host a secret is added for",
                "CONNECT to the other host through the proxy itself"))
        if request.http_version not in (b"1.0", b"1.1"):  # h2's preface parses as HTTP/2.0
            raise ExchangeError(505, Refusal(
                f"HTTP/{request.http_version.decode('ascii', 'replace')} inside the tunnel to "
                f"{self.authority}: the proxy speaks HTTP/1.1 to a host a secret is added for",
                "use HTTP/1.1 (the only protocol the proxy offers by ALPN)"))
        target = request.target
        if not target.startswith(b"/") and target != b"*":  # absolute-form
            parts = urlsplit(target.decode("ascii", "replace"))
            if parts.scheme.lower() != "https" or not self._is_this_host(
                    parts.netloc.rpartition("@")[2].encode()):
                raise self._misdirected(f"request target {parts.scheme}://{parts.netloc}")
            target = (parts.path or "/").encode() + (f"?{parts.query}".encode()
                                                     if parts.query else b"")
        for name, value in request.headers:
            if name == b"host" and not self._is_this_host(value):
                raise self._misdirected(f"Host header {value.decode('ascii', 'replace')}")
        return target

    def _is_this_host(self, authority: bytes) -> bool:
        """authority names the tunnel's host (and its port, if it names one: clients leave
        the port out of Host for 443, and some for any port)."""
        text = authority.decode("ascii", "replace").strip().lower()
        host, port = text, str(self.port)
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port = rest.removeprefix(":") if rest else port
        elif ":" in text:
            host, _, port = text.rpartition(":")
        address = parse_address(host)
        try:
            same = str(address) == self.host if address is not None else \
                normal_name(host) == self.host
        except RuleError:
            return False
        return same and port.isdigit() and int(port) == self.port

    def _misdirected(self, named: str) -> ExchangeError:
        return ExchangeError(421, Refusal(
            f"the {named[:200]} names another host than the tunnel's, {self.authority}: a "
            "secret is added only to requests to its host",
            f"send the request to {self.authority} only, or to the other host through its "
            "own CONNECT"))

    async def _send_request(self, request: h11.Request, target: bytes, near: Stream,
                            far: Stream, counted: Callable[[int, int], None]) -> None:
        if len(request.headers) > self.max_headers:
            raise ExchangeError(431, f"request head of more than {self.max_headers} headers")
        headers = [(name, value) for name, value in request.headers.raw_items()]
        self.secrets.check(self.host, self.port, readable_forms(request.target, headers))
        done = substitute(target, headers, self.own)
        self.forms += done.forms  # a Basic credential it made may come back in a later answer
        for secret in done.used:
            self.used(secret)
        framed = {name.lower() for name, _ in done.headers}
        sent = [(name, value) for name, value in done.headers if name.lower() not in _DROPPED
                # with both, Transfer-Encoding frames the body h11 sends: the other would lie
                and not (name.lower() == b"content-length" and b"transfer-encoding" in framed)]
        if b"host" not in framed:  # an HTTP/1.0 request may have none; HTTP/1.1 needs one
            sent.insert(0, (b"Host", self.authority.removesuffix(":443").encode()))
        sent.append((b"Accept-Encoding", b"identity"))  # a body the proxy can scrub
        if self.client.they_are_waiting_for_100_continue:
            near[1].write(self.client.send(h11.InformationalResponse(status_code=100,
                                                                     headers=[])))
        data = self.server.send(h11.Request(method=request.method, target=done.target,
                                            headers=sent))
        while True:
            event = await _next_event(self.client, near[0], IDLE_TIMEOUT, self.bad_request)
            if isinstance(event, h11.Data):
                data += self.server.send(event)
            elif isinstance(event, h11.EndOfMessage):
                data += self.server.send(h11.EndOfMessage())  # trailers are not forwarded
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

    async def _send_response(self, near: Stream, far: Stream, head: bool,
                             counted: Callable[[int, int], None]) -> None:
        scrubber = Scrubber(self.forms)
        while True:
            event = await _next_event(self.server, far[0], IDLE_TIMEOUT, self.bad_response)
            if isinstance(event, h11.InformationalResponse):
                if event.status_code == 100:
                    continue  # the proxy answered the client's Expect itself
                self._write(near, self.client.send(h11.InformationalResponse(
                    status_code=event.status_code, reason=scrubber.scrub(event.reason),
                    headers=self._scrubbed(scrubber, event.headers.raw_items(), set()))),
                    counted)
            elif isinstance(event, h11.Response):
                break
            else:
                raise ExchangeError(502, f"{self.authority} closed without a response")
        # A scrubbed body may change its length: h11 frames it anew (chunked, or to the close
        # for an HTTP/1.0 client), except where there is no body to frame.
        keep_framing = head or event.status_code in (204, 304)
        dropped = set() if keep_framing else set(_RESPONSE_FRAMING)
        decoded = None
        encoding = encoding_of(event.headers.raw_items())
        if not keep_framing and encoding != b"identity":
            if encoding not in _UNDONE:
                raise ExchangeError(502, Refusal(
                    f"{self.authority} answered in Content-Encoding "
                    f"{encoding.decode() if encoding in _KNOWN else 'of a name it made up'} "
                    "though asked for identity: the proxy cannot scrub a secret's value from "
                    "it, so the response is refused",
                    "ask the host for an uncompressed response (or for gzip)"))
            decoded, dropped = Decoded(), dropped | {b"content-encoding"}
        response = h11.Response(status_code=event.status_code,
                                headers=self._scrubbed(scrubber, event.headers.raw_items(),
                                                       dropped),
                                reason=scrubber.scrub(event.reason))
        if keep_framing:  # h11 knows there is no body: anything after the head is an error
            self._ended(await _next_event(self.server, far[0], IDLE_TIMEOUT, self.bad_response),
                        f"after its answer to a request that has no body ({_BODILESS})", 502)
            self._write(near, self.client.send(response) + self.client.send(h11.EndOfMessage()),
                        counted)
            await near[1].drain()
            return
        self._write(near, self.client.send(response), counted)
        await self._send_body(near, far, scrubber, decoded, counted)

    async def _send_body(self, near: Stream, far: Stream, scrubber: Scrubber,
                         decoded: Decoded | None, counted: Callable[[int, int], None]) -> None:
        while True:
            event = await _next_event(self.server, far[0], IDLE_TIMEOUT, self.bad_body)
            if isinstance(event, h11.Data):
                for piece in decoded.pieces(event.data) if decoded else (event.data,):
                    if data := scrubber.feed(piece):
                        self._write(near, self.client.send(h11.Data(data=data)), counted)
                        await near[1].drain()
            else:
                # The body's end unsent: the client sees a response cut short, not a whole one.
                self._ended(event, "past the end of its response's body", 0)
                rest = scrubber.end()  # trailers (event.headers) are not forwarded
                out = self.client.send(h11.Data(data=rest)) if rest else b""
                self._write(near, out + self.client.send(h11.EndOfMessage()), counted)
                await near[1].drain()
                return

    def _ended(self, event: object, where: str, status: int) -> None:
        """event must end the response, with nothing sent after it (it would be read as the
        answer to the next request, and parsed there: it may hold a value)."""
        if not isinstance(event, h11.EndOfMessage):
            raise ExchangeError(0, f"{self.authority} closed mid-response")
        if self.server.trailing_data[0]:
            raise ExchangeError(status, Refusal(
                f"{self.authority} sent bytes {where}: a protocol error, so the connection "
                "is closed", "the host's server is at fault (a HEAD answered with a body, or "
                             "a Content-Length that does not count the body's bytes)"))

    @staticmethod
    def _scrubbed(scrubber: Scrubber, headers: Sequence[tuple[bytes, bytes]],
                  dropped: set[bytes]) -> list[tuple[bytes, bytes]]:
        """Headers without those dropped, each name and value scrubbed."""
        return [(scrubber.scrub(name), scrubber.scrub(value)) for name, value in headers
                if name.lower() not in dropped]

    @staticmethod
    def _write(near: Stream, data: bytes | None, counted: Callable[[int, int], None]) -> None:
        if data:
            near[1].write(data)
            counted(0, len(data))
