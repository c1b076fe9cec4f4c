"""What the framework adapters share: importing a framework by its extra, tools granted by
bare name across a session's runs, and an Execution said as text for a model."""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

from ..client import AsyncSandbox, Execution, Sandbox, ToolLimits
from ..extras import install_hint

# Python's names for the JSON-schema types frameworks describe their tools' inputs with.
SCHEMA_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool",
                "array": "list", "object": "dict", "null": "None", "any": "Any"}
MAX_TRACEBACK_LINES = 12  # of an error's traceback a model reads (its end: the code's own line)


def need(module: str, extra: str) -> ModuleType:
    """Import a framework's module, or ImportError naming the extra and the command that adds it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"sandbox_kernel.frameworks needs {module.split('.')[0]} here: "
                          f"install the [{extra}] extra: {install_hint(extra)}") from exc


def forwarders(names: list[str]) -> str:
    """Kernel code binding each granted tool's name in the session's globals to a function that
    calls the current run's stub (a stub refuses once its run has ended; these stay usable
    in every later run that grants the tool), with the stub's signature and docstring."""
    if not names:
        return ""
    return (
        "def __sandbox_forwarders(names):\n"
        "    import functools, sys\n"
        "    import sandbox_tools\n"
        "    def forwarder(name):\n"
        "        @functools.wraps(getattr(sandbox_tools, name))\n"
        "        def tool(*args, **kwargs):\n"
        "            __tracebackhide__ = True\n"
        "            return getattr(sys.modules['sandbox_tools'], name)(*args, **kwargs)\n"
        "        return tool\n"
        "    globals().update({name: forwarder(name) for name in names})\n"
        f"__sandbox_forwarders({names!r})\n"
        "del __sandbox_forwarders\n")


def schema_signature(inputs: Mapping[str, Mapping[str, Any]],
                     required: Any = None) -> inspect.Signature:
    """A signature from a JSON-schema-like description of a tool's inputs ({name: {"type",
    "description", "nullable"?}}); required: the names without a default (None: all but the
    nullable ones)."""
    params = []
    for name, spec in inputs.items():
        kind = spec.get("type", "any")
        annotation = " | ".join(SCHEMA_TYPES.get(k, "Any") for k in kind) \
            if isinstance(kind, list) else SCHEMA_TYPES.get(kind, "Any")
        optional = spec.get("nullable", False) if required is None else name not in required
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        annotation=annotation,
                                        default=spec.get("default") if optional
                                        else inspect.Parameter.empty))
    # Parameters with defaults after those without, as Python requires.
    params.sort(key=lambda p: p.default is not inspect.Parameter.empty)
    return inspect.Signature(params)


def host_function(name: str, call: Callable[..., Any], doc: str,
                  signature: inspect.Signature) -> Callable[..., Any]:
    """`call` as a tool the bridge grants: the name, docstring and signature a model reads.
    `call` gets every argument by keyword (the stub may send them by position), as frameworks'
    tools take a mapping of their schema's names."""
    def named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        return dict(signature.bind(*args, **kwargs).arguments)

    def tool(*args: Any, **kwargs: Any) -> Any:
        return plain(call(**named(args, kwargs)))

    async def atool(*args: Any, **kwargs: Any) -> Any:
        return plain(await call(**named(args, kwargs)))

    if inspect.iscoroutinefunction(call):  # served on the sandbox's event loop
        tool = atool
    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = doc
    tool.__signature__ = signature  # type: ignore[attr-defined]
    return tool


