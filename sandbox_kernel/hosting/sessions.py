"""Sessions: a kernel held for one API key, its state kept between executions, culled when idle.

With a state dir, a session holds its lease in the store while it runs here, and its key's
paused sessions count against its limit (the store says which); pausing and resuming are
pausing.py's, which calls this module and is never called back by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from ..client import AsyncSandbox
from ..client.sessions import KernelSession, SessionLimit, SessionTable
from ..errors import KernelUnavailable
from .events import json_line, log
from .keys import ApiKey
from .network import Network, NetworkChoice, Secrets, policy_name
from .snapshots import refused_restore
from .sources import Kernels, kernel_id
from .store import Store

Reason = Literal["unknown", "gone", "busy", "pausing", "key_limit", "service_full",
                 "restore_refused", "holds_secrets", "other_network", "other_runtime"]


class SessionError(Exception):
    """A session request that cannot be carried out, in the service's words.

    `status` is the HTTP status the service answers; `reason` the kind of refusal and `facts`
    what it names (the session, a limit, a snapshot...), from which another face words its own
    answer (the MCP server's, for a model: mcp/problems.py) without reading the message.
    """

    def __init__(self, status: int, message: str, reason: Reason, **facts: Any) -> None:
        super().__init__(message)
        self.status, self.reason, self.facts = status, reason, facts


# What a restore reports (client/sandbox.py, restore()), as both faces answer it; its cwd, a
# path of the host's, stays here.
RESTORE_PARTS = ("restored", "skipped", "packages", "files")


@dataclass(eq=False)
class Session(KernelSession):
    """One kernel, one API key."""

    network: Network
    dead: str | None = None  # why the kernel is gone, told on the next call
    lost_unseen: bool = False  # its kernel was restarted by a call no one heard the end of
    pausing: bool = False  # being snapshotted to be paused (pausing.py)
    run_id: str | None = None  # a face's run in progress, when its runs outlive a call (MCP's)

    @property
    def busy(self) -> bool:
        """Running code or a file operation (or a run is about to take the kernel)."""
        return self.run_id is not None or self.lock.locked()

    @property
    def kernel_id(self) -> str:
        """The id of the session's kernel."""
        return kernel_id(self.sandbox)

    def restore_report(self) -> dict[str, list[Any]] | None:
        """What opening it from a snapshot brought back and what it left out (each with the
        reason): its names, %pip packages and files; None if it was not opened from one. For
        the answer that opened it: a later restart empties the kernel, not this report."""
        report = self.sandbox.restored
        if not isinstance(report, dict):
            return None
        return {part: list(report.get(part) or []) for part in RESTORE_PARTS}

    def describe(self) -> dict[str, object]:
        """The session as the API shows it."""
        hosts = self.network.hosts if isinstance(self.network, NetworkChoice) \
            and self.network.mode == "hosts" else None
        return {"id": self.id, "network": bool(self.network), "allow_hosts": hosts,
                "policy": policy_name(self.network),
                "idle_timeout": self.idle_timeout, "created": self.created,
                "idle_seconds": round(self.idle_seconds(), 3), "busy": self.busy,
                "alive": self.dead is None, "dead_reason": self.dead, "usage": self.spent(),
                "paused": False}


class Sessions(SessionTable[Session]):
    """Every open session, by id; a key sees only its own."""

    def __init__(self, kernels: Kernels, max_sessions: int, per_key: int,
                 id_bytes: int = SessionTable.id_bytes) -> None:
        super().__init__(max_sessions)
        self.id_bytes = id_bytes  # the MCP server's are short: a model copies them
        self.kernels = kernels
        self.per_key = per_key  # a key's limit unless its entry in the keys file sets one
        self.store: Store | None = None  # with --state-dir: leases and paused sessions

    async def create(self, key: ApiKey, network: Network, idle_timeout: float,
                     restore: dict[str, Any] | None = None,
                     session_id: str | None = None, secrets: Secrets = None) -> Session:
        """A new session with a fresh kernel (restore: the options restoring a snapshot into
        it); 429 past the key's or the service's limit (a key's own max_sessions, else
        --max-sessions-per-key, else its fair share; its paused sessions count too). secrets: the
        caller's own, for this session's kernel alone (never described back)."""
        extra = {**(restore or {}), **({"secrets": secrets} if secrets else {})}
        async def make(session_id: str) -> Session:
            try:
                sandbox = await self.kernels.get(network, **extra)
            except KernelUnavailable as exc:
                if restore and refused_restore(exc.__cause__):
                    raise SessionError(422, f"the snapshot could not be restored: "
                                       f"{exc.__cause__}", "restore_refused",
                                       why=str(exc.__cause__)) from exc
                raise
            return Session(session_id, key.id, sandbox, idle_timeout, network=network)

        limit = self.per_key if key.max_sessions is None else key.max_sessions
        paused = self._paused_elsewhere(key, session_id)
        try:
            session = await self.open(key.id, limit - paused, make, session_id)
        except SessionLimit as full:
            if full.per_owner:
                raise SessionError(429, f"API key {key.id!r} may hold {limit} sessions at once"
                                   f"{f' ({paused} of them paused)' if paused else ''}; "
                                   "delete one first", "key_limit", limit=limit,
                                   paused=paused) from None
            raise SessionError(429, f"the service holds its limit of {full.limit} sessions; "
                               "delete one or try again later", "service_full",
                               limit=full.limit) from None
        if self.store is not None:  # it runs here: another instance sharing the dir is refused
            self.store.lease(session.id, key.id)
        return session

    def _paused_elsewhere(self, key: ApiKey, resuming: str | None) -> int:
        """The key's paused sessions (not the one resuming, nor those running here): they
        count against its limit."""
        if self.store is None:
            return 0
        return len([p for p in self.store.paused_of(key.id)
                    if p.id != resuming and self.find(key.id, p.id) is None])

    def get(self, key: ApiKey, session_id: str) -> Session:
        """The key's session; 404 for another key's, so ids of others cannot be probed."""
        session = self.find(key.id, session_id)
        if session is None:
            raise SessionError(404, f"no session {session_id!r} for this API key", "unknown",
                               session=session_id)
        return session

    async def acquire(self, session: Session) -> AsyncSandbox:
        """Take the session's kernel for one call: 409 if busy, 410 if its kernel is gone.

        Busy is answered at once, not queued: a session runs one thing at a time.
        """
        if session.dead is not None:
            raise self.gone(session)
        if session.pausing:
            raise SessionError(409, f"session {session.id} is being paused; send the request "
                               "again in a moment: it resumes the session", "pausing",
                               session=session.id)
        if session.busy:
            raise SessionError(409, f"session {session.id} is running another execution; "
                               "wait for it or interrupt it", "busy", session=session.id,
                               run=session.run_id)
        await session.lock.acquire()
        try:
            alive = await session.sandbox.manager.is_alive()
        except BaseException:
            self.release(session)
            raise
        if not alive:
            self.release(session)
            self.mark_dead(session, "its kernel process exited")
            raise self.gone(session)
        return session.sandbox

    @staticmethod
    def gone(session: Session) -> SessionError:
        """The 410 for a session whose kernel is lost (`session.dead` says why)."""
        return SessionError(410, f"session {session.id}'s kernel is gone: {session.dead}; "
                            "delete the session and create a new one", "gone",
                            session=session.id, why=session.dead)

    def release(self, session: Session) -> None:
        """Give the kernel back after a call taken with acquire."""
        session.last_used = time.monotonic()
        session.lock.release()

    @contextlib.asynccontextmanager
    async def using(self, session: Session) -> AsyncIterator[AsyncSandbox]:
        """acquire and release around a block."""
        sandbox = await self.acquire(session)
        try:
            yield sandbox
        finally:
            self.release(session)

    def mark_dead(self, session: Session, why: str) -> None:
        """The kernel is lost: shut it down, keep the session so its next call says why."""
        if session.dead is None:
            session.dead = why
            self.kernels.discard(session.sandbox)

    def delete(self, session: Session, why: str = "the session was closed",
               for_good: bool = True) -> None:
        """Forget the session and shut its kernel down in the background; a call already
        holding it gets 410.

        for_good: its pause and lease in the state dir go too (False: it was just paused).
        """
        self._forget(session, why, for_good)
        self.kernels.discard(session.sandbox)

    async def close_now(self, session: Session, why: str = "the session was closed") -> None:
        """delete, answered once its kernel is gone (a face that says "closed" after it)."""
        self._forget(session, why, for_good=True)
        await self.kernels.close_now(session.sandbox)

    def _forget(self, session: Session, why: str, for_good: bool) -> None:
        self.forget(session)
        session.dead = session.dead or why
        if self.store is not None and for_good:
            self.store.drop_paused(session.id)
            self.store.forget_lease(session.id)

    def cull(self) -> list[str]:
        """Close sessions idle past their timeout (dead ones too, after the same time)."""
        culled = self.idle()
        for session in culled:
            log.info(json_line(event="session_culled", session=session.id, key=session.owner,
                               kernel=session.kernel_id))
            self.delete(session)
        return [s.id for s in culled]

    async def cull_forever(self, interval: float) -> None:
        """Close idle sessions every interval seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.cull()

    def close(self) -> None:
        """Close every session and its kernel."""
        for session in self.all():
            self.delete(session)
