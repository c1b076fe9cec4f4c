"""`--tools-from NAME=COMMAND|URL`: other MCP servers' tools, callable from run_python's code.

When the server starts it connects, as an MCP client, to each server the operator named: a
command started as a subprocess over stdio with the operator's environment (so its credentials
stay in the host: the sandbox's kernels never get that environment), or a Streamable HTTP URL.
It lists their tools and declares each one to the tool bridge (hosting/tools.py's `Declared`)
as `NAME__tool` (the tool's name made module-safe: each run of characters an identifier cannot
hold becomes `_`), with a Python stub typed from the tool's input schema and its description as
the docstring. Every run_python (fresh or in a session) is granted them all; its description
lists the stubs, so a model knows to `from sandbox_tools import ...` and can call many tools
in one run and get back only what its code returns.

A call is sent to its server with the arguments given; the answer is the server's structured
content if it has any (a plain value the SDKs wrap as `{"result": value}` unwrapped), else its
text content joined, parsed when it is one JSON object or array (images and other content are
left out, named); an error result raises `ToolFailed` with its text, which the code gets as
`sandbox_tools.ToolError`. The bridge's rules hold as for any caller's tool: the per-call
timeout, the run's budget, sizes capped both ways, and every call in `usage.tool_calls`. The
operator trusts the servers it names; the model's code reaches only the tools they list.

`--tools-header NAME:Header-Name=ENV_VAR` gives a URL server's requests a header (a bearer
token, an API key) whose value is read from this server's environment when it starts, so the
secret is never on a command line; it lives only in that server's HTTP client (never in a
kernel) and is masked in whatever this server prints about it (`redact`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..hosting.tools import Declared, ToolFailed, annotation_of, granted, module_safe

NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")
MAX_LISTED = 256  # tools taken from one server
MAX_PAGES = 16  # pages of a server's tool listing read
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")  # an HTTP field name (a token)
VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # an environment variable's name
HIDDEN = "[redacted ${}]"  # what a header's value is shown as: the variable it came from


class BridgeError(Exception):
    """A --tools-from server that could not be used, in the operator's words."""


@dataclass(frozen=True)
class Header:
    """One --tools-header: a header every request to the URL server `upstream` carries, its
    value read from the environment variable `variable` (by `read`, when the server starts).
    The value is left out of the repr, so a logged config never shows it."""

    upstream: str
    name: str
    variable: str
    value: str = field(default="", repr=False, compare=False)

    @classmethod
    def parse(cls, text: str) -> Header:
        """NAME:Header-Name=ENV_VAR."""
        upstream, colon, rest = text.partition(":")
        name, equals, variable = rest.partition("=")
        if not (colon and equals and NAME.fullmatch(upstream) and HEADER_NAME.fullmatch(name)
                and VARIABLE.fullmatch(variable)):
            raise ValueError(f"expected NAME:Header-Name=ENV_VAR (NAME a --tools-from name, "
                             f"ENV_VAR the variable of this server's environment holding the "
                             f"value): {text!r}")
        return cls(upstream, name, variable)

    def read(self, environ: Mapping[str, str]) -> Header:
        """This header with its value from environ; ValueError naming the variable when it
        is unset or empty."""
        value = environ.get(self.variable, "")
        if not value:
            state = "empty" if self.variable in environ else "not set"
            raise ValueError(f"--tools-header {self}: the environment variable "
                             f"{self.variable} is {state} (set it in this server's environment)")
        if "\r" in value or "\n" in value:
            raise ValueError(f"--tools-header {self}: the value of {self.variable} holds a "
                             "line break, which no header may")
        return replace(self, value=value)

    def __str__(self) -> str:
        return f"{self.upstream}:{self.name}={self.variable}"


