"""The kernel's unconfined companion: it holds what user code must never touch.

Forked before any confinement, in its own session, the reaper is the only process that keeps
the launcher's stderr. The kernel's fds 0-2 become /dev/null and a pipe whose other end the
reaper reads, so the kernel's log still reaches the launcher, bounded and rate-limited, while
user code can neither truncate the launcher's log file, read its terminal, nor write to the
launcher's stdout (where `sandbox-kernel run --json` prints its one JSON object).

Over a socketpair (the *channel*) the kernel hands the reaper, before user code runs, what must
outlive it or stay out of its reach: the lock on its uid (held until the kernel is gone) and the
seccomp listener with the audit file (denials are answered and recorded here, see audit.py).
The reaper learns of the kernel's end from a pidfd, which user code cannot fake, then deletes
the scratch directory: the kernel itself cannot, Landlock grants it nothing on the parent.

This module is the process (its stdio, its event loop, its end); the log relay is logrelay.py,
the channel's messages handover.py, the denials' record audit.py.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import threading
import time
from typing import Any

from ..fdwait import readable
from . import audit, handover, vault
from .logrelay import LauncherLog, LogRelay
from .tally import Tally


def start(scratch_dir: str, kernel: str = "", sealed: int | None = None) -> int:
    """Fork the reaper; give this process a stdio of its own; return the channel's fd.

    Call before any confinement, while single-threaded. Afterwards fds 0-2 of this process are
    /dev/null and the log pipe: nothing of the launcher's stdio is left here. sealed: the
    launcher's vault (vault.py), which only the reaper reads; this process closes its copy.
    """
    kernel_pid = os.getpid()
    log_read, log_write = os.pipe()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.fork() == 0:
        try:
            ours.close()
            _run(kernel_pid, kernel, scratch_dir, log_read, theirs.detach(), sealed)
        finally:
            os._exit(0)
    if sealed is not None:
        os.close(sealed)
    os.close(log_read)
    theirs.close()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(log_write, 1)
    os.dup2(log_write, 2)
    os.close(null)
    os.close(log_write)
    channel = ours.detach()
    os.set_inheritable(channel, True)
    return channel


def _run(kernel_pid: int, kernel_name: str, scratch_dir: str, log_read: int,
         channel: int, sealed: int | None = None) -> None:
    os.setsid()  # survive the kernel's process group being killed
    held = vault.open_vault(sealed) if sealed is not None else {}
    launcher = os.dup(2)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # keep nothing of the launcher's stdio but one stderr
        os.dup2(null, fd)
    keep = sorted({launcher, log_read, channel})
    os.closerange(3, keep[0])
    for low, high in zip(keep, [*keep[1:], 65536], strict=True):
        os.closerange(low + 1, high)
    try:
        kernel = os.pidfd_open(kernel_pid)
    except OSError:
        kernel = -1
    if os.getppid() != kernel_pid:  # the kernel died before we could watch it
        shutil.rmtree(scratch_dir, ignore_errors=True)
        return
    Reaper(kernel_pid, kernel, launcher, log_read, channel, kernel_name, held).serve()
    shutil.rmtree(scratch_dir, ignore_errors=True)


class Reaper:
    """The reaper's event loop: log relay, handovers from the kernel, seccomp notifications."""

    def __init__(self, kernel_pid: int, kernel: int, launcher: int, log_read: int,
                 channel: int, kernel_name: str = "",
                 held: dict[str, Any] | None = None) -> None:
        self.kernel_pid, self.kernel_name = kernel_pid, kernel_name
        self.held_secrets = held or {}  # the launcher's vault: for the egress proxy alone
        self.out = LauncherLog(launcher)
        self.relay = LogRelay(self.out, kernel=kernel_name or str(kernel_pid))
        self.kernel, self.log_read, self.channel = kernel, log_read, channel
        self.channel_socket = socket.socket(fileno=channel)
        self.held: list[int] = []  # the uid lock: released when we exit
        self.auditor: audit.Auditor | None = None
        self.egress: tuple[dict[str, Any], int, int | None] | None = None  # until a connection
        self.proxy: tuple[Any, threading.Thread] | None = None  # the egress proxy, once serving
        self.ca: Any = None  # the kernel's CA (egress/ca.py), made here for a kernel with secrets
        self.mark = time.thread_time()  # this thread's CPU when the last event was handled
        self.poller = select.poll()
        for fd in (log_read, channel) + ((kernel,) if kernel >= 0 else ()):
            self.poller.register(fd, select.POLLIN)

    def serve(self) -> None:
        """Run until the kernel process is gone."""
        try:
            while self._kernel_alive():
                for fd, events in self.poller.poll(self._wait()):
                    self._ready(fd, events)
                    self.mark = time.thread_time()  # the CPU after this is the next event's
                if self.auditor is not None:
                    self._resume_answers(self.auditor)
                    if self.auditor.due():
                        self.auditor.report_suppressed()
            self._drain_log()
        finally:
            self._stop_egress()
            if self.auditor is not None:
                self.auditor.report_suppressed()
            self.relay.flush()
            self.out.close()

    def _wait(self) -> int | None:
        """How long poll may wait (ms): the count of unrecorded denials is written within 1 s,
        and a kernel past its CPU share has its next call answered when its pause ends."""
        wait = None if self.kernel >= 0 else 1000
        if self.auditor is not None and self.auditor.suppressed:
            wait = 1000
        if self.auditor is not None and self.auditor.paused_until is not None:
            due = max(0, round((self.auditor.paused_until - time.monotonic()) * 1000))
            wait = due if wait is None else min(wait, due)
        return wait

    def _resume_answers(self, auditor: audit.Auditor) -> None:
        """Past its pause, answer one call of a kernel past its share; watch its listener
        again once the kernel's own CPU has paid for more (audit.py, share.py)."""
        if auditor.paused_until is None or auditor.paused_until > time.monotonic():
            return
        auditor.answer(self.mark, floor=True)
        self.mark = time.thread_time()
        if auditor.paused_until is None and not auditor.hung_up:
            self.poller.register(auditor.listener, select.POLLIN)

    def _stop_egress(self, timeout: float = 5.0) -> None:
        """Close the proxy's open connections, recording each, and write what it counted."""
        if self.proxy is not None:
            proxy, thread = self.proxy
            proxy.stop()
            thread.join(timeout)

    def _kernel_alive(self) -> bool:
        if self.kernel >= 0:
            return not readable(self.kernel, 0)
        return os.getppid() == self.kernel_pid  # without pidfds: reparented, the kernel is gone

    def _ready(self, fd: int, events: int) -> None:
        if not events & select.POLLIN:  # hung up: nothing will come from there any more
            self.poller.unregister(fd)
        elif fd == self.log_read:
            data = os.read(fd, 65536)
            if data:
                self.relay.feed(data)
            else:  # user code closed every copy; nothing more to relay
                self.poller.unregister(fd)
        elif fd == self.channel:
            self._receive()
        elif self.auditor is not None and fd == self.auditor.listener:
            self.auditor.answer(self.mark)
            if self.auditor.paused_until is not None:  # past its share: answered when due
                self.poller.unregister(fd)
        elif self.egress is not None and fd == self.egress[1]:
            self._serve_egress_now()

    def _drain_log(self) -> None:
        """Relay what the kernel wrote before it ended (its write ends are closed now)."""
        os.set_blocking(self.log_read, False)
        try:
            for _ in range(64):
                data = os.read(self.log_read, 65536)
                if not data:
                    break
                self.relay.feed(data)
        except OSError:
            pass

    def _receive(self) -> None:
        received = handover.receive(self.channel_socket)
        if received is None:  # the kernel closed its end: every handover is done
            self.poller.unregister(self.channel)
            self.channel_socket.close()
            return
        request, fds = received
        if request.get("hold"):
            self.held += fds
        elif "audit" in request and fds:
            self._start_audit(request["audit"], fds)
        elif "egress" in request and fds:
            self._start_egress(request["egress"], fds)
        elif request.get("ca") and self.ca is None:
            self._make_ca()
        else:
            for fd in fds:
                os.close(fd)

    def _make_ca(self) -> None:
        """Make the kernel's CA here, outside the kernel; answer with its certificate only.

        Only for a kernel this reaper holds secrets for; any other is answered "none".
        """
        if not vault.secrets_of(self.held_secrets):
            self.channel_socket.send(b"none")
            return
        from .egress.ca import KernelCA

        self.ca = KernelCA(self.kernel_name)
        self.channel_socket.send(self.ca.certificate_pem())

    def _start_egress(self, settings: dict[str, Any], fds: list[int]) -> None:
        """Serve the egress listener once user code first connects to it.

        Most runs of a network kernel never connect (every Dify request asks for the network);
        a thread and an event loop per kernel cost ~3 ms of CPU, so they wait for a connection,
        which waits in the listener's backlog meanwhile.
        """
        listener, *files = fds
        self.egress = (settings, listener, files[0] if files else None)
        self.poller.register(listener, select.POLLIN)

    def _serve_egress_now(self) -> None:
        assert self.egress is not None
        settings, listener, audit_file = self.egress
        self.poller.unregister(listener)
        self.egress = None
        tally = None if self.auditor is None else self.auditor.tally
        proxy = egress_proxy(settings, audit_file, self.out, tally, self.held_secrets, self.ca)
        if proxy is None:
            os.close(listener)
            return
        thread = threading.Thread(target=_serve_egress, daemon=True, name="egress",
                                  args=(proxy, listener, self.out))
        self.proxy = (proxy, thread)
        thread.start()

    def _start_audit(self, settings: dict[str, Any], fds: list[int]) -> None:
        self.auditor = auditor_for(settings, fds, self.out, self.kernel_pid)
        self.poller.register(self.auditor.listener, select.POLLIN)


