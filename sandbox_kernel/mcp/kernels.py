"""Kernels for the MCP server: fresh ones for each call, and sessions that keep one.

A call without a session runs on a one-shot kernel (kernel/oneshot.py: a process of the fork
server's pool for its network setting, confined before the call and gone after it); with
--one-shot-pool-size 0, --cold-start or credentials in the policy, on a ZMQ kernel no one used
(launch/pool.py keeps some started), closed after the call. A session holds one kernel for one
owner (the API key over HTTP, the one client over stdio); another owner's session ids are
unknown to it, so ids cannot be probed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..client import AsyncSandbox, CallerLimits
from ..client.sessions import KernelSession, SessionLimit, SessionTable
from ..launch.forkserver import ForkServerClient
from ..launch.oneshot import OneShotPool, OneShotUnavailable
from ..launch.pool import KernelPool, start_sandbox
from ..policy import SandboxPolicy
from ..service.oneshots import OneShots
from .config import McpConfig

log = logging.getLogger("sandbox_kernel.mcp")


class SessionProblem(Exception):
    """A session request that cannot be carried out; the message is for a model."""


def _with_network(base: SandboxPolicy, network: bool) -> SandboxPolicy:
    values = {**base.as_dict(), "allow_network": network}
    if not network:  # the operator's secrets are for kernels with the network only
        values.update(secrets=[], secrets_file="")
    return SandboxPolicy(**values)


class KernelSource:
    """Started, never-used kernels per network setting, from a warm pool when one is ready."""

    def __init__(self, config: McpConfig) -> None:
        self.config = config
        self.pools: dict[bool, KernelPool] = {}
        self.one_shots: OneShots | None = None
        self._asking: dict[bool, asyncio.Future[bool]] = {}
        self.python, self.preload = sys.executable, list(config.preload)
        if config.runtime:  # its current build, its own modules preloaded too
            from ..runtimes import find

            record = find(config.runtime)
            self.python = str(record.python())
            self.preload = list(dict.fromkeys([*record.preload, *config.preload]))
        if config.one_shot_pool_size > 0 and not config.cold_start:
            self.one_shots = OneShots({network: self.options(network) for network in (False, True)},
                                      config.one_shot_pool_size)

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
        """Begin filling the pools of the default kernels (those of the policy as given)."""
        self._pool(self.config.policy.allow_network)
        if self.one_shots is not None:  # asked for now, so that the first run finds it full
            self._asking[self.config.policy.allow_network] = asyncio.ensure_future(
                self._ask_one_shot(self.one_shots, self.config.policy.allow_network))

    async def one_shot(self, network: bool) -> tuple[OneShotPool, CallerLimits] | None:
        """The pool of one-shot kernels for runs without a session, and what their caller
        accepts; None when those runs take a ZMQ kernel (no pool, or it could not be had)."""
        if self.one_shots is None or network not in self.one_shots.pools:
            return None
        if network not in self._asking:
            self._asking[network] = asyncio.ensure_future(
                self._ask_one_shot(self.one_shots, network))
        if not await asyncio.shield(self._asking[network]):
            return None
        return self.one_shots.pools[network], self.one_shots.limits[network]

    @staticmethod
    async def _ask_one_shot(one_shots: OneShots, network: bool) -> bool:
        """Ask the fork server for the pool, once: one that cannot be had is not asked for
        again, the log says why, and the runs take ZMQ kernels."""
        pool = one_shots.pools[network]
        try:
            pool.path = await asyncio.to_thread(pool.ask)
            return True
        except OneShotUnavailable as exc:
            log.warning("no one-shot kernels with the network %s (%s): runs without a session "
                        "take a ZMQ kernel each", "on" if network else "off", exc)
            return False

    async def get(self, network: bool, secrets: Mapping[str, Any] | None = None
                  ) -> AsyncSandbox:
        """A started kernel of its own for the caller, who closes it (with the caller's own
        secrets: started for it, never pooled)."""
        pool = None if secrets else self._pool(network)
        if pool is not None:
            return await pool.get_soonest()
        return await start_sandbox(**self.options(network),
                                   **({"secrets": secrets} if secrets else {}))

    async def close(self) -> None:
        """Close the pools and end the fork server their kernels came from."""
        for asking in self._asking.values():
            asking.cancel()
        await asyncio.gather(*(pool.close() for pool in self.pools.values()),
                             *self._asking.values(), return_exceptions=True)
        if not self.config.cold_start:
            ForkServerClient(python=self.python, preload=tuple(self.preload)).stop_server()


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

    def __init__(self, config: McpConfig, source: KernelSource) -> None:
        super().__init__(config.max_sessions)
        self.config = config
        self.source = source

    async def create(self, owner: str, network: bool, owner_limit: int | None,
                     secrets: Mapping[str, Any] | None = None) -> Session:
        """A new session on a fresh kernel, within the server's and the owner's limits;
        secrets: the caller's own, for its kernel alone (never described back)."""
        async def make(session_id: str) -> Session:
            kernel = await self.source.get(network, **({"secrets": secrets} if secrets else {}))
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
        with contextlib.suppress(Exception):
            await session.sandbox.close(now=True)

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
