"""A record of every system call the filter refused, kept where user code cannot reach it.

The allowlist's default action is SECCOMP_RET_USER_NOTIF: a refused call waits until whoever
holds the filter's listener answers. The kernel hands the listener to the reaper before user
code runs and closes its own copy; the reaper answers EPERM and writes one bounded JSON line
per denial to the audit file: --audit-log, or by default default_path() (never the launcher's
terminal, where the user's own output goes; only when no audit file can be opened do the lines
go to the launcher's log, so the record is never lost silently). Should the reaper be gone,
the kernel's pending and later refused calls fail with ENOSYS: still refused.

Answering costs the reaper CPU, outside every limit of the kernel's: each kernel's answers are
paid from a share of the kernel's own CPU (share.py) and charged to it (the tally carries the
figure to its usage); past its share a kernel's calls wait, answered one at a time. The records
are rate-limited too, and the ones left out are counted per system call in a summary record.

Raw ioctls rather than libseccomp's seccomp_notify_*: those are tied to the filter context of
the process that loaded it, and the reaper is another process holding only the descriptor.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import pwd
import select
import time
from collections import Counter
from typing import Any

from .denials import library_probe, uncounted
from .logrelay import LineSink, TokenBucket, escaped
from .share import LONGEST_PAUSE, PAUSE, CpuShare
from .tally import Tally

# struct seccomp_notif: u64 id; u32 pid; u32 flags; struct seccomp_data {int nr; u32 arch;
# u64 instruction_pointer; u64 args[6]}. struct seccomp_notif_resp: u64 id; s64 val;
# s32 error; u32 flags. The ioctls are _IOWR('!', 0 / 1, <struct>).
_NOTIF_SIZE, _RESP_SIZE = 80, 24
SECCOMP_IOCTL_NOTIF_RECV = (3 << 30) | (_NOTIF_SIZE << 16) | (ord("!") << 8) | 0
SECCOMP_IOCTL_NOTIF_SEND = (3 << 30) | (_RESP_SIZE << 16) | (ord("!") << 8) | 1

AUDIT_BURST = 100  # denials recorded at once ...
AUDIT_RATE = 10.0  # ... and per second after that; the rest are counted, not lost silently
FLUSH_AFTER = 1.0  # seconds after the first denial left out, the count of them is written
BATCH = 16  # answers in one turn of the reaper's loop: other kernels' turns come in between
ROOT_AUDIT_LOG = "/var/log/sandbox-kernel/audit.jsonl"


class Notification(ctypes.Structure):
    """struct seccomp_notif."""

    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("nr", ctypes.c_int32), ("arch", ctypes.c_uint32), ("ip", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class Response(ctypes.Structure):
    """struct seccomp_notif_resp."""

    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


assert ctypes.sizeof(Notification) == _NOTIF_SIZE and ctypes.sizeof(Response) == _RESP_SIZE


def receive(listener: int) -> Notification | None:
    """The next pending notification; None when its caller is already gone."""
    buffer = bytearray(_NOTIF_SIZE)
    try:
        fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, buffer, True)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EINTR):
            return None
        raise
    return Notification.from_buffer_copy(buffer)


def refuse(listener: int, notification: Notification, error: int = errno.EPERM) -> None:
    """Make the waiting call fail with error."""
    response = Response(id=notification.id, val=0, error=-error, flags=0)
    try:
        fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, bytearray(bytes(response)), True)
    except OSError as exc:
        if exc.errno != errno.ENOENT:  # ENOENT: the caller was killed meanwhile
            raise


def syscall_name(number: int) -> str:
    """The native system call's name, or its number when unknown."""
    try:
        import pyseccomp

        name = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, number)
    except (ImportError, RuntimeError, OSError, ValueError):
        name = b""
    return name.decode() if name else f"syscall_{number}"


def thread_name(tid: int) -> str:
    """The calling thread's name (16 bytes at most), to tell user code from the kernel's own."""
    try:
        with open(f"/proc/{tid}/comm", "rb") as comm:
            name = comm.read(64).decode(errors="replace").rstrip("\n")
    except OSError:
        return ""
    return "".join(c if c.isprintable() else "?" for c in name)  # user code names threads


def record(notification: Notification, kernel_id: str, uid: int | None,
           name: str | None = None) -> dict[str, Any]:
    """One denial as a JSON-able record of bounded size (name: the call's, when known)."""
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kernel": kernel_id[:128],
        "pid": notification.pid,
        "thread": thread_name(notification.pid),
        "uid": uid,
        "syscall": name or syscall_name(notification.nr),
        "nr": notification.nr,
        "args": [hex(value) for value in notification.args],
        "errno": "EPERM",
    }


