"""The seccomp-bpf filter: which system calls untrusted code may make.

Two filters are stacked, because libseccomp refuses a rule whose action equals the filter's
default action: an *allowlist* (default EPERM) and a small *denylist* (default allow) for the
few calls that are allowed except for some argument values (the kernel applies the stricter
verdict of the two). Both are loaded with TSYNC so every thread of the kernel gets them.

libseccomp compiles each filter to a BPF program, which a kernel loads with seccomp(2). A fork
server compiles them once for all its kernels: the allowlist, which names the kernel's pid, for
a placeholder pid, and each kernel writes its own pid into the instructions found to hold it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import socket
import struct
import termios
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import pyseccomp as _sc
except (ImportError, RuntimeError, OSError) as exc:  # RuntimeError: libseccomp not found
    _sc = None
    _IMPORT_ERROR: BaseException | None = exc
else:
    _IMPORT_ERROR = None


class SeccompError(RuntimeError):
    """The filter could not be built, loaded or verified."""


# A broad allowlist, modelled on a container runtime's default profile, minus everything that
# reaches outside this process or whose only use is attacking the host kernel.
ALLOWED = (
    # memory
    "brk", "mmap", "munmap", "mprotect", "madvise", "mincore", "msync",
    "mlock", "mlock2", "munlock", "membarrier", "pkey_alloc", "pkey_free", "pkey_mprotect",
    "get_mempolicy", "map_shadow_stack", "mseal",
    # threads, futexes, signals (targets are restricted below)
    "futex", "futex_waitv", "set_robust_list", "set_tid_address", "rseq", "arch_prctl",
    "gettid", "sched_yield", "sched_getparam", "sched_getscheduler", "sched_getattr",
    "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval", "getcpu",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigsuspend",
    "rt_sigtimedwait", "sigaltstack", "restart_syscall", "pause",
    "exit", "exit_group", "wait4", "waitid",
    # time
    "clock_gettime", "clock_getres", "clock_nanosleep", "gettimeofday", "time", "nanosleep",
    "alarm", "getitimer", "setitimer", "times",
    "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime", "timer_settime",
    "timerfd_create", "timerfd_gettime", "timerfd_settime",
    # identity and process information (read-only)
    "getpid", "getppid", "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid",
    "getgroups", "getpgid", "getpgrp", "getsid", "setsid", "setpgid", "capget", "getrlimit",
    "getrusage", "getpriority", "uname", "sysinfo", "getrandom", "umask",
    # files (Landlock decides which paths)
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
    "preadv2", "pwritev2", "open", "openat", "creat", "close", "close_range",
    "lseek", "dup", "dup2", "dup3", "flock", "ioctl",
    "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs",
    "access", "faccessat", "faccessat2", "readlink", "readlinkat", "getcwd", "chdir", "fchdir",
    "getdents", "getdents64", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat",
    "rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat",
    "ftruncate", "fallocate", "fadvise64", "readahead",
    "fsync", "fdatasync", "sync_file_range", "syncfs",
    "utime", "utimes", "utimensat", "futimesat",
    "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr",
    "sendfile", "splice", "tee", "vmsplice", "copy_file_range",
    "inotify_rm_watch",
    # event loops and pipes
    "pipe", "pipe2", "eventfd", "eventfd2", "signalfd", "signalfd4",
    "poll", "ppoll", "select", "pselect6",
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2",
    # operations on sockets that already exist (creation, bind, listen, connect: below)
    "accept", "accept4", "shutdown",
    "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg",
    "getsockname", "getpeername", "getsockopt", "setsockopt",
    # may only tighten this process further
    "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
)

# Never allowed, whatever the policy: documented here and checked against ALLOWED by the tests.
NEVER = (
    "fork", "vfork", "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "userfaultfd",
    "perf_event_open", "add_key", "request_key", "keyctl",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount",
    "fsconfig", "fspick", "mount_setattr", "unshare", "setns",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at", "name_to_handle_at", "seccomp", "kcmp", "pidfd_getfd",
    "pidfd_send_signal", "process_madvise", "process_mrelease", "tkill", "mknod", "mknodat",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid",
    "setfsgid", "setgroups", "capset", "setrlimit", "chown", "fchown", "lchown", "fchownat",
    # Landlock does not cover file modes: as the files' owner, code could chmod them anywhere.
    "chmod", "fchmod", "fchmodat", "fchmodat2",
    # Memory that RLIMIT_DATA does not count: memfd and SysV/POSIX shared memory; and mremap,
    # which moves a page of the main thread's stack into a stack mapping of any size (stack
    # mappings only grow against RLIMIT_STACK, and mremap checks not even that). glibc's
    # realloc copies instead when mremap fails.
    "memfd_create", "memfd_secret", "mremap",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "iopl", "ioperm",
    "settimeofday", "clock_settime", "adjtimex", "clock_adjtime", "sethostname",
    "setdomainname", "modify_ldt", "fanotify_init", "migrate_pages", "move_pages",
    "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop",
    "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend",
    "mq_timedreceive", "mq_notify", "mq_getsetattr", "ioprio_set", "mlockall", "vhangup",
    # Listening servers: the kernel's own sockets are bound before the filter is loaded, and
    # Landlock's port rule ignores the address (any host address) and UDP (any port).
    "bind", "listen",
    # inotify watches paths Landlock does not check and takes from a per-user instance quota.
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_mark",
)

# Namespace and other flags a thread-creating clone() must not carry.
_CLONE_FORBIDDEN = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
    | 0x00000080  # CLONE_NEWTIME
    | 0x00001000  # CLONE_PIDFD
)
_CLONE_THREAD = 0x00010000

# prctl options that only read state or change this thread's own harmless attributes.
_PRCTL_OPTIONS = (
    1,  # PR_SET_PDEATHSIG
    2,  # PR_GET_PDEATHSIG
    3,  # PR_GET_DUMPABLE
    4,  # PR_SET_DUMPABLE
    15,  # PR_SET_NAME
    16,  # PR_GET_NAME
    21,  # PR_GET_SECCOMP
    23,  # PR_CAPBSET_READ
    29,  # PR_SET_TIMERSLACK
    30,  # PR_GET_TIMERSLACK
    38,  # PR_SET_NO_NEW_PRIVS
    39,  # PR_GET_NO_NEW_PRIVS
    40,  # PR_GET_TID_ADDRESS
    42,  # PR_GET_THP_DISABLE
    52,  # PR_GET_SPECULATION_CTRL
    0x53564D41,  # PR_SET_VMA (glibc names its anonymous mappings)
)

# Calls whose first argument names a process: allowed for this process only (0 or its pid).
_OWN_PROCESS_ONLY = ("sched_setaffinity", "sched_getaffinity", "sched_setparam",
                     "sched_setscheduler", "sched_setattr", "get_robust_list")
_OWN_PID_ONLY = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open")

_LOW32 = 0xFFFFFFFF
_SCHED_OTHER = 0
_MAP_TYPE_AND_ANONYMOUS = 0x0F | 0x20
_SHARED_ANONYMOUS = (0x01 | 0x20, 0x03 | 0x20)  # MAP_SHARED / MAP_SHARED_VALIDATE, anonymous
# Stack-like mappings are accounted as stack, not data: each grows to RLIMIT_STACK unseen by
# RLIMIT_DATA, and there is no limit on how many exist.
_MAP_GROWSDOWN = 0x0100
_SOCK_TYPE_MASK = 0xF  # the rest of socket()'s type argument is SOCK_NONBLOCK / SOCK_CLOEXEC
_MSG_FASTOPEN = 0x20000000  # sendto/sendmsg that connect a TCP socket first
_O_ACCMODE_AND_TRUNC = 0o3 | 0o1000
_O_TRUNC = 0o1000
_LANDLOCK_TRUNCATE_ABI = 3

# fcntl commands that act on this process's own descriptors only. Missing on purpose:
# F_SETOWN (allowed below for this process only) and F_SETOWN_EX, whose signals (F_SETSIG,
# SIGIO, SIGURG) go to any process the owner names; F_NOTIFY (dnotify) and F_SETLEASE, which
# watch or block other processes' access to files.
_FCNTL_COMMANDS = (
    0, 1, 2, 3, 4,  # F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL
    5, 6, 7,  # F_GETLK, F_SETLK, F_SETLKW
    9, 10, 11, 16,  # F_GETOWN, F_SETSIG, F_GETSIG, F_GETOWN_EX
    36, 37, 38,  # F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW
    1025, 1027, 1028, 1030,  # F_GETLEASE, F_DUPFD_QUERY, F_CREATED_QUERY, F_DUPFD_CLOEXEC
    1031, 1032, 1033, 1034,  # F_SETPIPE_SZ, F_GETPIPE_SZ, F_ADD_SEALS, F_GET_SEALS
    1035, 1036, 1037, 1038,  # F_GET/SET_RW_HINT, F_GET/SET_FILE_RW_HINT
)
_F_SETOWN = 8

# ioctls refused on any descriptor: keystroke injection, and the ones that make a descriptor or
# a terminal signal a process (the owner of a socket, a terminal's process group and session).
_IOCTLS_REFUSED = (
    termios.TIOCSTI, getattr(termios, "TIOCLINUX", 0x541C),
    0x8901,  # FIOSETOWN
    0x8902,  # SIOCSPGRP
    termios.TIOCSPGRP, termios.TIOCSCTTY, termios.TIOCNOTTY,
    termios.TIOCSWINSZ,  # SIGWINCH to the terminal's foreground process group
)


@dataclass(frozen=True)
class Rule:
    """One rule: an action for a syscall when every (arg, mask, value) comparison holds."""

    syscall: str
    action: str = "allow"  # "allow", "eperm" or "enosys"
    args: tuple[tuple[int, int, int], ...] = ()


def _masked(arg: int, value: int, mask: int = _LOW32) -> tuple[int, int, int]:
    # int-sized arguments are truncated to 32 bits by the kernel but compared as 64 bits by
    # seccomp, so every comparison masks: high bits then cannot make a value look different.
    return (arg, mask, value)


def allowlist_rules(pid: int, allow_network: bool, landlock_abi: int = 0) -> list[Rule]:
    """The allowlist filter's rules for a kernel process with this pid.

    landlock_abi is the Landlock ABI in force (0: none); rules that stand in for rights an
    older Landlock lacks depend on it.
    """
    rules = [Rule(name) for name in ALLOWED]
    rules.append(Rule("clone", args=(_masked(0, _CLONE_THREAD, _CLONE_THREAD | _CLONE_FORBIDDEN),)))
    # glibc falls back from clone3 to clone on ENOSYS; clone3's flags live in memory we cannot see.
    rules.append(Rule("clone3", action="enosys"))
    rules += [Rule(name, args=(_masked(0, pid),)) for name in _OWN_PID_ONLY]
    for target in (0, pid):
        rules += [Rule(name, args=(_masked(0, target),)) for name in _OWN_PROCESS_ONLY]
        rules.append(Rule("prlimit64", args=(_masked(0, target), (2, 2**64 - 1, 0))))
        rules.append(Rule("setpriority", args=(_masked(0, 0), _masked(1, target))))
        # 0 clears the owner; a positive pid other than ours, or a negative process group,
        # would be signalled by the descriptor (F_SETSIG + O_ASYNC) whatever kill() allows.
        rules.append(Rule("fcntl", args=(_masked(1, _F_SETOWN), _masked(2, target))))
    rules += [Rule("fcntl", args=(_masked(1, command),)) for command in _FCNTL_COMMANDS]
    # Every new libzmq thread sets its own policy to SCHED_OTHER by its thread id, which a filter
    # cannot tell from another process's pid; SCHED_OTHER can only demote, never boost.
    rules.append(Rule("sched_setscheduler", args=(_masked(1, _SCHED_OTHER),)))
    rules += [Rule("prctl", args=(_masked(0, option),)) for option in _PRCTL_OPTIONS]
    rules.append(Rule("personality", args=(_masked(0, 0xFFFFFFFF),)))  # query only
    # asyncio and friends need socketpair(AF_UNIX, SOCK_STREAM) even when the network is off.
    # Not SOCK_DGRAM: a datagram socket sends to any pathname socket (/dev/log, ...) by address.
    rules.append(Rule("socketpair", args=(_masked(0, socket.AF_UNIX),
                                          _masked(1, socket.SOCK_STREAM, _SOCK_TYPE_MASK))))
    # Without the network there is nothing to connect: refusing connect() also stops
    # disconnecting one of the kernel's own TCP sockets (AF_UNSPEC) and reconnecting it
    # anywhere, which Landlock only catches from ABI 4.
    if allow_network:
        rules.append(Rule("connect"))
        for family in (socket.AF_INET, socket.AF_INET6):
            for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                rules.append(Rule("socket", args=(_masked(0, family),
                                                  _masked(1, kind, _SOCK_TYPE_MASK))))
    if landlock_abi >= _LANDLOCK_TRUNCATE_ABI:
        rules.append(Rule("truncate"))
        rules.append(Rule("openat2"))
    else:
        # Landlock < 3 does not handle truncation: truncate(path) is refused, and openat2, whose
        # flags a filter cannot read, answers ENOSYS so that callers fall back to openat.
        rules.append(Rule("openat2", action="enosys"))
    return rules


def denylist_rules(allow_network: bool = False) -> list[Rule]:
    """Argument values refused for calls the allowlist admits."""
    rules = [Rule("ioctl", action="eperm", args=(_masked(1, request),))
             for request in _IOCTLS_REFUSED]
    # Shared anonymous memory and stack-like mappings escape RLIMIT_DATA, the memory limit.
    rules += [Rule("mmap", action="eperm", args=(_masked(3, flags, _MAP_TYPE_AND_ANONYMOUS),))
              for flags in _SHARED_ANONYMOUS]
    rules.append(Rule("mmap", action="eperm", args=(_masked(3, _MAP_GROWSDOWN, _MAP_GROWSDOWN),)))
    # open(O_RDONLY | O_TRUNC) truncates a file Landlock < 3 only checked for reading.
    rules.append(Rule("open", action="eperm", args=(_masked(1, _O_TRUNC, _O_ACCMODE_AND_TRUNC),)))
    rules.append(Rule("openat", action="eperm",
                      args=(_masked(2, _O_TRUNC, _O_ACCMODE_AND_TRUNC),)))
    if not allow_network:
        # A TCP socket that is not connected (one of the kernel's listeners after shutdown())
        # connects inside sendto/sendmsg with MSG_FASTOPEN, without calling connect().
        for name, flags_arg in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3)):
            rules.append(Rule(name, action="eperm",
                              args=(_masked(flags_arg, _MSG_FASTOPEN, _MSG_FASTOPEN),)))
    return rules


@functools.cache
def available() -> str | None:
    """None when seccomp can be used here; otherwise why not (a fact of the running Linux
    and libseccomp: found out once per process, by a fork server for all its kernels)."""
    if _sc is None:
        return (f"libseccomp is not usable ({_IMPORT_ERROR}); install the system package "
                "libseccomp2 (Debian/Ubuntu: apt-get install libseccomp2)")
    status = Path("/proc/self/status").read_text()
    if "Seccomp:" not in status:
        return "this Linux kernel was built without seccomp support"
    return None


def _compile(rules: Iterable[Rule], default: int) -> Any:
    assert _sc is not None
    actions = {"allow": _sc.ALLOW, "eperm": _sc.ERRNO(errno.EPERM),
               "enosys": _sc.ERRNO(errno.ENOSYS)}
    flt = _sc.SyscallFilter(default)
    # Foreign architectures (i386 via int 0x80) and the x32 ABI kill the whole process.
    flt.set_attr(_sc.Attr.ACT_BADARCH, _sc.KILL_PROCESS)
    # _load loads the exported program with these, as libseccomp's own load would; setting them
    # still makes libseccomp check that this Linux has TSYNC (and TSYNC_ESRCH to notify).
    flt.set_attr(_sc.Attr.CTL_TSYNC, 1)
    flt.set_attr(_sc.Attr.CTL_NNP, 1)
    for rule in rules:
        number = _sc.resolve_syscall(_sc.Arch.NATIVE, rule.syscall)
        if number < 0:  # not a syscall on this architecture (or unknown to this libseccomp)
            continue
        args = [_sc.Arg(arg, _sc.MASKED_EQ, mask, value) for arg, mask, value in rule.args]
        flt.add_rule(actions[rule.action], number, *args)
    return flt


def _export(compiled: Any) -> bytes:
    """The BPF program libseccomp would load for a compiled filter."""
    # Through a pipe: pods refuse memfd_create, and a kernel started on its own compiles under
    # Landlock, which may refuse a file. The write end does not block, so a program larger than the
    # pipe (a loadable one is at most 32 KiB, a pipe holds 64 KiB unless the user's pipe quota
    # is spent) is cut short, which libseccomp does not notice, instead of hanging: a pipe that
    # came back full is refused.
    read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    with open(read_end, "rb", buffering=0) as source:
        with open(write_end, "wb", buffering=0) as sink:
            capacity = fcntl.fcntl(sink, fcntl.F_GETPIPE_SZ)
            compiled.export_bpf(sink)
        program = source.read(capacity) or b""  # all of it: nothing more can be written
    if not program or len(program) >= capacity or len(program) % _INSTRUCTION.size:
        raise SeccompError(f"libseccomp exported a BPF program of {len(program)} bytes "
                           f"through a pipe of {capacity}")
    return program


def _default_action(notify: bool) -> int:
    assert _sc is not None
    return _sc.NOTIFY if notify else _sc.ERRNO(errno.EPERM)


@functools.cache
def _denylist(allow_network: bool) -> bytes:
    """The denylist program, compiled once per process (it names no process): a fork server's
    kernels load the server's copy."""
    assert _sc is not None
    return _export(_compile(denylist_rules(allow_network), _sc.ALLOW))


