"""Sessions for the MCP server: a kernel kept for one owner (the API key over HTTP, the one
client over stdio); another owner's session ids are unknown to it, so ids cannot be probed.

Kernels come from hosting/ (sources.py's `Kernels`); a call without a session is hosting's
fresh run (fresh.py), whose rule decides its kernel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..client.sessions import KernelSession, SessionLimit, SessionTable
from ..hosting.sources import Kernels
from .config import McpConfig

log = logging.getLogger("sandbox_kernel.mcp")


class SessionProblem(Exception):
    """A session request that cannot be carried out; the message is for a model."""


@dataclass(eq=False)
class Session(KernelSession):
    """One kernel kept for one owner; it runs one thing at a time."""

    network: bool
    run_id: str | None = None  # the run in progress, if one is

    @property
    def busy(self) -> bool:
        """Running code or a file operation."""
        return self.run_id is not None or self.lock.locked()

    def describe(self) -> dict[str, Any]:
        """What list_sessions shows of it."""
        return {"session": self.id, "network": self.network, "busy": self.busy,
                "running": self.run_id, "created": self.created,
                "idle_seconds": round(self.idle_seconds(), 1), "usage": self.spent()}


class Sessions(SessionTable[Session]):
    """Every open session by id; an owner sees only its own."""

    id_bytes = 8  # short: a model copies it into every call

    def __init__(self, config: McpConfig, kernels: Kernels) -> None:
        super().__init__(config.max_sessions)
        self.config = config
        self.kernels = kernels

    async def create(self, owner: str, network: bool, owner_limit: int | None,
                     secrets: Mapping[str, Any] | None = None) -> Session:
        """A new session on a fresh kernel, within the server's and the owner's limits;
        secrets: the caller's own, for its kernel alone (never described back)."""
        async def make(session_id: str) -> Session:
            kernel = await self.kernels.get(network, **({"secrets": secrets} if secrets else {}))
            return Session(session_id, owner, kernel, self.config.session_idle_timeout,
                           network=network)

        try:
            return await self.open(owner, owner_limit, make)
        except SessionLimit as full:
            if full.per_owner:
                raise SessionProblem(f"you may hold {full.limit} sessions at once: close one "
                                     "you no longer need (close_session), or run without a "
                                     "session") from None
            raise SessionProblem(f"this server already holds its {full.limit} sessions: "
                                 "close one you no longer need (close_session)") from None

    def get(self, owner: str, session_id: str) -> Session:
        """The owner's session; the same answer for another owner's id as for no id."""
        session = self.find(owner, session_id)
        if session is None:
            raise SessionProblem(f"there is no session {session_id!r}: create one with "
                                 "create_session, or see yours with list_sessions")
        return session

    async def close(self, session: Session) -> None:
        """Forget the session and shut its kernel down."""
        self.forget(session)
        await self.kernels.close_now(session.sandbox)

    async def cull(self) -> None:
        """Close sessions idle past the idle timeout."""
        for session in self.idle():
            log.info("session %s of %s closed after %g s idle", session.id, session.owner,
                     session.idle_timeout)
            await self.close(session)

    async def close_all(self) -> None:
        """Close every session (at shutdown); one that fails does not stop the others."""
        await asyncio.gather(*(self.close(s) for s in self.all()),
                             return_exceptions=True)
