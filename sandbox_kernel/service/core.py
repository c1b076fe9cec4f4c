"""The running service: its parts (kernels, admission, runner, sessions, keys, metrics) and
their lifetime; the routes reach it through `deps.ServiceDep`."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine
from typing import Any, TypeVar

from .. import __version__
from ..client import Execution
from ..client.tools import ToolLimits
from ..errors import ExecutionTimeout
from ..hosting.admission import DIFY_TENANT, Admission, fair_share, tenant_of
from ..hosting.events import http_url
from ..hosting.fresh import Runner
from ..hosting.keys import ApiKey, BearerKeys, dify_key, load_keys, same
from ..hosting.oneshots import OneShots
from ..hosting.pausing import Pausing
from ..hosting.sessions import Sessions
from ..hosting.sources import Kernels, KernelSource, make_source, runtime_build
from ..hosting.store import Quota, Store
from ..hosting.tools import Desk
from ..launch.oneshot import OneShotUnavailable
from ..policy import SandboxPolicy
from ..runtimes import RuntimesError
from .access import json_line
from .config import ServiceConfig, upstream_proxy
from .metrics import Metrics

log = logging.getLogger("sandbox_kernel.service")
T = TypeVar("T")
CULL_INTERVAL = 1.0  # cheap: a look at each session's last use
PAUSE_AT_LEAST = 2.0  # seconds sessions get to pause at a stop whose grace runs went through
FOLLOW_INTERVAL = 1.0  # s between looks at the runtime's record (a small file read)
MOVE_WITHIN = 30.0  # s a new build's kernels get to start before runs go to them anyway
# s the old build's one-shot pools stay after a move: a run that chose one just before the move
# still connects to it (one that took its process no longer needs the server)
MOVE_GRACE = 2.0


async def wait_started(source: KernelSource, within: float) -> None:
    """Until every policy of the source has started a kernel (for /ready), at most within s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline and not all(
            state["started"] for state in source.health().values()):
        await asyncio.sleep(0.1)


async def retire(source: KernelSource, one_shots: OneShots | None,
                 grace: float = MOVE_GRACE) -> None:
    """Let a build's pools go after `grace` s (their runs finish): the fork servers stopped,
    the build's files removed by a later update or remove once nothing runs on it."""
    await asyncio.sleep(grace)
    if one_shots is not None:
        await one_shots.close()
    await source.close()