# struct sock_filter (linux/filter.h): code, jt, jf, k. A pid is compared by a
# BPF_JMP | BPF_JEQ | BPF_K instruction, in its k.
_INSTRUCTION = struct.Struct("=HBBI")
_K_OFFSET = 4
_JEQ_K = 0x15
# Two values no process can have as its pid (pid_max is at most 2**22) that stand for the
# kernel's pid while the allowlist is compiled once for all kernels.
_PLACEHOLDERS = (0x5EC0_1D00, 0x2BAD_F00D)


@dataclass(frozen=True)
class _Template:
    """The allowlist compiled for a placeholder pid, and where that pid sits in the program."""

    program: bytes
    pid_offsets: tuple[int, ...]  # byte offsets of the k fields that hold the pid
    # libseccomp sorts the values one argument is compared with and merges equal ones, so only
    # a pid above every other value compared where the pid is compiles like the placeholders.
    floor: int

    def for_pid(self, pid: int) -> bytes:
        program = bytearray(self.program)
        for offset in self.pid_offsets:
            struct.pack_into("=I", program, offset, pid)
        return bytes(program)


def _compared_with_pid(rules: list[Rule], pid: int) -> set[int]:
    """The other values the rules compare with an argument that is also compared with pid."""
    places = {(rule.syscall, arg) for rule in rules for arg, _, value in rule.args if value == pid}
    return {value for rule in rules for arg, _, value in rule.args
            if (rule.syscall, arg) in places and value != pid}


