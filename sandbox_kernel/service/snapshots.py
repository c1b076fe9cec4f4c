"""The service's one seam to the client's snapshots (client/snapshot.py): take one from a
session's kernel, and the options that restore one into a fresh kernel.

A snapshot is made inside the sandboxed kernel and sealed (MAC'd with the service's key, bound
to its owner) by the client; the service only moves its bytes between the kernel and the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..client import AsyncSandbox
from ..client.snapshot import SnapshotError
from .store import StoreError


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


async def take(sandbox: AsyncSandbox, key: bytes, owner: str, max_size: int) -> Taken:
    """Snapshot the kernel's user state, sealed for owner; StoreError if it cannot be made
    (413 past max_size, refused before its bytes leave the kernel)."""
    try:
        made = await sandbox.snapshot(key, owner, max_size=max_size)
    except SnapshotError as exc:
        status = 413 if "over the limit" in str(exc) else 422
        raise StoreError(status, f"the session could not be snapshotted: {exc}"
                         + (" (--max-snapshot-size)" if status == 413 else "")) from exc
    return Taken(bytes(made.data), dict(made.manifest))


def restore_options(payload: bytes, key: bytes, owner: str) -> dict[str, Any]:
    """The AsyncSandbox options that restore a snapshot inside a fresh sandboxed kernel (its
    seal is checked again there, by the client, before a byte goes in)."""
    return {"snapshot": payload, "snapshot_key": key, "snapshot_owner": owner}


def refused_restore(error: BaseException | None) -> bool:
    """Whether a kernel failed to start because its snapshot was refused (the client checks
    the seal, the size and the policy again before a byte goes in), not for a start problem."""
    return isinstance(error, SnapshotError)
