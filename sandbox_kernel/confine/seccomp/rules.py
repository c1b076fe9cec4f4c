"""The seccomp policy as data: which system calls untrusted code may make, with which arguments.

Two filters are stacked, because libseccomp refuses a rule whose action equals the filter's
default action: an *allowlist* (default EPERM) and a small *denylist* (default allow) for the
few calls that are allowed except for some argument values (the kernel applies the stricter
verdict of the two). What the filter keeps (describe(), and the seccomp lines of promises.py)
is read from these rules by GUARANTEES, never written beside them: change a rule and what the
kernel claims changes with it.
"""

from __future__ import annotations

import functools
import socket
import termios
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    "lseek", "dup", "dup2", "dup3", "ioctl",
    "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs",
    "access", "faccessat", "faccessat2", "readlink", "readlinkat", "getcwd", "chdir", "fchdir",
    "getdents", "getdents64", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat",
    "rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat",
    "ftruncate", "fallocate", "fadvise64", "readahead",
    "fsync", "fdatasync", "sync_file_range",
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
    # Writes back every dirty page of a whole file system, the host's included (and sync, all
    # of them): I/O that other tenants pay for, on any file the kernel can merely open.
    "syncfs", "sync",
)

# What a kernel that fails the architecture check gets (program.py maps it to libseccomp's).
FOREIGN_ARCH = "kill process"

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
LANDLOCK_TRUNCATE_ABI = 3

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
_F_SETOWN_EX = 15
# flock() may only unlock: a shared or exclusive lock needs no more than a file opened for
# reading, and Landlock lets user code read the interpreter, system libraries and read grants,
# so it could hold a lock that host processes wait for. (fcntl record locks stay: SQLite needs
# them, and their type lives in memory a filter cannot read; docs/SECURITY.md says what remains.)
_LOCK_UN, _LOCK_NB = 8, 4

# ioctls refused on any descriptor: keystroke injection, and the ones that make a descriptor or
# a terminal signal a process (the owner of a socket, a terminal's process group and session).
_FIOSETOWN, _SIOCSPGRP = 0x8901, 0x8902
_IOCTLS_REFUSED = (
    termios.TIOCSTI, getattr(termios, "TIOCLINUX", 0x541C),
    _FIOSETOWN, _SIOCSPGRP, termios.TIOCSPGRP, termios.TIOCSCTTY, termios.TIOCNOTTY,
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
    rules.append(Rule("flock", args=(_masked(1, _LOCK_UN, _LOW32 & ~_LOCK_NB),)))
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
    if landlock_abi >= LANDLOCK_TRUNCATE_ABI:
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




@dataclass(frozen=True)
class Filter:
    """Both filters' rules for one kernel, as install() loads them: what GUARANTEES read."""

    pid: int
    allow: tuple[Rule, ...]
    deny: tuple[Rule, ...]

    @functools.cached_property
    def _allowed(self) -> dict[str, list[Rule]]:
        by_name: dict[str, list[Rule]] = {}
        for rule in self.allow:
            if rule.action == "allow":
                by_name.setdefault(rule.syscall, []).append(rule)
        return by_name

    def allowing(self, name: str) -> list[Rule]:
        """The allowlist's rules that let name through (under their argument conditions)."""
        return self._allowed.get(name, [])

    def refuses(self, *names: str) -> bool:
        """No rule lets any of these calls through: the allowlist's default refuses them."""
        return not any(self.allowing(name) for name in names)

    def refuses_value(self, name: str, arg: int, value: int, mask: int = _LOW32) -> bool:
        """The denylist refuses name whenever argument arg, under mask, equals value."""
        return any(rule.syscall == name and rule.action != "allow"
                   and rule.args == ((arg, mask, value),) for rule in self.deny)


def _pinned(rule: Rule, arg: int, mask: int = _LOW32) -> int | None:
    """The value the rule requires argument arg (under mask) to have; None if it requires none."""
    return next((value for index, bits, value in rule.args if index == arg and bits == mask),
                None)


def _threads_only(rules: Filter) -> bool:
    # clone must carry CLONE_THREAD and none of the namespace flags, both under the rule's mask.
    need = _CLONE_THREAD | _CLONE_FORBIDDEN
    return rules.refuses("fork", "vfork", "execve", "execveat", "clone3") and all(
        any(arg == 0 and mask & need == need and value & need == _CLONE_THREAD
            for arg, mask, value in rule.args) for rule in rules.allowing("clone"))


def _fcntl_signals_only_us(rule: Rule, pid: int) -> bool:
    command = _pinned(rule, 1)
    if command == _F_SETOWN:
        return _pinned(rule, 2) in (0, pid)
    return command is not None and command != _F_SETOWN_EX


def _signals_only_us(rules: Filter) -> bool:
    return (rules.refuses("tkill", "pidfd_send_signal")
            and all(_pinned(rule, 0) == rules.pid
                    for name in _OWN_PID_ONLY for rule in rules.allowing(name))
            and all(_fcntl_signals_only_us(rule, rules.pid) for rule in rules.allowing("fcntl"))
            and all(rules.refuses_value("ioctl", 1, request)
                    for request in (_FIOSETOWN, _SIOCSPGRP, termios.TIOCSPGRP)))


def _no_unix_sockets(rules: Filter) -> bool:
    return (all(_pinned(rule, 0) not in (None, socket.AF_UNIX) for rule in rules.allowing("socket"))
            and all(_pinned(rule, 1, _SOCK_TYPE_MASK) == socket.SOCK_STREAM
                    for rule in rules.allowing("socketpair")))


def _no_connection_out(rules: Filter) -> bool:
    inet = (None, socket.AF_INET, socket.AF_INET6)
    return (rules.refuses("connect")
            and all(_pinned(rule, 0) not in inet for rule in rules.allowing("socket"))
            and all(rules.refuses_value(name, arg, _MSG_FASTOPEN, _MSG_FASTOPEN)
                    for name, arg in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3))))


