"""Sandbox and AsyncSandbox: a sandboxed kernel to run code (or a `main()` call) in.

    with Sandbox() as sb:
        ex = sb.run("def main(x):\n    print('hi')\n    return {'y': x * 2}", inputs={"x": 21})
        ex.result  # {'y': 42}; ex.stdout == 'hi\\n'

Both classes share one body: each operation is written once, in `_SandboxCore`, as *steps*, a
generator that yields the calls it needs made (`(inbox.receive, 0.2)`, `(manager.is_alive,)`)
and is sent back their answers (or has their exceptions thrown in). Sandbox makes those calls as
they are; AsyncSandbox awaits the ones that return awaitables. jupyter_client derives its
blocking manager from the async one with run_sync, which turns an event loop for every call;
here the blocking Sandbox stays plain blocking calls, so its hot path (a warm `main()` call,
a fresh fork-served request) costs what it did while nothing is written twice.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import queue
import shlex
import sys
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from .. import advice, jsonwire
from ..confine import paths
from ..errors import ExecutionAborted
from ..install import DEFAULT_NAME
from ..kernel.snapshot import CHUNK_MESSAGE, DEFAULT_MAX_FILES  # names only: nothing unpickles
from ..launch.oneshot import OneShotPool, OneShotUnavailable, default_process
from ..policy import SandboxPolicy
from ..resultcheck import checked_elsewhere
from . import oneshot
from .collect import POLL, Call, Callback, Collector, Watchdog, info_of
from .execution import Execution, Usage, error_from
from .inbox import AsyncInbox, Inbox, queued_reply
from .managers import AsyncSandboxKernelManager, SandboxKernelManager
from .meter import KernelProcess, Meter, SessionTotal, open_process
from .receive import SMALL_PART, CallerLimits, oversize_error, shared_context
from .snapshot import (
    DEFAULT_MAX_SIZE,
    FORMAT_VERSION,
    Sealing,
    Snapshot,
    SnapshotError,
    SnapshotTooLarge,
    check_policy,
    new_key,
    open_sealed,
    restore_policy,
)
from .specs import installed_policy, manager_kwargs
from .tools import (
    Approve,
    StdinDesk,
    StdinLink,
    Toolbox,
    ToolLimits,
    ToolLoop,
    ToolRun,
    refuse_reentry,
)

GRACE_SECONDS = 5.0  # default time a kernel gets past its deadline, and after an interrupt
# After the kernel_info_reply, how long to wait for an IOPub message (which proves the
# subscription) before asking again: a fork-served kernel answers before IOPub has joined.
_IOPUB_JOIN = 0.05
_RECONNECT_MS = 10
_REPLY_WAIT = 2.0  # the reply is sent before the kernel goes idle; this only bounds a lost one
# warm_up()'s request: silent and without history, it leaves no execution count, no history
# entry and no variable behind (and the kernel keeps its last-result state as it was); it only
# makes the first run pay nothing for first-time work.
_WARM_UP = {"code": "pass", "silent": True, "store_history": False, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": False}
_STARTING = ("Kernel died before replying to kernel_info",  # as jupyter_client's wait_for_ready
             "Kernel didn't respond in {timeout:g} seconds")
_WARMING_UP = ("the kernel died while warming up (before any code of the caller ran)",
               "the kernel did not answer a silent `pass` within {timeout:g} s")

# The kernel side of snapshots (kernel/snapshot.py), called with the main() convention.
_SNAPSHOT_ENTRYPOINT = "__sandbox_snapshot__"
_SNAPSHOT_CODE = f"from sandbox_kernel.kernel.snapshot import {_SNAPSHOT_ENTRYPOINT}"
# Payload bytes per message at most (a frame the caller's sockets take: fewer under small
# --max-output/--max-result), and per call (the messages one call publishes wait in the
# kernel's IOPub queue, whose high-water mark is far above this many).
_SNAPSHOT_CHUNK = 16 * 2**20
_SNAPSHOT_CHUNKS_PER_CALL = 4
_SNAPSHOT_CALL_TIMEOUT = 600.0  # one step of a snapshot or restore (a 1 GB one takes seconds)

T = TypeVar("T")
Steps = Generator[Call, Any, T]


def _reply_error(execution: Execution, reply: dict[str, Any] | None) -> None:
    """Take the error from the execute_reply when no `error` message came (e.g. a kernel at its
    thread limit cannot format and publish one, or one that aborted the request without running
    it): a failed run never reads as a success."""
    content = (reply or {}).get("content", {})
    if execution.error is None and content.get("status") == "error":
        execution.error = error_from(content)
    elif execution.error is None and content.get("status") == "aborted":
        execution.error = info_of(ExecutionAborted(
            "the kernel aborted this run without running it (it was shutting down, or another "
            "client's cell queued before it failed); run it again"))


def _sandbox_metadata(inputs: dict | None, timeout: float | None, entrypoint: str,
                      timeout_source: str = "Sandbox.run(timeout=)") -> dict:
    meta: dict[str, Any] = {}
    if inputs is not None:
        meta["entrypoint"] = entrypoint
        meta["inputs"] = inputs
    if timeout is not None:
        # The label only names the limit in the kernel's ExecutionTimeout message.
        meta.update(timeout=timeout, timeout_source=timeout_source)
    return {"sandbox": meta} if meta else {}


def _execute_request(client: Any, code: str, inputs: dict | None, timeout: float | None,
                     entrypoint: str, timeout_source: str) -> dict[str, Any]:
    msg = client.session.msg("execute_request", {
        # A main() call is not a notebook cell: no history to write (it costs the kernel a thread
        # wake-up and a database row per call).
        "code": code, "silent": False, "store_history": inputs is None,
        # Not stop_on_error: a run the caller stopped waiting for (a cancelled task) that then
        # fails must not abort the next run queued behind it, as a notebook's "run all" would.
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": False})
    msg["metadata"].update(_sandbox_metadata(inputs, timeout, entrypoint, timeout_source))
    return msg  # type: ignore[no-any-return]


def _warm_up_request(client: Any) -> dict[str, Any]:
    """The silent `pass` of warm_up(), marked so the kernel also keeps its last-result state."""
    msg = client.session.msg("execute_request", dict(_WARM_UP))
    msg["metadata"]["sandbox"] = {"warm_up": True}
    return msg  # type: ignore[no-any-return]


def _fast_reconnecting(client: Any) -> Any:
    """The sockets of a client (or manager) retry a refused connection after 10 ms, not 100.

    The first kernel_info request goes out before the kernel has bound its sockets; a
    fork-served kernel binds them within tens of milliseconds, and would otherwise wait out
    the rest of the 100 ms. The same holds for the manager's control socket, connected as the
    kernel starts: a shutdown soon after the start waited for its reconnection, 100 ms of
    every fresh kernel's graceful close. The context is the client's (or manager's) own.
    """
    client.context.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
    return client


def _start_channels(client: Any) -> None:
    """Connect the shell and IOPub channels, the only ones a sandbox reads.

    Liveness is the kernel process's (the manager's is_alive), not a client heartbeat thread;
    requests never allow stdin; the manager has a control socket of its own. The others are
    still created, and connected, the first time client.control_channel (etc.) is used.
    """
    client.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)


def _never_waiting(context: Any) -> Any:
    """No send on the context's sockets may wait: it raises zmq.Again instead.

    jupyter_client's Session.send sends synchronously, even on an asyncio socket; a DEALER whose
    peer failed the handshake (a port taken by another process's socket of the wrong type) has
    no pipe left, and such a send would hold the event loop forever (it froze the service).
    """
    context.setsockopt(zmq.SNDTIMEO, 0)
    return context


def _check_start(alive: bool, deadline: float, timeout: float,
                 errors: tuple[str, str] = _STARTING) -> None:
    """Raise if the kernel died or took too long (errors: what to say for each)."""
    if not alive:
        raise RuntimeError(errors[0])
    if time.monotonic() > deadline:
        raise RuntimeError(errors[1].format(timeout=timeout))


def _check_grants(kernel_info: dict[str, Any]) -> None:
    """Refuse a kernel that could not grant the folder its policy asked for (--grant-cwd), as
    a one-shot kernel refuses its request: the caller's reads would fail and its writes land
    in a scratch that is removed. (A notebook's kernel explains each refused open instead.)"""
    layers = kernel_info.get("sandbox", {}).get("layers", {})
    cwd = layers.get("cwd") if isinstance(layers, dict) else None
    if isinstance(cwd, dict) and cwd.get("refused"):
        raise RuntimeError(paths.cwd_not_granted(str(cwd.get("mode")), str(cwd["refused"])))


# --- the two ways of making a step's calls ------------------------------------------------------

_DONE = object()


def _advance(steps: Steps[Any], answer: Any, error: BaseException | None) -> Call:
    """The next call the steps ask for, or (_DONE, their return value)."""
    try:
        return steps.throw(error) if error is not None else steps.send(answer)
    except StopIteration as done:
        return (_DONE, done.value)


def _blocking_answer(call: Call) -> tuple[Any, Exception | None]:
    try:
        return call[0](*call[1:]), None
    except Exception as exc:  # handed to the steps, which catch what they expect
        return None, exc


async def _awaited_answer(call: Call) -> tuple[Any, Exception | None]:
    try:
        answer = call[0](*call[1:])
        return (await answer if inspect.isawaitable(answer) else answer), None
    except Exception as exc:  # handed to the steps, which catch what they expect
        return None, exc


def _blocking(operation: Callable[..., Steps[T]], locked: bool, name: str) -> Callable[..., T]:
    """A Sandbox method: the core's steps, each call made as it is (under the lock if locked)."""
    @functools.wraps(operation)
    def method(self: Sandbox, *args: Any, **kwargs: Any) -> T:
        refuse_reentry(self)  # a tool of this sandbox's run: its lock is held by that run
        with self._lock if locked else _NO_LOCK:
            steps = operation(self, *args, **kwargs)
            outcome: tuple[Any, Exception | None] = (None, None)
            while (call := _advance(steps, *outcome))[0] is not _DONE:
                outcome = _blocking_answer(call)
            return call[1]  # type: ignore[no-any-return]

    method.__name__ = name
    return method


def _awaiting(operation: Callable[..., Steps[T]], locked: bool, name: str) -> Callable[..., Any]:
    """An AsyncSandbox method: the core's steps, awaiting what their calls return."""
    @functools.wraps(operation)
    async def method(self: AsyncSandbox, *args: Any, **kwargs: Any) -> T:
        refuse_reentry(self)  # a tool of this sandbox's run: its lock is held by that run
        async with self._lock if locked else _NO_ASYNC_LOCK:
            steps = operation(self, *args, **kwargs)
            outcome: tuple[Any, Exception | None] = (None, None)
            while (call := _advance(steps, *outcome))[0] is not _DONE:
                outcome = await _awaited_answer(call)
            return call[1]  # type: ignore[no-any-return]

    method.__name__ = name
    return method


class _Operation:
    """A public method of both sandboxes written once, as steps: each class's `_driver` makes
    the method (Sandbox's makes the calls as they are, AsyncSandbox's awaits them)."""

    def __init__(self, steps: Callable[..., Steps[Any]], locked: bool = False) -> None:
        self.steps, self.locked, self.name = steps, locked, steps.__name__
        self.methods: dict[type, Callable[..., Any]] = {}
        self.__doc__ = steps.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, sandbox: Any, cls: type | None = None) -> Any:
        cls = cls or type(sandbox)
        method = self.methods.get(cls)
        if method is None:  # made once per class
            driver = getattr(cls, "_driver")  # noqa: B009  (each sandbox class has its own)
            method = self.methods[cls] = driver(self.steps, self.locked, self.name)
        return method if sandbox is None else method.__get__(sandbox, cls)


class _NoLock:
    """Stands in for the lock of a method that needs none."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NO_ASYNC_LOCK = _NoLock()


# --- the one body --------------------------------------------------------------------------------


def install_code(packages: Sequence[str], upgrade: bool = False) -> str:
    """The cell that installs packages (wheels) into a kernel's session: `%pip install ...`."""
    if not packages:
        raise ValueError("name at least one package to install")
    for package in packages:
        if not package or package.startswith("-") or any(c.isspace() for c in package):
            raise ValueError(f"not a requirement: {package!r} (give names such as 'x==1.0'; "
                             "options are not available)")
    return "%pip install " + ("-U " if upgrade else "") + shlex.join(packages)


class _ChunkCollector(Collector):
    """A run's collector that also takes the snapshot chunks the kernel publishes on IOPub."""

    def __init__(self, payload: Sealing, *args: Any) -> None:
        super().__init__(*args)
        self.payload = payload

    def feed(self, msg: dict[str, Any]) -> None:
        """Chunks go to the payload; everything else as to any run."""
        if (msg["header"]["msg_type"] == CHUNK_MESSAGE
                and msg.get("parent_header", {}).get("msg_id") == self.msg_id):
            content = msg["content"]
            if isinstance(content, (bytes, memoryview)):
                content = jsonwire.loads(content)
            self.payload.take(content.get("offset") if isinstance(content, dict) else None,
                              msg.get("buffers", []))
            return
        super().feed(msg)


class _SandboxCore:
    """What Sandbox and AsyncSandbox are made of: a kernel manager, limits, and the steps."""

    manager_class: type = SandboxKernelManager
    _complete: Any  # each class: how a one-shot run is completed
    _off_loop: Any  # each class: how a blocking call is made
    # How a large result kept as JSON is checked before the collector takes it: None, in
    # place (a blocking caller waits anyway); an event loop's caller, in a child process.
    _check_large: Any = None
    lock_class: type = threading.Lock
    context_class: type = zmq.Context
    inbox_class: type = Inbox
    sleep: Callable[[float], Any] = staticmethod(time.sleep)

    def __init__(self, kernel_name: str | None = DEFAULT_NAME, *,
                 policy: SandboxPolicy | None = None, startup_timeout: float = 60.0,
                 grace: float = GRACE_SECONDS, max_output: int | None = None,
                 max_result: int | None = None, cold_start: bool = False,
                 preload: Sequence[str] = (), timeout_source: str = "Sandbox.run(timeout=)",
                 one_shot: bool = False, python: str | None = None,
                 one_shot_process: str | None = None,
                 secrets: Mapping[str, Mapping[str, Any]] | None = None,
                 snapshot: Snapshot | bytes | None = None, snapshot_key: bytes | None = None,
                 snapshot_owner: str | None = None,
                 tools: Mapping[str, Callable[..., Any]] | None = None,
                 tool_limits: ToolLimits | None = None, approve_tool: Approve | None = None,
                 audit_tool_payloads: bool = False) -> None:
        """kernel_name: an installed kernelspec, or None for this package's own with `policy`,
        `cold_start` and `preload`. timeout_source: what a timeout's message says set the
        limit. one_shot: every run gets a kernel of its own that ends with it: with
        kernel_name None (and no cold_start) a one-shot kernel from the fork server's pool of
        this policy (kernel/lean.py, or kernel/oneshot.py with one_shot_process "kernel": no
        ZMQ, no state between runs; no kernel_info or install; interrupt() sends the run's
        process SIGINT), else a ZMQ kernel whose timeout keeps no state.
        one_shot_process: "shell" (the lean process) or "kernel"; None: the default
        (SANDBOX_ONE_SHOT_PROCESS, else launch/oneshot.py's DEFAULT_ONE_SHOT_PROCESS).
        python: with kernel_name None, the interpreter to run on (a runtime's, runtimes/).
        secrets: the caller's own, {NAME: {"value": ..., "hosts": [...]}}, with kernel_name
        None: declared in the policy by name and hosts, their values given to the kernel's
        companion alone (the package's secrets.py), each host within the policy's network.
        snapshot: a Snapshot (or its sealed bytes) to restore as soon as the kernel has
        started (see restore(); snapshot_key and snapshot_owner default to the Snapshot's);
        the report is then in `restored`.
        tools: {name: callable} the code of every run may call as `from sandbox_tools import
        name` (client/tools.py; run(tools=...) grants a run other ones); each call runs here,
        in the caller's process, within tool_limits (calls per run, seconds per call, bytes
        each way); approve_tool(name, {"args", "kwargs"}) -> True, or False or a reason to
        refuse the call; audit_tool_payloads: keep each call's arguments and result in
        `Execution.tool_calls` (by default only sizes, duration and outcome)."""
        policy, self._secret_values = _with_secrets(policy, secrets, kernel_name)
        policy = _advised_as_caller(policy, kernel_name)
        if snapshot is not None and one_shot:
            raise ValueError("a one-shot sandbox keeps no state to restore a snapshot into: "
                             "create the Sandbox without one_shot=True")
        recorded = policy.as_dict() if policy is not None else (
            installed_policy(kernel_name) if kernel_name else SandboxPolicy().as_dict())
        # Enforced here on what arrives, whatever the kernel does (see receive.py).
        self.limits = CallerLimits.from_policy(recorded, max_output, max_result)
        # The ZMQ context and kernel manager are made when first used (`context`, `manager`):
        # a one-shot sandbox's runs need neither, unless they fall back to a ZMQ kernel. The
        # arguments are checked now, as they always were.
        self._manager_kwargs = manager_kwargs(kernel_name, policy, cold_start, preload, python)
        self._context: Any = None
        self._manager: Any = None
        self.startup_timeout = startup_timeout
        self.grace = grace
        self.timeout_source = timeout_source
        self.one_shot = one_shot
        self._one_shot_run: oneshot.RunHandle | None = None  # the one-shot run going on
        # cold_start keeps meaning an interpreter of its own, started without the fork server.
        # Credentials reach a kernel's companion in a vault that one-shot kernels, made
        # before their request, cannot yet be given: their runs take a ZMQ kernel instead.
        self.one_shot_pool = OneShotPool(
            policy or SandboxPolicy(), 1, python=python or sys.executable, preload=preload,
            process=one_shot_process or default_process()) \
            if one_shot and kernel_name is None and not cold_start \
            and not (policy is not None and policy.holds_credentials()) else None
        self.client: Any = None
        self._inbox: Any = None
        self._process: KernelProcess | None = None
        self._total = SessionTotal()
        self._lock = self.lock_class()
        self._recorded_policy = recorded
        self._to_restore = (snapshot, snapshot_key, snapshot_owner) if snapshot is not None \
            else None
        self.restored: dict[str, Any] | None = None  # what restoring `snapshot` reported
        self.toolbox = Toolbox(tools or {}, limits=tool_limits, approve=approve_tool,
                               audit_payloads=audit_tool_payloads)
        self._tool_loop: ToolLoop | None = None  # a blocking Sandbox's loop for its tools
        self._stdin_link: StdinLink | None = None  # its stdin channel, once a run grants tools

    @property
    def context(self) -> Any:
        """The ZMQ context of this sandbox's sockets (the shared bounded one), once used."""
        if self._context is None:
            self._context = shared_context(self.limits, self.context_class)
        return self._context

    @context.setter
    def context(self, context: Any) -> None:
        self._context = context

    @property
    def manager(self) -> Any:
        """The kernel manager of this sandbox's ZMQ kernels, made when first used."""
        if self._manager is None:
            # Its control socket lives on the sandbox's context (its own was one more I/O
            # thread per kernel).
            self._manager = self.manager_class(context=self.context, **self._manager_kwargs)
            jsonwire.use_exact_json(self._manager.session)  # results exact with or without orjson
        return self._manager

    @property
    def holds_callers_secrets(self) -> bool:
        """Whether the caller gave secrets of its own (`secrets=`): their values live only in
        this process, so no snapshot carries them and a kernel restored from one lacks them."""
        return bool(self._secret_values)

    def _sending_context(self, context: Any) -> Any:
        """The context the manager and client send on (AsyncSandbox: sends never wait)."""
        return context

    def _live_context(self) -> Any:
        """The shared bounded ZMQ context for the sockets (another if someone closed it)."""
        if self.context.closed:
            self.context = shared_context(self.limits, self.context_class)
        return self._sending_context(self.context)

    def _start_steps(self) -> Steps[None]:
        """Start the kernel and wait until it answers."""
        if self.one_shot_pool is not None:  # each run's kernel is started for it: the pool
            if not self.one_shot_pool.path:
                try:
                    self.one_shot_pool.path = yield (self._off_loop, self.one_shot_pool.ask)
                    return
                except OneShotUnavailable as exc:
                    # As a ZMQ kernel falls back to a cold start: a kernel of its own instead
                    # (one that cannot start either says its own reason).
                    logging.getLogger(__name__).warning(
                        "sandbox-kernel: no one-shot kernel (%s); starting a kernel of its "
                        "own instead", exc)
                    self.one_shot_pool = None
            else:
                return
        context = self._live_context()  # also the manager's control socket's (shutdown requests)
        if self.manager.context is not context:
            self.manager.context = context
        start = _fast_reconnecting(self.manager).start_kernel
        if self._secret_values:  # the launcher's environment for this kernel, values and all
            start = functools.partial(start, env={**os.environ, **self._secret_values})
        yield (start,)
        yield from self._connect_steps()
        if self._to_restore is not None:
            snapshot, key, owner = self._to_restore
            try:
                self.restored = yield from self._restore_steps(snapshot, key, owner)
            except Exception:
                yield from self._close_steps()  # a sandbox that did not start holds no kernel
                raise

    def _connect_steps(self) -> Steps[None]:
        self.client = _fast_reconnecting(
            self.manager.sandbox_client(context=self._live_context()))
        _start_channels(self.client)
        if self.toolbox.tools:  # connected now: by the first run it surely is
            self.client.stdin_channel.start()
        try:
            yield from self._wait_for_ready()
        except RuntimeError:  # dead, late or refused (a grant it could not give): nothing of
            yield from self._close_steps(now=True)  # it to keep, and no SIGINT in its log
            raise

    def _wait_for_ready(self) -> Steps[None]:
        """Ready once kernel_info is answered and IOPub delivers (not after 0.2 s of silence)."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                msg_id = self.client.kernel_info()
            except zmq.Again:  # nothing takes it (see _never_waiting): as if no reply came
                yield (self.sleep, 1.0)
                _check_start((yield (self.manager.is_alive,)), deadline, self.startup_timeout)
                continue
            try:
                reply = yield (self.client.get_shell_msg, 1.0)
                while reply["parent_header"].get("msg_id") != msg_id:
                    reply = yield (self.client.get_shell_msg, 1.0)
                yield (self.client.get_iopub_msg, _IOPUB_JOIN)  # the subscription is live
                _check_grants(reply["content"])
                return
            except queue.Empty:
                pass
            _check_start((yield (self.manager.is_alive,)), deadline, self.startup_timeout)

    def _close_steps(self, now: bool = False) -> Steps[None]:
        """Shut the kernel down: graceful, or with now=True killed at once.

        now=True is the one-shot close of a kernel whose results have all arrived: no shutdown
        handshake, the kernel is gone when this returns and its reaper still removes the
        scratch directory.
        """
        if self.client is not None:
            self._stop_client()
        if self._tool_loop is not None:
            self._tool_loop.close()
            self._tool_loop = None
        if self._manager is not None and self._manager.has_kernel:  # a one-shot's has none
            self._total.retire(self._process)  # before it ends: its last ticks are readable
            # Graceful by default; either way the scratch reaper removes the scratch directory.
            try:
                yield (functools.partial(self.manager.shutdown_kernel, now=now),)
            except zmq.Again:  # its control port takes nothing: no polite request, then
                yield (functools.partial(self.manager.shutdown_kernel, now=True),)
        self._forget_process()

    def _restart_steps(self) -> Steps[None]:
        """Replace the kernel with a fresh one; all state is lost."""
        self._stop_client()
        self._total.retire(self._process)
        yield (functools.partial(self.manager.restart_kernel, now=True),)
        yield from self._connect_steps()

    def _interrupt_steps(self) -> Steps[None]:
        """Interrupt the code that is running (a one-shot sandbox's: SIGINT to its process)."""
        if self.one_shot_pool is not None:
            if self._one_shot_run is not None:
                self._one_shot_run.interrupt()
            return
        yield (self.manager.interrupt_kernel,)

    def _needs_a_kernel(self, what: str, instead: str) -> None:
        if self.one_shot_pool is not None:
            raise RuntimeError(f"{what} needs a live kernel, and a one-shot sandbox has none "
                               f"({instead}): create the Sandbox without one_shot=True")

    def _kernel_info_steps(self) -> Steps[dict[str, Any]]:
        """The kernel_info_reply content, including the sandbox's policy and layers."""
        self._needs_a_kernel("kernel_info()", "each run has a kernel of its own")
        reply = yield (functools.partial(self.client.kernel_info, reply=True,
                                         timeout=self.startup_timeout),)
        return reply["content"]  # type: ignore[no-any-return]

    def _warm_up_steps(self) -> Steps[None]:
        """Send one silent `pass` through run()'s path, so the next run() pays no first time.

        It sets up the run's IOPub reader, drains what the start left on IOPub and takes the
        kernel through its execute path once, leaving no history, execution count or variable:
        the kernel stays as fresh as it started. Pools call it before handing a kernel out.
        """
        if self.one_shot_pool is not None:  # its kernels wait in the pool, warm already
            return
        msg = _warm_up_request(self.client)
        collector, inbox = self._send(msg)
        deadline = time.monotonic() + self.startup_timeout
        while not collector.idle:
            frames = yield (inbox.receive, POLL)
            if frames is None:
                _check_start((yield (self.manager.is_alive,)), deadline, self.startup_timeout,
                             _WARMING_UP)
            else:
                collector.feed_frames(frames)
        yield from self._take_reply(msg["header"]["msg_id"])

    def _install_steps(self, *packages: str, upgrade: bool = False,
                       timeout: float | None = None) -> Steps[Execution]:
        """Install wheels into this kernel's session (`%pip install`) for later runs to import;
        the execution's error (PackageInstallError) says why when that is not allowed."""
        self._needs_a_kernel("install()", "nothing stays installed after a run")
        return (yield from self._run_steps(install_code(packages, upgrade), timeout=timeout))

    def _run_steps(self, code: str, inputs: dict | None = None, timeout: float | None = None,
                   on_stdout: Callback = None, on_stderr: Callback = None,
                   on_display: Callback = None, entrypoint: str = "main",
                   raw_result: bool = False,
                   tools: Mapping[str, Callable[..., Any]] | Toolbox | None = None,
                   ) -> Steps[Execution]:
        """Run code; with inputs, then call `entrypoint(**inputs)` and return its dict.

        raw_result: leave a main() result as its JSON bytes in `result_json` (checked, never
        parsed into objects), for a caller that only passes it on (the service).
        tools: the tools this run grants instead of the sandbox's ({}: none); calls are in
        `Execution.tool_calls`; a Toolbox: these tools with its own limits, hook and audit
        settings (a host's, for its callers' runs)."""
        toolbox = self.toolbox if tools is None else tools if isinstance(tools, Toolbox) \
            else self.toolbox.with_tools(tools)
        return (yield from self._execute_steps(code, inputs, timeout, on_stdout, on_stderr,
                                               on_display, entrypoint, raw_result,
                                               toolbox=toolbox))

    def _tool_submitter(self) -> Callable[..., Any]:
        """Where a run's tool calls are served: a loop of the blocking Sandbox's own."""
        if self._tool_loop is None:
            self._tool_loop = ToolLoop()
        return self._tool_loop.submit

    def _serve_tools(self, toolbox: Toolbox | None, msg: dict[str, Any]) -> ToolRun | None:
        """Grant the run its tools: in the request, and a run to serve their calls."""
        if toolbox is None or not toolbox.tools:
            return None
        self.client.stdin_channel.start()  # connected now, if it was not (kernel/tools.py
        # gives a request a moment to find it), and again if a frame was refused on it
        self._current_stdin_link().mend()
        msg["metadata"].setdefault("sandbox", {})["tools"] = toolbox.metadata(
            self.limits.max_message)
        return toolbox.start(msg["header"]["msg_id"], self)

    def _execute_steps(self, code: str, inputs: dict | None = None,
                       timeout: float | None = None, on_stdout: Callback = None,
                       on_stderr: Callback = None, on_display: Callback = None,
                       entrypoint: str = "main", raw_result: bool = False,
                       buffers: Sequence[Any] = (), collect: Callable[..., Collector] = Collector,
                       toolbox: Toolbox | None = None) -> Steps[Execution]:
        """run()'s body; buffers: binary frames the request carries; collect: what makes the
        run's collector (the snapshot's also takes the chunks the kernel publishes);
        toolbox: the tools the run grants."""
        if self.one_shot_pool is not None and not self.one_shot_pool.path:
            yield from self._start_steps()  # a ZMQ kernel instead if no pool could be had
        if self.one_shot_pool is not None:
            self._one_shot_run = handle = oneshot.RunHandle()  # for interrupt()
            try:
                execution = yield (self._complete, oneshot.run(
                    self.one_shot_pool, code, inputs, timeout, on_stdout=on_stdout,
                    on_stderr=on_stderr, on_display=on_display, limits=self.limits,
                    raw_result=raw_result, grace=self.grace, entrypoint=entrypoint,
                    timeout_source=self.timeout_source, handle=handle,
                    tools=toolbox if toolbox is not None and toolbox.tools else None,
                    owner=self))
            finally:
                self._one_shot_run = None
            self._total.add_run(execution.usage, own_kernel=True)
            return execution
        watchdog = Watchdog(timeout, self.grace, self.one_shot)
        msg = _execute_request(self.client, code, inputs, timeout, entrypoint,
                               self.timeout_source)
        if buffers:
            msg["buffers"] = list(buffers)
        tool_run = self._serve_tools(toolbox, msg)
        if tool_run is not None:
            desk = StdinDesk(tool_run, self.client, self._tool_submitter())
        meter = Meter(self._kernel_process())
        collector, inbox = self._send(msg, on_stdout, on_stderr, on_display, raw_result,
                                      collect)
        if tool_run is not None:
            inbox.serve(desk)
        try:
            lost = yield from self._collect_steps(collector, inbox, watchdog, meter)
        finally:
            if tool_run is not None:
                inbox.serve(None)
                desk.close()
        execution = self._finish(watchdog, collector, lost)
        jsonwire.thaw()
        reply = None
        if lost:
            yield from self._restart_steps()
        else:
            reply = yield from self._take_reply(msg["header"]["msg_id"])
            _reply_error(execution, reply)
        execution.usage = meter.finish(execution.duration, collector.budget.output_received,
                                       collector.result_bytes, reply)
        if tool_run is not None:
            tool_run.account(execution)
        self._total.add_run(execution.usage, own_kernel=False)
        return execution

    def _collect_steps(self, collector: Collector, inbox: Any, watchdog: Watchdog,
                       meter: Meter) -> Steps[str | None]:
        """The run's messages until the kernel is idle, or why it was lost."""
        lost = None
        while not collector.idle and not lost:
            frames = yield (inbox.receive, POLL)
            if frames is not None:
                ours = collector.unpack(frames)
                if ours is not None and self._check_large and collector.checks_elsewhere(ours):
                    ours["checked"] = yield (self._check_large, ours["content"])
                if ours is not None:
                    collector.feed(ours)
                if not watchdog.due():
                    continue
            meter.sample()
            lost = yield from watchdog.verdict(self.manager, inbox)
        meter.stop()
        return lost

    def _take_reply(self, msg_id: str) -> Steps[dict[str, Any] | None]:
        """Read the execute_reply (and any stale one before it) so replies do not pile up."""
        give_up = time.monotonic() + _REPLY_WAIT  # absolute: a stream of stale ones ends too
        socket = self.client.shell_channel.socket
        while (left := give_up - time.monotonic()) > 0:
            # The kernel sends the reply before it goes idle: it is usually queued already.
            try:
                reply = queued_reply(self.client, (yield (
                    functools.partial(socket.recv_multipart, flags=zmq.NOBLOCK, copy=False),)))
            except zmq.Again:
                reply = None
            if reply is None:
                try:
                    reply = yield (self.client.get_shell_msg, left)
                except queue.Empty:
                    return None
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply
        return None

    def _send(self, msg: dict[str, Any], on_stdout: Callback = None, on_stderr: Callback = None,
              on_display: Callback = None, raw_result: bool = False,
              collect: Callable[..., Collector] = Collector) -> tuple[Collector, Any]:
        """Send an execute request; return what collects its output and the inbox to read."""
        collector = collect(msg["header"]["msg_id"], on_stdout, on_stderr, on_display,
                            self.limits, self.client.session, raw_result)
        inbox = self._current_inbox()  # before the send: nothing of the reply may be missed
        self.client.shell_channel.send(msg)
        return collector, inbox

    def _finish(self, watchdog: Watchdog, collector: Collector, lost: str | None) -> Execution:
        watchdog.oversize = oversize_error(self.limits)
        return watchdog.finish(collector.execution, lost, self.manager)

    def _kernel_process(self) -> KernelProcess | None:
        """The /proc files of the current kernel process (a restart gives another pid)."""
        pid = getattr(self.manager.provisioner, "pid", None)
        if self._process is None or self._process.pid != pid:
            self._forget_process()
            self._process = open_process(pid)
        return self._process

    def total_usage(self) -> Usage:
        """What this sandbox's kernels have spent so far in all, billed in an execution or not.

        CPU (read from the host) counts each kernel from its first execution on, including what
        threads left running spend between executions and after the last one; with one_shot,
        the sum of the runs. `egress_cpu_seconds` sums what the executions were charged. Ask
        before close() for the last kernel's ticks after its last execution."""
        process = self._process if self.one_shot_pool is None else None
        return self._total.usage(process)

    def _forget_process(self) -> None:
        if self._process is not None:
            self._total.retire(self._process)
            self._process.close()
            self._process = None

    def _current_inbox(self) -> Any:
        """The inbox of the current client (a restart replaces the client and its sockets)."""
        if self._inbox is None or self._inbox.client is not self.client:
            self._close_inbox()
            self._inbox = self.inbox_class(self.client)
        return self._inbox

    def _current_stdin_link(self) -> StdinLink:
        """The current client's stdin channel, watched (see StdinLink)."""
        if self._stdin_link is None or self._stdin_link.client is not self.client:
            self._close_stdin_link()
            self._stdin_link = StdinLink(self.client)
        return self._stdin_link

    def _close_stdin_link(self) -> None:
        if self._stdin_link is not None:
            self._stdin_link.close()
            self._stdin_link = None

    def _stop_client(self) -> None:
        """Close the client's sockets, the IOPub monitor first.

        libzmq stops a monitor only while its socket is open: closed afterwards, the monitor's
        own socket stayed behind in the (shared) context, and after a few hundred kernels the
        context's sockets stopped receiving (the next kernel never answered kernel_info).
        """
        self._close_inbox()
        self._close_stdin_link()
        self.client.stop_channels()

    def _close_inbox(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None

    # --- snapshots ------------------------------------------------------------------------------

    def _snapshot_policy(self) -> dict[str, Any]:
        """The network and runtime of this kernel, as the caller knows them (not the kernel)."""
        spec = self.manager.kernel_spec
        return restore_policy(self._recorded_policy, spec.argv[0] if spec else sys.executable)

    def _chunk_size(self) -> int:
        """Payload bytes per message: a frame within what the caller's sockets accept."""
        largest = self.limits.max_message
        return _SNAPSHOT_CHUNK if largest < 0 else min(_SNAPSHOT_CHUNK, largest - SMALL_PART)

    def _snapshot_call(self, op: str, timeout: float | None, buffers: Sequence[Any] = (),
                       collect: Callable[..., Collector] = Collector,
                       **inputs: Any) -> Steps[dict[str, Any]]:
        """One step in the kernel (kernel/snapshot.py); SnapshotError with its error if it
        failed."""
        execution = yield from self._execute_steps(
            _SNAPSHOT_CODE, {"op": op, **inputs}, timeout=timeout or _SNAPSHOT_CALL_TIMEOUT,
            entrypoint=_SNAPSHOT_ENTRYPOINT, buffers=buffers, collect=collect)
        if execution.error is not None:
            raise SnapshotError(f"the kernel could not {op} the snapshot: "
                                f"{execution.error.name}: {execution.error.value}")
        if not isinstance(execution.result, dict):
            raise SnapshotError(f"the kernel's answer to {op} is not an object")
        return execution.result

    def _snapshot_steps(self, key: bytes | None = None, owner: str = "", *,
                        max_size: int = DEFAULT_MAX_SIZE, max_files: int = DEFAULT_MAX_FILES,
                        timeout: float | None = None) -> Steps[Snapshot]:
        """Save this session's user state: a Snapshot (sealed bytes and manifest).

        Made inside the kernel: the user namespace (each name on its own; what cannot be
        saved, such as a generator or an open file, is in manifest["skipped"] with the
        reason), the %pip packages by name and version, the scratch files up to max_files
        bytes, the working directory. Sealed with HMAC-SHA256 under key, bound to owner; with
        no key a random one is generated and kept on the Snapshot (`snapshot.key`): store it
        apart from the data, restoring needs it. max_size: refuse a larger snapshot (0: any).
        The session goes on as it was.
        """
        self._needs_a_kernel("snapshot()", "nothing stays after a run")
        made = yield from self._snapshot_call("take", timeout, max_files=max_files)
        try:
            size = made["bytes"]
            if not isinstance(size, int) or size < 0:
                raise SnapshotError(f"the kernel's snapshot has no valid size ({size!r})")
            if max_size and size > max_size:
                raise SnapshotTooLarge(size, max_size)
            manifest = {"version": FORMAT_VERSION, "saved": made.get("saved", []),
                        "skipped": made.get("skipped", []), "bytes": size,
                        "policy": self._snapshot_policy(),
                        "packages": made.get("packages", []), "files": made.get("files", []),
                        "cwd": made.get("cwd", "."), "serializer": made.get("serializer"),
                        "python": made.get("python")}
            payload = Sealing(manifest, size)  # grows as bytes arrive, not with the claim
            chunk = self._chunk_size()
            while payload.received < size:
                asked = min(chunk * _SNAPSHOT_CHUNKS_PER_CALL, size - payload.received)
                before = payload.received
                yield from self._snapshot_call(
                    "read", timeout, collect=functools.partial(_ChunkCollector, payload),
                    offset=before, size=asked, chunk=chunk)
                if payload.received != before + asked:
                    raise SnapshotError(f"the kernel sent {payload.received - before} bytes "
                                        f"of the snapshot where {asked} were asked for")
        except Exception:
            yield from self._snapshot_call("drop", timeout)  # its memory goes back
            raise
        yield from self._snapshot_call("drop", timeout)
        key = key or new_key()
        return Snapshot(payload.close(key, owner), manifest, key, owner)

    def _restore_steps(self, snapshot: Snapshot | bytes, key: bytes | None = None,
                       owner: str | None = None, *, max_size: int = DEFAULT_MAX_SIZE,
                       packages: bool = True, timeout: float | None = None
                       ) -> Steps[dict[str, Any]]:
        """Load a snapshot into this (fresh) session; what was restored and what was not.

        The seal is checked first (key and owner default to the Snapshot's): one altered byte,
        another owner or key, or more than max_size bytes is a SnapshotError, as is a snapshot
        of another network or runtime than this kernel's. The payload is then loaded inside
        the kernel only: packages=True installs the snapshot's %pip packages again (through
        the same policy), then the files, the working directory and the names. The report:
        restored (names), skipped ([{name, reason}]), packages, files, cwd.
        """
        self._needs_a_kernel("restore()", "nothing stays after a run")
        data = snapshot.data if isinstance(snapshot, Snapshot) else snapshot
        if isinstance(snapshot, Snapshot):
            key = key if key is not None else snapshot.key
            owner = owner if owner is not None else snapshot.owner
        manifest, payload = open_sealed(data, key or b"", owner or "", max_size)
        check_policy(manifest.get("policy"), self._snapshot_policy())
        yield from self._snapshot_call("begin", timeout, size=payload.nbytes)
        chunk = self._chunk_size()
        step = chunk * _SNAPSHOT_CHUNKS_PER_CALL
        for offset in range(0, payload.nbytes, step):
            piece = payload[offset:offset + step]
            yield from self._snapshot_call(
                "write", timeout, offset=offset,
                buffers=[piece[start:start + chunk] for start in range(0, piece.nbytes, chunk)])
        return (yield from self._snapshot_call("load", timeout, packages=packages))

    start = _Operation(_start_steps)
    close = _Operation(_close_steps)
    restart = _Operation(_restart_steps)
    interrupt = _Operation(_interrupt_steps)
    kernel_info = _Operation(_kernel_info_steps, locked=True)
    warm_up = _Operation(_warm_up_steps, locked=True)
    run = _Operation(_run_steps, locked=True)
    install = _Operation(_install_steps, locked=True)
    snapshot = _Operation(_snapshot_steps, locked=True)
    restore = _Operation(_restore_steps, locked=True)
    _connect = _Operation(_connect_steps)


class Sandbox(_SandboxCore):
    """A sandboxed kernel whose state persists across `run` calls; use it as a context manager."""

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    _driver = staticmethod(_blocking)
    _complete = staticmethod(asyncio.run)  # a one-shot run, to its end
    _off_loop = staticmethod(lambda call: call())  # a blocking call (asking for the pool)


def _advised_as_caller(policy: SandboxPolicy | None, kernel_name: str | None
                       ) -> SandboxPolicy | None:
    """The policy, its refusals' advice said as SandboxPolicy(...) unless a launcher (`run`,
    a server) said its own way: the caller gave it as Python."""
    if kernel_name is not None or (policy is not None and policy.changed_with):
        return policy
    values = (policy or SandboxPolicy()).as_dict()
    values.pop("allow_network", None)  # network says it
    return SandboxPolicy(**{**values, "changed_with": advice.PYTHON})


def _with_secrets(policy: SandboxPolicy | None, given: Mapping[str, Mapping[str, Any]] | None,
                  kernel_name: str | None) -> tuple[SandboxPolicy | None, dict[str, str]]:
    """The policy with the caller's secrets declared, and their values; unchanged without.

    SecretError (a TraitError) names what is wrong, never a value.
    """
    if not given:
        return policy, {}
    from ..secrets import SecretError, checked_entries

    if kernel_name is not None:
        raise SecretError("secrets need kernel_name=None and a policy: an installed "
                          "kernelspec's policy is its own")
    entries = checked_entries(dict(given), "secrets")
    base = policy or SandboxPolicy()
    values = base.as_dict()
    values.pop("allow_network", None)  # network says it
    values["secrets"] = [*base.secrets, *(f"{name}={host}" for name, entry in entries.items()
                                          for host in entry["hosts"])]
    declared = SandboxPolicy(**values)
    declared.declared_secrets()  # each host within the policy's network, else refused now
    return declared, {name: entry["value"] for name, entry in entries.items()}


class AsyncSandbox(_SandboxCore):
    """The asyncio twin of Sandbox: the same methods, awaited."""

    manager_class = AsyncSandboxKernelManager
    lock_class = asyncio.Lock
    context_class = zmq.asyncio.Context
    inbox_class = AsyncInbox
    sleep = staticmethod(asyncio.sleep)
    _driver = staticmethod(_awaiting)
    _complete = staticmethod(lambda run: run)  # awaited by the driver
    _off_loop = staticmethod(asyncio.to_thread)
    _check_large = staticmethod(checked_elsewhere)

    async def __aenter__(self) -> AsyncSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _sending_context(self, context: Any) -> Any:
        return _never_waiting(context)

    def _tool_submitter(self) -> Callable[..., Any]:
        """Where a run's tool calls are served: this sandbox's own event loop."""
        return asyncio.ensure_future

