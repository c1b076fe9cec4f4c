"""The service's one seam to the client's snapshots (client/snapshot.py): take one from a
session's kernel, and the options that restore one into a fresh kernel.

A snapshot is made inside the sandboxed kernel and sealed (MAC'd with the service's key, bound
to its owner) by the client; the service only moves its bytes between the kernel and the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..client import AsyncSandbox
from ..client.snapshot import SnapshotError, SnapshotTooLarge
from .store import Store, StoreError


@dataclass
class Taken:
    """A snapshot as the service keeps it: the sealed bytes, and what was saved and skipped."""

    payload: bytes
    manifest: dict[str, Any]

    @property
    def saved(self) -> list[str]:
        """The names saved."""
        return list(self.manifest.get("saved", []))

    @property
    def skipped(self) -> Any:
        """The names not saved, each with its reason."""
        return self.manifest.get("skipped", [])


async def take(sandbox: AsyncSandbox, store: Store, owner: str, kept: bool = True) -> Taken:
    """Snapshot the kernel's user state, sealed for owner; StoreError if it cannot be made.

    kept: a snapshot the key keeps, bounded by its quota (QuotaError before the kernel is
    asked when the key has no place left); else a session's pause, bounded by
    --max-snapshot-size alone. A larger claim is refused (413) before its bytes leave the
    kernel; bytes past it never arrive (the client's buffer grows with what arrives).
    """
    limit = store.room(owner)[0] if kept else store.max_size
    try:
        made = await sandbox.snapshot(store.key, owner, max_size=limit)
    except SnapshotTooLarge as exc:
        raise store.refuse_size(owner, exc.size) from exc
    except SnapshotError as exc:
        raise StoreError(422, f"the session could not be snapshotted: {exc}") from exc
    store.check_size(len(made.data))  # the seal's own bytes are counted too
    return Taken(bytes(made.data), dict(made.manifest))


def restore_options(payload: bytes, key: bytes, owner: str) -> dict[str, Any]:
    """The AsyncSandbox options that restore a snapshot inside a fresh sandboxed kernel (its
    seal is checked again there, by the client, before a byte goes in)."""
    return {"snapshot": payload, "snapshot_key": key, "snapshot_owner": owner}


def refused_restore(error: BaseException | None) -> bool:
    """Whether a kernel failed to start because its snapshot was refused (the client checks
    the seal, the size and the policy again before a byte goes in), not for a start problem."""
    return isinstance(error, SnapshotError)
