"""The tools an agent calls: run code, keep sessions, move files.

Each tool is a plain async function whose signature and return annotation are its input and
output schemas (the SDK derives them, so annotations here are evaluated, not postponed);
failures a model can act on raise ToolError with a message written for it.
"""


import base64
import contextlib
import time
from collections.abc import Awaitable
from typing import Annotated, Any, Literal, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import Field

from ..client.sandbox import install_code
from ..hosting.sessions import Session, SessionError
from ..hosting.store import StoreError
from ..secrets import SecretError
from . import files, messages, render
from .bridge import described
from .problems import SessionProblem, for_model
from .shapes import (
    Done,
    FileContent,
    FileEntry,
    FileList,
    FileWritten,
    RestoreInfo,
    RunResult,
    SessionInfo,
    SessionList,
    SnapshotInfo,
    SnapshotList,
    paused_info,
    session_info,
)
from .state import State

RUN_PYTHON = """Run Python code in a sandbox and return what it printed, its result, charts and \
errors.
No subprocesses or shell commands{network}; files live in the sandbox's working directory.
Without `session`, each call gets a fresh sandbox and nothing is kept afterwards; create a \
session (create_session) to keep variables, imports and files between calls.
With `inputs`, the code must define `main(**inputs)` returning a JSON-able dict: that dict is \
the result. Otherwise the value of the last expression is returned, as in a notebook.
Charts (matplotlib, PIL images shown with display()) come back as images. A call returns \
within about {patience:g} s: a longer run answers with status "running" and the output so far; \
collect the rest with wait_run."""


T = TypeVar("T")
PROGRESS_EVERY = 1.0  # seconds between progress notifications while a call waits for its run


def _check(call: Any) -> Any:
    """Run a state operation, turning what a model can act on into a ToolError."""
    try:
        return call()
    except (SessionProblem, files.FileError, ValueError) as exc:
        raise ToolError(str(exc)) from None
    except (SessionError, StoreError) as exc:
        raise ToolError(for_model(exc)) from None


async def _hosted(call: Awaitable[T]) -> T:
    """Await one of hosting's operations, its refusals said to a model as a ToolError."""
    try:
        return await call
    except (SessionError, StoreError) as exc:
        raise ToolError(for_model(exc)) from None