def _pid_offsets(first: bytes, second: bytes) -> tuple[int, ...] | None:
    """Where the two placeholders sit in programs compiled for each, if they sit only there.

    Verified, not assumed: the programs differ in exactly the instructions that compare with
    the placeholder, each is the same comparison in both, and neither placeholder occurs
    anywhere else. Otherwise None: the pid cannot be patched in.
    """
    if len(first) != len(second):
        return None
    offsets = []
    pairs = zip(_INSTRUCTION.iter_unpack(first), _INSTRUCTION.iter_unpack(second), strict=True)
    for index, (one, other) in enumerate(pairs):
        if (one[3], other[3]) == _PLACEHOLDERS and one[:3] == other[:3] and one[0] == _JEQ_K:
            offsets.append(index * _INSTRUCTION.size + _K_OFFSET)
        elif one != other or one[3] in _PLACEHOLDERS or other[3] in _PLACEHOLDERS:
            return None
    return tuple(offsets) if offsets else None


def _allowlist_template(allow_network: bool, truncate: bool, notify: bool) -> _Template | None:
    """The allowlist for these settings with a placeholder pid; None if the placeholder could not
    be located exactly (kernels then compile their own)."""
    landlock_abi = _LANDLOCK_TRUNCATE_ABI if truncate else 0
    first, second = (_export(_compile(allowlist_rules(placeholder, allow_network, landlock_abi),
                                      _default_action(notify)))
                     for placeholder in _PLACEHOLDERS)
    offsets = _pid_offsets(first, second)
    rules = allowlist_rules(_PLACEHOLDERS[0], allow_network, landlock_abi)
    floor = max(_compared_with_pid(rules, _PLACEHOLDERS[0]), default=0)
    if offsets is None or min(_PLACEHOLDERS) <= floor:
        return None
    return _Template(first, offsets, floor)


