"""The one-shot kernels' companion: one unconfined process that serves many confined ones.

A ZMQ kernel forks its reaper before it confines itself (reaper.py). A one-shot kernel forks
nothing: it is one of a pool of processes forked from its pool's zygote as children of the fork
server (launch/forkserver/zygote.py), each confined before its request arrives. What a reaper
holds for its kernel, the companion holds for every one-shot process of its server: it is
forked from the server (single-threaded, nothing of any request in it) the first time the
server makes a pool, and never reads a request or its output.

Each one-shot process registers, before it confines itself, over the server's *registry* (a
SOCK_SEQPACKET socket its processes share until they close it, before any user code): it hands
over a pidfd of itself and one end of a channel of its own, and names its scratch directory.
Over that channel come the same handovers a reaper takes (handover.py): the uid lock (held until
the process is gone), the seccomp listener with the refusal count and audit file (refused calls
answered and recorded, audit.py, each process's answers paid from its CPU share, share.py: one
process's flood slows down that process, not the others), the egress listener (served by the
egress proxy, egress/proxy.py, on one event loop for all, in a thread). When the pidfd says
the process is gone, the companion releases the uid, stops its proxy and removes its scratch.
It ends once its server is gone and every process it serves is too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import audit, handover, scratch
from .logrelay import LauncherLog
from .reaper import auditor_for, egress_proxy
from .rounds import run_round


def start(close_in_child: Callable[[], None]) -> tuple[int, int]:
    """In the fork server, single-threaded: fork the companion; its pid and the registry fd.

    close_in_child: closes the server's descriptors in the companion (a listener it kept open
    would take launchers' connections and never answer them once the server is gone)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ours.close()
            close_in_child()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            Companion(theirs.detach(), server).serve()
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    return pid, ours.detach()


