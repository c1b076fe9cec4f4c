"""The session bookkeeping the service and the MCP server share (client/sessions.py): its limits,
owners' privacy and idle sessions, without kernels (the table never touches its sessions' kernels;
tests/service/test_sessions.py and tests/test_mcp.py drive it with real ones)."""

from __future__ import annotations

import asyncio
import time

import pytest

from sandbox_kernel.client.sessions import KernelSession, SessionLimit, SessionTable

KERNEL = object()  # stands for the AsyncSandbox, which the table only stores


def _maker(owner: str, idle_timeout: float = 60.0, started: asyncio.Event | None = None):
    async def make(session_id: str) -> KernelSession:
        if started is not None:
            await started.wait()  # the kernel is still starting
        return KernelSession(session_id, owner, KERNEL, idle_timeout)
    return make


def test_the_limit_counts_sessions_whose_kernel_is_still_starting():
    async def scenario():
        table: SessionTable[KernelSession] = SessionTable(max_sessions=1)
        started = asyncio.Event()
        first = asyncio.ensure_future(table.open("a", None, _maker("a", started=started)))
        await asyncio.sleep(0)
        with pytest.raises(SessionLimit) as refused:
            await table.open("b", None, _maker("b"))
        started.set()
        return refused.value, await first, len(table)

    refused, first, held = asyncio.run(scenario())
    assert (refused.limit, refused.per_owner) == (1, False)
    assert first.owner == "a" and held == 1


def test_an_owner_past_its_limit_is_refused_and_others_are_not():
    async def scenario():
        table: SessionTable[KernelSession] = SessionTable(max_sessions=10)
        await table.open("a", 1, _maker("a"))
        with pytest.raises(SessionLimit) as refused:
            await table.open("a", 1, _maker("a"))
        other = await table.open("b", 1, _maker("b"))
        return refused.value, other, table

    refused, other, table = asyncio.run(scenario())
    assert (refused.limit, refused.per_owner) == (1, True)
    assert [s.owner for s in table.owned_by("a")] == ["a"] and table.owned_by("b") == [other]


def test_a_kernel_that_fails_to_start_leaves_no_place_taken():
    async def failing(session_id: str) -> KernelSession:
        raise RuntimeError("the kernel did not start")

    async def scenario():
        table: SessionTable[KernelSession] = SessionTable(max_sessions=1)
        with pytest.raises(RuntimeError):
            await table.open("a", None, failing)
        return await table.open("a", None, _maker("a")), table

    session, table = asyncio.run(scenario())
    assert table.all() == [session]


def test_another_owners_id_is_answered_as_an_unknown_one():
    async def scenario():
        table: SessionTable[KernelSession] = SessionTable(max_sessions=2)
        return await table.open("a", None, _maker("a")), table

    session, table = asyncio.run(scenario())
    assert len(session.id) == 2 * SessionTable.id_bytes
    assert table.find("a", session.id) is session
    assert table.find("b", session.id) is None
    assert table.find("b", "0" * len(session.id)) is None
    table.forget(session)
    assert table.find("a", session.id) is None and len(table) == 0


def test_idle_lists_sessions_past_their_timeout_but_not_busy_or_timeless_ones():
    async def scenario():
        table: SessionTable[KernelSession] = SessionTable(max_sessions=4)
        idle = await table.open("a", None, _maker("a", idle_timeout=5))
        busy = await table.open("a", None, _maker("a", idle_timeout=5))
        timeless = await table.open("a", None, _maker("a", idle_timeout=0))
        await table.open("a", None, _maker("a", idle_timeout=5))  # just used
        for session in (idle, busy, timeless):
            session.last_used = time.monotonic() - 10
        await busy.lock.acquire()
        return table.idle(), idle, busy

    found, idle, busy = asyncio.run(scenario())
    assert found == [idle]
    assert busy.busy and busy.idle_seconds() == 0.0 and idle.idle_seconds() >= 10


def test_an_owners_limit_counts_its_sessions_still_starting():
    async def scenario():
        table: SessionTable[KernelSession] = SessionTable(max_sessions=10)
        started = asyncio.Event()
        first = asyncio.ensure_future(table.open("a", 1, _maker("a", started=started)))
        await asyncio.sleep(0)
        with pytest.raises(SessionLimit) as refused:  # sent while the first still starts
            await table.open("a", 1, _maker("a"))
        other = await table.open("b", 1, _maker("b"))
        started.set()
        return refused.value, await first, other

    refused, first, other = asyncio.run(scenario())
    assert (refused.limit, refused.per_owner) == (1, True)
    assert (first.owner, other.owner) == ("a", "b")
