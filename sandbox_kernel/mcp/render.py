"""A run as an MCP tool result: structured content (shapes.RunResult) plus content blocks a
model reads (the output as text, images as image content, files as links or embedded)."""

from __future__ import annotations

import base64
import dataclasses
import json
import mimetypes
from typing import Any, Literal
from urllib.parse import quote

from mcp.types import (
    BlobResourceContents,
    CallToolResult,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from ..client import Execution
from ..errors import ExecutionTimeout
from . import messages
from .config import McpConfig
from .runs import Run
from .shapes import Chunk, Display, ErrorInfo, FileInfo, RunResult, Usage

IMAGES = ("image/png", "image/jpeg", "image/gif", "image/webp")
TEXT_DISPLAYS = ("image/svg+xml", "text/html", "text/markdown", "text/latex", "application/json",
                 "text/plain")


def file_uri(session: str, path: str) -> str:
    """The resource URI of a file in a session's working directory."""
    return f"sandbox://sessions/{session}/files/{quote(path, safe='/')}"


def mime_of(path: str) -> str:
    """The MIME type of a file by its name; octet-stream when unknown."""
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


def usage_of(execution: Execution) -> Usage:
    """The execution's usage, as the client measured it."""
    return Usage(**dataclasses.asdict(execution.usage))


def _usage_line(usage: Usage) -> str:
    parts = [f"wall {usage.wall_seconds:.3f} s"]
    if usage.cpu_user_seconds is not None and usage.cpu_system_seconds is not None:
        parts.append(f"cpu {usage.cpu_user_seconds + usage.cpu_system_seconds:.2f} s")
    if usage.peak_memory_bytes is not None:
        parts.append(f"peak memory {usage.peak_memory_bytes / 2**20:.1f} MiB")
    parts.append(f"output {usage.output_bytes:,} B")
    if usage.refused_syscalls:
        parts.append(f"refused calls {usage.refused_syscalls}")
    return "[usage] " + ", ".join(parts)


def _output(chunks: list[dict[str, str]], limit: int) -> list[Chunk]:
    """The chunks, merged per stream run, operator markers said for a model, within limit."""
    merged: list[Chunk] = []
    for chunk in chunks:
        if merged and merged[-1].stream == chunk["stream"]:
            merged[-1].text += chunk["text"]
        else:
            merged.append(Chunk(stream=chunk["stream"], text=chunk["text"]))  # type: ignore[arg-type]
    total = sum(len(c.text) for c in merged) or 1
    for part in merged:
        part.text = messages.cut(messages.plain_output(part.text),
                                 max(200, limit * len(part.text) // total))
    return merged


def _display(bundle: dict[str, Any], limit: int) -> tuple[Display, ContentBlock | None]:
    image = next((m for m in IMAGES if m in bundle), None)
    if image is not None:
        data = bundle[image]
        data = "".join(data) if isinstance(data, list) else str(data)
        return Display(mime_type=image), ImageContent(data=data.replace("\n", ""),
                                                      mime_type=image)
    kind = next((m for m in TEXT_DISPLAYS if m in bundle), None)
    if kind is None:
        return Display(mime_type=next(iter(bundle), "unknown")), None
    value = bundle[kind]
    text = json.dumps(value, ensure_ascii=False) if kind == "application/json" else \
        "".join(value) if isinstance(value, list) else str(value)
    return Display(mime_type=kind, text=messages.cut(text, limit)), None


def _files(run: Run, config: McpConfig) -> tuple[list[FileInfo], list[ContentBlock]]:
    infos: list[FileInfo] = []
    blocks: list[ContentBlock] = []
    for path, size, _ in run.written:
        mime = mime_of(path)
        if run.session is not None:
            uri = file_uri(run.session.id, path)
            infos.append(FileInfo(path=path, size=size, uri=uri))
            blocks.append(ResourceLink(uri=uri, name=path, mime_type=mime, size=size))
            continue
        content = run.embedded.get(path)
        infos.append(FileInfo(path=path, size=size, embedded=content is not None))
        if content is None:
            continue
        uri = f"sandbox://runs/{run.id}/files/{quote(path, safe='/')}"
        try:
            resource: Any = TextResourceContents(uri=uri, mime_type=mime,
                                                 text=content.decode("utf-8"))
        except UnicodeDecodeError:
            resource = BlobResourceContents(uri=uri, mime_type=mime,
                                            blob=base64.b64encode(content).decode())
        blocks.append(EmbeddedResource(resource=resource))
    return infos, blocks


def _state(run: Run) -> Literal["kept", "lost", "fresh"]:
    if run.session is None:
        return "fresh"
    return "lost" if run.execution is not None and run.execution.state_lost else "kept"


def result(run: Run, config: McpConfig) -> CallToolResult:
    """What the caller gets now: everything new about the run, and the end if it ended."""
    chunks, bundles = run.take_new()
    output = _output(chunks, config.max_text)
    shown = [_display(bundle, config.max_text) for bundle in bundles]
    shape = RunResult(
        status="running", run=run.id, session=run.session.id if run.session else None,
        output=output, stdout="".join(c.text for c in output if c.stream == "stdout"),
        stderr="".join(c.text for c in output if c.stream == "stderr"),
        displays=[display for display, _ in shown], state=_state(run))
    blocks: list[ContentBlock] = [block for _, block in shown if block is not None]
    execution = run.execution
    if execution is not None:
        network = bool(run.session.network) if run.session else config.policy.allow_network
        said = messages.for_model(execution, run.timeout, run.session is not None,
                                  config.policy.memory_limit, network)
        shape.status = "error" if said else "ok"
        shape.result, shape.value = execution.result, execution.text
        if execution.result is not None:
            shape.value = None  # the result is the value: not twice
        elif shape.value is not None:
            shape.value = messages.cut(shape.value, config.max_text)
        if said is not None:
            shape.error = ErrorInfo(name=said.name, value=said.message,
                                    traceback=said.traceback, refused=said.refused)
            shape.timed_out = said.name == ExecutionTimeout.code
        shape.files, file_blocks = _files(run, config)
        blocks += file_blocks
        shape.usage, shape.duration = usage_of(execution), round(execution.duration, 3)
    text = TextContent(text=summary(shape))
    return CallToolResult(content=[text, *blocks], structured_content=shape.model_dump(
        mode="json"), is_error=shape.status == "error")


def summary(shape: RunResult) -> str:
    """The run as text, for a model that reads only the text content."""
    lines = []
    for chunk in shape.output:
        lines.append(f"[{chunk.stream}]\n{chunk.text.rstrip()}")
    if shape.result is not None:
        lines.append("[result]\n" + json.dumps(shape.result, ensure_ascii=False, indent=1))
    elif shape.value is not None:
        lines.append(f"[value]\n{shape.value}")
    for number, display in enumerate(shape.displays, start=1):
        lines.append(f"[display {number}: {display.mime_type}]" + (
            "" if display.text is None else f"\n{display.text}"))
    if shape.error is not None:
        lines.append(f"[error] {shape.error.name}: {shape.error.value}")
        if not shape.error.refused and shape.error.traceback:
            lines.append("\n".join(shape.error.traceback[-12:]))
    for file in shape.files:
        where = file.uri or ("content below" if file.embedded else
                             "too large to return: run in a session to keep it")
        lines.append(f"[file] {file.path} ({file.size:,} bytes): {where}")
    if shape.usage is not None:
        lines.append(_usage_line(shape.usage))
    if shape.status == "running":
        lines.append(f"[running] run {shape.run} is still going: call wait_run with run="
                     f"{shape.run!r} for the rest, or interrupt to stop it")
    elif shape.session is not None:
        lines.append(f"[session {shape.session}] variables "
                     + ("kept" if shape.state == "kept" else "LOST: the session restarted"))
    return "\n".join(lines) or "(no output)"
