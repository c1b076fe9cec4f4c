"""A run of code in the background, collected in parts: a long run never holds a call.

`run_python` starts a Run and waits up to the server's patience for it. A run still going by
then is answered with the output so far and its id; `wait_run` collects the rest, each answer
carrying what the previous ones did not. A run that ends unasked-for is kept a while for its
caller, then forgotten.

A run in a session runs on its kernel here; a run without one is hosting's fresh run
(hosting/fresh.py: its kernel, its deadline, the owner's share of --max-runs by hosting's
admission), which keeps the files it wrote for the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..client import AsyncSandbox, Execution, oneshot
from ..client.collect import info_of
from ..client.tools import Toolbox
from ..errors import KernelUnavailable, ServiceStopping
from ..hosting.admission import Admission, Busy
from ..hosting.fresh import Runner, RunRecord
from ..hosting.sessions import Session, Sessions
from . import files
from .config import McpConfig
from .problems import SessionProblem

log = logging.getLogger("sandbox_kernel.mcp")
KEEP_FINISHED = 600.0  # seconds a finished run waits to be collected
WRITTEN_LIMIT = 50  # files a run wrote that its result lists at most


@dataclass(eq=False)
class Run:
    """One execution in progress or done, and how much of it its caller has seen."""

    id: str
    owner: str
    session: Session | None
    timeout: float
    started: float = field(default_factory=time.time)
    chunks: list[dict[str, str]] = field(default_factory=list)  # stream output, in order
    displays: list[dict[str, Any]] = field(default_factory=list)
    seen_chunks: int = 0
    seen_displays: int = 0
    execution: Execution | None = None
    written: list[tuple[str, int, float]] = field(default_factory=list)
    embedded: dict[str, bytes] = field(default_factory=dict)  # a fresh kernel's files, kept
    sandbox: AsyncSandbox | None = None  # a session's kernel, while the run is on it
    fresh: RunRecord | None = None  # a run without a session: hosting's record of it
    task: asyncio.Task[None] | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        """Whether the run has finished (its execution is in)."""
        return self.execution is not None

    @property
    def has_kernel(self) -> bool:
        """Whether its code has a kernel yet (the first fresh run waits for the fork server
        and its pool to start; a session's run for the session's lock)."""
        return self.sandbox is not None or bool(self.fresh and self.fresh.kernel_id)

    def progress(self) -> str:
        """What a progress notification says of the run while it goes on."""
        elapsed = time.time() - self.started
        if not self.has_kernel:
            return (f"starting a sandbox for the code ({elapsed:.0f} s; the first run after "
                    "the server starts also starts its kernels, ~10 s)")
        return f"running ({elapsed:.0f} s)"

    def take_new(self) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
        """The output and displays the caller has not been given yet."""
        chunks, displays = self.chunks[self.seen_chunks:], self.displays[self.seen_displays:]
        self.seen_chunks, self.seen_displays = len(self.chunks), len(self.displays)
        return chunks, displays


class Runs:
    """Every run not yet collected, by id; an owner sees only its own."""

    def __init__(self, config: McpConfig, runner: Runner, sessions: Sessions) -> None:
        self.config = config
        self.runner = runner
        self.sessions = sessions
        self._runs: dict[str, Run] = {}
        self.toolbox: Toolbox | None = None  # the --tools-from servers' tools, every run's

    def get(self, owner: str, run_id: str) -> Run:
        """The caller's run of that id; SessionProblem when it is not theirs or gone."""
        run = self._runs.get(run_id)
        if run is None or run.owner != owner:
            raise SessionProblem(f"there is no run {run_id!r} (a finished run is forgotten "
                                 "once its result was returned)")
        return run

    @property
    def admission(self) -> Admission:
        """Hosting's admission of runs without a session (--max-runs, a share per key)."""
        return self.runner.admission

    def start(self, owner: str, code: str, inputs: dict | None, session: Session | None,
              timeout: float) -> Run:
        """Begin a run in the session's kernel, or in a fresh one (within the owner's share
        and the server's --max-runs at once)."""
        if session is not None and session.busy:
            doing = f"run {session.run_id}" if session.run_id else "a file operation"
            raise SessionProblem(f"session {session.id} is still busy with {doing}: collect a "
                                 "run with wait_run, or stop it with interrupt")
        release = None if session is not None else self._admit(owner)
        run = Run(secrets.token_hex(8), owner, session, timeout)
        if session is not None:
            session.run_id = run.id  # busy from now, before the run's task takes the lock
        self._runs[run.id] = run
        run.task = asyncio.ensure_future(self._execute(run, code, inputs))
        if release is not None:
            run.task.add_done_callback(lambda _: release())
        return run

    def _admit(self, owner: str) -> Callable[[], None]:
        """A place for a run without a session, or why there is none, said for a model."""
        try:
            return self.admission.enter(owner)
        except Busy as busy:
            if not busy.per_tenant:
                raise SessionProblem(
                    f"this server is running its limit of {self.config.max_runs} runs "
                    "without a session: try again in a moment, or run in a session "
                    "(create_session)") from None
            raise SessionProblem(
                f"you have {self.admission.in_flight_of(owner)} runs without a session still "
                f"going (at most {self.admission.requests_cap} at once): collect them with "
                "wait_run or stop them with interrupt, then try again") from None

    async def wait(self, run: Run, seconds: float) -> None:
        """Wait until the run ends or `seconds` pass, whichever is first."""
        if run.task is not None and not run.task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(run.task), seconds)

    def forget(self, run: Run) -> None:
        """The caller has the whole run: drop it."""
        self._runs.pop(run.id, None)

    def owned_by(self, owner: str) -> list[Run]:
        """The runs this client (API key) started and has not collected."""
        return [run for run in self._runs.values() if run.owner == owner]

    def cull(self) -> None:
        """Forget finished runs nobody collected."""
        now = time.monotonic()
        for run in [r for r in self._runs.values()
                    if r.finished_at is not None and now - r.finished_at > KEEP_FINISHED]:
            self.forget(run)

    async def interrupt(self, run: Run) -> None:
        """Interrupt the run's code (a session's kernel stays)."""
        if run.fresh is not None and not run.done:
            await run.fresh.interrupt()
        elif run.sandbox is not None and not run.done:
            await run.sandbox.interrupt()

    def _callbacks(self, run: Run) -> dict[str, Any]:
        return {"on_stdout": lambda text: run.chunks.append({"stream": "stdout", "text": text}),
                "on_stderr": lambda text: run.chunks.append({"stream": "stderr", "text": text}),
                "on_display": run.displays.append}

    async def _execute(self, run: Run, code: str, inputs: dict | None) -> None:
        try:
            if run.session is not None:
                await self._in_session(run, run.session, code, inputs)
            else:
                await self._fresh(run, code, inputs)
        except Exception as exc:  # the kernel could not be had, or was lost under the run
            log.warning("run %s failed: %s", run.id, exc)
            run.execution = Execution(error=info_of(KernelUnavailable(
                f"the sandbox could not run the code: {exc}")), state_lost=True)
        finally:
            if run.execution is None:  # cancelled at shutdown
                run.execution = Execution(error=info_of(ServiceStopping(
                    "the server is shutting down")), state_lost=True)
            run.finished_at = time.monotonic()

    async def _in_session(self, run: Run, session: Session, code: str,
                          inputs: dict | None) -> None:
        async with session.lock:
            run.sandbox = session.sandbox
            try:
                run.execution = await session.sandbox.run(code, inputs, timeout=run.timeout,
                                                          tools=self.toolbox,
                                                          **self._callbacks(run))
                await self._find_written(run, session.sandbox)
            except Exception:
                # its kernel cannot be trusted to work again
                await self.sessions.close_now(session, "its kernel failed under a run")
                raise
            finally:
                session.run_id, session.last_used = None, time.monotonic()

    async def _fresh(self, run: Run, code: str, inputs: dict | None) -> None:
        """A run without a session, on the kernel hosting's rule gives it; the files it wrote
        are kept (a one-shot kernel sends them before it ends; a ZMQ kernel is asked)."""
        run.fresh = RunRecord(one_shot=oneshot.RunHandle(
            files.keep_request(run.started, WRITTEN_LIMIT, self.config.embed_bytes)))

        def on_output(kind: str, payload: Any) -> None:
            if kind == "display":
                run.displays.append(payload)
            else:
                run.chunks.append({"stream": kind, "text": payload})

        async def keep(sandbox: AsyncSandbox, execution: Execution) -> None:
            await self._keep_files(run, sandbox)

        run.execution, _ = await self.runner.run(
            code, network=self.config.policy.allow_network, timeout=run.timeout,
            tenant=run.owner, inputs=inputs, record=run.fresh, on_output=on_output,
            raw_result=False, keep=keep, tools=self.toolbox)
        if run.fresh.on_one_shot and run.fresh.one_shot is not None \
                and not run.execution.state_lost:
            try:
                run.written, run.embedded = files.kept(run.fresh.one_shot.kept, WRITTEN_LIMIT,
                                                       self.config.embed_bytes)
            except files.FileError as exc:
                log.info("run %s: could not keep its files: %s", run.id, exc)

    async def _find_written(self, run: Run, sandbox: AsyncSandbox) -> None:
        """The files the run wrote or changed (not worth failing the run over)."""
        try:
            run.written, _ = await files.listing(sandbox, ".", since=run.started,
                                                 limit=WRITTEN_LIMIT)
        except Exception as exc:
            log.info("run %s: could not list its files: %s", run.id, exc)

    async def _keep_files(self, run: Run, sandbox: AsyncSandbox) -> None:
        """A fresh kernel's scratch ends with it: list the files the run wrote and keep the
        small ones (not worth failing the run over)."""
        try:
            run.written, run.embedded = await files.keep(sandbox, run.started, WRITTEN_LIMIT,
                                                         self.config.embed_bytes)
        except Exception as exc:
            log.info("run %s: could not keep its files: %s", run.id, exc)

    async def close(self) -> None:
        """Cancel the runs in progress."""
        tasks = [run.task for run in self._runs.values() if run.task and not run.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