# The templates precompile() made, by (allow_network, truncate, notify). Only a process that
# forks kernels makes them: for a single kernel, two compiles would cost more than its own one.
_templates: dict[tuple[bool, bool, bool], _Template | None] = {}


def _allowlist(pid: int, allow_network: bool, landlock_abi: int, notify: bool) -> bytes:
    """The allowlist program for this pid: the template with the pid written in, or compiled."""
    template = _templates.get((allow_network, landlock_abi >= _LANDLOCK_TRUNCATE_ABI, notify))
    if template is not None and pid > template.floor:
        return template.for_pid(pid)
    rules = allowlist_rules(pid, allow_network, landlock_abi)
    return _export(_compile(rules, _default_action(notify)))


def precompile() -> None:
    """Compile, before a fork server forks, what every kernel would otherwise compile again:
    both denylists and the allowlist's templates for every setting. Nothing is loaded here:
    the server itself stays unfiltered."""
    if available() is not None:
        return
    for allow_network in (False, True):
        _denylist(allow_network)
        for truncate in (False, True):
            for notify in (False, True):
                settings = (allow_network, truncate, notify)
                if settings not in _templates:
                    _templates[settings] = _allowlist_template(*settings)
    _tsync_flags()


# seccomp(2) and prctl(2) (linux/seccomp.h, linux/prctl.h).
_SECCOMP_SET_MODE_FILTER = 1
_FLAG_TSYNC = 1
_FLAG_NEW_LISTENER = 1 << 3
_FLAG_TSYNC_ESRCH = 1 << 4
_PR_SET_NO_NEW_PRIVS = 38


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _seccomp(flags: int, program: Any) -> int:
    """seccomp(SECCOMP_SET_MODE_FILTER, flags, program); OSError when it fails."""
    assert _sc is not None
    number = _sc.resolve_syscall(_sc.Arch.NATIVE, "seccomp")
    result = _libc().syscall(ctypes.c_long(number), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                             ctypes.c_long(flags), program)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(result)


