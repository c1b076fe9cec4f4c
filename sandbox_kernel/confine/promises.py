"""The policy's promises, and which layer keeps each one on this host.

A layer is a mechanism (Landlock, the seccomp filter, an rlimit); a promise is what the policy
says user code cannot do. Landlock's rights depend on the host's ABI, so the same promise is kept
by Landlock on one host and by a seccomp rule that stands in for the missing right on another.
The rule: every promise is kept by some layer here, or was waived by a flag, or the kernel
refuses to start and says which promise, what is missing and which flag waives it.
What the seccomp filter keeps is read from its rules (seccomp.rules.GUARANTEES), never restated
here: a promise whose rule is gone is no longer claimed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ConfinementError
from .seccomp import rules as seccomp_rules


class PromiseError(ConfinementError):
    """A promise of the policy is kept by no layer on this host, and no flag waived it."""

    layer = "promises"  # the reason names, per promise, the flag that waives it


@dataclass(frozen=True)
class Host:
    """What the layers can do here, as the policy asked for them."""

    landlock_abi: int  # 0: none (or capped to none)
    landlock_on: bool  # False: --no-landlock
    seccomp_reason: str | None  # why libseccomp cannot be used here; None: it can
    seccomp_on: bool  # False: --no-seccomp
    allow_network: bool
    max_threads: int
    memory_limit: int
    uid: int  # whom user code runs as


@dataclass
class Promise:
    """One promise and its verdict on a host."""

    name: str
    enforced_by: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)  # what would keep it, when nothing does
    waived_by: str | None = None  # a flag of the policy that gave it up on purpose
    waiver: str = ""  # the flag that gives it up

    @property
    def missing(self) -> bool:
        """Neither kept by a layer nor waived: the kernel must not start."""
        return not self.enforced_by and self.waived_by is None

    def as_dict(self) -> dict[str, Any]:
        """JSON form for `check --json` and kernel_info_reply."""
        return {"promise": self.name, "enforced_by": self.enforced_by, "needs": self.needs,
                "waived_by": self.waived_by, "waiver": self.waiver}

    def describe(self) -> str:
        """One human line: the promise and who keeps it, or what it lacks and its flag."""
        if self.enforced_by:
            return f"{self.name}: {' + '.join(self.enforced_by)}"
        if self.waived_by:
            return f"{self.name}: NOT ENFORCED, waived by {self.waived_by}"
        return (f"{self.name}: MISSING, needs {' or '.join(self.needs)}; "
                f"to run without it on purpose: {self.waiver}")


def _landlock(host: Host, right: str, first_abi: int) -> tuple[bool, str]:
    """(usable, description) of one Landlock right on this host."""
    label = f"Landlock {right} (ABI >= {first_abi})"
    if not host.landlock_on:
        return False, label
    if host.landlock_abi >= first_abi:
        return True, f"Landlock {right}"
    return False, f"{label}; this host: ABI {host.landlock_abi}"


def _seccomp(host: Host, key: str, prefix: str = "") -> tuple[bool, str]:
    """(usable, description) of one of the filter's guarantees on this host."""
    kept = seccomp_rules.keeps(key, host.allow_network, host.landlock_abi if host.landlock_on
                               else 0)
    rule = prefix + (kept or seccomp_rules.GUARANTEES[key].text)
    if not host.seccomp_on:
        return False, f"seccomp ({rule})"
    if host.seccomp_reason:
        return False, f"seccomp ({rule}); here: {host.seccomp_reason}"
    if kept is None:
        return False, f"seccomp ({rule}); its rules here do not keep it"
    return True, f"seccomp: {rule}"


def _judge(name: str, candidates: list[tuple[bool, str, str]], waiver: str,
           waived_by: str | None = None) -> Promise:
    """A promise kept by every usable candidate (usable, description, flag switching it off)."""
    promise = Promise(name, waiver=waiver)
    for usable, description, _flag in candidates:
        (promise.enforced_by if usable else promise.needs).append(description)
    if not promise.enforced_by:
        off = [flag for _usable, _description, flag in candidates if flag]
        promise.waived_by = waived_by or (off[0] if off else None)
    return promise


def evaluate(host: Host) -> list[Promise]:
    """Every promise the policy makes, judged for this host."""
    no_ll = "--no-landlock" if not host.landlock_on else ""
    no_sc = "--no-seccomp" if not host.seccomp_on else ""

    def landlock(right: str, abi: int) -> tuple[bool, str, str]:
        return (*_landlock(host, right, abi), no_ll)

    def seccomp(key: str) -> tuple[bool, str, str]:
        return (*_seccomp(host, key), no_sc)

    files_off = no_ll or None  # without Landlock there are no grants to keep files within
    promises = [
        _judge("files: read and write only the interpreter, scratch and grants",
               [landlock("file rights", 1)], "--no-landlock", files_off),
        _judge("files: truncate none outside the grants",
               [landlock("truncate", 3)] if host.landlock_abi >= 3 else
               [landlock("truncate", 3),
                seccomp("truncate")],
               "--no-landlock", files_off),
        _judge("processes: create none (threads only)",
               [seccomp("processes")], "--no-seccomp"),
        _judge("other processes: signal none",
               [landlock("signal scope", 6),
                seccomp("signals")], "--no-seccomp"),
        _judge("servers: listen on no address or port",
               [seccomp("servers")], "--no-seccomp"),
        _judge("host sockets: no datagram or connection to a unix socket",
               [seccomp("unix_sockets")], "--no-seccomp"),
        _judge("host files: watch none (inotify, fanotify)",
               [seccomp("watches")], "--no-seccomp"),
        _judge("kernel interfaces: none of the rare ones (io_uring, bpf, namespaces, ...)",
               [seccomp("rare_interfaces")], "--no-seccomp"),
    ]
    if not host.allow_network:
        # Not Landlock's TCP connect right (ABI 4): sendto(MSG_FASTOPEN) connects a new TCP
        # socket past it (seen on Linux 6.18, ABI 7), and it has no rule for UDP.
        promises.append(_judge(
            "network: no connection out",
            [seccomp("network_off")], "--no-seccomp"))
    if host.memory_limit:
        rlimit_and_filter = _seccomp(host, "memory", prefix="RLIMIT_DATA, and ")
        promises.append(_judge(f"memory: at most {host.memory_limit / 2**20:g} MiB",
                               [(*rlimit_and_filter, no_sc)], "--memory-limit 0"))
    if host.max_threads:
        bound = host.uid != 0
        promises.append(_judge(
            f"threads: at most {host.max_threads}",
            [(bound, f"RLIMIT_NPROC of uid {host.uid}" if bound
              else "RLIMIT_NPROC of a uid other than 0 (uid 0 is exempt; use --run-as)", "")],
            "--max-threads 0"))
    return promises


def refusal(promises: list[Promise]) -> str | None:
    """The one-line reason to refuse to start, or None when every promise is kept or waived."""
    missing = [promise.describe() for promise in promises if promise.missing]
    if not missing:
        return None
    return "cannot keep these promises on this host: " + "; ".join(missing)


def require(promises: list[Promise]) -> None:
    """Raise PromiseError unless every promise is kept or waived."""
    reason = refusal(promises)
    if reason:
        raise PromiseError(reason)
