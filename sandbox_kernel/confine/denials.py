"""Clear messages for calls the sandbox refused.

The filter answers a refused call with a bare EPERM, which Python shows as "Operation not
permitted". These wrappers call the real function first and, only when the kernel really refused
it, re-raise a PermissionError that says which rule refused it and what would allow it. They are a
courtesy, not a layer: calling the unwrapped function still hits the same filter.

Landlock answers a file outside the grants with a bare EACCES, from whichever call touched it
(open, listdir, scandir, pathlib, stat, a library's own open). Rather than wrapping them all,
the kernel explains such an error when it shows it (`explain_file_error`): the kernel knows its
grants, so an EACCES on a path under none of them is the sandbox's; one inside a grant is the
host's own answer and is left alone. `user_part` cuts a refusal's traceback at the user's call.

Each refusal is a `Rule`: the operator's explanation (with the flag) that the error carries, and
the same refusal said for a model (`for_model`), which the MCP server shows in its place.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import pty
import shlex
import socket
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from ..advice import change


@dataclass(frozen=True)
class Rule:
    """One thing the sandbox refuses, said twice: once for the operator, once for a model.

    `why` is what the error text carries (the rule, and the flag that changes it: for whoever
    runs the sandbox); `for_model` is what an agent reading the result can act on (what happened
    and what its code can do instead). Faces that talk to a model (the MCP server) find the rule
    by its `why` in the error (`rule_in`) and show `for_model`, keeping `why` for their log.
    """

    why: str
    for_model: str

    def __str__(self) -> str:
        return self.why


PROCESSES = Rule(
    "creating processes is not allowed in the sandbox (no policy flag allows it: run external "
    "programs outside the kernel)",
    "no subprocesses in this sandbox: you cannot run programs or shell commands; do the work "
    "in Python (call the library directly instead of its command-line tool)")
NETWORK_OFF = Rule(
    "the network is off in this sandbox (--network off)",
    "the network is off in this sandbox: you cannot download or call web services; use the "
    "files and data you were given")
NETWORK_KINDS = Rule(
    "the sandbox only allows AF_INET/AF_INET6 stream and datagram sockets, even with "
    "--allow-network",
    "only ordinary TCP/UDP internet sockets are allowed here: use a TCP or UDP socket (or an "
    "HTTP library) instead of raw, netlink or other socket kinds")
FILE_MODES = Rule(
    "changing file permissions is not allowed in the sandbox (copy files with "
    "shutil.copyfile, which keeps the default mode)",
    "file permissions cannot be changed in this sandbox: leave the default mode (copy files "
    "with shutil.copyfile, not shutil.copy)")
TRUNCATE_BY_PATH = Rule(
    "truncating a file by its path is refused where Landlock is older than ABI 3 (it could not "
    "keep truncation inside the grants): open the file for writing and use f.truncate()",
    "truncating a file by its path is refused here: open the file for writing and call "
    "f.truncate() instead")
SERVERS = Rule(
    "listening for connections is not allowed in the sandbox (no policy flag allows it: "
    "connect out with --allow-network instead)",
    "you cannot open a server or listen on a port in this sandbox: compute the result in "
    "Python and return it instead")
DESCRIPTOR_OWNER = Rule(
    "a descriptor's owner may only be the kernel's own process in the sandbox (its signals "
    "would reach other processes; no policy flag allows it)",
    "signals may only go to this sandbox's own process: drop the F_SETOWN call")
UNIX_DATAGRAMS = Rule(
    "the sandbox only allows stream socketpairs (socket.socketpair()): datagram sockets could "
    "send to the host's unix sockets",
    "only stream socket pairs are allowed here: call socket.socketpair() without a datagram type")
PROXY_ONLY = Rule(
    "user code's network reaches only the sandbox's egress proxy (HTTP_PROXY): direct "
    "connections, UDP and name lookups do not leave the kernel's own network namespace; use an "
    "HTTP client (requests, httpx, urllib, pip, aiohttp with trust_env=True), which goes "
    "through the proxy, to a host --allow-host names",
    "direct connections and DNS lookups are not possible here: use an HTTP library (requests, "
    "httpx, urllib), which goes through the sandbox's proxy to the hosts it allows")
DEBUGGER = Rule(
    "debugging is not available in the sandbox: the debugger runs debugpy's adapter as a "
    "subprocess, and the sandbox forbids creating processes",
    "there is no debugger in this sandbox: add print() calls or assertions to see what the "
    "code does")
_F_SETOWN, _F_SETOWN_EX = 8, 15

_SHELL_FAILED = 127 << 8  # what os.system returns when the shell could not be started


def network_fix(launcher: str) -> str:
    """What NETWORK_OFF's refusals add: the launcher's way to turn the network on."""
    return ("; to let the code reach the hosts it needs, "
            + change(launcher, "--network hosts --allow-host NAME",
                     ("--network on", "for any public address"))
            + ", one --allow-host per host")


def _denied(what: str, rule: Rule, fix: str = "") -> PermissionError:
    message = f"Operation not permitted: the sandbox blocked {what}: {rule.why}{fix}"
    exc = PermissionError(errno.EPERM, message)
    exc.sandbox_rule = rule.why  # type: ignore[attr-defined]  # marks it as explained, a refusal
    return exc


def _unexplained(exc: PermissionError, errnos: tuple[int, ...] = (errno.EPERM,)) -> bool:
    return exc.errno in errnos and not hasattr(exc, "sandbox_rule")


def _explain(original: Callable[..., Any], what: str, why: Rule,
             errnos: tuple[int, ...] = (errno.EPERM,), fix: str = "") -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except PermissionError as exc:
            if not _unexplained(exc, errnos):
                raise
            raise _denied(what, why, fix) from None

    return wrapper


def _explain_system(original: Callable[[Any], int]) -> Callable[[Any], int]:
    @functools.wraps(original)
    def system(command: Any) -> int:
        status = original(command)
        if status == _SHELL_FAILED:
            raise _denied("os.system()", PROCESSES)
        return status

    return system


def _explain_socket(allow_network: bool, fix: str) -> Callable[..., None]:
    original = socket.socket.__init__

    @functools.wraps(original)
    def __init__(self: socket.socket, family: Any = -1, type: Any = -1, *args: Any,
                 **kwargs: Any) -> None:
        try:
            original(self, family, type, *args, **kwargs)
        except PermissionError as exc:
            if not _unexplained(exc):
                raise
            if allow_network:
                raise _denied("creating a socket", NETWORK_KINDS) from None
            raise _denied("creating a socket", NETWORK_OFF, fix) from None

    return __init__


def _explain_fcntl(original: Callable[..., Any]) -> Callable[..., Any]:
    explained = _explain(original, "fcntl()", DESCRIPTOR_OWNER)

    @functools.wraps(original)
    def fcntl(fd: Any, cmd: int, *args: Any) -> Any:
        # Only the owner-setting commands: other EPERMs (O_NOATIME, ...) are the host's own.
        if cmd in (_F_SETOWN, _F_SETOWN_EX):
            return explained(fd, cmd, *args)
        return original(fd, cmd, *args)

    return fcntl


def _unreachable(exc: OSError, what: str) -> OSError:
    explained = OSError(exc.errno, f"{exc.strerror}: the sandbox blocked {what}: {PROXY_ONLY}")
    explained.sandbox_rule = PROXY_ONLY.why  # type: ignore[attr-defined]
    return explained


def _explain_unreachable(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    """With the network through the proxy: say why a direct connection found no route."""
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except OSError as exc:
            if exc.errno != errno.ENETUNREACH or hasattr(exc, "sandbox_rule"):
                raise
            raise _unreachable(exc, what) from None

    return wrapper


def _explain_lookup(original: Callable[..., Any], why: Rule, fix: str = ""
                    ) -> Callable[..., Any]:
    """Say why a name lookup failed: the resolver's own words ("Temporary failure in name
    resolution") read as a passing fault of the host's DNS, worth retrying."""
    said = "the sandbox resolves no names itself" if why is PROXY_ONLY else \
        "the sandbox blocked a name lookup"

    @functools.wraps(original)
    def getaddrinfo(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except socket.gaierror as exc:
            if hasattr(exc, "sandbox_rule"):
                raise
            explained = socket.gaierror(exc.errno, f"{exc.strerror}: {said}: {why}{fix}")
            explained.sandbox_rule = why.why  # type: ignore[attr-defined]
            raise explained from None

    return getaddrinfo


def install(allow_network: bool, proxy: bool = False, launcher: str = "") -> None:
    """Wrap the usual ways Python creates processes and sockets.

    proxy: the network goes through the egress proxy (explain direct attempts).
    launcher: the policy's changed_with, for the way to turn the network on (advice.py).
    """
    fix = network_fix(launcher)
    import _posixsubprocess
    import subprocess

    for name in ("fork", "posix_spawn", "posix_spawnp", "execv", "execve"):
        if hasattr(os, name):
            setattr(os, name, _explain(getattr(os, name), f"os.{name}()", PROCESSES))
    # forkpty opens /dev/ptmx (refused by Landlock) before it forks. pty.fork, and so IPython's
    # `!cmd`, would then retry by hand and report "out of pty devices": let forkpty answer.
    os.forkpty = _explain(os.forkpty, "os.forkpty()", PROCESSES, (errno.EPERM, errno.EACCES))
    pty.fork = os.forkpty
    os.system = _explain_system(os.system)  # type: ignore[assignment]
    for name in ("chmod", "fchmod", "lchmod"):
        if hasattr(os, name):
            setattr(os, name, _explain(getattr(os, name), f"os.{name}()", FILE_MODES))
    fork_exec = _explain(_posixsubprocess.fork_exec, "starting a subprocess", PROCESSES)
    _posixsubprocess.fork_exec = fork_exec  # multiprocessing looks it up here
    subprocess._fork_exec = fork_exec  # type: ignore[attr-defined]  # subprocess keeps a copy
    socket.socket.__init__ = _explain_socket(allow_network, fix)  # type: ignore[method-assign]
    os.truncate = _explain(os.truncate, "os.truncate()", TRUNCATE_BY_PATH)
    fcntl.fcntl = _explain_fcntl(fcntl.fcntl)
    socket.socketpair = _explain(socket.socketpair, "socket.socketpair()", UNIX_DATAGRAMS)
    for name in ("bind", "listen"):
        setattr(socket.socket, name, _explain(getattr(socket.socket, name),
                                              f"socket.{name}()", SERVERS))
    if not allow_network:
        for name in ("connect",):
            setattr(socket.socket, name, _explain(getattr(socket.socket, name),
                                                  f"socket.{name}()", NETWORK_OFF, fix=fix))
        socket.getaddrinfo = _explain_lookup(socket.getaddrinfo, NETWORK_OFF, fix)
    if proxy:
        for name in ("connect", "sendto"):
            setattr(socket.socket, name, _explain_unreachable(getattr(socket.socket, name),
                                                              f"socket.{name}()"))
        socket.getaddrinfo = _explain_lookup(socket.getaddrinfo, PROXY_ONLY)


# --- refusals libraries cope with: recorded, not shown ------------------------------------------

_CLONE_THREAD = 0x10000
_NUMA_CALLS = ("mbind", "set_mempolicy")
_NUMA_HINT = ("a NUMA placement hint (OpenBLAS, numpy's BLAS, gives one for each buffer it "
              "maps; the memory is used all the same)")
_PROBED_PROCESS = ("starting a process (matplotlib's font cache runs fc-list, ctypes.util runs "
                   "ldconfig; each falls back when refused); Python code that starts one is "
                   "told so in its own PermissionError")


def uncounted(syscall: str) -> bool:
    """Whether a refused call is only a library's own hint, one no Python code of the user's
    makes (NUMA placement): recorded in the audit, but left out of an execution's count of
    refused calls, which a model or a dashboard reads as something the code ran into."""
    return syscall in _NUMA_CALLS


def library_probe(syscall: str, args: Sequence[int]) -> str | None:
    """What library habit a refused call is, when libraries cope with its refusal; else None.

    The reaper records such a refusal in the audit file but does not print it to the
    launcher's stderr, which is the user's terminal under `jupyter execute`, papermill and
    nbclient: every `import numpy` would print lines there. A process that user code starts
    through Python is refused with an explained PermissionError in its own output (install()).
    """
    if syscall in _NUMA_CALLS:
        return _NUMA_HINT
    if syscall in ("fork", "vfork") or (syscall == "clone" and args
                                        and not args[0] & _CLONE_THREAD):
        return _PROBED_PROCESS
    return None


# --- files: explained when shown ------------------------------------------------------------------

# The file refusals' texts are built per path; each begins with its rule's `why`.
OUTSIDE_GRANTS = Rule(
    "the sandbox refused it: the path is outside what this kernel was granted",
    "that path is outside what this sandbox may read: work with the files in your working "
    "directory (the files you were given are there)")
READ_ONLY = Rule(
    "the sandbox refused it: this kernel was granted the path read-only",
    "that path is read-only in this sandbox: write your files in the working directory instead")
HIDDEN = Rule(
    "the sandbox hides it: the path is outside what this kernel was granted",
    OUTSIDE_GRANTS.for_model)
NOT_IN_SCRATCH = Rule(
    "the kernel's working directory is its private scratch",
    "that file is not in your working directory (the sandbox's own folder): write it there "
    "first, or use the files that are there")
HOST_REFUSES = Rule(
    "the host refuses it, not the sandbox: user code runs as a uid of its own",
    "the computer's own permissions keep this sandbox from writing there: keep the data in "
    "memory, or write your files under the folder in the HOME environment variable")
RULES = (PROCESSES, NETWORK_OFF, NETWORK_KINDS, PROXY_ONLY, FILE_MODES, TRUNCATE_BY_PATH, SERVERS,
         DESCRIPTOR_OWNER, UNIX_DATAGRAMS, DEBUGGER, OUTSIDE_GRANTS, READ_ONLY, HIDDEN,
         NOT_IN_SCRATCH, HOST_REFUSES)
HOST_WRITE_FIX = ("to let it write there, have user code run as a user (not root) who may "
                  "write in {dir}: {how}; or let other users write there (`chmod o+w {dir}`); "
                  "its HOME (the scratch) is always writable")


def host_write_fix(folder: str, launcher: str = "") -> str:
    """How to let user code's uid write in folder, which the host's permissions keep it out of."""
    return HOST_WRITE_FIX.format(dir=folder, how=change(launcher, "--run-as USER"))


HOST_TOO = "the host would refuse it too: user code runs as a uid of its own"


def host_write_refusal(path: str, uid: int, gid: int, launcher: str = "",
                       lead: str = HOST_REFUSES.why) -> str | None:
    """Why the host's own permissions keep uid:gid from writing path (a file, or a folder to
    create one in), or None. A grant keeps them: started by root, user code runs as a uid of
    its own, which a root-owned 0755 folder keeps out, --grant-cwd=rw or --write-path or not.
    The mode bits only (not ACLs): said before a kernel runs as that uid, as well as after."""
    target = path if os.path.lexists(path) else os.path.dirname(path) or "/"
    try:
        info = os.stat(target)
    except OSError:
        return None
    bit = 0o200 if info.st_uid == uid else 0o020 if info.st_gid == gid else 0o002
    if uid == 0 or info.st_mode & bit:
        return None
    folder = target if os.path.isdir(target) else os.path.dirname(target)
    return (f"{lead} ({uid}), which {target} (owner uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):04o}) does not let write; "
            + host_write_fix(folder, launcher))


def rule_in(text: str) -> Rule | None:
    """The rule whose operator explanation this error text carries, if any."""
    return next((rule for rule in RULES if rule.why in text), None)


def grant_path(path: str, launcher: str) -> str:
    """The step that grants path read-only (or read-write), said for the launcher."""
    quoted = shlex.quote(path)
    return change(launcher, f"--read-path {quoted}",
                  (f"--write-path {quoted}", "to write there too"))


def grant_cwd(launcher: str) -> str:
    """The step that grants the folder a kernel starts in, said for the launcher."""
    return (change(launcher, "--grant-cwd", ("--grant-cwd=rw", "to write there too"))
            + ": it then starts in that folder")


# Grants' real paths, kept for the process's life (and a pool's zygote works them out for
# every one-shot kernel it forks: ~80 paths, 1.5 ms): they only explain refusals here.
_real_path = functools.lru_cache(maxsize=1024)(os.path.realpath)


@dataclass(frozen=True)
class FileAccess:
    """What the kernel knows about its files: its grants, its scratch, where it was started."""

    landlock: bool  # off: every EACCES is the host's
    read: tuple[str, ...] = ()  # real paths granted read-only or read-write
    write: tuple[str, ...] = ()  # real paths granted read-write
    scratch: str = ""
    launch_dir: str = ""  # the cwd at launch: under Jupyter, the notebook's folder
    hidden: tuple[str, ...] = ()  # directories the kernel's view covers: only grants show there
    cwd_mode: str = ""  # --grant-cwd: "", "ro" or "rw"
    cwd_refused: str = ""  # why --grant-cwd was not honoured here
    launcher: str = ""  # the policy's changed_with: how its launcher changes it (advice.py)

    @classmethod
    def granted(cls, read: Iterable[str], write: Iterable[str], scratch: str,
                launch_dir: str, hidden: Iterable[str] = ()) -> FileAccess:
        """FileAccess for Landlock with these grants (resolved, as Landlock resolves them)."""
        real = [_real_path(path) for path in write]
        return cls(True, tuple(dict.fromkeys([*(_real_path(p) for p in read), *real])),
                   tuple(real), scratch, launch_dir, tuple(hidden))


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _folder(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(path) or "/"


def _host_lets_write(path: str) -> bool:
    """What the host's own permissions say (access() is not subject to Landlock)."""
    target = path if os.path.lexists(path) else os.path.dirname(path)
    return os.access(target, os.W_OK)


def _existing(path: str) -> str:
    """path, or the folder a file that is not there yet would be created in."""
    return path if os.path.lexists(path) else os.path.dirname(path) or "/"


def _host_lets_read(path: str) -> bool:
    """Whether this uid could read it (list it, for a folder) were it granted."""
    return os.access(path, os.R_OK | os.X_OK if os.path.isdir(path) else os.R_OK)


def _explained(exc: OSError, message: str) -> OSError:
    explained = type(exc)(exc.errno, f"{exc.strerror}: {exc.filename!r}: {message}")
    explained.sandbox_rule = message  # type: ignore[attr-defined]
    return explained


def _refusal(exc: OSError, path: str, access: FileAccess) -> OSError | None:
    if not _under(path, access.read) and not _host_lets_read(path):
        # A grant keeps the host's permissions: --read-path alone would not help.
        return _explained(exc, f"{OUTSIDE_GRANTS.why}, and the host does not let its uid "
                          f"({os.getuid()}) read it either; to let user code read it, make it "
                          "readable by that uid (or have it run as a user who may read it: "
                          f"--run-as USER), then " + grant_path(_folder(path), access.launcher))
    if not _under(path, access.read):
        return _explained(exc, f"{OUTSIDE_GRANTS.why}; to let user code read it, "
                          + grant_path(_folder(path), access.launcher))
    if not _under(path, access.write) and _host_lets_read(_existing(path)):
        # What the host lets this uid read, Landlock refused: a write (a read the host
        # refuses, a 0600 file of another uid, is the host's own answer, left as it is).
        return _explained(exc, _read_only(path, access))
    if not _under(path, access.write):
        return None
    said = None if _host_lets_write(path) else \
        host_write_refusal(path, os.getuid(), os.getgid(), access.launcher)
    return None if said is None else _explained(exc, said)  # None: the host's own (an ACL)


def _read_only(path: str, access: FileAccess) -> str:
    """Why a write inside a read-only grant was refused, and what would allow it: the grant's
    mode, and the host's permissions too where they keep the kernel's uid out anyway (a
    root-owned 0755 folder, for a kernel root started)."""
    if access.cwd_mode == "ro" and _under(path, [os.path.realpath(access.launch_dir)]):
        said = ("the sandbox refused it: this kernel was granted the folder it started in "
                "read-only (--grant-cwd); to let user code write there, "
                + change(access.launcher, "--grant-cwd=rw"))
    else:
        said = (f"{READ_ONLY.why}; to let user code write there, "
                + change(access.launcher, f"--write-path {shlex.quote(_folder(path))}"))
    host = None if _host_lets_write(path) else \
        host_write_refusal(path, os.getuid(), os.getgid(), access.launcher, HOST_TOO)
    return said if host is None else f"{said}; but {host}"


def _hidden(exc: OSError, path: str, access: FileAccess) -> OSError | None:
    if not _under(path, access.hidden) or _under(path, access.read):
        return None  # not found on the host either, or inside a grant: the host's answer
    return _explained(exc, f"{HIDDEN.why}; to let user code read it (or a folder above it), "
                      + grant_path(path, access.launcher))


def _not_in_scratch(exc: OSError, name: str, access: FileAccess) -> OSError | None:
    elsewhere = os.path.join(access.launch_dir, name)
    started = (f"{NOT_IN_SCRATCH.why} ({access.scratch}), not "
               f"the folder it was started in ({access.launch_dir}: the notebook's folder under "
               "Jupyter)")
    if not os.path.lexists(elsewhere):
        # A folder the kernel's view covers cannot be looked into: say where to look anyway.
        hidden = _hidden(exc, elsewhere, access)
        if hidden is not None or os.access(access.launch_dir, os.X_OK):
            return hidden
        # The host keeps the kernel's uid out (a 0700 directory above it): it cannot tell.
        return _explained(exc, f"{started}, which this kernel's uid cannot look into; if "
                          f"{name!r} is there, to read it by this name, "
                          + grant_cwd(access.launcher))
    where = f"{started}, which has {name!r}"
    if access.cwd_refused:
        return _explained(exc, f"{where}; --grant-cwd could not grant that folder: "
                          f"{access.cwd_refused}: move the notebook and its data into a folder "
                          "of their own, or open the file by an absolute path granted with "
                          "--read-path")
    if access.landlock and not _under(os.path.realpath(elsewhere), access.read):
        return _explained(exc, f"{where}; to read it by this name, " + grant_cwd(access.launcher))
    return _explained(exc, f"{where}; open {elsewhere!r}")


def explain_file_error(exc: BaseException, access: FileAccess | None) -> OSError | None:
    """The same error, saying what the sandbox has to do with it; None when it has nothing."""
    if access is None or not isinstance(exc, OSError) or hasattr(exc, "sandbox_rule") \
            or not isinstance(exc.filename, (str, bytes, os.PathLike)):
        return None
    name = os.fsdecode(exc.filename)
    if isinstance(exc, PermissionError) and exc.errno == errno.EACCES and access.landlock:
        return _refusal(exc, os.path.realpath(name), access)
    if isinstance(exc, FileNotFoundError) and os.path.isabs(name):
        return _hidden(exc, os.path.normpath(name), access)
    if isinstance(exc, FileNotFoundError) and access.launch_dir \
            and os.path.realpath(access.launch_dir) != os.path.realpath(os.getcwd()):
        return _not_in_scratch(exc, name, access)
    return None


def is_refusal(exc: BaseException) -> bool:
    """Whether the sandbox refused this (and said why): its traceback ends at the user's call."""
    return hasattr(exc, "sandbox_rule")


def user_part(tb: TracebackType | None, is_user_frame: Callable[[FrameType], bool]
              ) -> TracebackType | None:
    """The traceback up to the user's last frame: no library or sandbox frames after it."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    last = max((i for i, entry in enumerate(entries) if is_user_frame(entry.tb_frame)),
               default=len(entries) - 1)
    cut: TracebackType | None = None
    for entry in reversed(entries[:last + 1]):
        cut = TracebackType(cut, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return cut
