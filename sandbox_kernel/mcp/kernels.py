"""Kernels for the MCP server: fresh ones from warm pools, and sessions that keep one.

A call without a session gets a kernel no one used (launch/pool.py keeps some started), closed
after the call. A session holds one kernel for one owner (the API key over HTTP, the one client
over stdio); another owner's session ids are unknown to it, so ids cannot be probed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..client import AsyncSandbox
from ..launch.forkserver import ForkServerClient
from ..launch.pool import KernelPool, start_sandbox
from ..policy import SandboxPolicy
from .config import McpConfig

log = logging.getLogger("sandbox_kernel.mcp")


class SessionProblem(Exception):
    """A session request that cannot be carried out; the message is for a model."""


def _with_network(base: SandboxPolicy, network: bool) -> SandboxPolicy:
    return SandboxPolicy(**{**base.as_dict(), "allow_network": network})


class KernelSource:
    """Started, never-used kernels per network setting, from a warm pool when one is ready."""

    def __init__(self, config: McpConfig) -> None:
        self.config = config
        self.pools: dict[bool, KernelPool] = {}
        self.python, self.preload = sys.executable, list(config.preload)
        if config.runtime:  # its current build, its own modules preloaded too
            from ..runtimes import find

            record = find(config.runtime)
            self.python = str(record.python())
            self.preload = list(dict.fromkeys([*record.preload, *config.preload]))

    def options(self, network: bool) -> dict[str, Any]:
        """The AsyncSandbox options of a kernel with network on or off."""
        return {"kernel_name": None, "policy": _with_network(self.config.policy, network),
                "python": self.python, "preload": self.preload,
                "cold_start": self.config.cold_start}

    def _pool(self, network: bool) -> KernelPool | None:
        if self.config.pool_size < 1:
            return None
        if network not in self.pools:
            self.pools[network] = KernelPool(self.config.pool_size, **self.options(network))
            self.pools[network].start()
        return self.pools[network]

    def start(self) -> None:
        """Begin filling the pool of the default kernels (those of the policy as given)."""
        self._pool(self.config.policy.allow_network)

    async def get(self, network: bool) -> AsyncSandbox:
        """A started kernel of its own for the caller, who closes it."""
        pool = self._pool(network)
        if pool is not None:
            return await pool.get_soonest()
        return await start_sandbox(**self.options(network))

    async def close(self) -> None:
        """Close the pools and end the fork server their kernels came from."""
        await asyncio.gather(*(pool.close() for pool in self.pools.values()),
                             return_exceptions=True)
        if not self.config.cold_start:
            ForkServerClient(python=self.python, preload=tuple(self.preload)).stop_server()


@dataclass(eq=False)
class Session:
    """One kernel kept for one owner; it runs one thing at a time."""

    id: str
    owner: str
    network: bool
    sandbox: AsyncSandbox
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    run_id: str | None = None  # the run in progress, if one is
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def busy(self) -> bool:
        """Running code or a file operation."""
        return self.run_id is not None or self.lock.locked()

    def describe(self) -> dict[str, Any]:
        """What list_sessions shows of it."""
        return {"session": self.id, "network": self.network, "busy": self.busy,
                "running": self.run_id, "created": self.created,
                "idle_seconds": 0.0 if self.busy
                else round(time.monotonic() - self.last_used, 1)}


class Sessions:
    """Every open session by id; an owner sees only its own."""

    def __init__(self, config: McpConfig, source: KernelSource) -> None:
        self.config = config
        self.source = source
        self._sessions: dict[str, Session] = {}
        self._starting = 0

    def owned_by(self, owner: str) -> list[Session]:
        """The sessions this client (API key) owns."""
        return [s for s in self._sessions.values() if s.owner == owner]

    async def create(self, owner: str, network: bool, owner_limit: int | None) -> Session:
        """A new session on a fresh kernel, within the server's and the owner's limits."""
        if len(self._sessions) + self._starting >= self.config.max_sessions:
            raise SessionProblem(f"this server already holds its {self.config.max_sessions} "
                                 "sessions: close one you no longer need (close_session)")
        if owner_limit is not None and len(self.owned_by(owner)) >= owner_limit:
            raise SessionProblem(f"you may hold {owner_limit} sessions at once: close one you "
                                 "no longer need (close_session), or run without a session")
        self._starting += 1
        try:
            sandbox = await self.source.get(network)
        finally:
            self._starting -= 1
        session = Session(secrets.token_hex(8), owner, network, sandbox)
        self._sessions[session.id] = session
        return session

    def get(self, owner: str, session_id: str) -> Session:
        """The owner's session; the same answer for another owner's id as for no id."""
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise SessionProblem(f"there is no session {session_id!r}: create one with "
                                 "create_session, or see yours with list_sessions")
        return session

    async def close(self, session: Session) -> None:
        """Forget the session and shut its kernel down."""
        self._sessions.pop(session.id, None)
        with contextlib.suppress(Exception):
            await session.sandbox.close(now=True)

    async def cull(self) -> None:
        """Close sessions idle past the idle timeout."""
        limit = self.config.session_idle_timeout
        now = time.monotonic()
        for session in [s for s in self._sessions.values()
                        if limit > 0 and not s.busy and now - s.last_used > limit]:
            log.info("session %s of %s closed after %g s idle", session.id, session.owner,
                     limit)
            await self.close(session)

    async def close_all(self) -> None:
        """Close every session (at shutdown); one that fails does not stop the others."""
        await asyncio.gather(*(self.close(s) for s in list(self._sessions.values())),
                             return_exceptions=True)
