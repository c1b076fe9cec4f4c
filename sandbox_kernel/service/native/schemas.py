"""The native API's request and answer shapes (what /openapi.json documents)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field

from ...hosting.network import NetworkChoice
from ...hosting.tools import MAX_TOOLS, is_tool_name
from ..validation import sendable


def _tool_name(name: str) -> str:
    if not is_tool_name(name):
        raise ValueError("a tool's name is a Python identifier that does not start with _ "
                         "and is not one of sandbox_tools' error classes")
    return name


class ToolDeclaration(BaseModel):
    """A tool the run's code may call (`from sandbox_tools import name`), answered by the caller
    on the run's event stream: its stub is typed from `parameters`."""

    name: Annotated[str, Field(max_length=64), AfterValidator(_tool_name)]
    description: str = Field("", max_length=8192, description="The stub's docstring.")
    parameters: dict[str, Any] = Field(
        default_factory=dict, description="JSON schema of the arguments, an object: its "
        "properties become the stub's parameters (required first; str, int, float, bool, "
        "list, dict where the schema says).")
    returns: str | None = Field(None, max_length=200,
                                description="The stub's return annotation, as text.")


def _unique(tools: list[ToolDeclaration] | None) -> list[ToolDeclaration] | None:
    if tools is not None and len({tool.name for tool in tools}) < len(tools):
        raise ValueError("each tool is declared once")
    return tools


class ExecuteRequest(BaseModel):
    """Code to run; with `inputs`, the code's `main(**inputs)` is called and its dict returned."""

    code: Annotated[str, AfterValidator(sendable)] = Field(description="Python source.")
    inputs: Annotated[dict[str, Any] | None, AfterValidator(sendable)] = Field(
        None, description="main()'s arguments by name; omit to run the code as a cell.")
    timeout: float | None = Field(
        None, gt=0, description="Seconds the execution may run (default: the service's "
        "--session-timeout in a session, --worker-timeout on a fresh kernel; at most "
        "--max-timeout).")
    tools: Annotated[list[ToolDeclaration] | None, AfterValidator(_unique)] = Field(
        None, max_length=MAX_TOOLS, description="Tools the code may call; each call is a "
        "`tool_call` event on the run's event stream (Accept: text/event-stream), answered on "
        "POST /api/v1/runs/{run}/tool_calls/{call}. Without the stream a call fails at once "
        "(ToolUnavailable).")
    tool_timeout: float | None = Field(
        None, gt=0, description="Seconds a tool call waits for its answer (default and at "
        "most --max-tool-timeout); then ToolTimeout in the code.")


def _host_entries(hosts: list[str]) -> list[str]:
    from ...confine.egress.rules import RuleError, parse_host_entry

    for entry in hosts:
        try:
            parse_host_entry(entry)
        except RuleError as exc:
            raise ValueError(str(exc)) from None
    return hosts


class NetworkRequest(BaseModel):
    """The network a kernel gets: always through the service's egress proxy, never the host's
    loopback or private addresses (unless the operator granted one with --allow-address)."""

    mode: Literal["off", "hosts", "on"] = Field(
        description="off: no network; hosts: only allow_hosts; on: any public host.")
    allow_hosts: Annotated[list[Annotated[str, Field(max_length=260)]],
                           AfterValidator(_host_entries)] = Field(
        default_factory=list, max_length=100,
        description="With mode hosts: names (api.example.com, *.example.com), optionally "
        ":PORT, or public addresses/CIDRs.")

    def choice(self) -> NetworkChoice:
        """As the service's kernels take it."""
        hosts = tuple(self.allow_hosts) if self.mode == "hosts" else ()
        return NetworkChoice(self.mode, hosts)


def network_choice(value: bool | NetworkRequest) -> bool | NetworkChoice:
    """A request's network field: true/false as before, or a NetworkRequest object."""
    return value.choice() if isinstance(value, NetworkRequest) else value


class OneShotRequest(ExecuteRequest):
    """Code to run on a fresh kernel, and the network it may use."""

    network: bool | NetworkRequest = Field(
        False, description="true: any public host (as mode on); or an object choosing off, "
        "hosts (with allow_hosts) or on. Always through the egress proxy.")


class InstallRequest(BaseModel):
    """Packages to install into a session's kernel (wheels only, from the operator's index)."""

    packages: list[Annotated[str, Field(pattern=r"^[^\s-][^\s]*$", max_length=200)]] = Field(
        min_length=1, max_length=50, description="Requirements such as 'x' or 'x==1.0'.")
    upgrade: bool = Field(False, description="Upgrade packages the session has already.")
    timeout: float | None = Field(
        None, gt=0, description="Seconds the install may take (default: the service's "
        "--session-timeout; at most --max-timeout).")


