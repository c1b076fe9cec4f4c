"""Snapshots of a session's user state, as the caller holds them: sealed bytes and a manifest.

A snapshot is made inside the sandboxed kernel (kernel/snapshot.py) and is the tenant's own
untrusted data: this side never unpickles it. It only seals what the kernel sent, with a MAC
bound to its owner, and opens a sealed snapshot again (checking the MAC and the size) before
sending it into a fresh sandboxed kernel, which loads it there.

The sealed form: SEAL_MAGIC, the manifest's length (8 bytes, big-endian), the manifest (JSON),
the payload, and HMAC-SHA256 (32 bytes) keyed with the caller's key over the owner (its length
first) and every byte before the MAC. A byte altered anywhere, another owner or another key
fails the check; the comparison takes constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SEAL_MAGIC = b"SKSEAL1\n"
FORMAT_VERSION = 1
_LENGTH = 8
_MAC = hashlib.sha256().digest_size
DEFAULT_MAX_SIZE = 2**31  # bytes a snapshot may have unless the caller allows more
KEY_BYTES = 32


class SnapshotError(Exception):
    """A snapshot could not be made, opened or restored; the message says why and what to do."""


class SnapshotTooLarge(SnapshotError):
    """The kernel's snapshot is over the caller's max_size: refused before its bytes leave the
    kernel. `size` is the kernel's claim, `limit` the max_size."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the session's state is {size} bytes, over the limit of {limit} "
                         "bytes (max_size raises it)")
        self.size, self.limit = size, limit


@dataclass
class Snapshot:
    """A sealed snapshot (`data`, the bytes to store) and its manifest (what it holds).

    manifest: version, saved (names), skipped ([{name, reason}]: what could not be kept),
    bytes (the payload's size), policy (network and runtime a restore must match), packages
    ([{name, version}]), files ([{path, size}]), cwd. `key` and `owner` are what it was sealed
    with: a caller of Sandbox.snapshot() that gave no key finds the generated one here, and
    must keep it (restoring needs it) as secret as the data is valuable.
    """

    data: bytes
    manifest: dict[str, Any]
    key: bytes = field(default=b"", repr=False)
    owner: str = ""


def new_key() -> bytes:
    """A random key to seal snapshots with."""
    return secrets.token_bytes(KEY_BYTES)


def _mac(key: bytes, owner: str, *pieces: bytes | bytearray | memoryview) -> bytes:
    if not key:
        raise SnapshotError("a snapshot needs a key to be sealed or opened: give the key it "
                            "was made with (Snapshot.key, or the one you passed)")
    owned = owner.encode()
    mac = hmac.new(key, len(owned).to_bytes(_LENGTH, "big") + owned, hashlib.sha256)
    for piece in pieces:
        mac.update(piece)
    return mac.digest()


def seal(payload: bytes | bytearray | memoryview, manifest: dict[str, Any], key: bytes,
         owner: str) -> bytes:
    """The sealed bytes of a payload and its manifest, bound to owner by a MAC with key."""
    view = memoryview(payload).cast("B")
    sealing = Sealing(manifest, view.nbytes)
    sealing.take(0, [view])
    return sealing.close(key, owner)


class Sealing:
    """A sealed snapshot built as its payload arrives from the kernel, in order.

    The size is the kernel's claim (manifest["bytes"]), the tenant's word: memory here grows
    with the bytes that arrived, up to that size, and never with the claim itself, so a
    kernel claiming a gigabyte and sending nothing costs nothing. Each piece is copied once.
    """

    def __init__(self, manifest: dict[str, Any], size: int) -> None:
        head = json.dumps(manifest, separators=(",", ":")).encode()
        self._room = bytearray(SEAL_MAGIC + len(head).to_bytes(_LENGTH, "big") + head)
        self._start = len(self._room)
        self.size = size

    @property
    def received(self) -> int:
        """Payload bytes arrived so far."""
        return len(self._room) - self._start

    def take(self, offset: Any, buffers: Sequence[Any]) -> None:
        """Append a chunk message's buffers, if offset is where the payload goes on; one out of
        order or past the size is left out (with what follows), so the size check refuses."""
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            if offset != self.received or self.received + view.nbytes > self.size:
                return
            self._room += view
            offset = self.received

    def close(self, key: bytes, owner: str) -> bytes:
        """The sealed bytes, the MAC written last; SnapshotError if the payload is not whole."""
        if self.received != self.size:
            raise SnapshotError(f"the kernel sent {self.received} bytes of a {self.size}-byte "
                                "snapshot: it is refused")
        with memoryview(self._room) as view:
            mac = _mac(key, owner, view)
        room, self._room = self._room, bytearray()
        room += mac
        return bytes(room)


def open_sealed(data: bytes | bytearray | memoryview, key: bytes, owner: str,
                max_size: int = DEFAULT_MAX_SIZE) -> tuple[dict[str, Any], memoryview]:
    """The manifest and payload of sealed data, or SnapshotError if it was altered, belongs to
    another owner or key, or is over max_size bytes (0: no limit). The payload is a view."""
    view = memoryview(data).cast("B")
    if max_size and view.nbytes > max_size:
        raise SnapshotError(f"the snapshot is {view.nbytes} bytes, over the limit of "
                            f"{max_size} bytes (max_size raises it)")
    start = len(SEAL_MAGIC) + _LENGTH
    if view.nbytes < start + _MAC:
        raise SnapshotError("not a sealed sandbox-kernel snapshot: it is cut short")
    body, mac = view[:-_MAC], view[-_MAC:]
    if not hmac.compare_digest(_mac(key, owner, body), mac):
        raise SnapshotError("the snapshot's seal does not match: it was altered, or it was "
                            "made for another owner or with another key; it is refused")
    if view[:len(SEAL_MAGIC)] != SEAL_MAGIC:
        raise SnapshotError("not a sealed sandbox-kernel snapshot (its first bytes are wrong)")
    length = int.from_bytes(view[len(SEAL_MAGIC):start], "big")
    if length > body.nbytes - start:
        raise SnapshotError("the snapshot's manifest is cut short")
    try:
        manifest = json.loads(bytes(body[start:start + length]))
    except ValueError as exc:
        raise SnapshotError(f"the snapshot's manifest is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("version") != FORMAT_VERSION:
        raise SnapshotError(f"the snapshot's format is not version {FORMAT_VERSION}, the one "
                            "this sandbox-kernel reads")
    return manifest, body[start + length:]


def restore_policy(policy: dict[str, Any], runtime: str) -> dict[str, Any]:
    """What a restore must match of the policy a kernel runs under: its network and runtime."""
    network = "on" if policy.get("allow_network") else policy.get("network", "off")
    return {"network": network,
            "allow_hosts": sorted(policy.get("allow_hosts") or []) if network == "hosts" else [],
            "allow_addresses": sorted(policy.get("allow_addresses") or []),
            "runtime": runtime}


def check_policy(saved: Any, current: dict[str, Any]) -> None:
    """Refuse (SnapshotError) to restore a snapshot into a kernel of another network/runtime."""
    if not isinstance(saved, dict):
        raise SnapshotError("the snapshot names no policy; it is refused")
    for name, value in current.items():
        if saved.get(name) != value:
            raise SnapshotError(
                f"the snapshot was made on {name} {saved.get(name)!r} and this kernel runs on "
                f"{value!r}: restore it into a kernel of the same {name} (a restore never "
                "changes what the session's code may reach or run on)")