def _memory_counted(rules: Filter) -> bool:
    return (rules.refuses("mremap", "memfd_create", "memfd_secret", "shmget")
            and all(rules.refuses_value("mmap", 3, flags, _MAP_TYPE_AND_ANONYMOUS)
                    for flags in _SHARED_ANONYMOUS)
            and rules.refuses_value("mmap", 3, _MAP_GROWSDOWN, _MAP_GROWSDOWN))


def _no_truncation(rules: Filter) -> bool:
    return (rules.refuses("truncate", "openat2")
            and rules.refuses_value("open", 1, _O_TRUNC, _O_ACCMODE_AND_TRUNC)
            and rules.refuses_value("openat", 2, _O_TRUNC, _O_ACCMODE_AND_TRUNC))


@dataclass(frozen=True)
class Guarantee:
    """Something the filter keeps, in words, and the check of the rules that makes it true."""

    text: str
    holds: Callable[[Filter], bool]


GUARANTEES = {
    "processes": Guarantee("clone without CLONE_THREAD, fork, execve refused", _threads_only),
    "signals": Guarantee("kill/tgkill, fcntl F_SETOWN to this process only; F_SETOWN_EX, "
                         "FIOSETOWN, SIOCSPGRP, TIOCSPGRP refused", _signals_only_us),
    "servers": Guarantee("bind and listen refused after set-up",
                         lambda rules: rules.refuses("bind", "listen")),
    "unix_sockets": Guarantee("no AF_UNIX socket(), socketpair SOCK_STREAM only",
                              _no_unix_sockets),
    "watches": Guarantee("inotify and fanotify refused", lambda rules: rules.refuses(
        "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark")),
    "rare_interfaces": Guarantee("allowlist", lambda rules: rules.refuses(*NEVER)),
    "network_off": Guarantee("socket() and connect() refused, no MSG_FASTOPEN",
                             _no_connection_out),
    "memory": Guarantee("no shared anonymous memory, MAP_GROWSDOWN, mremap or memfd",
                        _memory_counted),
    "truncate": Guarantee("truncate(path), open(O_RDONLY|O_TRUNC) and openat2 refused",
                          _no_truncation),
}

