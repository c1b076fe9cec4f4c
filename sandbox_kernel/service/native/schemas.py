"""The native API's request and answer shapes (what /openapi.json documents)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field

from ..validation import sendable


class ExecuteRequest(BaseModel):
    """Code to run; with `inputs`, the code's `main(**inputs)` is called and its dict returned."""

    code: Annotated[str, AfterValidator(sendable)] = Field(description="Python source.")
    inputs: Annotated[dict[str, Any] | None, AfterValidator(sendable)] = Field(
        None, description="main()'s arguments by name; omit to run the code as a cell.")
    timeout: float | None = Field(
        None, gt=0, description="Seconds the execution may run (default: the service's "
        "--worker-timeout; at most --max-timeout).")


class OneShotRequest(ExecuteRequest):
    network: bool = Field(False, description="Run on a kernel that may open network sockets.")


class InstallRequest(BaseModel):
    """Packages to install into a session's kernel (wheels only, from the operator's index)."""

    packages: list[Annotated[str, Field(pattern=r"^[^\s-][^\s]*$", max_length=200)]] = Field(
        min_length=1, max_length=50, description="Requirements such as 'x' or 'x==1.0'.")
    upgrade: bool = Field(False, description="Upgrade packages the session has already.")
    timeout: float | None = Field(
        None, gt=0, description="Seconds the install may take (default: the service's "
        "--worker-timeout; at most --max-timeout).")


class SessionRequest(BaseModel):
    network: bool = Field(False, description="Let the session's kernel open network sockets.")
    idle_timeout: float | None = Field(
        None, gt=0, description="Seconds idle before the session is closed (default: "
        "--session-idle-timeout; at most --max-session-idle-timeout).")


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


class SessionShape(BaseModel):
    """A session the caller holds."""

    id: str
    network: bool
    policy: str
    idle_timeout: float
    created: float
    idle_seconds: float
    busy: bool
    alive: bool
    dead_reason: str | None


class FileShape(BaseModel):
    """A file written into a session."""

    path: str
    size: int
