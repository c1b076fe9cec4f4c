"""The server name (SNI) a TLS ClientHello asks for, read without terminating TLS.

Written here rather than taken from a library: the maintained TLS libraries (ssl, OpenSSL,
cryptography) do not parse a ClientHello they did not receive as a server, and packet libraries
(scapy, dpkt) are large for the ~40 lines of RFC 8446 §4.1.2 / RFC 6066 §3 needed.
"""

from __future__ import annotations

import struct

HANDSHAKE = 22
RECORD_TYPES = (20, 21, 22, 23)  # change_cipher_spec, alert, handshake, application_data
CLIENT_HELLO = 1
SERVER_NAME = 0
MAX_HELLO = 64 * 1024  # bytes of records read looking for one ClientHello
# A fatal access_denied alert (RFC 8446 §6): the client's TLS library reports it by name.
ACCESS_DENIED_ALERT = bytes([21, 3, 3, 0, 2, 2, 49])


class NotTLS(ValueError):
    """The bytes are not the start of a TLS ClientHello."""


def hello_length(data: bytes) -> int | None:
    """Bytes of records that hold the whole ClientHello; None while more are needed."""
    payload, used = b"", 0
    while True:
        if len(data) < used + 5:
            return None
        kind, _version, length = struct.unpack_from("!BHH", data, used)
        if kind != HANDSHAKE:
            raise NotTLS("not a TLS handshake record")
        if len(data) < used + 5 + length:
            return None
        payload += data[used + 5:used + 5 + length]
        used += 5 + length
        if len(payload) >= 4:
            if payload[0] != CLIENT_HELLO:
                raise NotTLS("not a ClientHello")
            if len(payload) >= 4 + int.from_bytes(payload[1:4], "big"):
                return used
        if used > MAX_HELLO:
            raise NotTLS("ClientHello too long")


def server_name(data: bytes) -> str | None:
    """The host_name of the SNI extension in the ClientHello records data; None if absent.

    data: exactly the records hello_length counted; NotTLS when they cannot be read.
    """
    payload, used = b"", 0
    try:
        while used < len(data):
            _kind, _version, length = struct.unpack_from("!BHH", data, used)
            payload += data[used + 5:used + 5 + length]
            used += 5 + length
        return _sni(memoryview(payload)[4:4 + int.from_bytes(payload[1:4], "big")])
    except (struct.error, IndexError, UnicodeDecodeError):
        raise NotTLS("malformed ClientHello") from None


def whole_records(data: bytes, start: int) -> bool:
    """Whether data[start:] is whole TLS records (False while the last is incomplete).

    What a client sends after its ClientHello, before any answer (TLS 1.3 early data), must
    be TLS records too; NotTLS when it is not.
    """
    at = start
    while at < len(data):
        if len(data) < at + 5:
            return False
        kind, version, length = struct.unpack_from("!BHH", data, at)
        if kind not in RECORD_TYPES or version >> 8 != 3:
            raise NotTLS("bytes after the ClientHello that are not a TLS record")
        if len(data) < at + 5 + length:
            return False
        at += 5 + length
    return True


def _sni(hello: memoryview) -> str | None:
    at = 2 + 32  # legacy_version, random
    at += 1 + hello[at]  # session id
    at += 2 + struct.unpack_from("!H", hello, at)[0]  # cipher suites
    at += 1 + hello[at]  # compression methods
    if at == len(hello):
        return None  # no extensions at all
    end = at + 2 + struct.unpack_from("!H", hello, at)[0]
    at += 2
    while at + 4 <= end:
        kind, length = struct.unpack_from("!HH", hello, at)
        at += 4
        if kind == SERVER_NAME:
            names = hello[at + 2:at + length]
            while len(names) >= 3:
                name_type, name_length = names[0], struct.unpack_from("!H", names, 1)[0]
                if name_type == 0:
                    return bytes(names[3:3 + name_length]).decode("ascii")
                names = names[3 + name_length:]
            return None
        at += length
    return None