@functools.cache
def _tsync_flags() -> int:
    """TSYNC, with TSYNC_ESRCH where this Linux has it, as libseccomp chooses them.

    TSYNC_ESRCH makes a failed synchronisation an ESRCH error instead of a thread id, which is
    what lets TSYNC and the notification listener (whose fd is the result) go together.
    """
    try:  # a NULL program: EFAULT if the flags are understood, EINVAL if not
        _seccomp(_FLAG_TSYNC | _FLAG_TSYNC_ESRCH, None)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            return _FLAG_TSYNC | _FLAG_TSYNC_ESRCH
    return _FLAG_TSYNC


def _load(program: bytes, listener: bool) -> int | None:
    """Load a BPF program into every thread as libseccomp's load would; the listener's fd if
    asked for one."""
    # Without CAP_SYS_ADMIN, seccomp() requires no_new_privs; libseccomp sets it before each load.
    no_new_privs = (ctypes.c_ulong(value) for value in (1, 0, 0, 0))
    if _libc().prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), *no_new_privs) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")
    flags = _tsync_flags()
    if listener:
        if not flags & _FLAG_TSYNC_ESRCH:  # the kernel refuses TSYNC with a listener without it
            raise SeccompError("recording denials with every thread filtered needs Linux 5.7")
        flags |= _FLAG_NEW_LISTENER
    instructions = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // _INSTRUCTION.size, ctypes.addressof(instructions))
    result = _seccomp(flags, ctypes.byref(fprog))
    if listener:
        return result
    if result:  # without TSYNC_ESRCH, a thread that could not be synchronised is named
        raise OSError(errno.ESRCH, f"thread {result} could not receive the filter")
    return None


