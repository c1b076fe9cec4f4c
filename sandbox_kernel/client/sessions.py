"""Sessions: a kernel kept for one owner between calls, and the table that bounds them.

The service (an owner is an API key) and the MCP server (an API key, or its one stdio client)
keep sessions the same way: ids another owner's lookups cannot tell from unknown ones, a limit
for the whole table that counts kernels still starting, one per owner, and idle ones closed.
Each face subclasses both with what only it tracks, and words the table's answers (`None` for
an unknown id, `SessionLimit`) for its own callers.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Generic, TypeVar

from .sandbox import AsyncSandbox


@dataclass(eq=False)
class KernelSession:
    """One kernel kept for one owner; it runs one thing at a time (under `lock`)."""

    id: str
    owner: str
    sandbox: AsyncSandbox
    idle_timeout: float  # seconds idle before the table closes it; 0 for never
    _: KW_ONLY
    created: float = field(default_factory=time.time)  # wall clock, to show
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def busy(self) -> bool:
        """Running something now."""
        return self.lock.locked()

    def idle_seconds(self) -> float:
        """Seconds since its last call ended; 0 while busy."""
        return 0.0 if self.busy else time.monotonic() - self.last_used

    def spent(self) -> dict[str, float | None]:
        """What its kernel has spent so far in all, between and after executions too (for the
        faces' session descriptions: a figure a caller can bill; see Sandbox.total_usage)."""
        total = self.sandbox.total_usage()
        return {"cpu_user_seconds": total.cpu_user_seconds,
                "cpu_system_seconds": total.cpu_system_seconds,
                "egress_cpu_seconds": total.egress_cpu_seconds,
                "companion_cpu_seconds": total.companion_cpu_seconds}


class SessionLimit(Exception):
    """A new session would pass a limit: the table's (`per_owner` False) or its owner's."""

    def __init__(self, limit: int, per_owner: bool) -> None:
        super().__init__(f"{limit} sessions {'per owner' if per_owner else 'in all'}")
        self.limit, self.per_owner = limit, per_owner


S = TypeVar("S", bound=KernelSession)


class SessionTable(Generic[S]):
    """Every open session by id; an owner sees only its own."""

    id_bytes = 16  # random bytes in a session id

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._sessions: dict[str, S] = {}
        self._starting: dict[str, int] = {}  # per owner, sessions whose kernel is starting

    def __len__(self) -> int:
        return len(self._sessions)

    def all(self) -> list[S]:
        """Every open session."""
        return list(self._sessions.values())

    def owned_by(self, owner: str) -> list[S]:
        """The sessions this owner holds."""
        return [s for s in self._sessions.values() if s.owner == owner]

    def find(self, owner: str, session_id: str) -> S | None:
        """The owner's session of that id; None for another owner's, as for an unknown one."""
        session = self._sessions.get(session_id)
        return session if session is not None and session.owner == owner else None

    async def open(self, owner: str, owner_limit: int | None,
                   make: Callable[[str], Awaitable[S]], session_id: str | None = None) -> S:
        """A new session, `make(id)` (which starts its kernel); SessionLimit past a limit.

        session_id: the id of a session coming back (resumed from a pause), else a new one.
        """
        # Kernels still starting count too: requests sent at once must not all pass the check.
        starting = self._starting.get(owner, 0)
        if len(self._sessions) + sum(self._starting.values()) >= self.max_sessions:
            raise SessionLimit(self.max_sessions, per_owner=False)
        if owner_limit is not None and len(self.owned_by(owner)) + starting >= owner_limit:
            raise SessionLimit(owner_limit, per_owner=True)
        self._starting[owner] = starting + 1
        try:
            session = await make(session_id or secrets.token_hex(self.id_bytes))
        finally:
            self._starting[owner] -= 1
        self._sessions[session.id] = session
        return session

    def forget(self, session: S) -> None:
        """Drop the session from the table (its face shuts its kernel down)."""
        self._sessions.pop(session.id, None)

    def idle(self) -> list[S]:
        """The sessions idle past their idle timeout, to close."""
        now = time.monotonic()
        return [s for s in self._sessions.values()
                if not s.busy and s.idle_timeout > 0 and now - s.last_used > s.idle_timeout]
