"""What the tools share: the settings, hosting's kernels, runner, admission, sessions and
pausing, the runs, and who is asking."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from mcp.server.auth.middleware.auth_context import get_access_token

from ..client.sandbox import GRACE_SECONDS
from ..client.tools import Toolbox
from ..hosting.admission import Admission, fair_share
from ..hosting.fresh import Runner
from ..hosting.keys import ApiKey
from ..hosting.oneshots import OneShots
from ..hosting.pausing import Pausing
from ..hosting.sessions import Sessions
from ..hosting.sources import Kernels, PoolSource, make_source
from ..hosting.store import Quota, Store
from .bridge import Bridge
from .config import McpConfig
from .runs import Runs

LOCAL = "local"  # the owner over stdio: the one client that started the server


@dataclass
class State:
    """The server's live state, made when it starts and closed when it stops."""

    config: McpConfig
    key_limits: dict[str, int | None] = field(default_factory=dict)  # per key id (HTTP)
    source: PoolSource = field(init=False)
    kernels: Kernels = field(init=False)
    runner: Runner = field(init=False)
    sessions: Sessions = field(init=False)
    runs: Runs = field(init=False)
    pausing: Pausing | None = field(default=None, init=False)  # with --state-dir
    # run_python's registration, its description given the bridged tools' stubs (tools.py)
    describe: Callable[[str], None] | None = field(default=None, init=False)
    _culler: asyncio.Task[None] | None = field(default=None, init=False)
    _pauser: asyncio.Task[None] | None = field(default=None, init=False)
    _starting: asyncio.Future[None] | None = field(default=None, init=False)
    _asking: asyncio.Future[bool] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        config = self.config
        # Both network settings, the policy's own filled from the start (hosting/network.py
        # makes each policy); no probe: this server has no /ready to prove its kernels to.
        self.source = make_source(config.policy, (False, True), config.pool_size,
                                  runtime=config.runtime, preload=config.preload,
                                  cold_start=config.cold_start,
                                  filled=(config.policy.allow_network,), probe=False)
        self.kernels = Kernels(self.source)
        one_shots = (OneShots(self.source.options, config.one_shot_pool_size,
                              self.source.preload_sets, process=config.one_shot_process)
                     if config.one_shot_pool_size > 0 and not config.cold_start else None)
        runs_per_key = self.run_limit(LOCAL)
        # Runs without a session are refused past their caps, never queued (a model is told
        # to collect or interrupt): as many workers as places.
        admission = Admission(config.max_runs, config.max_runs, runs_per_key, runs_per_key)
        # The client's own deadline (interrupt at timeout + grace, give up a grace later)
        # answers first; hosting's bound is the backstop.
        self.runner = Runner(self.kernels, admission, 2 * GRACE_SECONDS, None, one_shots)
        # A session's id is short: a model copies it into every call.
        self.sessions = Sessions(self.kernels, config.max_sessions,
                                 config.max_sessions_per_key
                                 or fair_share(config.max_sessions, len(self.key_limits)),
                                 id_bytes=8)
        self.runs = Runs(config, self.runner, self.sessions)
        if config.state_dir:
            store = Store(config.state_dir, config.max_snapshot_size,
                          Quota(config.max_snapshots_per_key, config.max_snapshot_bytes_per_key))
            self.pausing = Pausing(self.sessions, store, config.runtime)

    @contextlib.asynccontextmanager
    async def bridged(self) -> AsyncIterator[None]:
        """The --tools-from servers connected while the block runs: their tools granted to
        every run and listed in run_python's description (mcp/bridge.py)."""
        if not self.config.tools_from:
            yield
            return
        async with Bridge(self.config.tools_from) as bridge:
            self.runs.toolbox = Toolbox(bridge.tools(), limits=self.config.tool_limits)
            if self.describe is not None:
                self.describe(bridge.stubs())
            try:
                yield
            finally:
                self.runs.toolbox = None

    def start(self) -> None:
        """Begin filling the pool and culling idle sessions and uncollected runs."""
        self._starting = asyncio.ensure_future(self.source.start())
        one_shots = self.runner.one_shots
        if one_shots is not None and self.config.policy.allow_network in one_shots.pools:
            # asked for now, so that the first run finds its pool full
            self._asking = asyncio.ensure_future(
                one_shots.had(self.config.policy.allow_network))
        self._culler = asyncio.ensure_future(self._cull_forever())
        if self.pausing is not None:  # idle sessions paused, expired pauses swept
            self._pauser = asyncio.ensure_future(
                self.pausing.maintain(self.config.session_pause_after))

    async def _cull_forever(self, interval: float = 30.0) -> None:
        while True:
            await asyncio.sleep(interval)
            self.sessions.cull()
            self.runs.cull()

    async def close(self) -> None:
        """Stop every run, session, pooled kernel and the fork server."""
        for task in (self._culler, self._pauser):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.runs.close()
        self.sessions.close()  # shut down with the kernels below
        if self.runner.one_shots is not None:
            await self.runner.one_shots.close()
        await self.kernels.close()

    def owner(self) -> str:
        """Who is asking: the API key's id over HTTP, LOCAL over stdio."""
        token = get_access_token()
        return token.client_id if token is not None else LOCAL

    def key(self, owner: str) -> ApiKey:
        """The owner as hosting knows a tenant: its id and its own session limit (its key's
        max_sessions; None: --max-sessions-per-key, else its fair share of the server's)."""
        return ApiKey(owner, "", self.key_limits.get(owner))

    @property
    def preload(self) -> list[str]:
        """The modules kernels start with (the runtime's and --preload's)."""
        return list(self.source.options[False].get("preload", ()))

    def run_limit(self, owner: str) -> int:
        """How many runs without a session (each a fresh kernel) this owner may have at once."""
        config = self.config
        return config.max_runs_per_key or fair_share(config.max_runs, len(self.key_limits))
