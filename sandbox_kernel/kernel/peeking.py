"""A kernel's Session: exact parsing, and peeks that leave a large request's inputs unparsed.

The ZMQ kernel's half of jsonwire (which imports nothing of Jupyter): the Session subclass a
sandbox kernel's session becomes (kernel.py), and what it parses with.
"""

from __future__ import annotations

import threading
from typing import Any

from jupyter_client.session import Session

from ..jsonwire import loads

_PEEKING = threading.local()
_PEEK_PARSES_UP_TO = 64 * 1024


class Unparsed(dict):  # type: ignore[type-arg]
    """A large part a peek did not parse: reads as empty; the full deserialize parses it."""


_PEEKED: set[bytes] = set()  # signatures of large requests a peek verified
_PEEKED_KEEP = 32  # more waiting means some went to subshells or failed: start afresh
_TRUSTED = threading.local()  # the signature deserialize() need not compute again


def _part_bytes(part: Any) -> bytes:
    return bytes(getattr(part, "bytes", part))  # a zmq.Frame when received with copy=False


class PeekingSession(Session):
    """A Session whose peeks (``deserialize(content=False)``) leave large parts unparsed.

    ipykernel's shell-channel thread peeks at every request to route it by its header, which
    parsed the metadata (a main() call's inputs) a second time before the main thread parsed
    it again. Peeks still check the signature; only parts over 64 KiB stay unparsed.

    The main thread then computed a large request's signature a second time, over the same
    megabytes. It takes a signature a peek verified as verified (the replay check and the
    digest history stay as they are): the main thread receives shell requests only from the
    shell-channel thread, forwarded unchanged after their peek, so a request that reaches it
    with a peeked signature is the request that was peeked. Every other thread (control,
    subshells) checks every signature itself.
    """

    def deserialize(self, msg_list: Any, content: bool = True, copy: bool = True) -> Any:
        """Session.deserialize, taking a signature the peek already checked as checked."""
        if not content:
            return self._peek(msg_list, copy)
        if _PEEKED and threading.current_thread() is threading.main_thread():
            signature = _part_bytes(msg_list[0])
            if signature in _PEEKED:
                _PEEKED.discard(signature)
                _TRUSTED.signature = signature
        try:
            return super().deserialize(msg_list, content=content, copy=copy)
        finally:
            _TRUSTED.signature = None

    def _peek(self, msg_list: Any, copy: bool) -> Any:
        _PEEKING.active = True
        try:
            msg = super().deserialize(msg_list, content=False, copy=copy)
        finally:
            _PEEKING.active = False
        if self.auth is not None and any(len(part) > _PEEK_PARSES_UP_TO
                                         for part in msg_list[1:5]):
            if len(_PEEKED) >= _PEEKED_KEEP:
                _PEEKED.clear()
            _PEEKED.add(_part_bytes(msg_list[0]))
        return msg

    def sign(self, msg_list: Any) -> bytes:
        """Session.sign, answering the one check a peeked signature was taken for."""
        trusted = getattr(_TRUSTED, "signature", None)
        if trusted is not None:
            _TRUSTED.signature = None  # good for the one check it was set for
            return trusted  # type: ignore[no-any-return]
        return super().sign(msg_list)


def kernel_loads(data: bytes | bytearray | memoryview | str) -> Any:
    """loads, except for a large part during a peek (see PeekingSession)."""
    if len(data) > _PEEK_PARSES_UP_TO and getattr(_PEEKING, "active", False):
        return Unparsed()
    return loads(data, keep=True)  # the request lives until its execution ends


def use_in_kernel(session: Any, session_class: type[PeekingSession] = PeekingSession) -> None:
    """Exact parsing, and peeks that do not parse a request's inputs a second time
    (session_class: PeekingSession or a subclass, the kernel's)."""
    session.unpack = kernel_loads
    # The app made a plain Session and every part of the kernel already holds it: change what
    # it is rather than replace it (its message counter and digest history must stay one).
    session.__class__ = session_class
