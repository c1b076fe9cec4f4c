"""Where fresh ZMQ kernels come from, and the record of every kernel a face holds.

`KernelSource` is the one seam between a face and the ways to get a kernel: `get(network)`
returns a started AsyncSandbox of that network policy that no one has used. `PoolSource` takes
them from warm pools (`KernelPool`, pool.py), one per network policy; `make_source` builds it
for the service and the MCP server alike (network policies by hosting/network.py's rule).

`Kernels` wraps the source: it bounds the wait for a kernel, counts the kernels out, kills them
in the background so an answer never waits for a shutdown, and at shutdown closes them all.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ..client import AsyncSandbox
from ..errors import KernelUnavailable
from ..launch.forkserver import ForkServerClient
from ..launch.imports import PreloadSets
from ..policy import SandboxPolicy
from ..secrets import SecretError
from .events import json_line, log
from .network import Network, policy_name, split, with_network
from .pool import KernelPool, start_sandbox


class KernelSource(Protocol):
    """Hands out started, never-used kernels."""

    async def start(self) -> None:
        """Begin filling (may return before any kernel is ready)."""

    async def get(self, network: Network, **extra: Any) -> AsyncSandbox:
        """A started kernel of that network setting (extra: more AsyncSandbox options, e.g. a
        snapshot to restore or the caller's own secrets); raises RuntimeError if none can start."""

    def ready(self) -> dict[str, int]:
        """Started kernels waiting to be handed out, per policy name ("offline", "network")."""

    def health(self) -> dict[str, dict[str, Any]]:
        """Per policy name: whether its kernels start here ("started") and, if its latest
        start failed, why ("error")."""

    async def close(self) -> None:
        """Shut down every kernel not handed out."""


@dataclass
class Starts:
    """The latest kernel starts of one policy without a pool: readiness rests on them."""

    started: bool = False  # a kernel of the policy started and answered
    error: str = ""  # why the latest start failed; "" once one started after it

    def note(self, error: BaseException | None) -> None:
        """Record a start's outcome (None: it started)."""
        self.started = self.started or error is None
        self.error = "" if error is None else str(error) or type(error).__name__


class PoolSource:
    """Kernels from a warm pool per network policy (pool.py), else started on demand.

    A run takes the pool's kernel when one is ready or already starting unclaimed (it comes
    sooner than a new one). Otherwise the kernel is started here with the pool's own options
    rather than waiting behind other runs for the refill, so a burst of runs starts kernels
    side by side. Without a pool (--pool-size 0) one kernel per policy is started at once and
    closed again, and started again every PROBE_RETRY seconds until one has started: the proof
    /ready waits for (`probe`; the MCP server has no /ready and starts none).

    `filled`: the policies whose pools fill from the start (all by default); another's pool
    fills from its first kernel asked for.
    """

    PROBE_RETRY = 2.0

    def __init__(self, options: dict[bool, dict[str, Any]], pool_size: int,
                 filled: Iterable[bool] | None = None, probe: bool = True) -> None:
        self.options = options  # AsyncSandbox's keyword arguments, per network policy
        # A runtime's preloads as sets, for the one-shot pools (oneshots.py), or None
        self.preload_sets: PreloadSets | None = None
        self.build = 0  # the runtime's build its kernels run on (0: no runtime)
        self.pools = {network: KernelPool(pool_size, **kwargs)
                      for network, kwargs in options.items()} if pool_size > 0 else {}
        self.filled = set(options if filled is None else filled)
        self.starts = {network: Starts() for network in options if network not in self.pools}
        self.probe = probe
        self._probes: set[asyncio.Task[None]] = set()
        self.diagnoses: dict[bool, str] = {}  # per policy, once a start failed: check's words

    async def start(self) -> None:
        """Start filling the pools, and prove the policies without one."""
        for network, pool in self.pools.items():
            if network in self.filled:
                pool.start()
        for network in self.starts if self.probe else ():
            probe = asyncio.get_running_loop().create_task(self._probe(network))
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)

    async def _probe(self, network: bool) -> None:
        """Start (and close) a kernel of the policy until one has started."""
        record = self.starts[network]
        while not record.started:
            try:
                sandbox = await start_sandbox(**self.options[network])
            except Exception as exc:
                record.note(exc)
                log.warning(json_line(event="kernel_start_failed",
                                      policy=policy_name(network), error=record.error))
                await asyncio.sleep(self.PROBE_RETRY)
                continue
            record.note(None)
            await sandbox.close(now=True)

    async def get(self, network: Network, **extra: Any) -> AsyncSandbox:
        """A started kernel for that network: a pooled one when there is a pool, else a new one.

        extra: more AsyncSandbox options (a snapshot to restore, the caller's own secrets):
        such a kernel is started for its caller, never pooled.
        """
        allowed, hosts = split(network)
        if allowed not in self.options:
            raise RuntimeError(f"no {policy_name(network)} kernels are configured")
        options = {**self.options[allowed], **extra}
        pool = None if extra else self.pools.get(allowed)
        if hosts is not None:  # an allowlist of the caller's: started for it, never pooled
            pool = None
            options = {**options, "policy": with_network(options["policy"], True, hosts=hosts)}
        if pool is not None:
            pool.start()  # a policy not filled from the start fills from now
            return await pool.get_soonest()
        if hosts is not None or extra:  # the caller's choice, not the policy, might be what fails
            return await start_sandbox(**options)
        try:
            sandbox = await start_sandbox(**options)
        except Exception as exc:
            self.starts[allowed].note(exc)
            raise
        self.starts[allowed].note(None)
        return sandbox

    def ready(self) -> dict[str, int]:
        """How many kernels of each kind are ready now."""
        return {policy_name(network): self.pools[network].ready if network in self.pools else 0
                for network in self.options}

    def health(self) -> dict[str, dict[str, Any]]:
        """Per policy: started (a kernel of it has, and the latest start did not fail), and
        the latest start's error, with what `check` finds missing for it (once known). A
        pool's own starts speak for a pooled policy."""
        found = {}
        for network in self.options:
            pool = self.pools.get(network)
            started, error = ((pool.started > 0, pool.last_error) if pool is not None
                              else (self.starts[network].started, self.starts[network].error))
            if error:
                error += self._diagnosis(network)
            found[policy_name(network)] = {"started": started and not error, "error": error}
        return found

    def _diagnosis(self, network: bool) -> str:
        """What `check` says this policy misses ("" until known; asked once per policy)."""
        if network not in self.diagnoses:
            self.diagnoses[network] = ""
            task = asyncio.get_running_loop().create_task(self._diagnose(network))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
        return self.diagnoses[network]

    async def _diagnose(self, network: bool) -> None:
        values = json.dumps(self.options[network]["policy"].as_dict())
        checker = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-m", "sandbox_kernel.check", values,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await checker.communicate()
        try:
            problems = json.loads(out)
        except ValueError:
            return
        self.diagnoses[network] = (f"; sandbox-kernel check: {'; '.join(problems)}" if problems
                                   else "; sandbox-kernel check finds nothing missing")

    async def close(self) -> None:
        """Close the pools and stop the fork servers their kernels came from."""
        for probe in list(self._probes):
            probe.cancel()
        await asyncio.gather(*self._probes, *(pool.close() for pool in self.pools.values()),
                             return_exceptions=True)
        # No process outlives the face: the fork server its kernels came from ends too (a
        # later kernel of this interpreter, from anyone, starts a new one).
        for python, preload in {(kwargs.get("python"), tuple(kwargs.get("preload", ())))
                                for kwargs in self.options.values()
                                if not kwargs.get("cold_start")}:
            ForkServerClient(python=python or sys.executable, preload=preload).stop_server()


