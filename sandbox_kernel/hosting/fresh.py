"""The fresh run: a worker from admission (admission.py), a fresh kernel, a deadline, an
output budget; the one place that decides which kernel runs it.

The rule, for both faces: a run gets a one-shot kernel (kernel/oneshot.py) from the fork
server's pool of its network policy — a process confined before the request came, that takes
this one request and is gone after — when that policy has a pool and the pool can be had
(oneshots.py: not for a run's own host allowlist, a policy with credentials, --one-shot-pool-size
0 or --cold-start). Otherwise, and when no one-shot kernel took the request (nothing of it ran),
it runs on a fresh ZMQ kernel from the kernel source, once.

The deadline is the host's own: the kernel is asked to stop at `timeout` and the client
interrupts it a little later, but if neither works the run is cancelled at `timeout + grace`
and the kernel thrown away (a one-shot kernel is killed through its pidfd). Nothing the kernel
does can hold a worker longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..client import AsyncSandbox, Execution, oneshot
from ..client.collect import info_of
from ..client.tools import Toolbox
from ..errors import ExecutionTimeout, KernelUnavailable, OutputLimitExceeded, ServiceStopping
from ..launch.oneshot import OneShotPool, OneShotUnavailable
from .admission import Admission
from .events import json_line, log
from .network import Network, policy_name, split
from .oneshots import OneShots
from .sources import Kernels, kernel_id


class KernelClosed(RuntimeError):
    """The kernel was shut down under a run (its session deleted, the service stopping): its
    sockets were closed, which ends the client's pending reads as if they were cancelled."""


