"""The seccomp-bpf filter: which system calls untrusted code may make, loaded into every thread.

Porcelain over three plumbing modules, after the `landlock` package's split:
rules.py (the policy as data, and what it keeps), program.py (the rules compiled to BPF, ahead
of time in a fork server, and handed over to a lean zygote) and syscall.py (libseccomp, imported
only to compile, and the raw seccomp(2) load). Both filters are loaded with TSYNC so every
thread of the kernel gets them.
"""

from __future__ import annotations

from .program import adopt, allowlist, denylist, handover, precompile
from .rules import ALLOWED, NEVER, allowlist_rules, denylist_rules, describe
from .syscall import SeccompError, available, load, thread_modes

__all__ = ["ALLOWED", "NEVER", "SeccompError", "adopt", "allowlist_rules", "available",
           "denylist_rules", "describe", "handover", "install", "precompile", "thread_modes"]


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
        deny = denylist(allow_network)
        allow = allowlist(pid, allow_network, landlock_abi, notify)
        # The denylist goes first: once the allowlist is in, seccomp() itself is refused.
        load(deny, listener=False)
        listener = load(allow, listener=notify)
    except OSError as exc:
        raise SeccompError(f"loading the seccomp filter failed: {exc}") from exc
    unfiltered = [tid for tid, mode in thread_modes().items() if mode != 2]
    if unfiltered:
        raise SeccompError(f"threads {unfiltered} did not receive the seccomp filter")
    return listener