def register(server: MCPServer, state: State) -> None:
    """Add every tool to the server; `state.describe(stubs)` adds the --tools-from servers'
    tools to run_python's description once they are known (mcp/bridge.py)."""
    config = state.config
    network = " and no network" if not config.policy.allow_network else ""
    Code = Annotated[str, Field(description="Python source code.", max_length=1_000_000)]
    SessionId = Annotated[str, Field(description="A session id from create_session.")]

    async def session_of(session_id: str) -> Session:
        key = state.key(state.owner())
        if state.pausing is not None and state.sessions.find(key.id, session_id) is None:
            # a paused session comes back on a fresh kernel, its state restored
            await _hosted(state.pausing.resume(key, session_id))
        return _check(lambda: state.sessions.get(key, session_id))

    async def answer(run: Any, wait: float, ctx: Context | None = None) -> CallToolResult:
        """The run's answer once it ends or `wait` passes; meanwhile, to a caller that asked
        for progress, a notification every PROGRESS_EVERY seconds saying what it waits for."""
        deadline = time.monotonic() + wait
        while not run.done and (left := deadline - time.monotonic()) > 0:
            await state.runs.wait(run, min(PROGRESS_EVERY, left))
            if ctx is not None and not run.done:  # a no-op unless the caller sent a token
                await ctx.report_progress(time.time() - run.started, message=run.progress())
        result = render.result(run, config)
        if run.done:
            state.runs.forget(run)
        return result

    async def run_python(
        code: Code,
        inputs: Annotated[dict[str, Any] | None, Field(
            description="Arguments of main(**inputs), by name; omit to run the code as a "
            "notebook cell.")] = None,
        session: Annotated[str | None, Field(
            description="Run in this session (create_session) to keep state between calls; "
            "omit for a fresh sandbox.")] = None,
        timeout: Annotated[float | None, Field(
            description=f"Seconds the code may run (default {config.default_timeout:g}, at "
            f"most {config.max_timeout:g}).")] = None,
        ctx: Context | None = None,
    ) -> Annotated[CallToolResult, RunResult]:
        limit = _check(lambda: config.timeout(timeout))
        held = await session_of(session) if session is not None else None
        owner = state.owner()
        run = _check(lambda: state.runs.start(owner, code, inputs, held, limit))
        return await answer(run, config.patience, ctx)

    async def wait_run(
        run: Annotated[str, Field(description="The run id a running answer gave.")],
        wait: Annotated[float | None, Field(
            description=f"Seconds to wait for it (default and most {config.patience:g}).",
            gt=0)] = None,
        ctx: Context | None = None,
    ) -> Annotated[CallToolResult, RunResult]:
        """Collect more of a run that was still going: its new output, and its end if it ended."""
        found = _check(lambda: state.runs.get(state.owner(), run))
        return await answer(found, min(wait or config.patience, config.patience), ctx)

    async def create_session(
        network: Annotated[bool | None, Field(
            description="Let its code use the network (only where this server allows it).")
        ] = None,
        packages: Annotated[list[str] | None, Field(
            description="Packages the code will import: those missing are installed (wheels "
            "from the package index, where the network is allowed); the session is refused, "
            "naming them, if any is still missing.")] = None,
        secrets: Annotated[dict[str, Any] | None, Field(
            description='Credentials the code may use but never read, {"NAME": {"value": '
            '"...", "hosts": ["api.example.com"]}}: os.environ[NAME] holds a placeholder that '
            "the sandbox's proxy replaces with the value in requests to those hosts. Needs "
            "the network. Never shown back.")] = None,
        snapshot: Annotated[str | None, Field(
            description="Start from this snapshot (snapshot_session): its variables, "
            "imports and files, on the network it was made with.")] = None,
    ) -> SessionInfo:
        """Open a session: a sandbox of its own that keeps variables, imports and files between
        run_python calls until closed (or idle too long)."""
        wanted = config.policy.allow_network if network is None else network
        if wanted and not config.policy.allow_network:
            raise ToolError(messages.NO_NETWORK_SESSION)
        key, restore = state.key(state.owner()), None
        if snapshot is not None:  # its own network: a restore never changes what it reaches
            if state.pausing is None:
                raise ToolError("this server keeps no snapshots (it was started without "
                                "--state-dir): create the session without snapshot")
            wanted, restore = _check(lambda: state.pausing.restorable(key.id, snapshot, network))
        try:
            session = await _hosted(state.sessions.create(
                key, wanted, config.session_idle_timeout, restore, secrets=secrets))
        except SecretError as exc:  # a SecretError never names a value
            raise ToolError(str(exc)) from None
        missing = await _provide_packages(session, packages or [], config.max_timeout)
        if missing:
            await state.sessions.close_now(session)
            how = "they could not be installed" if session.network else \
                "packages cannot be installed here (the network is off)"
            raise ToolError(f"not available in this sandbox: {', '.join(missing)}; {how}. Read "
                            "the sandbox://policy resource for what is installed, and use "
                            "those instead.")
        report = session.restore_report()
        return session_info(session).model_copy(
            update={"restore": None if report is None else RestoreInfo(**report)})

    async def close_session(session: SessionId) -> Done:
        """Close a session: its sandbox, variables and files are gone."""
        held = await session_of(session)
        await state.sessions.close_now(held)  # a run in it ends with an error, kept for wait_run
        return Done(ok=True, message=f"session {held.id} is closed")

    async def list_sessions() -> SessionList:
        """Your open sessions (paused ones too: the next call naming one resumes it)."""
        owner = state.owner()
        live = state.sessions.owned_by(owner)
        known = {s.id for s in live}  # a running session's last pause is not shown
        paused = [] if state.pausing is None else [
            paused_info(p) for p in state.pausing.store.paused_of(owner) if p.id not in known]
        return SessionList(sessions=[session_info(s) for s in live] + paused)

    async def restart_session(session: SessionId) -> Done:
        """Restart a session's Python: its variables, imports and files are gone; the session
        id stays."""
        held = await session_of(session)
        if held.busy:
            raise ToolError(f"session {held.id} is busy: interrupt it first")
        async with held.lock:
            await held.sandbox.restart()
        return Done(ok=True, message=f"session {held.id} restarted: its variables and files are "
                    "cleared")

    async def interrupt(
        session: Annotated[str | None, Field(description="Interrupt this session's run.")
                           ] = None,
        run: Annotated[str | None, Field(description="Or interrupt this run.")] = None,
    ) -> Done:
        """Stop code that is running (like Ctrl-C); a session keeps its variables."""
        if (session is None) == (run is None):
            raise ToolError("give either session or run")
        owner = state.owner()
        if session is not None:
            held = await session_of(session)
            if held.run_id is None:
                return Done(ok=False, message=f"session {held.id} is not running anything")
            run = held.run_id
        wanted: str = run  # type: ignore[assignment]  # one of the two is given
        found = _check(lambda: state.runs.get(owner, wanted))
        if found.done:
            return Done(ok=False, message=f"run {found.id} has already finished: collect it "
                        "with wait_run")
        await state.runs.interrupt(found)
        return Done(ok=True, message=f"run {found.id} interrupted: collect what it printed "
                    "with wait_run")

    async def list_files(
        session: SessionId,
        path: Annotated[str, Field(description="A folder in the working directory.")] = ".",
    ) -> FileList:
        """The files in a session's working directory (hidden ones left out)."""
        found, more = await _file_op(state, await session_of(session),
                                     lambda sb: files.listing(sb, path))
        return FileList(files=[FileEntry(path=p, size=s, modified=m) for p, s, m in found],
                        truncated=more)

    async def read_file(
        session: SessionId,
        path: Annotated[str, Field(description="Relative to the working directory.")],
    ) -> Annotated[CallToolResult, FileContent]:
        """Read a file from a session's working directory: text as text, images as images,
        other binary files as base64."""
        held = await session_of(session)
        content = await _file_op(state, held, lambda sb: files.read(
            sb, path, config.max_file_bytes))
        return _file_result(files.relative(path), content, config.max_text)

    async def write_file(
        session: SessionId,
        path: Annotated[str, Field(description="Relative to the working directory; folders "
                                   "are created.")],
        content: Annotated[str, Field(description="The text, or base64 with encoding "
                                      "base64.")],
        encoding: Literal["text", "base64"] = "text",
    ) -> FileWritten:
        """Write a file into a session's working directory, for its code to use."""
        held = await session_of(session)
        try:
            data = base64.b64decode(content, validate=True) if encoding == "base64" \
                else content.encode("utf-8")
        except ValueError:
            raise ToolError("content is not valid base64") from None
        if len(data) > config.max_file_bytes:
            raise ToolError(f"the file is larger than this server accepts "
                            f"({config.max_file_bytes:,} bytes)")
        size = await _file_op(state, held, lambda sb: files.write(sb, path, data))
        relative = files.relative(path)
        return FileWritten(path=relative, size=size, uri=render.file_uri(held.id, relative))

    if state.pausing is not None:
        _register_snapshots(server, state, SessionId, session_of)
    def describe(stubs: str = "") -> None:
        """(Re)add run_python, its description listing the bridged tools' stubs."""
        with contextlib.suppress(Exception):  # not added yet
            server.remove_tool("run_python")
        server.add_tool(run_python, description=RUN_PYTHON.format(
            network=network, patience=config.patience) + described(stubs),
            title="Run Python in a sandbox",
            annotations=ToolAnnotations(destructive_hint=False,
                                        open_world_hint=config.policy.allow_network
                                        or bool(stubs)))

    describe()
    state.describe = describe
    server.add_tool(wait_run, annotations=ToolAnnotations(read_only_hint=True))
    changing: tuple[Any, ...] = (create_session, close_session, restart_session, interrupt,
                                 write_file)
    for tool in changing:
        server.add_tool(tool, annotations=ToolAnnotations(open_world_hint=False))
    reading: tuple[Any, ...] = (list_sessions, list_files, read_file)
    for tool in reading:
        server.add_tool(tool, annotations=ToolAnnotations(read_only_hint=True,
                                                          open_world_hint=False))