class SessionRequest(BaseModel):
    """A session to open: its kernel's network and its idle timeout."""

    network: bool | NetworkRequest = Field(
        False, description="true: any public host (as mode on); or an object choosing off, "
        "hosts (with allow_hosts) or on. Always through the egress proxy.")
    idle_timeout: float | None = Field(
        None, gt=0, description="Seconds idle before the session is closed (default: "
        "--session-idle-timeout; at most --max-session-idle-timeout).")
    # Checked by the service (secrets.checked_entries), not by the schema: a schema error
    # would quote the input, the value with it.
    secrets: dict[str, Any] | None = Field(
        None, description='Credentials the session\'s code may use but never read, {"NAME": '
        '{"value": "...", "hosts": ["api.example.com"]}}: os.environ[NAME] holds a '
        "placeholder, the egress proxy adds the value for those hosts (which the session's "
        "network must reach). Never returned.")
    snapshot: str | None = Field(
        None, max_length=64, description="The id of one of this key's snapshots to start "
        "from (needs --state-dir): the new session has its variables and files, on the "
        "snapshot's network (asking for another is refused with 409).")


class ErrorShape(BaseModel):
    """The exception the code raised."""

    name: str
    value: str
    traceback: list[str]


class ExecutionShape(BaseModel):
    """Everything one execution produced, each kind of output kept apart."""

    result: dict[str, Any] | None = Field(None, description="main()'s returned dict.")
    text: str | None = Field(None, description="text/plain of the result or last expression.")
    stdout: str
    stderr: str
    logs: list[dict[str, str]] = Field(description="Stream chunks in arrival order.")
    displays: list[dict[str, Any]] = Field(description="Display MIME bundles in order.")
    error: ErrorShape | None = None
    duration: float
    state_lost: bool = Field(description="The kernel had to be restarted: variables are gone.")


class SessionUsage(BaseModel):
    """What the session's kernel has spent so far in all, from its first execution on: CPU its
    threads spend between executions and after the last one included (null: not measured)."""

    cpu_user_seconds: float | None
    cpu_system_seconds: float | None
    egress_cpu_seconds: float | None = Field(
        description="CPU the egress proxy spent outside the kernel on its connections.")
    companion_cpu_seconds: float | None = Field(
        None, description="CPU the companion spent answering and recording refused calls.")


class RestoreShape(BaseModel):
    """What opening a session from a snapshot brought back, and what it left out."""

    restored: list[str] = Field(description="The names restored.")
    skipped: list[dict[str, str]] = Field(
        description="What could not be restored ({name, reason}): a name, a file (file:PATH), "
        "a package.")
    packages: list[str] = Field(description="The %pip packages installed again.")
    files: list[str] = Field(description="The files written back into the scratch.")


class SessionShape(BaseModel):
    """A session the caller holds."""

    id: str
    network: bool
    allow_hosts: list[str] | None = Field(
        None, description="The names the session may reach (network mode hosts), else null.")
    policy: str
    idle_timeout: float
    created: float
    idle_seconds: float
    busy: bool
    alive: bool
    dead_reason: str | None
    usage: SessionUsage
    paused: bool = Field(False, description="Snapshotted with its kernel stopped; the next "
                         "request resumes it on a fresh kernel.")
    snapshot_bytes: int | None = Field(None, description="A paused session's snapshot size.")
    restore: RestoreShape | None = Field(
        None, description="In the answer that opened it from a snapshot: what was restored and "
        "what was skipped, with the reason; else null.")


class SnapshotShape(BaseModel):
    """A snapshot of a session's user state, kept sealed in the service's state dir."""

    id: str
    bytes: int = Field(description="Size of the sealed snapshot.")
    saved: list[str] = Field(description="The names saved.")
    skipped: Any = Field(description="The names not saved, each with the reason.")
    session: str = Field(description="The session it was taken from.")
    policy: str
    saved_at: float


class PausedShape(BaseModel):
    """A session just paused."""

    id: str
    paused: bool
    bytes: int = Field(description="Size of the sealed snapshot it is kept as.")


class FileShape(BaseModel):
    """A file written into a session."""

    path: str
    size: int


class ListedFile(BaseModel):
    """One file of a session's scratch directory."""

    path: str = Field(description="Relative to the scratch directory.")
    size: int = Field(description="Bytes.")
    modified: float = Field(description="Unix time of its last change.")


class ToolAnswer(BaseModel):
    """The answer to one tool call: its JSON result, or an error message (one of the two)."""

    result: Any = Field(None, description="The tool's result (JSON).")
    error: str | None = Field(None, max_length=4096,
                              description="Why the tool failed: the code gets ToolError.")


class FileListShape(BaseModel):
    """The files in a session's scratch directory."""

    files: list[ListedFile]
    truncated: bool = Field(description="More files exist than were listed (1,000 at most).")
