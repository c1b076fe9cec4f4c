"""A run of code in the background, collected in parts: a long run never holds a call.

`run_python` starts a Run and waits up to the server's patience for it. A run still going by
then is answered with the output so far and its id; `wait_run` collects the rest, each answer
carrying what the previous ones did not. A run that ends unasked-for is kept a while for its
caller, then forgotten.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ..client import AsyncSandbox, CallerLimits, Execution, oneshot
from ..client.collect import info_of
from ..errors import KernelUnavailable, ServiceStopping
from ..launch.oneshot import OneShotPool, OneShotUnavailable
from . import files
from .config import McpConfig
from .kernels import KernelSource, Session, SessionProblem, Sessions

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
    sandbox: AsyncSandbox | None = None
    one_shot: oneshot.RunHandle | None = None  # a run without a session on a one-shot kernel
    task: asyncio.Task[None] | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        """Whether the run has finished (its execution is in)."""
        return self.execution is not None

    def take_new(self) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
        """The output and displays the caller has not been given yet."""
        chunks, displays = self.chunks[self.seen_chunks:], self.displays[self.seen_displays:]
        self.seen_chunks, self.seen_displays = len(self.chunks), len(self.displays)
        return chunks, displays


class Runs:
    """Every run not yet collected, by id; an owner sees only its own."""

    def __init__(self, config: McpConfig, source: KernelSource, sessions: Sessions) -> None:
        self.config = config
        self.source = source
        self.sessions = sessions
        self._runs: dict[str, Run] = {}
        self._closing: set[asyncio.Future[None]] = set()  # fresh kernels being shut down
        # Per owner, fresh kernels not yet shut down: from a run's start until its kernel is
        # gone (collected or not, a run keeps its kernel up to its timeout).
        self._fresh_live: collections.Counter[str] = collections.Counter()

    def get(self, owner: str, run_id: str) -> Run:
        """The caller's run of that id; SessionProblem when it is not theirs or gone."""
        run = self._runs.get(run_id)
        if run is None or run.owner != owner:
            raise SessionProblem(f"there is no run {run_id!r} (a finished run is forgotten "
                                 "once its result was returned)")
        return run

    def start(self, owner: str, code: str, inputs: dict | None, session: Session | None,
              timeout: float, fresh_limit: int | None = None) -> Run:
        """Begin a run in the session's kernel, or in a fresh one (at most `fresh_limit` of
        the owner's, and the server's max_runs, at once)."""
        if session is not None and session.busy:
            doing = f"run {session.run_id}" if session.run_id else "a file operation"
            raise SessionProblem(f"session {session.id} is still busy with {doing}: collect a "
                                 "run with wait_run, or stop it with interrupt")
        if session is None:
            self._check_fresh(owner, fresh_limit)
        run = Run(secrets.token_hex(8), owner, session, timeout)
        if session is not None:
            session.run_id = run.id  # busy from now, before the run's task takes the lock
        else:
            self._fresh_live[owner] += 1  # until its kernel is shut down (_fresh_ended)
        self._runs[run.id] = run
        run.task = asyncio.ensure_future(self._execute(run, code, inputs))
        return run

    def _check_fresh(self, owner: str, limit: int | None) -> None:
        if sum(self._fresh_live.values()) >= self.config.max_runs:
            raise SessionProblem(f"this server is running its limit of {self.config.max_runs} "
                                 "runs without a session: try again in a moment, or run in a "
                                 "session (create_session)")
        if limit is not None and self._fresh_live[owner] >= limit:
            raise SessionProblem(f"you have {self._fresh_live[owner]} runs without a session "
                                 f"still going (at most {limit} at once): collect them with "
                                 "wait_run or stop them with interrupt, then try again")

    def _fresh_ended(self, owner: str) -> None:
        self._fresh_live[owner] -= 1

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
        if run.one_shot is not None:
            run.one_shot.interrupt()
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
                                                          **self._callbacks(run))
                await self._find_written(run, session.sandbox)
            except Exception:
                await self.sessions.close(session)  # its kernel cannot be trusted to work again
                raise
            finally:
                session.run_id, session.last_used = None, time.monotonic()

    async def _fresh(self, run: Run, code: str, inputs: dict | None) -> None:
        """A run without a session: on a one-shot kernel, else on a ZMQ kernel of its own."""
        try:
            one_shot = await self.source.one_shot(self.config.policy.allow_network)
            ran = one_shot is not None and await self._on_one_shot(run, *one_shot, code, inputs)
        except BaseException:
            self._fresh_ended(run.owner)
            raise
        if ran:
            self._fresh_ended(run.owner)  # its process ended with the run
        else:
            await self._on_zmq_kernel(run, code, inputs)

    async def _on_one_shot(self, run: Run, pool: OneShotPool, limits: CallerLimits, code: str,
                           inputs: dict | None) -> bool:
        """The run on a one-shot kernel, which sends the files it wrote before it ends; False
        when none took it (nothing ran: a ZMQ kernel runs it instead)."""
        run.one_shot = oneshot.RunHandle(files.keep_request(run.started, WRITTEN_LIMIT,
                                                            self.config.embed_bytes))
        try:
            run.execution = await oneshot.run(pool, code, inputs, run.timeout, limits=limits,
                                              handle=run.one_shot, **self._callbacks(run))
        except OneShotUnavailable as exc:
            log.warning("run %s: no one-shot kernel took it (%s): a ZMQ kernel runs it", run.id,
                        exc)
            run.one_shot = None
            return False
        if not run.execution.state_lost:
            try:
                run.written, run.embedded = files.kept(run.one_shot.kept, WRITTEN_LIMIT,
                                                       self.config.embed_bytes)
            except files.FileError as exc:
                log.info("run %s: could not keep its files: %s", run.id, exc)
        return True

    async def _on_zmq_kernel(self, run: Run, code: str, inputs: dict | None) -> None:
        try:
            sandbox = run.sandbox = await self.source.get(self.config.policy.allow_network)
        except BaseException:
            self._fresh_ended(run.owner)
            raise
        try:
            run.execution = await sandbox.run(code, inputs, timeout=run.timeout,
                                              **self._callbacks(run))
            if not run.execution.state_lost:
                await self._keep_files(run, sandbox)
        finally:  # the answer need not wait for the kernel's end
            closing = asyncio.ensure_future(_close_quietly(sandbox))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            closing.add_done_callback(lambda _: self._fresh_ended(run.owner))

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
        await asyncio.gather(*self._closing, return_exceptions=True)


async def _close_quietly(sandbox: AsyncSandbox) -> None:
    with contextlib.suppress(Exception):
        await sandbox.close(now=True)