@dataclass(frozen=True)
class Upstream:
    """One --tools-from: its name, and a command (argv) or a Streamable HTTP URL (with the
    headers --tools-header gives it)."""

    name: str
    command: tuple[str, ...] = ()
    url: str = ""
    headers: tuple[Header, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Upstream:
        """NAME=COMMAND (split as a shell would, run without one) or NAME=URL."""
        name, sep, target = text.partition("=")
        if not sep or not NAME.fullmatch(name) or "__" in name:
            raise ValueError(f"expected NAME=COMMAND or NAME=URL, NAME a letter then letters, "
                             f"digits or single underscores (at most 32): {text!r}")
        target = target.strip()
        if re.match(r"https?://", target):
            return cls(name, url=target)
        try:
            argv = tuple(shlex.split(target))
        except ValueError as exc:
            raise ValueError(f"{name}: cannot split the command {target!r}: {exc}") from None
        if not argv:
            raise ValueError(f"{name}: no command after the '='")
        return cls(name, command=argv)

    def describe(self) -> str:
        """Where it is, for the operator."""
        return self.url or shlex.join(self.command)

    def redact(self, text: str) -> str:
        """text with each header's value replaced by the name of the variable it came from."""
        for header in self.headers:
            text = text.replace(header.value, HIDDEN.format(header.variable))
        return text


def with_headers(upstreams: Iterable[Upstream], headers: Iterable[Header],
                 environ: Mapping[str, str]) -> list[Upstream]:
    """The upstreams, each URL one with its --tools-header headers read from environ;
    ValueError when a header names no URL server, or its variable is unset."""
    upstreams = list(upstreams)
    given: dict[str, list[Header]] = {}
    kinds = {upstream.name: upstream for upstream in upstreams}
    for header in headers:
        upstream = kinds.get(header.upstream)
        if upstream is None:
            raise ValueError(f"--tools-header {header}: no --tools-from is named "
                             f"{header.upstream}")
        if not upstream.url:
            raise ValueError(f"--tools-header {header}: {header.upstream} is a command, which "
                             "gets this server's environment itself: headers are for URLs")
        given.setdefault(header.upstream, []).append(header.read(environ))
    return [replace(upstream, headers=tuple(given.get(upstream.name, ())))
            for upstream in upstreams]


def wrapped(output_schema: Any) -> bool:
    """Whether a tool's output schema is the SDKs' wrapping of a plain value: an object whose
    one property, required, is `result`."""
    return isinstance(output_schema, dict) and \
        list((output_schema.get("properties") or {}).keys()) == ["result"] and \
        output_schema.get("required") == ["result"]


def returns_of(output_schema: Any) -> str:
    """The stub's return annotation: the wrapped value's type, dict for structured content,
    else what text may hold (JSON text comes back parsed)."""
    if wrapped(output_schema):
        return annotation_of(output_schema["properties"]["result"]) or "Any"
    return "dict" if output_schema else "dict | list | str"


def result_of(result: Any, unwrap: bool = False) -> Any:
    """A CallToolResult as the code gets it: its structured content (a wrapped plain value
    unwrapped), else its text joined, parsed when it is one JSON object or array; an error
    result raises ToolFailed with its text."""
    texts, other = [], []
    for item in result.content or []:
        if getattr(item, "type", None) == "text":
            texts.append(item.text)
        else:
            other.append(str(getattr(item, "type", "content")))
    if result.is_error:
        raise ToolFailed("\n".join(texts) or "the tool reported an error")
    structured = result.structured_content
    if structured is not None:
        return structured["result"] if unwrap and isinstance(structured, dict) \
            and "result" in structured else structured
    text = "\n".join(texts)
    if not other and text.lstrip()[:1] in ("{", "["):
        with contextlib.suppress(ValueError):
            return json.loads(text)
    if other:
        text += f"{chr(10) if text else ''}[left out: {', '.join(other)} content]"
    return text


class Redacting(logging.Formatter):
    """A formatter whose every record (its message, its traceback) comes out with the
    upstreams' header values masked: what the server logs never shows a token."""

    def __init__(self, inner: logging.Formatter, upstreams: Iterable[Upstream]) -> None:
        super().__init__()
        self.inner = inner
        self.upstreams = [upstream for upstream in upstreams if upstream.headers]

    def format(self, record: logging.LogRecord) -> str:
        """The inner formatter's text, redacted."""
        text = self.inner.format(record)
        for upstream in self.upstreams:
            text = upstream.redact(text)
        return text


@dataclass
class Bridge:
    """The --tools-from servers: connected while the MCP server runs, their tools declared."""

    upstreams: list[Upstream]
    connect_timeout: float = 60.0
    declared: list[tuple[Declared, Callable[[dict[str, Any]], Awaitable[Any]]]] = \
        field(default_factory=list)
    _stack: contextlib.AsyncExitStack | None = None
    # the first HTTP error status each URL server answered, for the error naming it
    _statuses: dict[str, tuple[int, str]] = field(default_factory=dict)

    async def __aenter__(self) -> Bridge:
        from mcp import Client

        self._stack = contextlib.AsyncExitStack()
        await self._stack.__aenter__()
        taken: dict[str, str] = {}
        names = [upstream.name for upstream in self.upstreams]
        if len(set(names)) < len(names):
            raise BridgeError(f"--tools-from names each server once: {', '.join(names)}")
        try:
            for upstream in self.upstreams:
                try:
                    server = await self._target(upstream)
                    client = await self._stack.enter_async_context(Client(server))
                    listed = await _listing(client)
                except Exception as exc:
                    raise BridgeError(upstream.redact(
                        f"--tools-from {upstream.name}={upstream.describe()}: could not "
                        f"connect and list its tools: {_reason(exc)}"
                        f"{self._refusal(upstream)}")) from exc
                for tool in listed:
                    name = f"{upstream.name}__{module_safe(tool.name)}"
                    if name in taken:
                        raise BridgeError(f"--tools-from {upstream.name}: its tools "
                                          f"{taken[name]!r} and {tool.name!r} are both "
                                          f"{name} in Python")
                    taken[name] = tool.name
                    declared = Declared(
                        name, tool.description or tool.title or "",
                        dict(tool.input_schema or {}),
                        returns=returns_of(tool.output_schema))
                    self.declared.append((declared, _sender(client, tool.name,
                                                            wrapped(tool.output_schema))))
        except BaseException:
            await self._stack.__aexit__(None, None, None)
            raise
        return self

    async def _target(self, upstream: Upstream) -> Any:
        """What the SDK's Client connects to: the command's parameters (with this server's
        environment), or for a URL a transport whose HTTP client (held open on the stack)
        sends the upstream's headers and notes the server's first refusal (the SDK's error
        for it names no status)."""
        from mcp import StdioServerParameters
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client  # the SDK's own defaults

        if upstream.command:
            return StdioServerParameters(command=upstream.command[0],
                                         args=list(upstream.command[1:]), env=dict(os.environ))
        assert self._stack is not None
        http = await self._stack.enter_async_context(create_mcp_http_client(
            headers={header.name: header.value for header in upstream.headers}))

        async def note(response: Any) -> None:
            if response.status_code >= 400:
                self._statuses.setdefault(upstream.name, (response.status_code,
                                                          response.reason_phrase))
        http.event_hooks["response"].append(note)
        return streamable_http_client(upstream.url, http_client=http)

    def _refusal(self, upstream: Upstream) -> str:
        """What the URL server answered when it refused, and for a 401 or 403 what to do."""
        if upstream.name not in self._statuses:
            return ""
        status, reason = self._statuses[upstream.name]
        said = f" (it answered HTTP {status} {reason}"
        if status not in (401, 403):
            return said + ")"
        if not upstream.headers:
            return said + f": give its credentials with --tools-header {upstream.name}:" \
                "Header-Name=ENV_VAR)"
        variables = ", ".join(f"${header.variable}" for header in upstream.headers)
        return said + f": check the headers' values, from {variables})"

    async def __aexit__(self, *exc: Any) -> None:
        if self._stack is not None:
            with contextlib.suppress(Exception):
                await self._stack.__aexit__(None, None, None)

    def tools(self) -> dict[str, Callable[..., Any]]:
        """The bridge's `tools=` for a run: every declared tool."""
        return granted(self.declared)

    def stubs(self) -> str:
        """Every tool as the stub a model reads."""
        return "\n\n".join(declared.stub_text() for declared, _ in self.declared)


def bridge_problem(exc: BaseException | None) -> BridgeError | None:
    """The BridgeError that ended a server, wherever its task groups wrapped it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, BridgeError):
            return exc
        inners = getattr(exc, "exceptions", None)  # an exception group (3.11, or anyio's)
        if isinstance(inners, (list, tuple)):
            for inner in inners:
                if (found := bridge_problem(inner)) is not None:
                    return found
        exc = exc.__cause__ or exc.__context__
    return None


def _reason(exc: BaseException) -> str:
    """An exception as `Type: message`, an exception group as its first leaf's (the SDK's
    task groups wrap a refused HTTP request in one)."""
    while isinstance(getattr(exc, "exceptions", None), (list, tuple)) and exc.exceptions:  # type: ignore[attr-defined]
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {exc}"


async def _listing(client: Any) -> list[Any]:
    tools: list[Any] = []
    cursor = None
    for _ in range(MAX_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor or len(tools) >= MAX_LISTED:
            break
    return tools[:MAX_LISTED]


def _sender(client: Any, tool: str, unwrap: bool) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    async def send(arguments: dict[str, Any]) -> Any:
        return result_of(await client.call_tool(tool, arguments), unwrap)
    return send


def described(stubs: str) -> str:
    """What run_python's description adds for the bridged tools."""
    if not stubs:
        return ""
    return ("\nThe code can call these tools as Python functions (import them: `from "
            "sandbox_tools import name`); call many in one run and return only what you "
            "need. A failed call raises sandbox_tools.ToolError.\n```python\n"
            f"{stubs}\n```")