class OutputBudget:
    """Bytes of output (streams and displays) one execution may still send the service.

    The kernel caps its own output, but user code can get around that; this cap is the service's.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit, self.left = limit, limit

    def spend(self, payload: Any) -> None:
        """Take payload's size off the budget; OutputLimitExceeded once it is spent."""
        if self.limit is None or self.left is None:
            return
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
    """What a caller learns about its run as it goes, for its log line, its answer, and to
    interrupt it: the kernel it runs on (a ZMQ kernel's `sandbox`, or the one-shot's handle,
    given by a caller that wants the files the run wrote kept: kernel/file_ops.py's request)."""

    kernel_id: str = ""
    chunks: list[dict[str, str]] = field(default_factory=list)
    sandbox: AsyncSandbox | None = None
    one_shot: oneshot.RunHandle | None = None
    on_one_shot: bool = False  # whether a one-shot kernel ran it (its handle has the files)
    preloaded: tuple[str, ...] = ()  # what the one-shot's zygote preloaded (launch/imports.py)

    async def interrupt(self) -> None:
        """Interrupt the run's code, on whichever kernel it runs."""
        if self.on_one_shot and self.one_shot is not None:
            self.one_shot.interrupt()
        elif self.sandbox is not None:
            await self.sandbox.interrupt()


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
    """Runs code on a fresh kernel per call: a one-shot kernel, else a ZMQ kernel."""

    def __init__(self, kernels: Kernels, admission: Admission, grace: float,
                 output_limit: int | None, one_shots: OneShots | None = None) -> None:
        self.kernels, self.admission, self.grace = kernels, admission, grace
        self.output_limit = output_limit  # bytes of output one run may send (None: no cap)
        self.one_shots = one_shots
        self.stopping = asyncio.Event()  # set when the shutdown grace period is over

    async def run(self, code: str, *, network: Network, timeout: float, tenant: str,
                  inputs: dict | None = None, record: RunRecord,
                  on_output: Callable[[str, Any], None] | None = None,
                  entrypoint: str = "main", raw_result: bool = True,
                  keep: Callable[[AsyncSandbox, Execution], Awaitable[None]] | None = None,
                  tools: Toolbox | None = None) -> tuple[Execution, bool]:
        """Wait for the tenant's worker, run on a fresh kernel, discard it; the execution, and
        whether the host had to end it. Needs an admission slot of the tenant's. With inputs,
        entrypoint(**inputs) is called after the code (the main() convention). keep: what to
        read from a ZMQ kernel before it is discarded (the files it wrote), unless it was lost.
        tools: what the run grants `sandbox_tools` (client/tools.py; a face's declared tools:
        tools.py), served on this loop on either kind of kernel.
        """
        budget = OutputBudget(self.output_limit)
        async with self.admission.worker(tenant):
            pool = await self._one_shot_pool(network, code)
            if pool is not None:
                try:
                    return await self.run_one_shot(code, network, timeout, inputs, record,
                                                   budget, on_output, entrypoint, raw_result,
                                                   tools, pool)
                except OneShotUnavailable as exc:  # nothing ran: a ZMQ kernel runs it
                    log.warning(json_line(event="one_shot_not_taken", error=str(exc),
                                          policy=policy_name(network)))
            return await self.run_on_kernel(code, network, timeout, inputs, record, budget,
                                            on_output, entrypoint, raw_result, keep, tools)

    async def _one_shot_pool(self, network: Network, code: str) -> OneShotPool | None:
        """The one-shot pool this run takes (its preload set's, chosen from its code), or None
        when it runs on a ZMQ kernel."""
        one_shots = self.one_shots
        if one_shots is None or one_shots.pool_for(network) is None \
                or not await one_shots.had(split(network)[0]):
            return None
        return one_shots.pool_for(network, code)

    async def run_on_kernel(self, code: str, network: Network, timeout: float,
                            inputs: dict | None, record: RunRecord, budget: OutputBudget,
                            on_output: Callable[[str, Any], None] | None, entrypoint: str,
                            raw_result: bool,
                            keep: Callable[[AsyncSandbox, Execution], Awaitable[None]] | None,
                            tools: Toolbox | None = None) -> tuple[Execution, bool]:
        """The run on a fresh ZMQ kernel, discarded whenever the run ends."""
        sandbox = record.sandbox = await self.kernels.get(network)
        record.kernel_id = kernel_id(sandbox)
        try:
            on = callbacks(record, budget, on_output)
            execution, lost = await bounded(
                sandbox.run(code, inputs, timeout=timeout, on_stdout=on["stdout"],
                            on_stderr=on["stderr"], on_display=on["display"],
                            raw_result=raw_result, entrypoint=entrypoint, tools=tools),
                timeout, self.grace, record, self.stopping)
            if keep is not None and not (lost or execution.state_lost):
                await keep(sandbox, execution)
            return execution, lost
        except OutputLimitExceeded as exc:
            return output_limited(record, exc, state_lost=True), False
        except zmq.ZMQError as exc:  # e.g. a send no peer takes (see client._never_waiting)
            raise KernelUnavailable(f"the connection to the {policy_name(network)} kernel "
                                    f"failed: {exc}") from exc
        finally:
            self.kernels.discard(sandbox)  # also when the caller went away mid-run

    async def run_one_shot(self, code: str, network: Network, timeout: float,
                           inputs: dict | None, record: RunRecord, budget: OutputBudget,
                           on_output: Callable[[str, Any], None] | None, entrypoint: str,
                           raw_result: bool, tools: Toolbox | None = None,
                           pool: OneShotPool | None = None,
                           ) -> tuple[Execution, bool]:
        """The run on a one-shot kernel of the pool given (default: the network's lean pool),
        killed whenever the run ends; OneShotUnavailable when none took it."""
        assert self.one_shots is not None
        allowed = split(network)[0]
        pool = pool or self.one_shots.pools[allowed]
        record.kernel_id, record.on_one_shot = "one-shot", True
        record.preloaded = tuple(pool.preload)
        on = callbacks(record, budget, on_output)
        try:
            return await bounded(
                oneshot.run(pool, code, inputs, timeout, on_stdout=on["stdout"],
                            on_stderr=on["stderr"], on_display=on["display"],
                            limits=self.one_shots.limits[allowed], raw_result=raw_result,
                            grace=self.grace, entrypoint=entrypoint, handle=record.one_shot,
                            tools=tools if tools is not None and tools.tools else None,
                            owner=record),
                timeout, self.grace, record, self.stopping)
        except OutputLimitExceeded as exc:
            return output_limited(record, exc, state_lost=True), False
        except OneShotUnavailable:
            record.kernel_id, record.on_one_shot = "", False
            raise


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
