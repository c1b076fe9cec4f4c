"""Warm pools: started kernels handed out once each, refilled in the background."""

import asyncio

import pytest

from sandbox_kernel.hosting.pool import KernelPool, PoolClosed, PoolStartError, SandboxPool

from .helpers import evaluate

PID = "import os; os.getpid()"


def test_async_pool_hands_each_kernel_out_once_and_refills():
    async def scenario():
        async with KernelPool(size=2) as pool:
            taken = [await pool.get() for _ in range(3)]  # more than it holds: it refills
            pids = [(await sb.run(PID)).text for sb in taken]
            kernels = [sb.manager.provisioner.process for sb in taken]
            for sb in taken:
                await sb.close()
            while pool.ready < 2:
                await asyncio.sleep(0.1)
            waiting = [sb.manager.provisioner.process for sb in list(pool._ready._queue)]
        with pytest.raises(PoolClosed):
            await pool.get()
        return pids, kernels, waiting

    pids, kernels, waiting = asyncio.run(scenario())
    assert len(set(pids)) == 3
    assert all(kernel.poll() is not None for kernel in kernels + waiting)  # close() ended them


def test_sync_pool_hands_out_started_private_kernels():
    with SandboxPool(size=1) as pool:
        first = pool.get(timeout=120)
        second = pool.get(timeout=120)
        try:
            assert first is not second
            a = evaluate(first, "import os; (os.getpid(), os.getcwd())")
            b = evaluate(second, "import os; (os.getpid(), os.getcwd())")
            assert a[0] != b[0] and a[1] != b[1]
        finally:
            first.close()
            second.close()
        while pool.ready < 1:
            pool._wanted.wait(0.1)
        spare = pool._ready.queue[0].manager.provisioner.process
    assert spare.poll() is not None
    with pytest.raises(PoolClosed):
        pool.get()


def test_pool_settings_are_checked():
    with pytest.raises(ValueError, match="refill_delay is a number of seconds >= 0"):
        KernelPool(size=1, refill_delay=-1)
    with pytest.raises(ValueError, match="at least one kernel"):
        SandboxPool(size=0)
    with pytest.raises(ValueError, match="parallel is at least one kernel, not 0"):
        KernelPool(size=1, parallel=0)


def test_a_kernel_that_cannot_start_is_reported_to_the_taker():
    async def scenario():
        async with KernelPool(size=1, kernel_name="no-such-kernelspec") as pool:
            with pytest.raises(PoolStartError, match="no-such-kernelspec"):
                await pool.get()
            with pytest.raises(PoolStartError):  # and again: the pool keeps trying
                await pool.get()

    asyncio.run(scenario())
    with SandboxPool(size=1, kernel_name="no-such-kernelspec") as pool, \
            pytest.raises(PoolStartError, match="no-such-kernelspec"):
        pool.get(timeout=60)


def test_options_a_sandbox_refuses_reach_the_taker():
    # preload without kernel_name=None names both a kernelspec ("sandbox") and start options:
    # the taker hears why, where it used to wait for ever (the pool's task died unseen).
    async def scenario():
        async with KernelPool(size=1, preload=["json"]) as pool:
            with pytest.raises(PoolStartError, match="give either kernel_name"):
                await asyncio.wait_for(pool.get(), 60)

    asyncio.run(scenario())
    with SandboxPool(size=1, preload=["json"]) as pool, \
            pytest.raises(PoolStartError, match="give either kernel_name"):
        pool.get(timeout=60)


# What user code can see of a kernel's past: its execution count, history, namespace, output
# cache, last result, compiled cells, loaded modules, garbage-collector state and IOPub/shell
# leftovers (the reply's execution_count). Run as the first code in each kernel compared.
FINGERPRINT = """\
import gc, linecache, sys
from ipykernel.compiler import get_tmp_directory
ip = get_ipython()
hidden = set(ip.user_ns_hidden)
cells = get_tmp_directory()
(ip.execution_count,
 list(ip.history_manager.input_hist_raw), list(ip.history_manager.input_hist_parsed),
 sorted(name for name in ip.user_ns if name not in hidden), sorted(hidden),
 len(ip.user_ns["Out"]), repr(ip.user_ns.get("_")), repr(ip.user_ns.get("_i")),
 ip.last_execution_result is None, ip.last_execution_succeeded,
 sorted("".join(entry[2]) for name, entry in list(linecache.cache.items())
        if name.startswith(cells) and len(entry) > 2),
 sorted(ip.compile._filename_map.values()), sorted(sys.modules), gc.isenabled())
"""