def register(registry: int, scratch_dir: str) -> int:
    """In a one-shot process, before any confinement: a channel of its own to the companion.

    Returns the channel's fd (inheritable), where the kernel application hands over what a
    reaper would take (kernel/app.py reads it from REAPER_VAR).
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pidfd = os.pidfd_open(os.getpid())
    try:
        handover.hand_over(registry, {"scratch": scratch_dir, "pid": os.getpid()},
                           [theirs.fileno(), pidfd])
    finally:
        theirs.close()
        os.close(pidfd)
    channel = ours.detach()
    os.set_inheritable(channel, True)
    return channel


@dataclass
class Ward:
    """One one-shot process the companion serves."""

    pid: int
    pidfd: int
    channel: socket.socket
    scratch: str
    held: list[int] = field(default_factory=list)  # the uid lock, until the process is gone
    auditor: audit.Auditor | None = None
    egress: tuple[dict[str, Any], int, int | None] | None = None  # until its first connection
    proxy: Future[Any] | None = None


class Companion:
    """The event loop: registrations, handovers, refused calls, egress, the end of each ward."""

    def __init__(self, registry: int, server_pid: int) -> None:
        self.registry = socket.socket(fileno=registry)
        self.out = LauncherLog(os.dup(2))  # the server's log
        self.selector = selectors.DefaultSelector()
        self.wards: dict[int, Ward] = {}  # by pidfd
        self.loop: asyncio.AbstractEventLoop | None = None  # the egress proxies', once needed
        self.paused: set[audit.Auditor] = set()  # wards past their CPU share (share.py)
        self.mark = time.thread_time()  # this thread's CPU when the last callback ended
        try:
            self.server = os.pidfd_open(server_pid)
        except OSError:
            self.server = -1
        self._watch(registry, self._register)
        if self.server >= 0:
            self._watch(self.server, self._server_gone)

    def _watch(self, fd: int, handler: Callable[[int], None]) -> None:
        self.selector.register(fd, selectors.EVENT_READ, lambda ready: self._timed(handler, ready))

    def _timed(self, handler: Callable[[int], None], fd: int) -> None:
        """Run a callback and mark where its CPU ends: from there on, the CPU (the next
        select's included) is the next callback's, charged to a ward if it answers one."""
        try:
            handler(fd)
        finally:
            self.mark = time.thread_time()

    def _unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError):
            self.selector.unregister(fd)

    def serve(self) -> None:
        """Run until the server is gone and so is every ward."""
        try:
            while self.registry.fileno() >= 0 or self.wards:
                run_round(self.selector, self._wait())
                self._resume_paused()
                if self.server < 0 and os.getppid() == 1:
                    self._server_gone(0)
        finally:
            for pidfd in list(self.wards):
                self._ward_gone(pidfd)
            self.out.close()

    def _wait(self) -> float | None:
        """How long select may wait: until the first paused ward's next answer is due."""
        wait = 1.0 if self.server < 0 else None
        for auditor in self.paused:
            due = max(0.0, (auditor.paused_until or 0.0) - time.monotonic())
            wait = due if wait is None else min(wait, due)
        return wait

    def _resume_paused(self) -> None:
        """Answer one call of each paused ward whose pause is over; watch again the listener
        of any ward whose own CPU has paid for more meanwhile."""
        for auditor in [a for a in self.paused if (a.paused_until or 0.0) <= time.monotonic()]:
            auditor.answer(self.mark, floor=True)
            self.mark = time.thread_time()
            if auditor.paused_until is None:
                self.paused.discard(auditor)
                self._watch_answers(auditor)

    def _server_gone(self, _: int) -> None:
        """No more registrations: the processes already registered are still served."""
        self._unwatch(self.registry.fileno())
        self.registry.close()
        if self.server >= 0:
            self._unwatch(self.server)
            os.close(self.server)
            self.server = -1

    def _register(self, _: int) -> None:
        received = handover.receive(self.registry)
        if received is None:  # the server closed its end
            self._server_gone(0)
            return
        request, fds = received
        path, pid = request.get("scratch"), request.get("pid")
        if len(fds) != 2 or not isinstance(path, str) or not isinstance(pid, int) \
                or not _is_scratch_of(path, pid):
            for fd in fds:
                os.close(fd)
            self.out.write(b"sandbox-kernel companion: a malformed registration was refused\n")
            return
        channel, pidfd = fds
        ward = Ward(pid, pidfd, socket.socket(fileno=channel), path)
        self.wards[pidfd] = ward
        self._watch(pidfd, lambda _: self._ward_gone(pidfd))
        self._watch(channel, lambda _: self._receive(ward))

    def _receive(self, ward: Ward) -> None:
        received = handover.receive(ward.channel)
        if received is None:  # the process closed its end: every handover is done
            self._unwatch(ward.channel.fileno())
            ward.channel.close()
            return
        request, fds = received
        if request.get("hold"):
            ward.held += fds
        elif "audit" in request and fds and ward.auditor is None:
            ward.auditor = auditor_for(request["audit"], fds, self.out, ward.pid)
            self._watch_answers(ward.auditor)
        elif "egress" in request and fds and ward.egress is None and ward.proxy is None:
            listener, *files = fds
            ward.egress = (request["egress"], listener, files[0] if files else None)
            # Served once user code first connects: most runs never do (see reaper.py).
            self._watch(listener, lambda _: self._serve_egress(ward))
        else:
            for fd in fds:
                os.close(fd)

    def _watch_answers(self, auditor: audit.Auditor) -> None:
        self._watch(auditor.listener, lambda _: self._answer(auditor))

    def _answer(self, auditor: audit.Auditor) -> None:
        """Answer the ward's refused calls waiting, as far as its CPU share allows.

        Not watched any more: a ward past its share (answered one call at a time by
        _resume_paused), and the listener of a process that is exiting, which reports its
        hang-up as readable until the ward's pidfd says the process is gone, once its exit freed
        its memory (~5 ms): each round meanwhile finds nothing, a thousand of them spinning
        while the next run wants the CPU. The listener is closed with the ward (_ward_gone).
        """
        auditor.answer(self.mark)
        if auditor.hung_up:
            self._unwatch(auditor.listener)
        elif auditor.paused_until is not None:
            self._unwatch(auditor.listener)
            self.paused.add(auditor)

    def _serve_egress(self, ward: Ward) -> None:
        assert ward.egress is not None
        settings, listener, audit_file = ward.egress
        self._unwatch(listener)
        ward.egress = None
        proxy = egress_proxy(settings, audit_file, self.out,
                             None if ward.auditor is None else ward.auditor.tally)
        if proxy is None:
            for fd in (listener, audit_file):
                if fd is not None:
                    os.close(fd)
            return
        ward.proxy = asyncio.run_coroutine_threadsafe(
            proxy.serve(socket.socket(fileno=listener)), self._egress_loop())
        if audit_file is not None:  # the proxy's records go there until it is stopped
            ward.proxy.add_done_callback(lambda _: os.close(audit_file))

    def _egress_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop every ward's egress proxy runs on, in a thread of its own."""
        if self.loop is None:
            loop = self.loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="egress").start()
        return self.loop

    def _ward_gone(self, pidfd: int) -> None:
        """The process ended: release its uid, stop its proxy, remove its scratch."""
        ward = self.wards.pop(pidfd)
        self._unwatch(pidfd)
        os.close(pidfd)
        if ward.channel.fileno() >= 0:
            self._unwatch(ward.channel.fileno())
            ward.channel.close()
        if ward.auditor is not None:  # what the reaper's exit would free, freed here
            auditor = ward.auditor
            self._unwatch(auditor.listener)
            self.paused.discard(auditor)
            auditor.close()
            tally = auditor.tally
            if tally is not None and ward.proxy is not None:  # unmapped in the proxy's thread,
                ward.proxy.add_done_callback(lambda _: tally.map.close())  # its last writer
            elif tally is not None:
                tally.map.close()
        if ward.egress is not None:
            _, listener, audit_file = ward.egress
            self._unwatch(listener)
            for fd in (listener, audit_file):
                if fd is not None:
                    os.close(fd)
        if ward.proxy is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(ward.proxy.cancel)  # closes its listener
        shutil.rmtree(ward.scratch, ignore_errors=True)
        for fd in ward.held:  # the uid is free once its files' owner is gone
            os.close(fd)


def _is_scratch_of(path: str, pid: int) -> bool:
    """Whether path is a scratch directory process pid made (the only thing removed here)."""
    candidate = Path(path)
    return (candidate.parent == Path(scratch.root()) and not candidate.is_symlink()
            and candidate.name.startswith(f"kernel-{pid}-"))