# The pid the rules are described for: any pid reads the same, this one is no real process.
_DESCRIBED_PID = 2**22 + 1


def _rules_abi(landlock_abi: int) -> int:
    """The one Landlock ABI fact the rules depend on: whether it handles truncation."""
    return LANDLOCK_TRUNCATE_ABI if landlock_abi >= LANDLOCK_TRUNCATE_ABI else 0


def described(allow_network: bool, landlock_abi: int = 0) -> Filter:
    """The rules a kernel with these settings loads (made once per process)."""
    return _described(allow_network, _rules_abi(landlock_abi))


@functools.cache
def _described(allow_network: bool, abi: int) -> Filter:
    return Filter(_DESCRIBED_PID, tuple(allowlist_rules(_DESCRIBED_PID, allow_network, abi)),
                  tuple(denylist_rules(allow_network)))


def keeps(key: str, allow_network: bool, landlock_abi: int = 0) -> str | None:
    """The words for GUARANTEES[key] when the rules for these settings keep it; else None."""
    return _kept(allow_network, _rules_abi(landlock_abi)).get(key)


@functools.cache
def _kept(allow_network: bool, abi: int) -> dict[str, str]:
    """The guarantees these rules keep, in words (read once per process: a fork server's
    kernels find them read)."""
    rules = _described(allow_network, abi)
    return {key: guarantee.text for key, guarantee in GUARANTEES.items()
            if guarantee.holds(rules)}


_FAMILIES: dict[int | None, str] = {socket.AF_INET: "inet", socket.AF_INET6: "inet6"}
_TYPES: dict[int | None, str] = {socket.SOCK_STREAM: "stream", socket.SOCK_DGRAM: "dgram"}


def _sockets(rules: Filter) -> str:
    allowed = rules.allowing("socket")
    families = dict.fromkeys(_FAMILIES.get(_pinned(rule, 0), "any") for rule in allowed)
    kinds = dict.fromkeys(_TYPES.get(_pinned(rule, 1, _SOCK_TYPE_MASK), "any")
                          for rule in allowed)
    pairs = "unix stream socketpair" if _no_unix_sockets(rules) else "any socketpair"
    if not allowed:
        return f"none ({pairs} only)"
    return f"{'/'.join(families)} {'+'.join(kinds)}, {pairs}"


def summarize(rules: Filter, notify: bool = False) -> dict[str, Any]:
    """What these rules allow, read from them (describe() for a kernel's own rules)."""
    return {
        "default": "EPERM, recorded by the reaper" if notify else "EPERM",
        "processes": "denied (threads only)" if _threads_only(rules) else "allowed",
        "sockets": _sockets(rules),
        "connect": "denied" if rules.refuses("connect") else "allowed",
        "bind_listen": "denied" if rules.refuses("bind", "listen") else "allowed",
        "foreign_arch": FOREIGN_ARCH,
        "signals": "to this process only (kill, tgkill, fcntl F_SETOWN)"
        if _signals_only_us(rules) else "to other processes too",
        "truncate_by_path": "denied (Landlock ABI < 3)" if _no_truncation(rules)
        else "Landlock decides",
        "never": [name for name in NEVER if rules.refuses(name)],
    }


def describe(allow_network: bool, notify: bool = False, *, landlock_abi: int = 0
             ) -> dict[str, Any]:
    """What the filter allows, for kernel_info_reply and `sandbox-kernel check`."""
    summary = _summary(allow_network, _rules_abi(landlock_abi), notify)
    return {**summary, "never": list(summary["never"])}  # the caller's own copy


@functools.cache
def _summary(allow_network: bool, abi: int, notify: bool) -> dict[str, Any]:
    return summarize(_described(allow_network, abi), notify)