class Auditor:
    """Answers the kernel's refused calls as far as its CPU share pays, and records each one,
    rate-limited."""

    def __init__(self, listener: int, audit_file: int | None, log: LineSink,
                 kernel_id: str, uid: int | None, tally: Tally | None = None,
                 pid: int | None = None) -> None:
        self.listener, self.audit_file, self.log = listener, audit_file, log
        self.tally = tally  # the kernel reads it for each execution's usage
        self.kernel_id, self.uid = kernel_id, uid
        self.share = CpuShare(pid)  # pid: the kernel's, whose CPU pays for its answers
        self.paused_until: float | None = None  # past its share: when one more is answered
        self.pause = PAUSE  # ... after this long, doubled at each answer while still past it
        self.hung_up = False  # no process uses the filter any more: nothing will wait again
        self.poller = select.poll()
        self.poller.register(listener, select.POLLIN)
        self.names = {0: syscall_name(0)}  # the names' library loaded now, not in an answer
        self.budget = TokenBucket(AUDIT_BURST, AUDIT_RATE)
        self.left_out: Counter[str] = Counter()  # denials not recorded, per system call
        self.pauses = 0  # times the kernel went past its share since the last summary
        self.suppressed = 0
        self.suppressed_since = 0.0

    def answer(self, since: float, floor: bool = False) -> None:
        """Answer the calls waiting (EPERM): at most BATCH, while the kernel's share allows or
        once its pause is over (floor: the wake-up is most of an answer's cost, so one turn
        frees every waiting thread); charge the kernel this thread's CPU from `since` (its CPU
        clock, time.thread_time(), when the work for it began)."""
        for _ in range(BATCH if floor or self.share.allows() else 0):
            if not self._waiting():
                break
            self._answer_one()
        spent = time.thread_time() - since
        if not floor:  # an answer per pause is the kernel's whatever its share: paid by time
            self.share.spend(spent)
        if self.tally is not None:
            self.tally.charge_answers(spent)
        if self.share.allows():
            self.paused_until, self.pause = None, PAUSE
        else:
            if self.paused_until is None:
                self.pauses += 1  # counted in the next summary record
            else:  # still past its share after a paid-by-time answer: wait twice as long
                self.pause = min(2 * self.pause, LONGEST_PAUSE)
            self.paused_until = time.monotonic() + self.pause

    def _waiting(self) -> bool:
        """Whether a call waits for its answer (a receive would block otherwise).

        The listener of a process that is exiting reports its hang-up as readable until the
        process is gone (~5 ms after its exit): that is noted, for the loop to stop watching."""
        for _, events in self.poller.poll(0):
            if events & select.POLLIN:
                return True
            self.hung_up = bool(events & select.POLLHUP)
        return False

    def _answer_one(self) -> None:
        """Refuse the next pending call (EPERM), then record it or count it as left out."""
        notification = receive(self.listener)
        if notification is None:
            return
        name = self.names.get(notification.nr)
        if name is None:
            name = self.names[notification.nr] = syscall_name(notification.nr)
        if self.tally is not None and not uncounted(name):
            self.tally.add()  # before the answer: counted by the time the call returns
        refuse(self.listener, notification)
        if not self.budget.take():
            if not self.suppressed:
                self.suppressed_since = time.monotonic()
            self.suppressed += 1
            self.left_out[name] += 1
            return
        self.report_suppressed()
        entry = record(notification, self.kernel_id, self.uid, name)
        probe = library_probe(name, list(notification.args))
        if probe is not None:  # a library's attempt it copes without: marked as such
            entry["probe"] = probe
        self._write(entry, f"refused {entry['syscall']}({', '.join(entry['args'])}) "
                           f"thread {entry['pid']} ({entry['thread']})")

    def due(self) -> bool:
        """Whether denials left out have waited FLUSH_AFTER seconds for their count."""
        return bool(self.suppressed) and \
            time.monotonic() - self.suppressed_since >= FLUSH_AFTER

    def report_suppressed(self) -> None:
        """Record how many denials the rate limit left out since the last record, per call,
        and how many times the kernel's answers were paced meanwhile (past its CPU share)."""
        if self.suppressed or self.pauses:
            calls = dict(self.left_out.most_common())
            self._write({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "kernel": self.kernel_id[:128], "suppressed": self.suppressed,
                         "syscalls": calls, "paced": self.pauses},
                        f"{self.suppressed} more denials not recorded (rate limit): "
                        + ", ".join(f"{name} x{count}" for name, count in calls.items())
                        + f"; answers paced {self.pauses} times (past the CPU share)")
            self.suppressed = self.pauses = 0
            self.left_out.clear()

    def close(self) -> None:
        """The kernel is gone: write the last count, close the listener and the audit file."""
        self.report_suppressed()
        self.share.close()
        os.close(self.listener)
        if self.audit_file is not None:
            os.close(self.audit_file)

    def _write(self, entry: dict[str, Any], summary: str) -> None:
        if self.audit_file is not None:
            try:  # one write per line: O_APPEND keeps concurrent kernels' lines whole
                os.write(self.audit_file, json.dumps(entry).encode() + b"\n")
                return
            except OSError as exc:
                self.log.write(f"sandbox-kernel audit: cannot write the audit log: {exc}\n"
                               .encode())
        # No audit file: the launcher's log keeps the record. Thread names are user code's:
        # every character of the line is shown printable.
        self.log.write(f"sandbox-kernel audit: kernel {escaped(self.kernel_id[:128])}: "
                       f"{escaped(summary)}\n".encode())


def default_path(uid: int | None = None) -> str:
    """Where the record goes without --audit-log: a log of root's, or the user's state dir.

    Taken from the account, not the environment: the kernel runs with a clean one (HOME is its
    scratch), and the launcher's `check` names the same file.
    """
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return ROOT_AUDIT_LOG
    try:
        home = pwd.getpwuid(uid).pw_dir
    except KeyError:  # an account-less uid: no home of its own to keep a record in
        return ""
    return os.path.join(home, ".local", "state", "sandbox-kernel", "audit.jsonl")


def open_log(path: str, make_folder: bool = False) -> int:
    """Open the audit file for appending (created 0600); the reaper keeps the fd.

    make_folder: create its folder (0700) first, as for the default path.
    """
    if make_folder:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                   0o600)
