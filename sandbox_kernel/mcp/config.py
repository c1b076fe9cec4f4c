"""The MCP server's settings: the sandbox policy its kernels get, and what it hands a model."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..client.tools import ToolLimits
from ..launch.oneshot import DEFAULT_ONE_SHOT_POOL
from ..policy import SandboxPolicy
from .bridge import Upstream

DEFAULT_TIMEOUT = 60.0  # seconds a run may take when neither the call nor --timeout says


@dataclass
class McpConfig:
    """Everything `sandbox-kernel mcp` is started with."""

    policy: SandboxPolicy = field(default_factory=SandboxPolicy)
    preload: list[str] = field(default_factory=list)
    runtime: str = ""  # an operator-built runtime kernels run on (`sandbox-kernel runtime`)
    cold_start: bool = False
    pool_size: int = 1  # started kernels kept ready per network setting
    # one-shot kernels kept confined and waiting per network setting, for runs without a
    # session (0: those take a ZMQ kernel from the pool above)
    one_shot_pool_size: int = DEFAULT_ONE_SHOT_POOL
    one_shot_process: str = ""  # the one-shot process those runs get ("": the default)
    patience: float = 20.0  # seconds a call waits for its run before answering with a handle
    max_timeout: float = 600.0  # the largest timeout a call may ask for
    max_text: int = 20_000  # characters of stdout and of stderr a result carries
    max_file_bytes: int = 8 * 2**20  # largest file read_file/write_file move
    embed_bytes: int = 256 * 2**10  # files a run wrote up to this size come back embedded
    max_sessions: int = 16  # sessions open at once on this server
    max_sessions_per_key: int | None = None  # a key's own limit, unless its entry sets one
    session_idle_timeout: float = 1800.0  # seconds idle before a session is closed (0: never)
    # Runs without a session each hold a fresh kernel until it is shut down (up to the run's
    # timeout, whether or not anyone collects the run): these bound them.
    max_runs: int = 8  # such kernels at once on this server
    max_runs_per_key: int | None = None  # one key's; None: its fair share of max_runs
    state_dir: str = ""  # sealed snapshots and paused sessions; "" turns both off
    max_snapshot_size: int = 1024 * 2**20  # largest snapshot the state dir keeps
    max_snapshots_per_key: int = 64  # snapshots one key (the client, over stdio) keeps
    max_snapshot_bytes_per_key: int = 8 * 2**30  # and their bytes, in all
    session_pause_after: float = 0.0  # seconds idle before a session is paused (0: never)
    # other MCP servers whose tools run_python's code may call (mcp/bridge.py), and the
    # bridge's limits on those calls (per call and per run)
    tools_from: list[Upstream] = field(default_factory=list)
    tool_limits: ToolLimits = field(default_factory=ToolLimits)

    @property
    def default_timeout(self) -> float:
        """A run's time limit when the call gives none: --timeout, else DEFAULT_TIMEOUT."""
        return min(self.policy.timeout or DEFAULT_TIMEOUT, self.max_timeout)

    def timeout(self, asked: float | None) -> float:
        """The time limit of a call: what it asked, within the server's maximum."""
        if asked is None:
            return self.default_timeout
        if not asked > 0:
            raise ValueError("timeout must be a number of seconds above 0")
        if asked > self.max_timeout:
            raise ValueError(f"timeout {asked:g} s is above this server's limit of "
                             f"{self.max_timeout:g} s: split the work into shorter runs")
        return asked
