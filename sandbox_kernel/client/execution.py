"""What one run produced: the Execution a caller gets back, its error and its usage."""

from __future__ import annotations

import base64
import json
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_ANSI = re.compile(r"\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])")


@dataclass
class ErrorInfo:
    """An error raised by the code, by `main`, or by the sandbox around them (data, not raised)."""

    name: str
    value: str
    traceback: list[str] = field(default_factory=list)


def error_from(content: dict[str, Any]) -> ErrorInfo:
    """The error of an `error` message or an error execute_reply, without ANSI colours."""
    return ErrorInfo(str(content.get("ename", "Error")), str(content.get("evalue", "")),
                     [_ANSI.sub("", str(line)) for line in content.get("traceback", [])])


@dataclass
class Usage:
    """What one execution cost, and where each figure came from.

    `source` names, for each figure, who measured it: "host" (read by the caller from the
    local kernel's /proc entry, which user code cannot alter), "sampled" (the same, but peak
    memory sampled from VmRSS where the caller may not reset the high-water mark), "kernel"
    (reported by the kernel in its reply: a remote kernel's figures, and the count of refused
    calls, which only the kernel's companion knows; as trustworthy as the kernel) or "caller"
    (counted on what arrived). A figure nobody could measure is None.

    CPU seconds from /proc have the clock tick's resolution (1/100 s). A kernel's own
    `peak_memory_bytes` is its high-water mark up to the end of the execution (an upper bound,
    exact when the execution set a new high). `refused_syscalls` counts the calls the seccomp
    allowlist refused (the ones the audit records); argument checks that answer EPERM at once
    (ioctl, mmap, open flags) are not counted. `egress_cpu_seconds` is the CPU the egress proxy
    spent, in the kernel's unconfined companion, on the kernel's connections (reading and judging
    request heads, TLS hellos, splicing): outside the kernel, so not in its CPU figures, and
    billable beside them; reported by the kernel from the companion's count ("kernel").
    `companion_cpu_seconds` is the CPU the companion spent answering and recording the calls
    the execution had refused (billable the same way; a flood of refusals is answered only as
    far as a share of the kernel's own CPU pays for, docs/SECURITY.md).
    `secret_uses`: with secrets (`--secret`), how many requests the proxy added each one to, by
    name, also from the companion's count.
    `tool_calls`: the tool calls the caller took from the run (client/tools.py), whatever their
    outcome; `tool_seconds`: the time they took, summed (concurrent calls each count), both
    counted by the caller.
    """

    wall_seconds: float = 0.0
    cpu_user_seconds: float | None = None
    cpu_system_seconds: float | None = None
    peak_memory_bytes: int | None = None
    output_bytes: int = 0
    result_bytes: int = 0
    refused_syscalls: int | None = None
    egress_cpu_seconds: float | None = None
    companion_cpu_seconds: float | None = None
    secret_uses: dict[str, int] | None = None
    tool_calls: int = 0
    tool_seconds: float = 0.0
    source: dict[str, str] = field(default_factory=dict)


@dataclass
class Execution:
    """Everything one `run` produced, each kind of output kept apart."""

    result: dict | None = None
    text: str | None = None
    logs: list[dict[str, str]] = field(default_factory=list)
    displays: list[dict[str, Any]] = field(default_factory=list)
    error: ErrorInfo | None = None
    duration: float = 0.0
    state_lost: bool = False
    usage: Usage = field(default_factory=Usage)
    # With run(..., raw_result=True): the main() result as the kernel's JSON bytes, checked to
    # be one well-formed JSON object but never turned into Python objects (`result` stays None).
    result_json: bytes | None = field(default=None, repr=False)
    # Each tool call the run made (client/tools.py's ToolCall): tool, bytes each way, duration,
    # outcome; arguments and result only with audit_tool_payloads.
    tool_calls: list[Any] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        """Everything the code printed to stdout."""
        return "".join(chunk["text"] for chunk in self.logs if chunk["name"] == "stdout")

    @property
    def stderr(self) -> str:
        """Everything the code printed to stderr."""
        return "".join(chunk["text"] for chunk in self.logs if chunk["name"] == "stderr")

    def to_dict(self) -> dict[str, Any]:
        """The whole execution as JSON-able values (sharing, not copying, result and outputs:
        a deep copy of a large result cost the service seconds and its size again in memory)."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__
                  if name != "result_json"}
        fields["error"] = None if self.error is None else _flat(self.error)
        fields["usage"] = _flat(self.usage)
        fields["tool_calls"] = [asdict(call) for call in self.tool_calls]
        return {**fields, "stdout": self.stdout, "stderr": self.stderr}

    def save_displays(self, directory: str | Path) -> list[str]:
        """Write each display to directory as display-N.EXT in its richest format; the paths."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        paths = []
        for number, bundle in enumerate(self.displays, start=1):
            kind = next((k for k in _DISPLAY_FILES if k[0] in bundle), None)
            if kind is None:
                continue
            mime, extension, encoding = kind
            path = Path(directory, f"display-{number}.{extension}")
            path.write_bytes(_display_bytes(bundle[mime], encoding))
            paths.append(str(path))
        return paths


def _flat(record: ErrorInfo | Usage) -> dict[str, Any]:
    """asdict of a record whose lists and dicts hold only strings and numbers: those copied one
    level deep, which is all of asdict's deep copy they need (a tenth of its cost)."""
    return {name: value.copy() if isinstance(value, dict | list) else value
            for name, value in ((name, getattr(record, name))
                                for name in record.__dataclass_fields__)}


# Richest first: (mime type, file extension, how the message carries it).
_DISPLAY_FILES = (
    ("image/png", "png", "base64"), ("image/jpeg", "jpg", "base64"),
    ("image/gif", "gif", "base64"), ("image/svg+xml", "svg", "text"),
    ("text/html", "html", "text"), ("text/markdown", "md", "text"),
    ("text/latex", "tex", "text"), ("application/json", "json", "json"),
    ("text/plain", "txt", "text"),
)


def _display_bytes(value: Any, encoding: str) -> bytes:
    if encoding == "base64":
        return base64.b64decode(value)
    if encoding == "json":
        return json.dumps(value, indent=2, ensure_ascii=False).encode()
    return ("".join(value) if isinstance(value, list) else str(value)).encode()


def __getattr__(name: str) -> Any:
    """`ExecutionError`, the old name of ErrorInfo (it is not an exception), still imports."""
    if name == "ExecutionError":
        warnings.warn("ExecutionError is now ErrorInfo (it is data, not an exception)",
                      DeprecationWarning, stacklevel=2)
        return ErrorInfo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
