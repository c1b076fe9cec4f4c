"""The tools' output schemas: what a tool returns as structured content, field by field."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from ..hosting.network import network_of
from ..hosting.sessions import Session
from ..hosting.store import Stored


class Chunk(BaseModel):
    """Text the code wrote to one stream."""

    stream: Literal["stdout", "stderr"]
    text: str


class Display(BaseModel):
    """One rich output (a chart, a table); images also come back as image content."""

    mime_type: str = Field(description="Its richest form, e.g. image/png, text/html.")
    text: str | None = Field(default=None, description="Its text form (SVG, HTML, JSON, plain "
                             "text), cut to the server's size cap; None for images.")


class ErrorInfo(BaseModel):
    """The error the code raised, or the sandbox's refusal."""

    name: str = Field(description="The exception's name, e.g. NameError, ExecutionTimeout.")
    value: str = Field(description="What happened and what the code can do instead.")
    traceback: list[str] = Field(description="Where it happened, ending at the code's line.")
    refused: bool = Field(description="The sandbox refused something the code tried.")


class FileInfo(BaseModel):
    """A file the code wrote."""

    path: str = Field(description="Relative to the working directory.")
    size: int
    uri: str | None = Field(default=None, description="A resource to read it by (sessions only).")
    embedded: bool = Field(default=False, description="Its content is in this result.")


class Usage(BaseModel):
    """What one run cost (the client's `Execution.usage`); None where nobody could measure."""

    wall_seconds: float
    cpu_user_seconds: float | None = None
    cpu_system_seconds: float | None = None
    peak_memory_bytes: int | None = Field(default=None, description="The kernel's peak "
                                          "memory during this run.")
    output_bytes: int = Field(description="Bytes of stdout and stderr.")
    result_bytes: int = Field(description="Bytes of the result (its JSON, or its text).")
    refused_syscalls: int | None = Field(default=None, description="System calls the sandbox "
                                         "refused during this run.")
    egress_cpu_seconds: float | None = Field(default=None, description="CPU the egress proxy "
                                             "spent outside the kernel on this run's "
                                             "connections.")
    companion_cpu_seconds: float | None = Field(default=None, description="CPU the "
                                                "sandbox's companion spent answering and "
                                                "recording the calls it refused this run.")
    tool_calls: int | None = Field(default=None, description="Host tools the run called.")
    tool_seconds: float | None = Field(default=None, description="Seconds those tools took.")
    secret_uses: dict[str, int] | None = Field(default=None, description="Requests each "
                                               "secret was added to by the egress proxy "
                                               "during this run, by the secret's name.")
    source: dict[str, str] = Field(description="Who measured each figure: host, sampled, "
                                   "kernel or caller.")


class RunResult(BaseModel):
    """What one run_python call produced (or, while it runs, produced so far)."""

    status: Literal["ok", "error", "running"] = Field(
        description="running: not finished yet; call wait_run with `run` for the rest.")
    run: str = Field(description="The run's id, for wait_run and interrupt.")
    session: str | None = Field(default=None, description="The session it ran in; None: a fresh "
                                "sandbox that is gone now.")
    output: list[Chunk] = Field(description="stdout and stderr in the order written (new "
                                "since the last answer about this run).")
    stdout: str
    stderr: str
    result: dict[str, Any] | None = Field(default=None,
                                          description="main(**inputs)'s returned dict.")
    value: str | None = Field(default=None, description="The last expression's value, as text.")
    displays: list[Display] = Field(default_factory=list)
    error: ErrorInfo | None = None
    timed_out: bool = False
    state: Literal["kept", "lost", "fresh"] = Field(
        description="kept: the session's variables are still there; lost: the session was "
        "restarted and its variables are gone; fresh: the run had a sandbox of its own.")
    files: list[FileInfo] = Field(default_factory=list,
                                  description="Files the run wrote or changed.")
    usage: Usage | None = Field(default=None, description="What the run cost: wall and CPU "
                                "seconds, peak memory, output and result bytes, refusals.")
    duration: float | None = Field(default=None, description="Seconds the run took.")


class SessionUsage(BaseModel):
    """What a session's sandbox has spent from its first run on, billed in a run or not (a
    thread left running included); None where nobody could measure."""

    cpu_user_seconds: float | None = None
    cpu_system_seconds: float | None = None
    egress_cpu_seconds: float | None = None
    companion_cpu_seconds: float | None = None


class SessionInfo(BaseModel):
    """A session the caller holds."""

    session: str
    network: bool = Field(description="Whether code in it may use the network.")
    busy: bool
    running: str | None = Field(default=None, description="The id of the run in progress.")
    created: float = Field(description="Unix time it was created.")
    idle_seconds: float
    usage: SessionUsage = Field(description="What its sandbox has spent so far in all, "
                                "between runs too.")
    paused: bool = Field(default=False, description="Saved with its sandbox stopped; the next "
                         "call naming it resumes it, state restored.")
    restore: RestoreInfo | None = Field(
        default=None, description="Opened from a snapshot: what was restored and what was "
        "skipped (create_session's answer only).")


class RestoreInfo(BaseModel):
    """What opening a session from a snapshot brought back, and what it left out."""

    restored: list[str] = Field(description="The variables and imports restored.")
    skipped: list[dict[str, str]] = Field(
        description="What could not be restored, each {name, reason}: recreate those in code.")
    packages: list[str] = Field(description="Packages installed again.")
    files: list[str] = Field(description="Files written back into the working directory.")


class SessionList(BaseModel):
    """The caller's sessions."""

    sessions: list[SessionInfo]


class SnapshotInfo(BaseModel):
    """A snapshot of a session, kept by the server."""

    snapshot: str = Field(description="Its id, for create_session(snapshot=...).")
    bytes: int
    saved: list[str] = Field(description="The names saved.")
    skipped: list[dict[str, Any]] = Field(description="What could not be saved, with why.")
    session: str = Field(description="The session it was made from.")


class SnapshotList(BaseModel):
    """The caller's snapshots."""

    snapshots: list[SnapshotInfo]


class Done(BaseModel):
    """Whether an action was carried out, and what came of it."""

    ok: bool
    message: str


class FileEntry(BaseModel):
    """One file in a session's working directory."""

    path: str
    size: int
    modified: float = Field(description="Unix time of its last change.")


class FileList(BaseModel):
    """The files in a session's working directory."""

    files: list[FileEntry]
    truncated: bool = Field(description="More files exist than were listed.")


class FileContent(BaseModel):
    """A file read from a session."""

    path: str
    size: int
    encoding: Literal["text", "base64"]
    content: str | None = Field(default=None, description="The text, or base64 for binary files "
                                "(images come back as image content instead).")
    mime_type: str


class FileWritten(BaseModel):
    """A file written into a session."""

    path: str
    size: int
    uri: str


def session_info(session: Session) -> SessionInfo:
    """A live session as list_sessions shows it."""
    return SessionInfo(session=session.id, network=bool(session.network), busy=session.busy,
                       running=session.run_id, created=session.created,
                       idle_seconds=round(session.idle_seconds(), 1),
                       usage=SessionUsage(**session.spent()))


def paused_info(item: Stored) -> SessionInfo:
    """A paused session (its kernel stopped, its state in the store) as list_sessions shows it."""
    record = item.record
    return SessionInfo(session=item.id, network=bool(network_of(record["network"])), busy=False,
                       created=record["created"], paused=True,
                       usage=SessionUsage(**record.get("usage") or {}),
                       idle_seconds=round(time.time() - record["last_used"], 1))