def _register_snapshots(server: MCPServer, state: State, SessionId: Any,
                        session_of: Any) -> None:
    """The snapshot tools, on a server with a state dir."""
    pausing = state.pausing
    assert pausing is not None

    async def snapshot_session(session: SessionId) -> SnapshotInfo:
        """Save a session's variables, imports, installed packages and files as a snapshot;
        the session goes on as it was. Open it again, as often as you like, with
        create_session(snapshot=...). What could not be saved (open files, generators,
        threads...) is listed in skipped, with the reason."""
        held = await session_of(session)
        item, taken = await _hosted(pausing.snapshot(held))
        return SnapshotInfo(snapshot=item.id, bytes=item.size, saved=taken.saved,
                            skipped=taken.skipped, session=held.id)

    async def list_snapshots() -> SnapshotList:
        """Your snapshots."""
        found = pausing.store.snapshots(state.owner())
        return SnapshotList(snapshots=[SnapshotInfo(
            snapshot=s.id, bytes=s.size, saved=s.record["manifest"].get("saved", []),
            skipped=s.record["manifest"].get("skipped", []), session=s.record["session"])
            for s in found])

    async def delete_snapshot(
        snapshot: Annotated[str, Field(description="A snapshot id from snapshot_session.")],
    ) -> Done:
        """Delete one of your snapshots (sessions opened from it go on)."""
        item = _check(lambda: pausing.store.snapshot(state.owner(), snapshot))
        pausing.store.delete_snapshot(item.owner, item.id)
        return Done(ok=True, message=f"snapshot {item.id} is deleted")

    for tool in (snapshot_session, delete_snapshot):
        server.add_tool(tool, annotations=ToolAnnotations(open_world_hint=False))
    server.add_tool(list_snapshots, annotations=ToolAnnotations(read_only_hint=True,
                                                                open_world_hint=False))


