"""A run on a one-shot kernel: one connection, one request, the kernel's messages, its end.

The caller's side of kernel/oneshot.py: the request is the execute_request a ZMQ client sends
(same metadata: main() inputs, timeout), and the answer is the same Jupyter messages, fed to
the same Collector within the same caller limits: an Execution reads the same whichever kernel
ran it. The caller's safety never depends on the kernel: every record is bounded before it is
read, and at `timeout + grace` the process is killed through the pidfd it handed over (its
own, so a recycled pid is never hit) and the run says so.

The messages are framed as a Jupyter Session frames them (delimiter, signature, header, parent
header, metadata, content), but neither end of this connection signs or needs a Session: the
request is framed and the answers are read here, without jupyter_client, whose deserialize
turns every date of a message into a datetime with dateutil (four-fifths of its cost, and
nothing here reads a date).

A run that grants tools (client/tools.py) gets their calls as `sandbox_tool_request` message
records; each is served as a task on the run's loop and answered with a TOOL_REPLY record on
the same connection (the process reads them while its code waits, kernel/tools.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any

from .. import jsonwire
from ..errors import (
    ExecutionTimeout,
    KernelDied,
    KernelRefused,
    MessageTooLarge,
    SandboxError,
)
from ..kernel import oneshot_wire as wire
from ..launch.oneshot import OneShotPool, OneShotUnavailable
from ..resultcheck import checked_elsewhere
from .collect import Callback, Collector, exit_description, info_of
from .execution import Execution, error_from
from .meter import Meter, open_process
from .receive import MESSAGE_ROOM, SMALL_PART, CallerLimits
from .tools import REQUEST as TOOL_REQUEST
from .tools import Toolbox, ToolRun, reply_message

GRACE_SECONDS = 2.0
# Bytes taken off the connection per event-loop turn: a flood of small messages (40,000
# one-byte prints) is ~220 of them per turn, a few ms, so other requests are answered between.
READ_STEP = 1 << 16
DELIMITER = b"<IDS|MSG>"  # ends a Jupyter message's routing identities
PROTOCOL_VERSION = "5.3"
_SESSION_ID = uuid.uuid4().hex  # the header's session: this caller process

__all__ = ["OneShotUnavailable", "RunHandle", "run"]


def request(code: str, inputs: dict | None, timeout: float | None, entrypoint: str = "main",
            timeout_source: str = "Sandbox.run(timeout=)",
            keep_files: dict[str, Any] | None = None,
            tools: Toolbox | None = None, max_message: int = -1) -> dict[str, Any]:
    """The execute_request a ZMQ client would send for this run (client/sandbox.py's); with
    keep_files (kernel/file_ops.py's "keep" inputs), the process sends the files it wrote;
    with tools, the grant of their calls, none larger than max_message (the caller's)."""
    header = {"msg_id": uuid.uuid4().hex, "msg_type": "execute_request",
              "username": "sandbox-kernel", "session": _SESSION_ID,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "version": PROTOCOL_VERSION}
    meta: dict[str, Any] = {}
    if inputs is not None:
        meta.update(entrypoint=entrypoint, inputs=inputs)
    if timeout is not None:
        meta.update(timeout=timeout, timeout_source=timeout_source)
    if keep_files is not None:
        meta.update(keep_files=keep_files)
    if tools is not None:
        meta.update(tools=tools.metadata(max_message))
    return {"header": header, "msg_id": header["msg_id"], "msg_type": header["msg_type"],
            "parent_header": {}, "metadata": {"sandbox": meta} if meta else {},
            "content": {"code": code, "silent": False, "store_history": inputs is None,
                        "user_expressions": {}, "allow_stdin": False,
                        "stop_on_error": True}}


def _msg(msg_type: str, content: dict[str, Any], parent: dict[str, Any]) -> dict[str, Any]:
    """A message of this caller (as Session.msg makes one), e.g. a tool call's reply."""
    header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "sandbox-kernel",
              "session": _SESSION_ID, "version": PROTOCOL_VERSION,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    return {"header": header, "parent_header": parent.get("header", {}), "metadata": {},
            "content": content}


def serialize(msg: dict[str, Any]) -> list[bytes]:
    """The message's frames, as Session.serialize makes them with no key (no signature)."""
    return [DELIMITER, b"", *(jsonwire.dumps(msg[part]) for part in
                              ("header", "parent_header", "metadata", "content"))]


def message(frames: list[memoryview], msg_id: str) -> dict[str, Any] | None:
    """The message in a record's frames if it answers msg_id (content still packed), else
    None; receive.unpack_frames's contract (small parts bounded before they are parsed, other
    requests' and malformed messages dropped), without a Session."""
    try:
        parts = frames[[bytes(frame) for frame in frames[:8]].index(DELIMITER) + 1:]
    except ValueError:  # not a Jupyter message at all
        return None
    if len(parts) < 5 or any(len(part) > SMALL_PART for part in parts[1:4]):
        return None
    try:
        header, parent, metadata = (jsonwire.loads(part) for part in parts[1:4])
    except ValueError:
        return None
    if not (isinstance(header, dict) and isinstance(header.get("msg_type"), str)
            and isinstance(parent, dict) and parent.get("msg_id") == msg_id):
        return None
    content = parts[4]
    return {"header": header, "msg_id": header.get("msg_id"), "msg_type": header["msg_type"],
            "parent_header": parent, "metadata": metadata, "content": content,
            "buffers": parts[5:], "content_size": len(content)}


class RunHandle:
    """What the caller of a one-shot run holds while it goes.

    interrupt(): SIGINT to the process through its pidfd (as a kernelspec's interrupt_mode
    "signal" interrupts a ZMQ kernel: KeyboardInterrupt in the code). keep_files: inputs of
    kernel/file_ops.py's "keep" operation, which the process runs after the code (its scratch
    ends with it); `kept` is then its answer as sent, for the caller to check.
    """

    def __init__(self, keep_files: dict[str, Any] | None = None) -> None:
        self.keep_files = keep_files
        self.kept: Any = None
        self._run: _Run | None = None

    def interrupt(self) -> bool:
        """Interrupt the run's code; False when it has no process (yet, or any more).

        Safe from another thread (a blocking Sandbox's caller): the pidfd is closed under the
        same lock, so its number never names another process by then."""
        run = self._run
        if run is None:
            return False
        with run.pidfd_lock:
            if run.pidfd < 0 or run.done:
                return False
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(run.pidfd, signal.SIGINT)
        return True

    def files_room(self) -> int:
        """Bytes the files' record may take: their budget in base64 and JSON, the listing."""
        budget = (self.keep_files or {}).get("budget", 0)
        return 2 * budget + MESSAGE_ROOM if isinstance(budget, int) else MESSAGE_ROOM


async def run(pool: OneShotPool, code: str, inputs: dict | None = None,
              timeout: float | None = None, *, on_stdout: Callback = None,
              on_stderr: Callback = None, on_display: Callback = None,
              limits: CallerLimits | None = None, raw_result: bool = False,
              grace: float = GRACE_SECONDS, entrypoint: str = "main",
              timeout_source: str = "Sandbox.run(timeout=)",
              handle: RunHandle | None = None, tools: Toolbox | None = None,
              owner: object = None) -> Execution:
    """Run code on a fresh one-shot kernel of the pool; OneShotUnavailable if none answers.
    handle: to interrupt the run, or keep the files it wrote (RunHandle). tools: the tools
    the run grants (client/tools.py), served here for `owner` (the sandbox running it)."""
    limits = limits or CallerLimits()
    handle = handle or RunHandle()
    loop = asyncio.get_running_loop()
    msg = request(code, inputs, timeout, entrypoint, timeout_source, handle.keep_files, tools,
                  limits.max_message)
    payload = wire.pack_frames(serialize(msg))
    collector = Collector(msg["header"]["msg_id"], on_stdout, on_stderr, on_display, limits,
                          None, raw_result)
    run = await _taken(loop, pool, collector, limits, handle)
    if tools is not None:
        run.tools = tools.start(msg["header"]["msg_id"], owner)
    try:
        if not run.pid:  # the server's answer (a broken pool), or its socket closed
            reason = run.refused or "the pool's socket closed before a kernel took the request"
            raise OneShotUnavailable(f"{reason}; {pool.server_log()}")
        started = time.monotonic()
        deadline = None if timeout is None else timeout + grace
        try:
            await loop.sock_sendall(run.conn, wire.record(wire.REQUEST, payload))
            await asyncio.wait_for(run.read(loop), deadline)
        except asyncio.TimeoutError:
            run.kill()
            run.lost = ExecutionTimeout(f"the execution ran past its {timeout:g} s limit and "
                                        "did not stop; its one-shot kernel was killed")
        except OSError:
            pass  # the process ended under the run: said below
        if run.refused and not run.messages:  # the process could not take the request
            raise OneShotUnavailable(run.refused)
        if not run.done and run.lost is None and run.pid:  # it died under the run: say how
            exit_code = await loop.run_in_executor(None, pool.exit_code, run.pid)
            if not run.messages:  # nothing of the run began: a kernel that could not start
                raise OneShotUnavailable(
                    f"the one-shot kernel ended before it began the run "
                    f"({exit_description(exit_code)}); {pool.server_log()}")
            run.lost = KernelDied(f"the kernel process died ({exit_description(exit_code)})")
    finally:
        run.close()
    handle.kept = run.files()
    execution = run.finish(time.monotonic() - started)
    if run.tools is not None:
        run.tools.account(execution)
    return execution


async def _taken(loop: asyncio.AbstractEventLoop, pool: OneShotPool, collector: Collector,
                 limits: CallerLimits, handle: RunHandle) -> _Run:
    """A connection a process of the pool took (it sent its pid), the request not sent yet.

    The request goes only to a process that took the connection and said who it is: nothing
    of it is ever sent where the server could read it. A server that retired as the caller
    connected closes the connection untaken: the next try asks its successor.
    """
    for attempt in range(2):
        conn = await loop.run_in_executor(None, pool.connect) if not pool.path \
            else await _connect(loop, pool)
        run = handle._run = _Run(conn, collector, limits, handle)
        try:
            await asyncio.wait_for(run.take_pidfd(loop), pool.server.start_timeout)
        except asyncio.TimeoutError:
            run.close()
            raise OneShotUnavailable(f"no one-shot kernel took the request within "
                                     f"{pool.server.start_timeout:g} s; "
                                     f"{pool.server_log()}") from None
        except BaseException:
            run.close()
            raise
        if run.pid or run.refused or attempt:
            return run
        run.close()
        pool.path = ""
    raise AssertionError("unreachable")


async def _connect(loop: asyncio.AbstractEventLoop, pool: OneShotPool) -> socket.socket:
    """A connection to the pool's socket (the server may have retired: then ask again)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.setblocking(False)
    try:
        await loop.sock_connect(conn, pool.path)
        return conn
    except OSError:
        conn.close()
        pool.path = ""
        return await loop.run_in_executor(None, pool.connect)


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Run:
    """One run's reading side: records to the collector, the pidfd, the end."""

    def __init__(self, conn: socket.socket, collector: Collector, limits: CallerLimits,
                 handle: RunHandle) -> None:
        conn.setblocking(False)
        self.conn, self.collector = conn, collector
        room = limits.max_message
        # The files' record is parsed here, on the caller's event loop: only when asked for,
        # once, and no larger than the budget it was asked with allows. User code owns the
        # connection and may send such records too: a larger one is dropped as it arrives,
        # whatever its size, and the run keeps its result.
        self.files_room = handle.files_room() if handle.keep_files is not None else 0
        self.records = wire.Records(0 if room < 0 else room + 4096,
                                    drop_larger={wire.FILES: self.files_room})
        self.kept: Any = None  # the files the run wrote, as the process sent them
        self.pidfd = -1
        self.pidfd_lock = threading.Lock()  # interrupt() may come from another thread
        self.pid = 0
        self.meter: Meter | None = None
        self.reply: dict[str, Any] | None = None
        self.refused = ""
        self.lost: SandboxError | None = None  # why the run was lost, once it was
        self.done = False
        self.metered = False
        self.messages = 0
        self.tools: ToolRun | None = None  # the run's tool calls, when it grants tools
        self.writing = asyncio.Lock()  # a record at a time on the connection
        self.answering: set[asyncio.Future[None]] = set()

    async def read(self, loop: asyncio.AbstractEventLoop) -> None:
        """Records until `done` or the connection's end."""
        while not self.done:
            data = await loop.sock_recv(self.conn, READ_STEP)
            if not data:
                # A record that never ended took what came after it as its bytes: user code
                # can write onto the connection (a length it never sends), the reply with it.
                unfinished = self.records.unfinished()
                if unfinished:
                    self.lost = MessageTooLarge(
                        f"the one-shot kernel sent a message the caller refuses: {unfinished} "
                        "never ended, and what came after it was taken for its bytes")
                return
            try:
                for kind, payload in self.records.feed(data):
                    await self._take(kind, payload)
            except wire.WireError as exc:  # larger than the caller takes, or malformed
                self.kill()
                self.lost = MessageTooLarge(
                    f"the one-shot kernel sent a message the caller refuses: {exc}")
                return

    async def take_pidfd(self, loop: asyncio.AbstractEventLoop) -> None:
        """The first record: the process's pid, with its pidfd (to kill exactly it)."""
        ready = loop.create_future()
        loop.add_reader(self.conn.fileno(), _set_once, ready)
        try:
            await ready
        finally:
            loop.remove_reader(self.conn.fileno())
        try:
            data, fds, _, _ = socket.recv_fds(self.conn, wire.HEADER.size + 32, 1)
        except OSError:  # reset: no process will take it
            return
        self.pidfd = fds[0] if fds else -1
        for fd in fds[1:]:
            os.close(fd)
        if not data:
            return
        for kind, payload in self.records.feed(data):
            if kind == wire.PID and payload.isdigit():
                self.pid = int(payload)
                self.meter = Meter(open_process(self.pid))
            else:
                await self._take(kind, payload)

    async def _take(self, kind: int, payload: bytes) -> None:
        if kind == wire.MESSAGE:
            self.messages += 1
            msg = message(wire.unpack_frames(payload), self.collector.msg_id)
            if msg is None:
                return
            if msg["header"]["msg_type"] == TOOL_REQUEST:
                if self.tools is not None:
                    task = asyncio.ensure_future(self._answer(msg))
                    self.answering.add(task)  # held until done (the loop keeps weak refs)
                    task.add_done_callback(self.answering.discard)
            elif msg["header"]["msg_type"] == "execute_reply":
                content = msg["content"]
                msg["content"] = jsonwire.loads(content) if isinstance(
                    content, (bytes, memoryview)) else content
                self.reply = msg
            else:
                if self.collector.checks_elsewhere(msg):
                    msg["checked"] = await checked_elsewhere(msg["content"])
                self.collector.feed(msg)
                if self.collector.idle and self.meter is not None and not self.metered:
                    self.meter.stop()  # the host's figures, at idle as a ZMQ run takes them
                    self.metered = True
        elif kind == wire.FILES:
            if self.files_room:
                self.files_room = 0  # one record parsed at most, whatever it holds
                with contextlib.suppress(ValueError):  # not JSON: as if none were sent
                    self.kept = jsonwire.loads(payload)
        elif kind == wire.REFUSED:
            self.refused = payload.decode("utf-8", "replace")
            self.done = True
        elif kind == wire.DONE:
            self.done = True

    async def _answer(self, msg: dict[str, Any]) -> None:
        """Serve one tool call and write its answer (nothing once the run is over)."""
        assert self.tools is not None
        content = await self.tools.serve(msg)
        if content is None or self.tools.closed:
            return
        reply = reply_message(_msg, msg, content)
        record = wire.record(wire.TOOL_REPLY, wire.pack_frames(serialize(reply)))
        async with self.writing:
            with contextlib.suppress(OSError):  # the process ended: nobody waits for it
                await asyncio.get_running_loop().sock_sendall(self.conn, record)

    def files(self) -> Any:
        """The files record as sent; if none was taken, why (one was larger than asked for)."""
        dropped = [size for kind, size in self.records.dropped if kind == wire.FILES]
        if self.kept is None and dropped and self.files_room:
            return {"error": f"the record of the files the run wrote ({max(dropped):,} bytes) "
                             f"is larger than the {self.files_room:,} asked for: dropped"}
        return self.kept

    def kill(self) -> None:
        """End the process now (its own pidfd: never another process)."""
        if self.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()  # calls still running are abandoned
        self.kill()  # it exits by itself after `done`; one that did not is ended here
        with self.pidfd_lock:
            if self.pidfd >= 0:
                os.close(self.pidfd)
                self.pidfd = -1
        self.conn.close()
        if self.meter is not None and self.meter.process is not None:
            self.meter.process.close()

    def finish(self, wall: float) -> Execution:
        """The Execution: the collector's, with the error of a run that did not end well."""
        ex = self.collector.execution
        ex.duration = wall
        content = (self.reply or {}).get("content", {})
        if ex.error is None and content.get("status") == "error":
            ex.error = error_from(content)
        if self.refused:
            ex.error = info_of(KernelRefused(self.refused))
        elif self.lost is not None:
            ex.error = info_of(self.lost)
            ex.state_lost = True
        if self.meter is not None:
            if not self.metered:
                self.meter.stop()
            ex.usage = self.meter.finish(wall, self.collector.budget.output_received,
                                         self.collector.result_bytes, self.reply)
        jsonwire.thaw()
        return ex
