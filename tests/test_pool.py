"""Warm pools: started kernels handed out once each, refilled in the background."""

import asyncio

import pytest

from sandbox_kernel.launch.pool import KernelPool, PoolClosed, PoolStartError, SandboxPool

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
