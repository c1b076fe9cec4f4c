"""`sandbox-kernel check`: what this host can enforce, measured against a policy."""

from __future__ import annotations

import os
import resource
from typing import Any

from .confine import landlock, privileges, seccomp
from .policy import SandboxPolicy


def _landlock() -> dict[str, Any]:
    abi = landlock.abi_version()
    return {"abi": abi, **landlock.supported(abi)}


def _rlimits() -> dict[str, Any]:
    def show(value: int) -> int | str:
        return "unlimited" if value == resource.RLIM_INFINITY else value

    return {name: [show(v) for v in resource.getrlimit(getattr(resource, f"RLIMIT_{name}"))]
            for name in ("DATA", "AS", "CPU", "FSIZE", "NOFILE", "CORE", "NPROC")}


def _problems(policy: SandboxPolicy, seccomp_reason: str | None, abi: int) -> list[str]:
    problems = []
    if seccomp_reason and policy.require_seccomp:
        problems.append(f"seccomp: {seccomp_reason} (or relax with --no-seccomp)")
    if not abi and policy.require_landlock:
        problems.append("landlock: not available on this kernel (or relax with --no-landlock)")
    if os.geteuid() == 0 and policy.run_as != "auto":
        try:
            missing = privileges.can_run_as(*privileges.resolve(policy.run_as))
        except privileges.PrivilegeError as exc:
            missing = str(exc)
        if missing:
            problems.append(f"--run-as {policy.run_as}: cannot read {missing}")
    return problems


def host_report(policy: SandboxPolicy) -> dict[str, Any]:
    """Each layer's support on this host, the effective policy, and what cannot be enforced."""
    seccomp_reason = seccomp.available()
    lock = _landlock()
    return {
        "seccomp": {"available": seccomp_reason is None, "reason": seccomp_reason},
        "landlock": lock,
        "rlimits": _rlimits(),
        "uid": os.geteuid(),
        "policy": policy.as_dict(),
        "problems": _problems(policy, seccomp_reason, lock["abi"]),
    }
