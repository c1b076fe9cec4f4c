"""Jupyter messages built without jupyter_client or ZMQ: the shapes a one-shot kernel sends.

A one-shot process answers with the same Jupyter messages a ZMQ kernel sends (stream,
display_data, execute_result, error, execute_reply, status, a tool call's request), each as the
frames `Session.serialize` makes, in one record on its connection (kernel/oneshot_wire.py).
Building them needs none of a Jupyter session's machinery: a header (`msg_id` from the
session id, the pid and a count; `msg_type`, `username`, `session`, the UTC `date`, the
protocol `version`), the parent's header, metadata and content, packed as jupyter_client
packs them (jsonwire.pack_message), and the frames `[idents..., DELIM, signature, header,
parent_header, metadata, content, buffers...]`. A one-shot's connection is private to its
caller: nothing is signed (the signature frame is empty, as a Session with key b"" leaves it).

`Messages` holds what one process's messages share (session id, username, count);
kernel/oneshot.py's session builds its messages here, and the lean one-shot process has no
Session at all. tests/test_messages.py checks the frames against `Session.serialize`'s.
"""

from __future__ import annotations

import os
from binascii import b2a_hex
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from .. import jsonwire

DELIM = b"<IDS|MSG>"
PROTOCOL_VERSION = "5.4"  # the Jupyter messaging protocol's (jupyter_client's protocol_version)

Ident = bytes | Sequence[bytes] | None


def new_id() -> str:
    """A random id as jupyter_client makes one: 16 bytes in hex, the first 4 apart."""
    buf = os.urandom(16)
    return "-".join(b2a_hex(part).decode("ascii") for part in (buf[:4], buf[4:]))


def header(msg_id: str, msg_type: str, username: str, session: str) -> dict[str, Any]:
    """A message's header, its keys in Session.msg_header's order."""
    return {"msg_id": msg_id, "msg_type": msg_type, "username": username, "session": session,
            "date": datetime.now(timezone.utc), "version": PROTOCOL_VERSION}


def parent_header(parent: dict[str, Any] | None) -> dict[str, Any]:
    """The header of the message answered: parent is that message, or its header."""
    if not parent:
        return {}
    if "header" in parent:
        found = parent["header"]
    else:
        parent["msg_id"]  # a KeyError, as jupyter_client's: neither a message nor a header
        found = parent
    return found if isinstance(found, dict) else dict(found)


def message(head: dict[str, Any], content: dict[str, Any] | None = None,
            parent: dict[str, Any] | None = None,
            metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The nested message dict (as Session.msg returns it) for a header."""
    return {"header": head, "msg_id": head["msg_id"], "msg_type": head["msg_type"],
            "parent_header": parent_header(parent),
            "content": {} if content is None else content,
            "metadata": {} if metadata is None else dict(metadata)}


def _packed_content(content: Any) -> bytes:
    if content is None:
        return b"{}"  # Session.none
    if isinstance(content, dict):
        return jsonwire.pack_message(content)
    if isinstance(content, bytes):  # already packed (a relayed message)
        return content
    if isinstance(content, str):
        return content.encode("utf8")
    raise TypeError(f"Content incorrect type: {type(content)}")


def serialize(msg: dict[str, Any], ident: Ident = None) -> list[bytes]:
    """The message's frames, unsigned: what Session.serialize gives with key b""."""
    frames: list[bytes] = []
    if isinstance(ident, (list, tuple)):
        frames.extend(ident)
    elif ident is not None:
        frames.append(ident)  # type: ignore[arg-type]
    pack = jsonwire.pack_message
    frames += [DELIM, b"", pack(msg["header"]), pack(msg["parent_header"]),
               pack(msg["metadata"]), _packed_content(msg.get("content", {}))]
    return frames


def split_identities(frames: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
    """The routing identities before the delimiter, and the message's own frames after it."""
    for index, frame in enumerate(frames):
        if bytes(frame) == DELIM:
            return [bytes(part) for part in frames[:index]], list(frames[index + 1:])
    raise ValueError("DELIM not in msg_list")


def deserialize(frames: Sequence[bytes]) -> dict[str, Any]:
    """An unsigned message's frames after the delimiter (signature, header, parent header,
    metadata, content, buffers...) as the nested dict, parsed exactly (jsonwire.loads). The
    header's date stays text: nothing here reads it."""
    if len(frames) < 5:
        raise TypeError(f"malformed message, must have at least 5 elements, got {len(frames)}")
    if bytes(frames[0]):
        raise ValueError("a signed message on an unsigned connection")
    head = jsonwire.loads(bytes(frames[1]))
    return {"header": head, "msg_id": head["msg_id"], "msg_type": head["msg_type"],
            "parent_header": jsonwire.loads(bytes(frames[2])),
            "metadata": jsonwire.loads(bytes(frames[3])),
            "content": jsonwire.loads(bytes(frames[4]), keep=True),
            "buffers": [memoryview(bytes(frame)) for frame in frames[5:]]}


class Messages:
    """One process's messages: its session id, username and message count.

    `send` takes the arguments of Session.send that a one-shot's senders pass, and writes the
    frames with the channel's `send_multipart`."""

    def __init__(self, username: str = "kernel", session: str | None = None) -> None:
        self.username = username
        self.session = session or new_id()
        self.message_count = 0

    def renew(self) -> None:
        """In a forked process: an id and a count of its own (ids name the pid as well)."""
        self.session = new_id()
        self.message_count = 0

    def next_id(self) -> str:
        """The next message's id: session, pid, count, as Session.msg_id makes it."""
        number = self.message_count
        self.message_count += 1
        return f"{self.session}_{os.getpid()}_{number}"

    def msg(self, msg_type: str, content: dict[str, Any] | None = None,
            parent: dict[str, Any] | None = None, head: dict[str, Any] | None = None,
            metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """A new message of this process (Session.msg)."""
        if head is None:
            head = header(self.next_id(), msg_type, self.username, self.session)
        return message(head, content, parent, metadata)

    def send(self, channel: Any, msg_or_type: dict[str, Any] | str,
             content: dict[str, Any] | None = None, parent: dict[str, Any] | None = None,
             ident: Ident = None, buffers: Sequence[bytes] | None = None,
             metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """Build (unless given a message) and write one message; the message."""
        if isinstance(msg_or_type, dict):  # a message made already: its buffers go too
            msg = msg_or_type
            buffers = buffers or msg.get("buffers", [])
        else:
            msg = self.msg(msg_or_type, content, parent, metadata=metadata)
        frames = serialize(msg, ident)
        frames.extend(bytes(buffer) for buffer in buffers or ())
        channel.send_multipart(frames)
        return msg

    @staticmethod
    def feed_identities(frames: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Session.feed_identities: the routing identities and the message's frames."""
        return split_identities(frames)

    @staticmethod
    def deserialize(frames: Sequence[bytes]) -> dict[str, Any]:
        """Session.deserialize of an unsigned message's frames (after the delimiter)."""
        return deserialize(frames)
