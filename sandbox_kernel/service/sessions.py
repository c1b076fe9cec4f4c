"""Sessions: a kernel held for one API key, its state kept between executions, culled when idle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..client import AsyncSandbox
from ..client.sessions import KernelSession, SessionLimit, SessionTable
from .access import json_line
from .auth import ApiKey
from .kernels import Kernels, Network, NetworkChoice, kernel_id, policy_name

log = logging.getLogger("sandbox_kernel.service")


class SessionError(Exception):
    """A session request that cannot be carried out; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Session(KernelSession):
    """One kernel, one API key."""

    network: Network
    dead: str | None = None  # why the kernel is gone, told on the next call
    lost_unseen: bool = False  # its kernel was restarted by a call no one heard the end of

    @property
    def kernel_id(self) -> str:
        """The id of the session's kernel."""
        return kernel_id(self.sandbox)

    def describe(self) -> dict[str, object]:
        """The session as the API shows it."""
        hosts = self.network.hosts if isinstance(self.network, NetworkChoice) \
            and self.network.mode == "hosts" else None
        return {"id": self.id, "network": bool(self.network), "allow_hosts": hosts,
                "policy": policy_name(self.network),
                "idle_timeout": self.idle_timeout, "created": self.created,
                "idle_seconds": round(self.idle_seconds(), 3), "busy": self.busy,
                "alive": self.dead is None, "dead_reason": self.dead}


class Sessions(SessionTable[Session]):
    """Every open session, by id; a key sees only its own."""

    def __init__(self, kernels: Kernels, max_sessions: int, per_key: int) -> None:
        super().__init__(max_sessions)
        self.kernels = kernels
        self.per_key = per_key  # a key's limit unless its entry in the keys file sets one

    async def create(self, key: ApiKey, network: Network, idle_timeout: float) -> Session:
        """A new session with a fresh kernel; 429 past the key's or the service's limit (a key's
        own max_sessions, else --max-sessions-per-key, else its fair share)."""
        async def make(session_id: str) -> Session:
            return Session(session_id, key.id, await self.kernels.get(network), idle_timeout,
                           network=network)

        try:
            limit = self.per_key if key.max_sessions is None else key.max_sessions
            return await self.open(key.id, limit, make)
        except SessionLimit as full:
            if full.per_owner:
                raise SessionError(429, f"API key {key.id!r} may hold {full.limit} sessions "
                                   "at once; delete one first") from None
            raise SessionError(429, f"the service holds its limit of {full.limit} sessions; "
                               "delete one or try again later") from None

    def get(self, key: ApiKey, session_id: str) -> Session:
        """The key's session; 404 for another key's, so ids of others cannot be probed."""
        session = self.find(key.id, session_id)
        if session is None:
            raise SessionError(404, f"no session {session_id!r} for this API key")
        return session

    async def acquire(self, session: Session) -> AsyncSandbox:
        """Take the session's kernel for one call: 409 if busy, 410 if its kernel is gone.

        Busy is answered at once, not queued: a session runs one thing at a time.
        """
        if session.dead is not None:
            raise SessionError(410, f"session {session.id}'s kernel is gone: {session.dead}; "
                               "delete the session and create a new one")
        if session.lock.locked():
            raise SessionError(409, f"session {session.id} is running another execution; "
                               "wait for it or interrupt it")
        await session.lock.acquire()
        try:
            alive = await session.sandbox.manager.is_alive()
        except BaseException:
            self.release(session)
            raise
        if not alive:
            self.release(session)
            self.mark_dead(session, "its kernel process exited")
            raise SessionError(410, f"session {session.id}'s kernel is gone: {session.dead}; "
                               "delete the session and create a new one")
        return session.sandbox

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

    def delete(self, session: Session) -> None:
        """Forget the session and shut its kernel down; a call already holding it gets 410."""
        self.forget(session)
        session.dead = session.dead or "the session was closed"
        self.kernels.discard(session.sandbox)

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
