"""Stateless runs: a worker from admission (admission.py), a fresh kernel each, a deadline.

A run gets a one-shot kernel (kernel/oneshot.py) from the fork server's pool of its network
policy: a process confined before the request came, that takes this one request and is gone
after (`OneShots`, oneshots.py). A run that needs what only a ZMQ kernel has (its own host
allowlist, which no pool's policy carries), or a service started with --one-shot-pool-size 0,
gets a fresh ZMQ kernel from the kernel source instead.

The deadline is the service's own: the kernel is asked to stop at `timeout` and the client
interrupts it a little later, but if neither works the service cancels the run at
`timeout + grace` and throws the kernel away (a one-shot kernel is killed through its pidfd).
Nothing the kernel does can hold a worker longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq
from starlette.requests import Request

from ..client import CallerLimits, Execution, oneshot
from ..client.collect import info_of
from ..errors import ExecutionTimeout, KernelUnavailable, OutputLimitExceeded, ServiceStopping
from ..launch.oneshot import OneShotPool, OneShotUnavailable
from .admission import Admission, Busy
from .kernels import Kernels, Network, kernel_id, policy_name
from .oneshots import OneShots

# Admission and Busy: where the routes import them; OneShots: where core.py does.
__all__ = ["Admission", "Busy", "OneShots", "Runner"]

T = TypeVar("T")


class KernelClosed(RuntimeError):
    """The kernel was shut down under a run (its session deleted, the service stopping): its
    sockets were closed, which ends the client's pending reads as if they were cancelled."""


class OutputBudget:
    """Bytes of output (streams and displays) one execution may still send the service.

    The kernel caps its own output, but user code can get around that; this cap is the service's.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.left = limit, limit

    def spend(self, payload: Any) -> None:
        """Take payload's size off the budget; OutputLimitExceeded once it is spent."""
        if isinstance(payload, str):
            size = len(payload)
        elif isinstance(payload, dict):
            size = sum(len(v) if isinstance(v, str) else len(json.dumps(v, default=str))
                       for v in payload.values())
        else:
            size = len(str(payload))
        self.left -= size
        if self.left < 0:
            raise OutputLimitExceeded(f"the execution sent more than {self.limit} bytes of output "
                              "(--max-output-total); the rest was dropped")


def output_limited(record: RunRecord, error: OutputLimitExceeded, state_lost: bool) -> Execution:
    """The execution a run gets when its output went past the service's limit."""
    return Execution(logs=list(record.chunks), state_lost=state_lost, error=info_of(error))


@dataclass
class RunRecord:
    """What a request learns about its run, for its log line and its answer."""

    kernel_id: str = ""
    chunks: list[dict[str, str]] = field(default_factory=list)


def service_timeout(timeout: float, record: RunRecord) -> Execution:
    """The execution a run gets when the service had to stop it."""
    message = (f"the execution ran past its {timeout:g} s limit and did not stop; the service "
               "shut its kernel down")
    return Execution(logs=list(record.chunks), state_lost=True,
                     error=info_of(ExecutionTimeout(message)))


def service_stopping(record: RunRecord) -> Execution:
    """The execution a run gets when the service shuts down before it ended."""
    message = ("the service is shutting down and the run did not end within its grace period; "
               "its kernel was shut down")
    return Execution(logs=list(record.chunks), state_lost=True,
                     error=info_of(ServiceStopping(message)))


