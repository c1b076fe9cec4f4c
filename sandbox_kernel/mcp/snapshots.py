"""Snapshots and pausing for the MCP server (`--state-dir`): the service's store (service/
store.py: sealed bytes, MAC'd with the server's own key, bound to their owner: the API key over
HTTP, the one client over stdio) and the same seam to the client's snapshots.

A snapshot holds a session's variables, imports, %pip packages and files; a session opened from
it starts with them on a fresh sandboxed kernel of the same network. With
--session-pause-after, an idle session is snapshotted into the store and its kernel stopped;
the next tool call naming it resumes it, same id, state restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from ..client.sessions import SessionLimit
from ..hosting.snapshots import Taken, restore_options, take
from ..hosting.sources import Kernels
from ..hosting.store import QuotaError, SizeError, Store, Stored, StoreError
from .kernels import Session, SessionProblem, Sessions

log = logging.getLogger("sandbox_kernel.mcp")


def for_model(refused: StoreError) -> str:
    """A snapshot the store refused, said to a model: what happened and what it can do (the
    operator's wording, with the setting, is in the log)."""
    kept = "Nothing was saved and the session goes on as it was."
    if isinstance(refused, SizeError):
        return (f"The session's state is {refused.size} bytes, more than the "
                f"{refused.limit} bytes a snapshot may have on this server. {kept} Free large "
                "variables or files (del name; remove files) and snapshot again.")
    if not isinstance(refused, QuotaError):
        return str(refused)
    if refused.reason == "key_count":
        held = f"You keep {refused.held} snapshots, the most this server allows you."
    else:
        held = (f"Your snapshots hold {refused.held} bytes and this one does not fit in the "
                f"{refused.limit} bytes this server allows you.")
    return (f"{held} {kept} Delete snapshots you no longer need (list_snapshots, then "
            "delete_snapshot) and snapshot again.")


class Snapshots:
    """The MCP server's snapshots and paused sessions."""

    def __init__(self, store: Store, sessions: Sessions, kernels: Kernels,
                 runtime: str) -> None:
        self.store, self.sessions, self.kernels, self.runtime = store, sessions, kernels, runtime
        self._resuming: dict[str, asyncio.Lock] = {}

    async def _take(self, session: Session, kept: bool = False) -> Taken:
        if session.busy:
            raise SessionProblem(f"session {session.id} is running {session.run_id}: wait for "
                                 "it (wait_run) or interrupt it first")
        async with session.lock:
            try:
                return await take(session.sandbox, self.store, session.owner, kept)
            except StoreError as exc:
                raise self._refused(session, exc) from None

    def _record(self, session: Session, taken: Taken) -> dict[str, Any]:
        return {"network": session.network, "runtime": self.runtime,
                "manifest": taken.manifest, "session": session.id}

    async def snapshot(self, session: Session) -> tuple[Stored, Taken]:
        """A new snapshot of the session, which goes on as it was."""
        taken = await self._take(session, kept=True)
        try:
            stored = self.store.save_snapshot(session.owner, taken.payload,
                                              self._record(session, taken))
        except StoreError as exc:  # another snapshot took the last place meanwhile
            raise self._refused(session, exc) from None
        return stored, taken

    @staticmethod
    def _refused(session: Session, refused: StoreError) -> SessionProblem:
        log.info("snapshot of session %s of %s refused: %s", session.id, session.owner, refused)
        return SessionProblem(for_model(refused))

    def find(self, owner: str, snapshot_id: str, payload: bool = False) -> Stored:
        """The owner's snapshot (payload: with its bytes, to open it); the same answer for
        another owner's id as for none."""
        try:
            return self.store.snapshot(owner, snapshot_id, payload)
        except StoreError as exc:
            if exc.status != 404:  # altered bytes: say so
                raise SessionProblem(f"snapshot {exc}") from None
            raise SessionProblem(f"there is no snapshot {snapshot_id!r}: see yours with "
                                 "list_snapshots") from None

    async def open(self, owner: str, item: Stored, owner_limit: int | None,
                   session_id: str | None = None) -> Session:
        """A session on a fresh kernel restored from the item (its network, this runtime)."""
        if item.record["runtime"] != self.runtime:
            raise SessionProblem(f"snapshot {item.id} was made on another Python runtime than "
                                 "this server's: it cannot be opened here")
        network = bool(item.record["network"])
        options = restore_options(item.payload, self.store.key, owner)

        async def make(new_id: str) -> Session:
            try:
                sandbox = await self.kernels.get(network, **options)
            except Exception as exc:  # the kernel's own reason, not hosting's wrapping
                raise SessionProblem(f"the snapshot could not be restored: "
                                     f"{exc.__cause__ or exc}") from None
            return Session(new_id, owner, sandbox, self.sessions.config.session_idle_timeout,
                           network=network)

        paused = len([p for p in self.store.paused_of(owner)
                      if p.id != session_id and self.sessions.find(owner, p.id) is None])
        limit = None if owner_limit is None else owner_limit - paused
        try:
            return await self.sessions.open(owner, limit, make, session_id)
        except SessionLimit as full:
            raise SessionProblem(f"you may hold {full.limit} sessions at once (paused ones "
                                 "count): close one you no longer need (close_session)"
                                 if full.per_owner else f"this server already holds its "
                                 f"{full.limit} sessions: close one you no longer need "
                                 "(close_session)") from None

    async def pause(self, session: Session) -> int:
        """Snapshot the session into the store and stop its kernel; the bytes kept."""
        if session.sandbox.holds_callers_secrets:  # never on disk: a resume would lack them
            raise SessionProblem(f"session {session.id} holds secrets of your own, which are "
                                 "never written to disk: it is not paused (snapshot it and "
                                 "create a session from the snapshot with the secrets again)")
        taken = await self._take(session)
        last_used = time.time() - session.idle_seconds()
        self.store.save_paused(session.owner, session.id, taken.payload, {
            **self._record(session, taken), "created": session.created,
            "last_used": last_used, "usage": session.spent(),
            "expires": last_used + session.idle_timeout if session.idle_timeout > 0 else 0})
        await self.sessions.close(session)
        log.info("session %s of %s paused (%d bytes)", session.id, session.owner,
                 len(taken.payload))
        return len(taken.payload)

    async def resume(self, owner: str, session_id: str, owner_limit: int | None
                     ) -> Session | None:
        """The owner's paused session back on a fresh kernel, or None if there is none."""
        if self.store.paused(owner, session_id) is None:
            return None
        lock = self._resuming.setdefault(session_id, asyncio.Lock())
        try:
            async with lock:  # calls arriving together resume it once
                live = self.sessions.find(owner, session_id)
                return live if live is not None else await self._resume(owner, session_id,
                                                                        owner_limit)
        finally:
            if not lock.locked():
                self._resuming.pop(session_id, None)

    async def _resume(self, owner: str, session_id: str, owner_limit: int | None
                      ) -> Session | None:
        """Resume it holding its lease (store.py), the paused record read under it and
        dropped before it is let go: of servers sharing the directory, one resumes it and
        another finds it resuming (refused) or gone from the directory (None)."""
        try:
            self.store.lease(session_id, owner)
        except StoreError:
            raise SessionProblem(f"session {session_id} is being resumed by another server "
                                 "sharing this one's snapshots: call again in a few seconds "
                                 "(it then runs there, not here)") from None
        try:
            item = self.store.paused(owner, session_id, payload=True)
            if item is None or 0 < item.record["expires"] < time.time():
                return None
            session = await self.open(owner, item, owner_limit, session_id)
            session.created = item.record["created"]
            self.store.drop_paused(session_id)
        except StoreError as exc:
            raise SessionProblem(f"session {exc}") from None
        finally:
            self.store.release(session_id)
        log.info("session %s of %s resumed", session_id, owner)
        return session

    async def pause_idle(self, after: float) -> None:
        """Pause every session idle for more than `after` seconds."""
        for session in self.sessions.all():
            if not session.busy and session.idle_seconds() > after:
                with contextlib.suppress(SessionProblem):  # busy again, or too large
                    await self.pause(session)
