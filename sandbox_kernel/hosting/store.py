"""The state directory (`--state-dir`): sealed snapshots and paused sessions, kept as bytes.

Everything here is launcher-side and never unpickles anything: a snapshot's payload is the
tenant's own data, made and loaded only inside a sandboxed kernel (client/snapshot.py); this
module stores it with a record saying whose it is and what it ran on. Each file is
`record JSON line + payload`, MAC'd (HMAC-SHA256) with the service's own key over both, so a
file altered by one byte, swapped to another id, or given another owner is refused as a
whole. The key is generated once, 0600, in the directory; replicas sharing the directory share
it.

Layout: `key`, `snapshots/<id>` (snapshots a caller made), `paused/<session id>` (a paused
session: its record and its snapshot), `leases/<session id>` (an flock held by the instance
whose kernel runs the session: a second instance cannot resume it meanwhile; the lock goes
with the process that held it, so a crashed instance frees its sessions), `quota/<hash of a
key id>` (an flock held while one key's snapshots are counted and a new one written, so
instances sharing the directory never both take the key's last place).

Quota: the snapshots a key made are bounded in count and bytes (`Quota`, the flags
--max-snapshots-per-key and --max-snapshot-bytes-per-key on `serve` and on `mcp`, which
share this store). A paused session is not counted there: it is bounded by the key's
session limit and --max-snapshot-size. A refusal is counted by reason (`refused`, the
service's /metrics).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEY_BYTES = 32
ID = re.compile(r"^[0-9a-f]{8,64}$")  # ids this service made: nothing else names a file
MAC_BYTES = hashlib.sha256().digest_size
MAX_RECORD = 16 * 2**20  # bytes of a record (its manifest lists the names and files kept)


class StoreError(Exception):
    """A store request that cannot be carried out; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class QuotaError(StoreError):
    """A key's snapshots are at its quota: `reason` is "key_count" or "key_bytes", `flag` the
    setting, `held` what the key keeps, `limit` what it may."""

    def __init__(self, status: int, message: str, reason: str, flag: str, held: int,
                 limit: int) -> None:
        super().__init__(status, message)
        self.reason, self.flag, self.held, self.limit = reason, flag, held, limit