class Service:
    """Everything one running service holds; routes reach it through `deps.ServiceDep`."""

    # Time a session's kernel gets to restart after a lost execution before the service gives up.
    restart_allowance = 30.0

    def __init__(self, config: ServiceConfig, policy: SandboxPolicy,
                 source: KernelSource | None = None) -> None:
        self.config, self.policy = config, policy
        self.kernels = Kernels(source or self.make_source())
        self.dify_key = dify_key(config.api_key, config.api_keys_file)
        keys = (load_keys(config.api_keys_file) if config.api_keys_file
                else [ApiKey("default", self.dify_key or "")])
        self.bearer_keys = BearerKeys(keys)
        # The dify routes' tenant: the native key of the same secret (without a keys file, the
        # one key is both), else a tenant of their own.
        same_key = [key for key in keys if same(self.dify_key, key.secret)]
        self.dify_tenant = tenant_of(same_key[0].id) if same_key else DIFY_TENANT
        tenants = len(keys) + (self.dify_key is not None and not same_key)
        self.admission = Admission(
            config.max_requests, config.max_workers,
            config.max_requests_per_key or fair_share(config.max_requests, tenants),
            config.max_workers_per_key or fair_share(config.max_workers, tenants))
        self.runner = Runner(self.kernels, self.admission, config.kernel_grace,
                             config.max_output_total, self.make_one_shots())
        # Runs whose tool calls the caller answers on a route of the run (hosting/tools.py);
        # its id starts every run id, so another instance can name this one.
        self.tool_desk = Desk(config.instance_id or secrets.token_hex(4), ToolLimits.max_result)
        self.sessions = Sessions(self.kernels, config.max_sessions,
                                 config.max_sessions_per_key
                                 or fair_share(config.max_sessions, len(keys)))
        # With a state dir: snapshots, and sessions that pause and resume (pausing.py).
        self.metrics = Metrics()
        quota = Quota(config.max_snapshots_per_key, config.max_snapshot_bytes_per_key)
        refused = self.metrics.snapshots_refused
        self.pausing = (Pausing(self.sessions, Store(
            config.state_dir, config.max_snapshot_size, quota,
            lambda reason: refused.labels(reason=reason).inc()), config.runtime)
            if config.state_dir else None)
        self.metrics.bind(lambda: len(self.kernels.live), lambda: self.kernels.source.ready(),
                          lambda: len(self.sessions), lambda: self.admission.in_flight)
        self.started = False
        self.stopping = False
        self._culler: asyncio.Task[None] | None = None
        self._pauser: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._moving = asyncio.Lock()  # one move to a runtime's new build at a time

    def make_source(self) -> KernelSource:
        """Where kernels come from: this interpreter's, or the runtime's current build."""
        config = self.config
        networks = (False, True) if config.enable_network else (False,)
        return make_source(self.policy, networks, config.pool_size, config.kernel_grace,
                           upstream_proxy(config), config.runtime)

    def make_one_shots(self, source: KernelSource | None = None) -> OneShots | None:
        """The one-shot pools stateless runs use, with the kernel source's policies (the
        service's, unless given); None when --one-shot-pool-size is 0 (or the source is not
        launch/'s pools, e.g. in tests)."""
        source = source or self.kernels.source
        options = getattr(source, "options", None)
        if not self.config.one_shot_pool_size or not isinstance(options, dict):
            return None
        return OneShots(options, self.config.one_shot_pool_size,
                        getattr(source, "preload_sets", None),
                        max(0, self.config.max_preload_pools), self.config.one_shot_process)

    async def use_current_runtime(self) -> None:
        """Move to the runtime's current build, if an update made a new one: its kernel source
        and one-shot pools (lean and preload sets, from the new build's preload) are made and
        filled first, while runs still go to the old ones, then take every new run; the old
        ones' runs finish, and their fork servers are stopped after MOVE_GRACE. One move at
        a time (the refresh route, /dependencies/update and `follow_runtime` all call this)."""
        async with self._moving:
            old_source, old_one_shots = self.kernels.source, self.runner.one_shots
            source = self.make_source()
            was, build = getattr(old_source, "build", 0), getattr(source, "build", 0)
            if build == was:
                return
            one_shots = self.make_one_shots(source)
            try:
                await source.start()
                await self.prepare_one_shots(one_shots, within=MOVE_WITHIN)
                await wait_started(source, MOVE_WITHIN)
            except BaseException:  # a failed or cancelled move (a stop): the new build's go
                await asyncio.shield(retire(source, one_shots, grace=0))
                raise
            self.kernels.source, self.runner.one_shots = source, one_shots
            sets = getattr(source, "preload_sets", None)
            log.info(json_line(event="runtime_moved", runtime=self.config.runtime,
                               from_build=was, build=build,
                               preload=sorted(sets.names) if sets is not None else []))
            self.background(retire(old_source, old_one_shots))

    async def follow_runtime(self, interval: float = FOLLOW_INTERVAL) -> None:
        """Move to the runtime's new build when `sandbox-kernel runtime update` made one while
        the service runs (its record says so; read every interval seconds)."""
        said = ""
        while not self.stopping:
            await asyncio.sleep(interval)
            try:
                build = await asyncio.to_thread(runtime_build, self.config.runtime)
                if build != getattr(self.kernels.source, "build", build):
                    await self.use_current_runtime()
                said = ""
            except RuntimesError as exc:  # e.g. removed: its kernels go on; said once
                if str(exc) != said:
                    said = str(exc)
                    log.warning(json_line(event="runtime_unreadable",
                                          runtime=self.config.runtime, error=said))

    async def prepare_one_shots(self, one_shots: OneShots | None = None,
                                within: float | None = None) -> None:
        """Have the fork server fill the one-shot pools (the runner's, unless given), then
        probe each (for /ready): in the background, or first for at most `within` seconds."""
        one_shots = one_shots or self.runner.one_shots
        if one_shots is None:
            return
        try:
            await asyncio.to_thread(one_shots.prepare)
        except OneShotUnavailable as exc:  # the probe retries; /ready says why
            log.warning(json_line(event="one_shot_unavailable", error=str(exc)))
        if within is not None:
            deadline = asyncio.get_running_loop().time() + within
            await one_shots.probe(
                stopped=lambda: self.stopping or asyncio.get_running_loop().time() > deadline)
        self.background(one_shots.probe(stopped=lambda: self.stopping))

    def background(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run a coroutine on its own, keeping a reference until it is done (an exception no
        one asks for is retrieved here, not reported as "never retrieved")."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return task

    def dify_key_ok(self, given: str | None) -> bool:
        """Whether an X-Api-Key is the dify-sandbox key (compared in constant time)."""
        return same(given, self.dify_key)

    def count_run(self, api: str, execution: Execution) -> None:
        """Count a finished run by API and outcome (ok, timeout, lost, error), its usage and
        its tool calls."""
        error = execution.error
        outcome = ("ok" if error is None else "timeout" if error.name == ExecutionTimeout.code
                   else "lost" if execution.state_lost else "error")
        self.metrics.labelled(self.metrics.runs, api, outcome).inc()
        self.metrics.observe_usage(api, execution.usage)
        self.metrics.observe_tool_calls(api, execution.tool_calls)

    async def start(self) -> None:
        """Start the kernel source and the session culler."""
        await self.kernels.source.start()
        self.background(self.prepare_one_shots())  # the fork server starts meanwhile
        if self.config.runtime:
            self.background(self.follow_runtime())
        self._culler = asyncio.get_running_loop().create_task(
            self.sessions.cull_forever(CULL_INTERVAL))
        if self.pausing is not None:
            self.pausing.announce()
            self._pauser = self.background(self.pausing.maintain(self.config.session_pause_after))
        self.started = True
        log.info(json_line(event="started", version=__version__,
                           url=http_url(self.config.host, self.config.port),
                           network=self.config.enable_network, pool_size=self.config.pool_size))

    def begin_shutdown(self) -> None:
        """On SIGTERM/SIGINT: refuse readiness now; end the runs still going after the grace
        period with an error answer (before the server would cancel them with a bare 500)."""
        if self.stopping:
            return
        self.stopping = True
        # Called from uvicorn's signal handler, which may run in the middle of the event loop's
        # own timer bookkeeping: only call_soon_threadsafe is safe there, call_later is not.
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(loop.call_later, self.config.shutdown_grace,
                                  self.runner.stopping.set)

    async def stop(self) -> None:
        """Let in-flight runs finish within the grace period, pause every session (with a state
        dir) in what is left of it, then shut every kernel down."""
        self.stopping = True
        for task in (self._culler, self._pauser):
            if task is not None:
                task.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shutdown_grace
        while self.admission.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if self.pausing is not None:
            await self.pausing.pause_all(max(deadline - loop.time(), PAUSE_AT_LEAST))
        self.sessions.close()
        if self.runner.one_shots is not None:
            await self.runner.one_shots.close()
        await self.kernels.close()
        log.info(json_line(event="stopped"))

    def readiness(self) -> dict[str, Any]:
        """Ready once a kernel of every policy served has started and answered here (proof
        that every layer applies), while the latest start of none has failed; never once
        stopping. "reason" says what it waits for, naming the policy and its error."""
        health = self.kernels.source.health()
        if self.runner.one_shots is not None:  # stateless runs need their pools to work too
            health.update({f"{name} one-shot": state
                           for name, state in self.runner.one_shots.health.items()})
        waiting = {name: state["error"] or "no kernel of it has started yet"
                   for name, state in health.items() if not state["started"]}
        reason = ("stopping" if self.stopping else "not started" if not self.started
                  else "; ".join(f"{name} kernels: {why}" for name, why in waiting.items()))
        return {"ready": self.started and not self.stopping and not waiting,
                **({"reason": reason} if reason else {}), "policies": health,
                "pool": self.kernels.source.ready(), "pool_size": self.config.pool_size,
                "kernels_live": len(self.kernels.live), "sessions": len(self.sessions),
                "runs_in_flight": self.admission.in_flight}
