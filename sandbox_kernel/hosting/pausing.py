"""Sessions that outlive their kernel: snapshots of a session, pausing, resuming, forking.

A session is paused (idle past --session-pause-after, asked to, or at a graceful stop) by
snapshotting its kernel into the store and stopping the kernel; it leaves the table of live
sessions and lives on as a record in the state dir. Its next request resumes it, on this
instance or another sharing the dir, on a fresh kernel of the same network and runtime
restored from the snapshot, with the same id. While a kernel runs it, the instance holds the
session's lease (store.py): a second instance is refused (409), never a silent double.

Rules an agent platform needs spelled out (docs/service.md says the same):
- Limits: a paused session holds disk, not a kernel: it does not count against --max-sessions
  (kernels), but does against its key's limit, so pausing is no way around it; resuming takes
  a kernel slot as creating does (429 when the service is full).
- Expiry: a paused session ends when its idle timeout, counted from its last use, runs out (the
  same time it would have been closed had it kept its kernel); a restart does not reset it.
- Secrets: nothing secret is written to the state dir (the record holds only its network,
  runtime, idle timeout and times). A session given secrets of the caller's own is therefore
  never paused, since it would resume without them: asked to, 409; idle or at a graceful stop,
  it is passed by and closed as it would be without --session-pause-after. The operator's
  declared secrets come from the launcher's environment at each start, so they survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from .events import json_line, log
from .keys import ApiKey
from .network import Network, NetworkChoice, network_of, network_record, policy_name
from .sessions import Session, SessionError, Sessions
from .snapshots import Taken, restore_options, take
from .store import Store, Stored, StoreError

EXPIRE_INTERVAL = 30.0  # seconds between sweeps of expired paused sessions (a directory read)


def describe_paused(item: Stored) -> dict[str, Any]:
    """A paused session as GET /sessions shows it (as Session.describe, paused)."""
    record, network = item.record, network_of(item.record["network"])
    return {"id": item.id, "network": bool(network),
            "allow_hosts": list(network.hosts) if network.mode == "hosts" else None,
            "policy": policy_name(network), "idle_timeout": idle_timeout_of(record),
            "created": record["created"],
            "idle_seconds": round(time.time() - record["last_used"], 3),
            "busy": False, "alive": True, "dead_reason": None, "paused": True,
            "usage": record.get("usage") or dict.fromkeys(
                ("cpu_user_seconds", "cpu_system_seconds", "egress_cpu_seconds")),
            "snapshot_bytes": item.size}


def idle_timeout_of(record: dict[str, Any]) -> float:
    """A paused session's idle timeout (a pause the MCP server once stored has only its
    expiry, which is its last use plus that timeout, 0 for never)."""
    if "idle_timeout" in record:
        return float(record["idle_timeout"])
    expires = record.get("expires") or 0
    return max(0.0, expires - record["last_used"]) if expires else 0.0


def refuse_if_secrets(session: Session) -> None:
    """409 for a session holding the caller's own secrets: their values are never written to
    disk, so a resumed session would silently lack them; it is not paused (when idle, it is
    closed at its idle timeout, as without --session-pause-after)."""
    if session.sandbox.holds_callers_secrets:
        raise SessionError(409, f"session {session.id} holds secrets of the caller's own, "
                           "which are never written to disk: it cannot be paused (snapshot it "
                           "and create a session from the snapshot with the secrets again)",
                           "holds_secrets", session=session.id)


class Pausing:
    """Snapshots, pauses and resumes the sessions of one service over one store."""

    def __init__(self, sessions: Sessions, store: Store, runtime: str) -> None:
        self.sessions, self.store, self.runtime = sessions, store, runtime
        self._resuming: dict[str, asyncio.Lock] = {}
        sessions.store = store  # leases and paused counts; sessions never call pausing

    # --- snapshots ---

    async def _take(self, session: Session, kept: bool = False) -> Taken:
        """Snapshot a session's kernel (the caller holds the session); kept: one its key keeps
        (its quota bounds it), else a pause."""
        return await take(session.sandbox, self.store, session.owner, kept)

    def _record(self, session: Session, taken: Taken) -> dict[str, Any]:
        return {"network": network_record(session.network), "runtime": self.runtime,
                "manifest": taken.manifest, "session": session.id}

    async def snapshot(self, session: Session) -> tuple[Stored, Taken]:
        """A new stored snapshot of the session, which keeps running."""
        async with self.sessions.using(session):
            taken = await self._take(session, kept=True)
        stored = self.store.save_snapshot(session.owner, taken.payload,
                                          self._record(session, taken))
        log.info(json_line(event="snapshot_saved", session=session.id, key=session.owner,
                           snapshot=stored.id, bytes=len(taken.payload)))
        return stored, taken

    def check_restorable(self, item: Stored, network: Network | None) -> NetworkChoice:
        """The network a restore of the item runs on; 409 if the caller asked another, or
        the item ran on another runtime than this service's."""
        theirs = network_of(item.record["network"])
        if network is not None and network_record(network) != network_record(theirs):
            hosts = f" ({', '.join(theirs.hosts)})" if theirs.hosts else ""
            raise SessionError(409, f"snapshot {item.id} ran with network "
                               f"{policy_name(theirs)!r}{hosts}; a restore gets the same "
                               "network: omit network or ask for that",
                               "other_network", snapshot=item.id, network=theirs)
        if item.record["runtime"] != self.runtime:
            raise SessionError(409, f"snapshot {item.id} ran on runtime "
                               f"{item.record['runtime'] or 'the service interpreter'!r}, this "
                               f"service runs {self.runtime or 'its own interpreter'!r}: "
                               "restore it on a service of that runtime (--runtime)",
                               "other_runtime", snapshot=item.id)
        return theirs

    def restorable(self, owner: str, snapshot_id: str, network: Network | None
                   ) -> tuple[NetworkChoice, dict[str, Any]]:
        """The network and kernel options of a new session restored from the owner's
        snapshot (network: what the caller asked, None for the snapshot's own); the store's
        404 for another owner's id as for none, 409 when it cannot be restored here."""
        item = self.store.snapshot(owner, snapshot_id, payload=True)
        return self.check_restorable(item, network), self.restore_extra(item)

    def restore_extra(self, item: Stored) -> dict[str, Any]:
        """The kernel options that restore the item (in the fresh kernel, never here)."""
        return restore_options(item.payload, self.store.key, item.owner)

    # --- pause and resume ---

    async def pause(self, session: Session, *, hold: bool = True) -> int:
        """Snapshot the session into the store, then stop its kernel; the bytes kept.

        hold: take the session first (409 if busy); False when the caller already has it.
        """
        refuse_if_secrets(session)
        if hold:
            async with self.sessions.using(session):
                session.pausing = True  # a request meanwhile is told to send it again
                try:
                    taken = await self._take(session)
                finally:
                    session.pausing = False
        else:
            taken = await self._take(session)
        last_used = time.time() - session.idle_seconds()
        expires = last_used + session.idle_timeout if session.idle_timeout > 0 else 0
        self.store.save_paused(session.owner, session.id, taken.payload, {
            **self._record(session, taken), "idle_timeout": session.idle_timeout,
            "created": session.created, "last_used": last_used, "expires": expires,
            "usage": session.spent()})  # what it spent until paused stays described
        self.sessions.delete(session, "the session was paused", for_good=False)
        self.store.release(session.id)
        log.info(json_line(event="session_paused", session=session.id, key=session.owner,
                           bytes=len(taken.payload)))
        return len(taken.payload)

    def paused(self, key: ApiKey, session_id: str, payload: bool = False) -> Stored | None:
        """The key's paused session of that id (payload: with its bytes, to resume it),
        unless it expired (then it is dropped)."""
        item = self.store.paused(key.id, session_id, payload)
        if item is not None and 0 < item.record["expires"] < time.time():
            self.drop(session_id)
            return None
        return item

    async def resume(self, key: ApiKey, session_id: str) -> Session | None:
        """The key's paused session back on a fresh kernel, or None if it has none of that id."""
        if self.paused(key, session_id) is None:
            if self.store.held_elsewhere(key.id, session_id):
                self.store.lease(session_id, key.id)  # raises the 409 that says so
            return None
        lock = self._resuming.setdefault(session_id, asyncio.Lock())
        try:
            async with lock:  # requests arriving together resume it once
                live = self.sessions.find(key.id, session_id)
                return live if live is not None else await self._resume(key, session_id)
        finally:
            if not lock.locked():
                self._resuming.pop(session_id, None)

    async def _resume(self, key: ApiKey, session_id: str) -> Session | None:
        self.store.lease(session_id, key.id)  # 409 while another instance runs it
        try:
            item = self.paused(key, session_id, payload=True)  # the latest pause, anywhere
            if item is None:  # deleted or expired meanwhile
                self.store.release(session_id)
                return None
            session = await self.sessions.create(
                key, self.check_restorable(item, None), idle_timeout_of(item.record),
                self.restore_extra(item), item.id)
            session.created = item.record["created"]
        except BaseException:
            self.store.release(session_id)
            raise
        log.info(json_line(event="session_resumed", session=session_id, key=key.id,
                           kernel=session.kernel_id))
        return session

    def drop(self, session_id: str) -> None:
        """Forget a paused session for good (deleted or expired)."""
        self.store.drop_paused(session_id)
        self.store.forget_lease(session_id)

    # --- the service's lifetime ---

    async def pause_idle(self, after: float) -> None:
        """Pause every live session idle for more than `after` seconds."""
        for session in self.sessions.all():
            if session.dead is None and not session.busy and session.idle_seconds() > after:
                with contextlib.suppress(SessionError, StoreError):  # busy again, or too big
                    await self.pause(session)

    async def pause_all(self, within: float) -> None:
        """At a graceful stop: pause every live session in `within` seconds; those not done
        by then (or that cannot be) are closed as before, and the log says which."""
        async def one(session: Session) -> None:
            try:
                await self.pause(session)
            except (SessionError, StoreError) as exc:
                log.warning(json_line(event="session_not_paused", session=session.id,
                                      error=str(exc)))

        work = [one(s) for s in self.sessions.all() if s.dead is None]
        if work:
            try:
                await asyncio.wait_for(asyncio.gather(*work), within)
            except asyncio.TimeoutError:
                for session in self.sessions.all():
                    log.warning(json_line(event="session_not_paused", session=session.id,
                                          error=f"not paused within {within:g} s "
                                          "(--shutdown-grace)"))

    def expire(self) -> None:
        """Drop paused sessions whose idle timeout ran out."""
        now, live = time.time(), {s.id for s in self.sessions.all()}
        for session_id, expires in self.store.all_paused():
            # A pause of a session running now (here or elsewhere) is its last one, not expired.
            if 0 < expires < now and session_id not in live \
                    and self.store.holder(session_id) is None:
                log.info(json_line(event="paused_session_expired", session=session_id))
                self.drop(session_id)

    def announce(self) -> None:
        """At start: list the paused sessions found (each resumes on first use)."""
        found = self.store.all_paused()
        log.info(json_line(event="paused_sessions", count=len(found),
                           sessions=[session_id for session_id, _ in found]))

    async def maintain(self, after: float) -> None:
        """Pause idle sessions each second and sweep expired ones now and then, until
        cancelled."""
        swept = 0.0
        while True:
            await asyncio.sleep(1.0)
            if after > 0:
                await self.pause_idle(after)
            if time.monotonic() - swept > EXPIRE_INTERVAL:
                swept = time.monotonic()
                self.expire()