def make_source(base: SandboxPolicy, networks: tuple[bool, ...], pool_size: int,
                grace: float | None = None, upstream_proxy: str = "", runtime: str = "",
                preload: Iterable[str] = (), cold_start: bool = False,
                filled: Iterable[bool] | None = None, probe: bool = True) -> PoolSource:
    """The kernel source a face uses: the one place to change how it gets kernels.

    With a runtime, kernels run on its current build with its modules preloaded (and
    `preload`'s): every one of them for ZMQ kernels (a session's), by set for one-shot kernels
    (the source's preload_sets, launch/imports.py); cold_start: each kernel exec'd, no fork
    server.
    """
    on_runtime: dict[str, Any] = {"python": sys.executable, "preload": list(preload)}
    sets, build = None, 0
    if runtime:
        from ..runtimes import find

        record = find(runtime)
        build = record.build
        on_runtime = {"python": str(record.python()),
                      "preload": list(dict.fromkeys([*record.preload, *preload]))}
        if record.preload:  # one-shot pools by preload set; ZMQ kernels preload everything
            sets = PreloadSets.from_record(record.preload, record.preload_modules, preload)
    extra = {"grace": grace} if grace is not None else {}
    if cold_start:
        extra["cold_start"] = True
    source = PoolSource({network: {"kernel_name": None, **extra, **on_runtime,
                                   "policy": with_network(base, network, upstream_proxy)}
                         for network in networks}, pool_size, filled, probe)
    source.preload_sets, source.build = sets, build
    return source