def auditor_for(settings: dict[str, Any], fds: list[int], out: LauncherLog,
                pid: int | None = None) -> audit.Auditor:
    """The auditor of a kernel's `audit` handover: its listener, refusal count, audit file;
    pid: the kernel's process, whose CPU pays for the answers (share.py)."""
    listener, *files = fds
    counted = None
    if settings.get("tally") and files:  # the count of refused calls comes first
        tally_fd, *files = files
        # Only a count whose size is sealed: a shrunk one would fault this process.
        counted = Tally(tally_fd, writable=True) if Tally.sealed(tally_fd) else None
        os.close(tally_fd)
    return audit.Auditor(listener, files[0] if files else None, out,
                         kernel_id=str(settings.get("kernel", "")),
                         uid=settings.get("uid"), tally=counted, pid=pid)


def egress_proxy(settings: dict[str, Any], audit_file: int | None, out: LauncherLog,
                 tally: Tally | None = None, held: dict[str, Any] | None = None,
                 ca: Any = None) -> Any:
    """The kernel's egress proxy under its rules; None (said on the log) when they are bad.

    Its CPU for the kernel's connections is added to the kernel's tally (for its usage).
    settings come from the kernel, so they never carry credentials; held is the launcher's
    vault (vault.py): the secrets to add, and the upstream proxy's URL with its credentials;
    ca: the kernel's CA (made here at the kernel's request), which their hosts' TLS ends with.
    The `upstream_ca` file of the settings is read here, outside the kernel.
    """
    from .egress.proxy import AuditSink, EgressProxy
    from .egress.rules import EgressRules, Upstream

    held = held or {}
    secrets = vault.secrets_of(held)
    try:
        rules = EgressRules.parse(settings["mode"], settings["allow_hosts"],
                                  settings["allow_addresses"])
        url = held.get("upstream_proxy") or settings.get("upstream_proxy")
        upstream = Upstream.parse(url) if url else None
        upstream_ca = None
        if settings.get("upstream_ca"):
            with open(settings["upstream_ca"], "rb") as file:
                upstream_ca = file.read()
        if secrets and ca is None:
            raise ValueError("the kernel has secrets but asked for no CA to add them with")
        if tally is not None and secrets:
            tally.name_secrets([secret.name for secret in secrets])
        return EgressProxy(rules, str(settings.get("kernel", ""))[:128],
                           AuditSink(audit_file, out), upstream,
                           charge=None if tally is None else tally.charge,
                           count_use=None if tally is None else tally.use,
                           secrets=secrets, ca=ca,
                           upstream_ca=upstream_ca)
    except (KeyError, TypeError, ValueError, OSError) as exc:
        out.write(f"sandbox-kernel: egress proxy not started: {exc}\n".encode())
        return None


def _serve_egress(proxy: Any, listener: int, out: LauncherLog) -> None:
    """Serve the kernel's egress listener until the proxy is stopped (a thread)."""
    import asyncio

    try:
        asyncio.run(proxy.serve(socket.socket(fileno=listener)))
    except asyncio.CancelledError:  # stopped: the kernel has ended
        pass
    except Exception as exc:  # never silently: user code would only see connections hang
        out.write(f"sandbox-kernel: the egress proxy stopped: {exc!r}\n".encode())
        raise