def _first_look(execution):
    import ast
    import gc

    from .helpers import ok

    ok(execution)
    # CPython 3.11 raises SystemError ("AST constructor recursion depth mismatch") when a
    # collection runs finalizers in the middle of building the tree: the kernels' clients
    # and managers closed just before are collected, so no collection may start meanwhile.
    gc.disable()
    try:
        return ast.literal_eval(execution.text)
    finally:
        gc.enable()


def test_a_pool_kernel_is_indistinguishable_from_a_fresh_one():
    """Pools and an explicit warm-up leave nothing user code could see: the same first look."""
    from sandbox_kernel.client import Sandbox

    with Sandbox() as fresh:
        expected = _first_look(fresh.run(FINGERPRINT))
    with Sandbox() as warmed:
        warmed.warm_up()
        assert _first_look(warmed.run(FINGERPRINT)) == expected

    async def from_pool():
        async with KernelPool(size=1) as pool:
            sandbox = await pool.get()
            try:
                return _first_look(await sandbox.run(FINGERPRINT))
            finally:
                await sandbox.close()

    assert asyncio.run(from_pool()) == expected
    with SandboxPool(size=1) as pool:
        sandbox = pool.get(timeout=120)
        try:
            assert _first_look(sandbox.run(FINGERPRINT)) == expected
        finally:
            sandbox.close()


def _kernels_of(server_pid):
    """Live kernels forked by the fork server (none without one)."""
    from .service.helpers import children

    return children(server_pid) if server_pid else set()


@pytest.mark.parametrize("wait", [0.0, 0.03, 0.08])
def test_closing_a_refilling_pool_leaves_no_kernel_behind(wait):
    """close() cancels a refill wherever it is (before, during or after the start): the
    kernel that was starting is shut down, not left running."""
    import time

    from sandbox_kernel.launch import forkserver

    async def scenario():
        pool = KernelPool(size=1, refill_delay=0)
        pool.start()
        while pool.ready < 1:
            await asyncio.sleep(0.02)
        taken = await pool.get()  # the replacement starts now
        await taken.close()
        await asyncio.sleep(wait)
        await pool.close()

    before = _kernels_of(forkserver.ForkServerClient().server_pid())
    asyncio.run(scenario())
    server = forkserver.ForkServerClient().server_pid()
    assert server is not None  # the tests' kernelspec is fork-served
    deadline = time.monotonic() + 20
    while (left := _kernels_of(server) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left


def test_a_kernel_starting_unclaimed_is_coming_and_goes_to_the_next_taker():
    """`coming` counts a kernel half-way through its start until a get() claims it; the pool
    then starts its own replacement beside it, without waiting for the first to finish."""
    async def scenario():
        async with KernelPool(size=1, refill_delay=0, parallel=2) as pool:
            while pool.ready < 1:
                await asyncio.sleep(0.02)
            first = await pool.get()  # the replacement starts now
            while pool._starting < 1:
                await asyncio.sleep(0.001)
            coming_while_starting = pool.coming
            taker = asyncio.ensure_future(pool.get())
            while pool._starting < 2 and not taker.done():
                await asyncio.sleep(0.001)
            side_by_side = pool._starting
            second = await taker  # the first start in flight, claimed by the taker
            pids = [(await sb.run(PID)).text for sb in (first, second)]
            for sb in (first, second):
                await sb.close(now=True)
            while pool.ready < 1:  # the replacement started beside it stays the pool's
                await asyncio.sleep(0.02)
            return coming_while_starting, side_by_side, pids

    coming_while_starting, side_by_side, pids = asyncio.run(scenario())
    assert (coming_while_starting, side_by_side) == (1, 2)
    assert len(set(pids)) == 2


def test_the_service_takes_the_pools_starting_kernel_instead_of_starting_another(monkeypatch):
    """A run that finds the pool's next kernel starting waits for it: no second start."""
    from sandbox_kernel.hosting import pool as pools
    from sandbox_kernel.hosting import sources as kernels
    from sandbox_kernel.policy import SandboxPolicy

    on_demand = []
    original = pools.start_sandbox

    async def counted(**options):
        on_demand.append(options)
        return await original(**options)

    monkeypatch.setattr(pools, "start_sandbox", counted)  # what get_soonest starts on demand

    async def scenario():
        source = kernels.make_source(SandboxPolicy(), (False,), pool_size=1, grace=5.0)
        pool = source.pools[False]
        await source.start()
        try:
            while pool.ready < 1:
                await asyncio.sleep(0.02)
            first = await source.get(False)
            while pool._starting < 1:  # the refill, after its pause
                await asyncio.sleep(0.001)
            second = await source.get(False)
            for sb in (first, second):
                await sb.close(now=True)
        finally:
            await pool.close()

    asyncio.run(scenario())
    assert on_demand == []