class SizeError(StoreError):
    """A snapshot past --max-snapshot-size: `size` its bytes (or its kernel's claim), `limit`
    the setting."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(413, f"the snapshot is {size} bytes, above this service's limit of "
                         f"{limit} (--max-snapshot-size): free some of the session's variables "
                         "or files, or raise the limit")
        self.size, self.limit = size, limit


class UnknownSnapshot(StoreError):
    """No snapshot of that id for this owner (another owner's is as unknown)."""

    def __init__(self, snapshot_id: str) -> None:
        super().__init__(404, f"no snapshot {snapshot_id!r} for this API key")
        self.snapshot_id = snapshot_id


class HeldElsewhere(StoreError):
    """Another instance sharing the directory runs the session (holds its lease)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(409, f"session {session_id} is running on another instance of this "
                         "service: send its requests there (a sticky load balancer), or pause "
                         "it there first")
        self.session_id = session_id


@dataclass(frozen=True)
class Quota:
    """What one key may keep of the snapshots it made (None: no bound)."""

    count: int | None = None  # --max-snapshots-per-key
    bytes: int | None = None  # --max-snapshot-bytes-per-key


@dataclass
class Stored:
    """One stored item: whose it is, what it ran on, and the sealed payload."""

    id: str
    owner: str
    record: dict[str, Any]  # what the routes show and check (network, runtime, manifest...)
    payload: bytes = field(repr=False)  # b"" unless read to be restored
    size: int = -1  # the payload's bytes, read or not

    def __post_init__(self) -> None:
        if self.size < 0:
            self.size = len(self.payload)


def new_id() -> str:
    """A fresh, unguessable id."""
    return secrets.token_hex(16)


class Store:
    """The files of one state directory; `max_size` bounds one payload, `quota` what one key
    keeps of snapshots; `refused` is told the reason of each refused snapshot ("size",
    "key_count", "key_bytes"), to count it."""

    def __init__(self, root: str | os.PathLike[str], max_size: int, quota: Quota = Quota(),
                 refused: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        self.max_size = max_size
        self.quota = quota
        self.refused = refused or (lambda reason: None)
        for part in ("snapshots", "paused", "leases", "quota"):
            (self.root / part).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.key = self._key()
        self._leases: dict[str, int] = {}  # session id -> the fd holding its flock

    def _key(self) -> bytes:
        """The service's MAC key: made once (O_EXCL, so replicas starting at once agree)."""
        path = self.root / "key"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            for _ in range(50):  # another instance may be writing it this moment
                key = path.read_bytes()
                if len(key) == KEY_BYTES:
                    return key
                time.sleep(0.02)
            raise StoreError(500, f"{path} is not a {KEY_BYTES}-byte key: remove it (every "
                             "stored snapshot becomes unreadable) or restore it") from None
        key = secrets.token_bytes(KEY_BYTES)
        with os.fdopen(fd, "wb") as out:
            out.write(key)
        return key

    # --- sealed files ---

    def _mac(self, part: str, kind: str, item_id: str, *pieces: bytes) -> bytes:
        # kind and id are under the MAC: a file copied to another name or kind is refused.
        mac = hmac.new(self.key, f"{part}\0{kind}\0{item_id}\0".encode(), hashlib.sha256)
        for piece in pieces:
            mac.update(piece)
        return mac.digest()

    def check_size(self, size: int) -> None:
        """413 past --max-snapshot-size (counted)."""
        if size > self.max_size:
            self.refused("size")
            raise SizeError(size, self.max_size)

    def _write(self, kind: str, item: Stored) -> None:
        os.replace(self._stage(kind, item), self.root / kind / item.id)

    def _stage(self, kind: str, item: Stored) -> Path:
        """The item written whole to a temporary file beside its place (named with a dot, so
        no listing sees it): a reader never sees half of it once it is renamed there."""
        self.check_size(len(item.payload))
        head = json.dumps({"owner": item.owner, **item.record},
                          separators=(",", ":")).encode() + b"\n"
        if len(head) > MAX_RECORD:
            raise StoreError(413, f"the snapshot's manifest is above {MAX_RECORD} bytes: the "
                             "session holds too many names or files to list")
        temporary = self.root / kind / f".{item.id}.{secrets.token_hex(4)}"
        try:
            with open(temporary, "wb") as out:
                out.write(self._mac("head", kind, item.id, head))
                out.write(self._mac("all", kind, item.id, head, item.payload))
                out.write(head)
                out.write(item.payload)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return temporary

    def _read(self, kind: str, owner: str, item_id: str, payload: bool = False
              ) -> Stored | None:
        """The owner's item, or None: unknown, another owner's, or its record altered (all
        alike to the caller, so ids cannot be probed; an altered file is never half-trusted).

        payload: read and check the whole file (to restore it); else only its record, under
        a MAC of its own, so listing a key's snapshots never reads gigabytes. The owner's item
        whose bytes were altered (its record intact) is StoreError 422: listed, never restored.
        """
        if not ID.match(item_id):
            return None
        try:
            with open(self.root / kind / item_id, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                macs = file.read(2 * MAC_BYTES)
                head = file.readline(MAX_RECORD)
                body = file.read(self.max_size + 1) if payload else b""
        except OSError:
            return None
        head_mac, all_mac = macs[:MAC_BYTES], macs[MAC_BYTES:]
        if not head.endswith(b"\n") or len(all_mac) != MAC_BYTES \
                or not hmac.compare_digest(head_mac, self._mac("head", kind, item_id, head)):
            return None
        record = json.loads(head)
        stored_owner = record.pop("owner")
        if not hmac.compare_digest(stored_owner.encode(), owner.encode()):
            return None
        if payload and not hmac.compare_digest(all_mac, self._mac("all", kind, item_id,
                                                                  head, body)):
            raise StoreError(422, f"{item_id}'s stored bytes were altered (they do not match "
                             "their MAC): it is refused; delete it")
        return Stored(item_id, stored_owner, record, body, size - 2 * MAC_BYTES - len(head))

    def _owners_ids(self, kind: str, owner: str) -> list[Stored]:
        found = []
        for path in sorted((self.root / kind).iterdir()):
            if not path.name.startswith("."):
                item = self._read(kind, owner, path.name)
                if item is not None:
                    found.append(item)
        return found

    def _delete(self, kind: str, item_id: str) -> None:
        if ID.match(item_id):
            with contextlib.suppress(FileNotFoundError):
                (self.root / kind / item_id).unlink()

    # --- snapshots a caller made ---

    def save_snapshot(self, owner: str, payload: bytes, record: dict[str, Any]) -> Stored:
        """Store a new snapshot of the owner's; 413 past the size limit, QuotaError past the
        key's quota (checked and written under the key's lock: never past it, even when
        instances sharing the directory save at once)."""
        item = Stored(new_id(), owner, {**record, "saved_at": time.time()}, payload)
        staged = self._stage("snapshots", item)  # the lock is held for the count, not the write
        try:
            with self._quota_lock(owner):
                self._check_quota(owner, len(payload))
                os.replace(staged, self.root / "snapshots" / item.id)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        return item

    def room(self, owner: str) -> tuple[int, str]:
        """The bytes the owner's next snapshot may have, and the flag that bounds them (asked
        before it is taken, so the kernel is refused before its bytes leave it); QuotaError
        now if the key has no place left."""
        held = self._check_quota(owner, 1)
        if self.quota.bytes is not None and self.quota.bytes - held < self.max_size:
            return self.quota.bytes - held, "--max-snapshot-bytes-per-key"
        return self.max_size, "--max-snapshot-size"

    def refuse_size(self, owner: str, size: int) -> StoreError:
        """The refusal (counted) of a snapshot of `size` bytes its kernel claimed, past
        room(): over --max-snapshot-size, or over what the key's quota leaves."""
        if size > self.max_size:
            self.refused("size")
            return SizeError(size, self.max_size)
        return self._quota_error("key_bytes", self._held(owner)[1], size)

    def _held(self, owner: str) -> tuple[int, int]:
        """How many snapshots the owner keeps, and their bytes."""
        kept = self.snapshots(owner)
        return len(kept), sum(item.size for item in kept)

    def _check_quota(self, owner: str, adding: int) -> int:
        """QuotaError (counted) if one more snapshot of `adding` bytes is past the owner's
        quota; else the bytes the owner keeps."""
        count, used = self._held(owner)
        if self.quota.count is not None and count >= self.quota.count:
            raise self._quota_error("key_count", count, 1)
        if self.quota.bytes is not None and used + adding > self.quota.bytes:
            raise self._quota_error("key_bytes", used, adding)
        return used

    def _quota_error(self, reason: str, held: int, adding: int) -> QuotaError:
        self.refused(reason)
        if reason == "key_count":
            limit, flag = self.quota.count or 0, "--max-snapshots-per-key"
            return QuotaError(429, f"this key keeps {held} snapshots, the most it may "
                              f"({flag} {limit}): delete snapshots it no longer needs, then "
                              "snapshot again", reason, flag, held, limit)
        limit, flag = self.quota.bytes or 0, "--max-snapshot-bytes-per-key"
        return QuotaError(413, f"this key's snapshots hold {held} bytes and this one needs "
                          f"{adding} more, past the {limit} bytes it may keep ({flag}): "
                          "delete snapshots it no longer needs, or free some of the session's "
                          "variables or files", reason, flag, held, limit)

    @contextlib.contextmanager
    def _quota_lock(self, owner: str) -> Iterator[None]:
        """The owner's quota lock (an flock: replicas sharing the directory wait for it too)."""
        name = hashlib.sha256(owner.encode()).hexdigest()[:32]
        fd = os.open(self.root / "quota" / name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def snapshot(self, owner: str, snapshot_id: str, payload: bool = False) -> Stored:
        """The owner's snapshot (payload: with its bytes, to restore); 404 for another's, an
        unknown or an altered one."""
        item = self._read("snapshots", owner, snapshot_id, payload)
        if item is None:
            raise UnknownSnapshot(snapshot_id)
        return item

    def snapshots(self, owner: str) -> list[Stored]:
        """The owner's snapshots."""
        return self._owners_ids("snapshots", owner)

    def delete_snapshot(self, owner: str, snapshot_id: str) -> None:
        """Delete the owner's snapshot; 404 as `snapshot`."""
        self.snapshot(owner, snapshot_id)
        self._delete("snapshots", snapshot_id)

    # --- paused sessions ---

    def save_paused(self, owner: str, session_id: str, payload: bytes,
                    record: dict[str, Any]) -> None:
        """Keep a paused session (replacing its earlier pause)."""
        self._write("paused", Stored(session_id, owner, {**record, "paused_at": time.time()},
                                     payload))

    def paused(self, owner: str, session_id: str, payload: bool = False) -> Stored | None:
        """The owner's paused session of that id (payload: with its bytes), or None."""
        return self._read("paused", owner, session_id, payload)

    def paused_of(self, owner: str) -> list[Stored]:
        """Every paused session of the owner."""
        return self._owners_ids("paused", owner)

    def all_paused(self) -> list[tuple[str, float]]:
        """(session id, expiry wall time) of every paused session, whoever's (for expiry and
        the start-up listing): read from the records, each MAC-checked."""
        found = []
        for path in sorted((self.root / "paused").iterdir()):
            if path.name.startswith("."):
                continue
            with contextlib.suppress(OSError, ValueError, KeyError):
                with open(path, "rb") as file:
                    file.seek(2 * MAC_BYTES)
                    owner = json.loads(file.readline(MAX_RECORD))["owner"]
                item = self._read("paused", owner, path.name)
                if item is not None:
                    found.append((item.id, float(item.record.get("expires", 0) or 0)))
        return found

    def drop_paused(self, session_id: str) -> None:
        """Forget a paused session (resumed, deleted or expired)."""
        self._delete("paused", session_id)

    # --- leases: one instance at a time runs a session ---

    def lease(self, session_id: str, owner: str) -> None:
        """Hold the session for this instance; 409 while another instance holds it."""
        if session_id in self._leases:
            return
        fd = os.open(self.root / "leases" / session_id, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise HeldElsewhere(session_id) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode(), 0)  # whose it is: a 409 tells only its owner it exists
        self._leases[session_id] = fd

    def holder(self, session_id: str) -> bytes | None:
        """The owner of the session if another instance runs it now (its lease is locked)."""
        if not ID.match(session_id) or session_id in self._leases:
            return None
        try:
            fd = os.open(self.root / "leases" / session_id, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return os.pread(fd, 1024, 0)
        finally:
            os.close(fd)
        return None

    def held_elsewhere(self, owner: str, session_id: str) -> bool:
        """Whether another instance runs the owner's session now."""
        holder = self.holder(session_id)
        return holder is not None and hmac.compare_digest(holder, owner.encode())

    def release(self, session_id: str) -> None:
        """Let other instances resume the session."""
        fd = self._leases.pop(session_id, None)
        if fd is not None:
            os.close(fd)  # closing the last fd of the open file drops its flock

    def forget_lease(self, session_id: str) -> None:
        """Release and remove the lease file of a session that is gone for good."""
        self.release(session_id)
        with contextlib.suppress(FileNotFoundError):
            (self.root / "leases" / session_id).unlink()