async def bounded(run: Awaitable[Execution], timeout: float, grace: float,
                  record: RunRecord, stopping: asyncio.Event) -> tuple[Execution, bool]:
    """The run's execution, and whether the service had to end it: its own deadline, or the
    end of the shutdown grace period (`stopping`), each answered with an error, not a 500."""
    work = asyncio.ensure_future(run)
    stop = asyncio.ensure_future(stopping.wait())
    # The run is cancelled (its finally blocks kill a one-shot kernel) however this is left:
    # its deadline, the shutdown, or this caller cancelled (a client that went away).
    async with cancelled_on_exit(work):
        try:
            done, _ = await asyncio.wait({work, stop}, timeout=timeout + grace,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if work in done:
            if work.cancelled():  # not by this function: the kernel's sockets closed under it
                raise KernelClosed("the kernel was shut down during the run")
            return work.result(), False
    return (service_stopping(record) if stop in done else service_timeout(timeout, record)), True


class Runner:
    """Runs code on a fresh kernel per call: a one-shot kernel, or a ZMQ kernel."""

    def __init__(self, kernels: Kernels, admission: Admission, grace: float,
                 output_limit: int, one_shots: OneShots | None = None) -> None:
        self.kernels, self.admission, self.grace = kernels, admission, grace
        self.output_limit = output_limit
        self.one_shots = one_shots
        self.stopping = asyncio.Event()  # set when the shutdown grace period is over

    async def run(self, code: str, *, network: Network, timeout: float, tenant: str,
                  inputs: dict | None = None, record: RunRecord,
                  on_output: Callable[[str, Any], None] | None = None,
                  entrypoint: str = "main") -> tuple[Execution, bool]:
        """Wait for the tenant's worker, run on a fresh kernel, discard it. Needs an admission
        slot of the tenant's. With inputs, entrypoint(**inputs) is called after the code (the
        main() convention)."""
        pool = None if self.one_shots is None else self.one_shots.pool_for(network)
        if pool is not None:
            assert self.one_shots is not None
            async with self.admission.worker(tenant):
                return await self.run_one_shot(pool, self.one_shots.limits[bool(network)],
                                               code, network, timeout, inputs, record,
                                               on_output, entrypoint)
        async with self.admission.worker(tenant):
            sandbox = await self.kernels.get(network)
            record.kernel_id = kernel_id(sandbox)
            try:
                on = callbacks(record, OutputBudget(self.output_limit), on_output)
                return await bounded(
                    sandbox.run(code, inputs, timeout=timeout, on_stdout=on["stdout"],
                                on_stderr=on["stderr"], on_display=on["display"],
                                raw_result=True, entrypoint=entrypoint),
                    timeout, self.grace, record, self.stopping)
            except OutputLimitExceeded as exc:
                return output_limited(record, exc, state_lost=True), False
            except zmq.ZMQError as exc:  # e.g. a send no peer takes (see client._never_waiting)
                raise KernelUnavailable(f"the connection to the {policy_name(network)} kernel "
                                        f"failed: {exc}") from exc
            finally:
                self.kernels.discard(sandbox)  # also when the client went away mid-run

    async def run_one_shot(self, pool: OneShotPool, limits: CallerLimits, code: str,
                           network: Network, timeout: float, inputs: dict | None,
                           record: RunRecord, on_output: Callable[[str, Any], None] | None,
                           entrypoint: str) -> tuple[Execution, bool]:
        """The run on a one-shot kernel of the pool; it is killed whenever the run ends."""
        record.kernel_id = "one-shot"
        on = callbacks(record, OutputBudget(self.output_limit), on_output)
        try:
            return await bounded(
                oneshot.run(pool, code, inputs, timeout, on_stdout=on["stdout"],
                            on_stderr=on["stderr"], on_display=on["display"], limits=limits,
                            raw_result=True, grace=self.grace, entrypoint=entrypoint),
                timeout, self.grace, record, self.stopping)
        except OutputLimitExceeded as exc:
            return output_limited(record, exc, state_lost=True), False
        except OneShotUnavailable as exc:
            raise KernelUnavailable(f"no {policy_name(network)} one-shot kernel: {exc}") from exc


def callbacks(record: RunRecord, budget: OutputBudget,
              on_output: Callable[[str, Any], None] | None) -> dict[str, Callable[[Any], None]]:
    """Keep stream chunks (for a run the service must cut short), count output against the
    budget (raising OutputLimitExceeded out of the client's run), and pass output on."""
    def stream(name: str) -> Callable[[Any], None]:
        def receive(text: Any) -> None:
            budget.spend(text)
            record.chunks.append({"name": name, "text": text})
            if on_output:
                on_output(name, text)
        return receive

    def display(bundle: Any) -> None:
        budget.spend(bundle)
        if on_output:
            on_output("display", bundle)

    return {"stdout": stream("stdout"), "stderr": stream("stderr"), "display": display}


async def _disconnected(request: Request) -> None:
    """Return when the client has gone away (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def client_left(request: Request, task: asyncio.Future[Any]) -> bool:
    """Wait until task is done or the client has gone away; True if the client left first
    (the task is left running: the caller decides whether to cancel it)."""
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    return not task.done()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run work; cancel it (its finally blocks free the kernel) if the client disconnects.

    Only for work whose kernel is thrown away after: cancelling a kernel's client half-way
    (e.g. through a restart) leaves it unusable.
    """
    task = asyncio.ensure_future(work)
    try:
        if not await client_left(request, task):
            return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None


@contextlib.asynccontextmanager
async def cancelled_on_exit(task: asyncio.Task[Any]) -> AsyncIterator[asyncio.Task[Any]]:
    """Cancel the task if the block is left before it finished (e.g. an SSE client left)."""
    try:
        yield task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