def plain(value: Any) -> Any:
    """A tool's answer as plain JSON types (a str subclass as str...); what JSON cannot hold is
    left as it is, for the bridge to refuse with the tool's name."""
    if isinstance(value, bool) or value is None:
        return value
    for kind in (str, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def error_text(execution: Execution) -> str:
    """The run's error as a model reads it: the traceback's end (the code's own line), then
    `Name: value`; empty without an error."""
    error = execution.error
    if error is None:
        return ""
    lines = [line for line in error.traceback if line.strip()][-MAX_TRACEBACK_LINES:]
    last = f"{error.name}: {error.value}"
    if not lines or lines[-1].strip() != last.strip():
        lines.append(last)
    if execution.state_lost:
        lines.append("(the sandbox was restarted: its variables and imports are gone)")
    return "\n".join(lines)


def output_text(execution: Execution) -> str:
    """What a run printed and showed, then its value or error, as one text for a model."""
    parts = [execution.stdout, execution.stderr]
    parts += [f"[display: {', '.join(sorted(bundle))}]" for bundle in execution.displays
              if "text/plain" not in bundle]
    parts += [bundle["text/plain"] for bundle in execution.displays if "text/plain" in bundle]
    if execution.result is not None:
        parts.append(json.dumps(execution.result))
    elif execution.text is not None:
        parts.append(execution.text)
    parts.append(error_text(execution))
    return "\n".join(part.rstrip("\n") for part in parts if part)


Named = tuple[str, Callable[..., Any]]


def granted_tools(tools: Iterable[Any] | Mapping[str, Callable[..., Any]],
                  convert: Callable[[Any], Named | None], kind: str) -> dict[str, Callable]:
    """A framework's tools (each made a host function by convert, None for a plain function)
    or plain functions, or {name: function}, as the bridge's {name: callable}."""
    if isinstance(tools, Mapping):
        return dict(tools)
    granted: dict[str, Callable[..., Any]] = {}
    for tool in tools:
        named = convert(tool)
        if named is None:
            if not callable(tool):
                raise TypeError(f"not a tool: {tool!r} ({kind} or a function)")
            named = (tool.__name__, tool)
        granted[named[0]] = named[1]
    return granted


def made_or_given(kind: type, sandbox: Any, tool_limits: ToolLimits | None,
                  options: dict[str, Any]) -> tuple[Any, bool]:
    """The sandbox given, or one of `kind` made from options with `kernel_name=None` (this
    package's own kernel, the default policy: no network, no processes); whether it was made."""
    if sandbox is not None:
        return sandbox, False
    return kind(**{"kernel_name": None, **options}, tool_limits=tool_limits), True


class _Session:
    """A sandbox (given, or made with `kernel_name=None`), the tools every run grants, their
    names bound in the kernel once it starts, and every run made (`executions`, an audit)."""

    kind: type = Sandbox

    def __init__(self, sandbox: Any, tools: dict[str, Callable[..., Any]], timeout: float | None,
                 tool_limits: ToolLimits | None, sandbox_options: dict[str, Any],
                 setup: str = "") -> None:
        self.sandbox, self.own = made_or_given(self.kind, sandbox, tool_limits, sandbox_options)
        self.tools = tools
        self.timeout = timeout
        self.setup = setup  # kernel code run with the tools' binding (after each restart too)
        self.executions: list[Execution] = []
        self.started = False

    def binding(self) -> str:
        """The kernel code that binds the tools' names (and runs `setup`)."""
        return forwarders(list(self.tools)) + self.setup

    def refused(self, done: Execution) -> None:
        """Raise if binding the tools failed."""
        if done.error is not None:
            raise RuntimeError(f"the sandbox refused the tools: {output_text(done)}")

    def run(self, code: str, **options: Any) -> Any:
        """The run of code with the tools granted (for AsyncSession, an awaitable)."""
        return self.sandbox.run(code, timeout=self.timeout, tools=self.tools, **options)


class Session(_Session):
    """A blocking Sandbox's session."""

    def start(self) -> None:
        """Start the kernel (unless it runs already) and bind the tools' names in it."""
        if not self.started:
            if self.sandbox.client is None:
                self.sandbox.start()
            self.started = True
            self.bind_tools()

    def bind_tools(self) -> None:
        """Bind the tools' names in the kernel (again after a restart)."""
        if code := self.binding():
            self.refused(self.run(code))

    def close(self) -> None:
        """Close the sandbox if this session made it."""
        if self.own and self.started:
            self.sandbox.close()
        self.started = False


class AsyncSession(_Session):
    """An AsyncSandbox's session."""

    kind = AsyncSandbox

    async def start(self) -> None:
        """Start the kernel (unless it runs already) and bind the tools' names in it."""
        if not self.started:
            if self.sandbox.client is None:
                await self.sandbox.start()
            self.started = True
            await self.bind_tools()

    async def bind_tools(self) -> None:
        """Bind the tools' names in the kernel (again after a restart)."""
        if code := self.binding():
            self.refused(await self.run(code))

    async def close(self) -> None:
        """Close the sandbox if this session made it."""
        if self.own and self.started:
            await self.sandbox.close()
        self.started = False