def runtime_build(runtime: str) -> int:
    """The runtime's current build, as its record says now (an update moves it on)."""
    from ..runtimes import find

    return find(runtime).build


def kernel_id(sandbox: AsyncSandbox) -> str:
    """The kernel's id for logs (jupyter_client's kernel id)."""
    return str(getattr(sandbox.manager, "kernel_id", None) or "")


class Kernels:
    """Every kernel the service holds: handed out by the source, closed through here."""

    def __init__(self, source: KernelSource, start_timeout: float = 60.0) -> None:
        self.source = source
        self.start_timeout = start_timeout
        self.live: set[AsyncSandbox] = set()
        self._closing: set[asyncio.Task[None]] = set()

    async def get(self, network: Network, **extra: Any) -> AsyncSandbox:
        """A fresh kernel, counted as live until `discard`; KernelUnavailable if none comes.

        A kernel that fails to start (not one that is slow to) is tried once more: on a loaded
        host a start can fail once; a host that cannot run the policy fails both, fast.
        SecretError when the caller's secrets cannot be used (it never names a value).
        """
        try:
            sandbox = await self._get(network, extra)
        except KernelUnavailable as first:
            if first.__cause__ is None:  # it timed out: the caller has waited long enough
                raise
            log.warning(json_line(event="kernel_start_failed", policy=policy_name(network),
                                  error=str(first), retrying=True))
            sandbox = await self._get(network, extra)
        self.live.add(sandbox)
        return sandbox

    async def _get(self, network: Network, extra: dict[str, Any]) -> AsyncSandbox:
        try:
            return await asyncio.wait_for(self.source.get(network, **extra), self.start_timeout)
        except SecretError:
            raise
        except asyncio.TimeoutError:
            raise KernelUnavailable(f"no {policy_name(network)} kernel started within "
                                    f"{self.start_timeout:g} s") from None
        except Exception as exc:
            raise KernelUnavailable(f"the {policy_name(network)} kernel did not start: "
                                    f"{exc}") from exc

    async def close_now(self, sandbox: AsyncSandbox) -> None:
        """Shut a kernel down and wait for it (a caller that answers once it is gone)."""
        self.live.discard(sandbox)
        await self._close(sandbox)

    def discard(self, sandbox: AsyncSandbox) -> None:
        """Shut a kernel down in the background; safe to call from a cancelled task."""
        if sandbox not in self.live:
            return
        self.live.discard(sandbox)
        task = asyncio.get_running_loop().create_task(self._close(sandbox))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close(sandbox: AsyncSandbox) -> None:
        # Killed, not asked to shut down: whatever it ran has answered or been given up, and
        # its state goes with it. Its reaper still removes the scratch directory; a graceful
        # shutdown only cost a control round trip and the kernel's own clean-up, per request.
        try:
            await sandbox.close(now=True)
        except Exception as exc:
            log.warning("closing kernel %s failed: %s", kernel_id(sandbox), exc)

    @property
    def closing(self) -> int:
        """How many kernels are being shut down now."""
        return len(self._closing)

    async def close(self) -> None:
        """Shut down every kernel: those out, those closing, those the source keeps ready."""
        for sandbox in list(self.live):
            self.discard(sandbox)
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self.source.close()