async def _file_op(state: State, session: Session, operation: Any) -> Any:
    """A file operation in the session's kernel, one at a time with its runs."""
    if session.busy:
        raise ToolError(f"session {session.id} is running {session.run_id}: wait for it "
                        "(wait_run) or interrupt it first")
    async with session.lock:
        try:
            return await operation(session.sandbox)
        except files.FileError as exc:
            raise ToolError(str(exc)) from None


_CHECK_PACKAGES = (
    "def main(names):\n"
    "    import importlib, importlib.metadata, importlib.util\n"
    "    importlib.invalidate_caches()\n"
    "    def there(name):\n"
    "        try:\n"
    "            importlib.metadata.distribution(name)\n"
    "            return True\n"
    "        except Exception:\n"
    "            pass\n"
    "        try:\n"
    "            return importlib.util.find_spec(name) is not None\n"
    "        except Exception:\n"
    "            return False\n"
    "    return {'missing': [n for n in names if not there(n)]}\n")


async def _missing(session: Session, names: list[str]) -> list[str]:
    execution = await session.sandbox.run(_CHECK_PACKAGES, {"names": names}, timeout=30)
    missing = (execution.result or {}).get("missing")
    return [str(name) for name in missing] if isinstance(missing, list) else list(names)


async def _provide_packages(session: Session, wanted: list[str], timeout: float) -> list[str]:
    """Install what the session lacks (%pip, where the network allows); what is still missing."""
    names = [name.split("==")[0].strip() for name in wanted[:50]]
    if not names:
        return []
    async with session.lock:
        missing = await _missing(session, names)
        if not missing or not session.network:
            return missing
        try:
            code = install_code([w for w, n in zip(wanted, names, strict=False) if n in missing])
        except ValueError as exc:
            raise ToolError(str(exc)) from None
        installed = await session.sandbox.run(code, timeout=timeout)
        if installed.error is not None:
            messages.log.info("installing %s failed: %s: %s", missing, installed.error.name,
                              installed.error.value)
        return await _missing(session, missing)


def _file_result(path: str, content: bytes, max_text: int) -> CallToolResult:
    mime = render.mime_of(path)
    if mime in render.IMAGES:
        shape = FileContent(path=path, size=len(content), encoding="base64", mime_type=mime)
        blocks: list[Any] = [TextContent(text=f"{path}: {len(content):,} bytes, {mime}"),
                             ImageContent(data=base64.b64encode(content).decode(),
                                          mime_type=mime)]
    else:
        try:
            text = content.decode("utf-8")
            shape = FileContent(path=path, size=len(content), encoding="text",
                                content=text, mime_type=mime)
            shown = messages.cut(text, max_text)
        except UnicodeDecodeError:
            data = base64.b64encode(content).decode()
            shape = FileContent(path=path, size=len(content), encoding="base64",
                                content=data, mime_type=mime)
            shown = f"{path}: {len(content):,} bytes of binary data ({mime}), base64:\n{data}"
        blocks = [TextContent(text=shown)]
    return CallToolResult(content=blocks, structured_content=shape.model_dump(mode="json"))