def install(pid: int, allow_network: bool, *, landlock_abi: int = 0,
            notify: bool = False) -> int | None:
    """Load both filters into every thread of this process, then verify that they took.

    With notify, the allowlist's default action is SECCOMP_RET_USER_NOTIF and the listener's fd
    is returned: whoever holds it answers (and records) every call the allowlist refuses. Once
    no process holds it, those calls fail with ENOSYS, so they stay refused.
    """
    reason = available()
    if reason:
        raise SeccompError(reason)
    try:
        denylist = _denylist(allow_network)
        allowlist = _allowlist(pid, allow_network, landlock_abi, notify)
        # The denylist goes first: once the allowlist is in, seccomp() itself is refused.
        _load(denylist, listener=False)
        listener = _load(allowlist, listener=notify)
    except OSError as exc:
        raise SeccompError(f"loading the seccomp filter failed: {exc}") from exc
    unfiltered = [tid for tid, mode in thread_modes().items() if mode != 2]
    if unfiltered:
        raise SeccompError(f"threads {unfiltered} did not receive the seccomp filter")
    return listener


def thread_modes() -> dict[int, int]:
    """Seccomp mode of every thread of this process (2 means a filter is active)."""
    modes = {}
    for task in Path("/proc/self/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Seccomp:"):
                modes[int(task.name)] = int(line.split()[1])
    return modes


def describe(allow_network: bool, notify: bool = False, *, landlock_abi: int = 0
             ) -> dict[str, Any]:
    """What the filter allows, for kernel_info_reply and `sandbox-kernel check`."""
    return {
        "default": "EPERM, recorded by the reaper" if notify else "EPERM",
        "processes": "denied (threads only)",
        "sockets": "inet/inet6 stream+dgram, unix stream socketpair" if allow_network
        else "none (unix stream socketpair only)",
        "connect": "allowed" if allow_network else "denied",
        "bind_listen": "denied",
        "foreign_arch": "kill process",
        "signals": "to this process only (kill, tgkill, fcntl F_SETOWN)",
        "truncate_by_path": "Landlock decides" if landlock_abi >= _LANDLOCK_TRUNCATE_ABI
        else "denied (Landlock ABI < 3)",
        "never": list(NEVER),
    }
