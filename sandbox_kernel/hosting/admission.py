"""Admission of stateless runs, fair between tenants: places in flight and workers, per key.

A tenant is who a run is for: a native API key, or the dify route (one key for all of Dify).
Every tenant has a cap on its runs in flight (running or waiting: past it, Busy at once) and on
its runs executing; the service's MAX_REQUESTS and MAX_WORKERS bound them all together. By
default a tenant's cap is `fair_share` of the total: all of it while only one tenant exists,
else half, rounded up, so the others together always keep the rest.

Workers are handed out by fair queuing: when one frees, it goes to the waiting tenant with the
fewest runs executing (the longest-waiting among equals), never to one at its cap; a tenant's
own runs start in the order they came. With two tenants, one tenant's load never delays the
other's first run: it holds at most its cap, and the rest is free or the other's.

The caps sit around a run, not inside it: whatever kernel executes the run (a ZMQ kernel or a
one-shot kernel) is taken only once the run has its worker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator

DIFY_TENANT = "dify route"  # not a key id: those are tenants' own, prefixed (see tenant_of)


def tenant_of(key_id: str) -> str:
    """The tenant of a native API key (apart from the dify route, whatever the key's id)."""
    return f"key {key_id}"


def fair_share(total: int, tenants: int) -> int:
    """A tenant's default cap of a limit: all of it for one tenant, else half, rounded up."""
    return total if tenants <= 1 else max(1, -(-total // 2))


class Busy(Exception):
    """More runs are in flight than the service, or than this tenant's cap, admits."""

    def __init__(self, per_tenant: bool) -> None:
        super().__init__("the tenant's cap" if per_tenant else "the service's limit")
        self.per_tenant = per_tenant


class Admission:
    """Places in flight (MAX_REQUESTS, a cap per tenant) and workers (MAX_WORKERS, a cap per
    tenant, fair queuing between tenants)."""

    def __init__(self, max_requests: int, max_workers: int, requests_per_tenant: int,
                 workers_per_tenant: int) -> None:
        self.max_requests, self.max_workers = max_requests, max_workers
        self.requests_cap, self.workers_cap = requests_per_tenant, workers_per_tenant
        self.in_flight = 0
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._running: collections.Counter[str] = collections.Counter()
        self._waiting: dict[str, collections.deque[tuple[int, asyncio.Future[None]]]] = {}
        self._order = itertools.count()

    def in_flight_of(self, tenant: str) -> int:
        """The tenant's runs in flight (running or waiting for a worker)."""
        return self._in_flight[tenant]

    def running_of(self, tenant: str) -> int:
        """The tenant's runs holding a worker."""
        return self._running[tenant]

    def enter(self, tenant: str) -> Callable[[], None]:
        """Take an in-flight place for the tenant, or raise Busy; returns the (idempotent)
        release."""
        if self.in_flight >= self.max_requests:
            raise Busy(per_tenant=False)
        if self._in_flight[tenant] >= self.requests_cap:
            raise Busy(per_tenant=True)
        self.in_flight += 1
        self._in_flight[tenant] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1
                self._in_flight[tenant] -= 1
        return release

    @contextlib.contextmanager
    def slot(self, tenant: str) -> Iterator[None]:
        """Hold an in-flight place for the block; raises Busy when none is free."""
        release = self.enter(tenant)
        try:
            yield
        finally:
            release()

    @contextlib.asynccontextmanager
    async def worker(self, tenant: str) -> AsyncIterator[None]:
        """Wait for a worker as the tenant's fair turn comes, and hold it for the block."""
        if self._may_start(tenant) and not self._waiting.get(tenant):
            self._running[tenant] += 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            queue = self._waiting.setdefault(tenant, collections.deque())
            entry = (next(self._order), turn)
            queue.append(entry)
            try:
                await turn
            except BaseException:
                if turn.done() and not turn.cancelled():  # granted as it was cancelled
                    self._free(tenant)
                else:
                    queue.remove(entry)
                raise
        try:
            yield
        finally:
            self._free(tenant)

    def _may_start(self, tenant: str) -> bool:
        return sum(self._running.values()) < self.max_workers \
            and self._running[tenant] < self.workers_cap

    def _free(self, tenant: str) -> None:
        self._running[tenant] -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Give free workers to waiting tenants: fewest executing first, then longest waiting."""
        while True:
            ready = [(self._running[t], queue[0][0], t) for t, queue in self._waiting.items()
                     if queue and self._may_start(t)]
            if not ready:
                return
            _, _, tenant = min(ready)
            _, turn = self._waiting[tenant].popleft()
            self._running[tenant] += 1
            turn.set_result(None)
