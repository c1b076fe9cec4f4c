"""`sandbox-kernel check`: what this host can enforce, measured against a policy."""

from __future__ import annotations

import json
import os
import pwd
import resource
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .confine import audit, denials, landlock, netns, paths, privileges, promises, scratch, seccomp
from .policy import SandboxPolicy

# Set in the service's image and compose files: where any is, `check` checks the service too.
SERVICE_VARIABLES = ("ENABLE_NETWORK", "SANDBOX_RUNTIME", "SANDBOX_PORT")


def _landlock(policy: SandboxPolicy) -> dict[str, Any]:
    abi = landlock.abi_version(policy.landlock_abi)
    return {"abi": abi, "host_abi": landlock.abi_version(), **landlock.supported(abi)}


def _rlimits() -> dict[str, Any]:
    def show(value: int) -> int | str:
        return "unlimited" if value == resource.RLIM_INFINITY else value

    return {name: [show(v) for v in resource.getrlimit(getattr(resource, f"RLIMIT_{name}"))]
            for name in ("DATA", "AS", "CPU", "FSIZE", "NOFILE", "CORE", "NPROC")}


def _user_code_uid(policy: SandboxPolicy) -> tuple[int, str | None]:
    """The uid user code would run as (as privileges.plan decides), and why not, if it cannot.

    As root with --run-as auto each kernel takes a free uid of its own when it starts; the
    first of --uid-range stands for it here (it is never 0).
    """
    if os.geteuid() != 0 or policy.run_as == "root":
        return os.geteuid(), None
    try:
        if policy.run_as == "auto":
            return privileges.parse_range(policy.uid_range)[0], None
        uid, _ = privileges.resolve(policy.run_as)
    except privileges.PrivilegeError as exc:
        return 0, str(exc)
    if uid == 0:
        return 0, f"--run-as {policy.run_as} is uid 0: say --run-as root to keep root"
    return uid, None


def write_warnings(policy: SandboxPolicy, cwd: str | None) -> list[str]:
    """Write grants the host's own permissions keep user code's uid out of (cwd: the folder
    --grant-cwd=rw would grant; None when it is not known yet, as at install)."""
    uid, problem = _user_code_uid(policy)
    if problem or uid == 0:
        return []
    gid = os.getegid() if uid == os.geteuid() else uid  # a kernel's own uid has the same gid
    if policy.run_as not in ("auto", "root") and os.geteuid() == 0:
        gid = privileges.resolve(policy.run_as)[1]
    said = [f"--write-path {path}: {refusal}" for path in policy.write_paths
            if (refusal := denials.host_write_refusal(path, uid, gid))]
    if policy.grant_cwd == "rw" and cwd is not None:
        if (refusal := denials.host_write_refusal(cwd, uid, gid)):
            said.append(f"--grant-cwd=rw here ({cwd}): {refusal}")
    elif policy.grant_cwd == "rw" and os.geteuid() == 0 and policy.run_as == "auto":
        said.append("--grant-cwd=rw: user code runs as a uid of its own, which may write only "
                    "in a notebook's folder that lets other users write (a root-owned 0755 "
                    "folder does not): " + denials.host_write_fix("that folder"))
    return said


def _network(policy: SandboxPolicy, uid: int) -> dict[str, Any]:
    """The network setting and whether this host gives each kernel a namespace of its own
    (tried as the kernel would: as root, else as user code's uid in a user namespace)."""
    switch_to = (uid, uid) if os.geteuid() == 0 and uid != 0 else None
    report: dict[str, Any] = {"mode": policy.network,
                              "namespace": netns.available(switch_to)}
    if policy.network == "hosts":
        report["allow_hosts"] = policy.allow_hosts
    if policy.network != "off":
        report["allow_addresses"] = policy.allow_addresses
        report["upstream_proxy"] = bool(policy.upstream_proxy)
    return report


def _network_problem(network: dict[str, Any]) -> str | None:
    if network["mode"] == "off" or network["namespace"]["available"]:
        return None
    return (f"network {network['mode']}: no network namespace here "
            f"({network['namespace']['reason']}): {netns.NAMESPACE_FIX}")


def _problems(policy: SandboxPolicy, judged: list[promises.Promise],
              run_as_problem: str | None, network: dict[str, Any]) -> list[str]:
    problems = [promise.describe() for promise in judged if promise.missing]
    if (network_problem := _network_problem(network)):
        problems.append(network_problem)
    if run_as_problem:
        problems.append(run_as_problem)
    return problems


def host_report(policy: SandboxPolicy) -> dict[str, Any]:
    """Each layer's support on this host, each promise's keeper, and what cannot be enforced."""
    seccomp_reason = seccomp.available()
    lock = _landlock(policy)
    uid, run_as_problem = _user_code_uid(policy)
    judged = promises.evaluate(promises.Host(
        landlock_abi=lock["abi"], landlock_on=policy.require_landlock,
        seccomp_reason=seccomp_reason, seccomp_on=policy.require_seccomp,
        allow_network=policy.allow_network, max_threads=policy.max_threads,
        memory_limit=policy.memory_limit, uid=uid))
    # The rules this policy's kernel would load (read from the rules, as in kernel_info_reply);
    # a kernel started as `python -I -m sandbox_kernel` has a reaper to record denials.
    rules = seccomp.describe(policy.allow_network, notify=True,
                             landlock_abi=lock["abi"] if policy.require_landlock else 0)
    network = _network(policy, uid)
    return {
        "seccomp": {"available": seccomp_reason is None, "reason": seccomp_reason,
                    "rules": rules if policy.require_seccomp else None},
        "landlock": lock,
        "network": network,
        "audit_log": policy.audit_log or audit.default_path(),
        "rlimits": _rlimits(),
        "uid": os.geteuid(),
        "user_code_uid": uid,
        "promises": [promise.as_dict() for promise in judged],
        "policy": policy.as_dict(),
        "problems": _problems(policy, judged, run_as_problem, network),
        "warnings": write_warnings(policy, os.getcwd()),
    }


def _writable(directory: Path) -> str | None:
    """None when root can make directory and write in it; else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def _directories(policy: SandboxPolicy) -> tuple[dict[str, str], list[str]]:
    """The directories the service writes, and a problem (naming the fix) per one it cannot."""
    from jupyter_core.paths import jupyter_runtime_dir

    found, problems = {}, []
    runtime = Path(jupyter_runtime_dir())
    found["connection files and fork server"] = str(runtime)
    if (why := _writable(runtime)):
        problems.append(f"cannot write JUPYTER_RUNTIME_DIR {runtime} ({why}), where the "
                        "kernels' connection files go: set JUPYTER_RUNTIME_DIR to a writable "
                        "directory (the image's compose files mount a tmpfs on /run)")
    found["scratch directories"] = str(scratch.root().parent)
    if (why := _writable(scratch.root().parent)):
        problems.append(f"cannot write {scratch.root().parent} ({why}), where the kernels' "
                        "scratch directories go: give the container a /tmp tmpfs, or TMPDIR")
    if os.geteuid() == 0 and policy.run_as == "auto":
        try:
            found["uid locks"] = str(privileges.lock_dir(policy.uid_lock_dir))
        except privileges.PrivilegeError as exc:
            problems.append(str(exc))
    return found, problems


def service_report(policy: SandboxPolicy, environ: Mapping[str, str]) -> dict[str, Any]:
    """What `sandbox-kernel serve` would run with this environment: each network policy it
    serves (ENABLE_NETWORK), its runtime (SANDBOX_RUNTIME), the directories it writes."""
    import argparse

    from traitlets import TraitError

    from .service import config as service_config

    try:
        config = service_config.from_arguments(argparse.Namespace(), dict(environ))
    except TraitError as exc:
        return {"problems": [f"serve would refuse its settings: {exc}"]}
    from .hosting.network import with_network

    problems: list[str] = []
    served = {"offline": with_network(policy, False)}
    if config.enable_network:
        served["network"] = with_network(policy, True, service_config.upstream_proxy(config))
    policies = {}
    for name, kernel_policy in served.items():
        found = host_report(kernel_policy)["problems"]
        policies[name] = "the kernel will start" if not found else "; ".join(found)
        problems += [f"{name} kernels (ENABLE_NETWORK={str(config.enable_network).lower()}): "
                     f"{problem}" for problem in found]
    runtime = None
    if config.runtime:
        from .runtimes import RuntimesError, find

        try:
            runtime = str(find(config.runtime).python())
        except RuntimesError as exc:
            problems.append(f"SANDBOX_RUNTIME={config.runtime}: {exc}")
    directories, unwritable = _directories(policy)
    return {"enable_network": config.enable_network, "runtime": runtime,
            "policies": policies, "directories": directories, "problems": problems + unwritable}


def wants_service(environ: Mapping[str, str]) -> bool:
    """Whether the environment is the service's (its image sets SERVICE_VARIABLES)."""
    return any(name in environ for name in SERVICE_VARIABLES)


def _service_lines(service: dict[str, Any]) -> list[str]:
    lines = ["what `sandbox-kernel serve` would run here:"]
    for name, state in service.get("policies", {}).items():
        lines.append(f"  {name} kernels: {state}")
    if service.get("runtime"):
        lines.append(f"  runtime: {service['runtime']}")
    for what, where in service.get("directories", {}).items():
        lines.append(f"  writes {what} in {where}")
    lines += [f"  MISSING  {problem}" for problem in service["problems"]]
    lines.append("  the service's kernels will start" if not service["problems"] else
                 "  the service would serve nothing: /ready stays 503 (see MISSING above)")
    return lines


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no account"


def _filter_lines(rules: dict[str, Any] | None) -> list[str]:
    """What the filter would allow, one line a setting (its never-list is in `check --json`)."""
    if not rules:
        return []
    return [f"    {name.replace('_', ' ')}: {value}" for name, value in rules.items()
            if name != "never"]


def _network_lines(network: dict[str, Any]) -> list[str]:
    namespace = network["namespace"]
    lines = [f"  network namespace per kernel: available ({namespace['owner']})"
             if namespace["available"] else
             f"  network namespace per kernel: NOT available: {namespace['reason']} "
             "(--network hosts/on refuse to start; off keeps the seccomp rules)"]
    mode = network["mode"]
    if mode == "off":
        lines.append("  network: off (no sockets; the namespace has no route)")
    else:
        what = (f"only {', '.join(network['allow_hosts']) or 'no names (nothing)'}"
                if mode == "hosts" else "any public address")
        grants = ", ".join(network["allow_addresses"]) or "none"
        upstream = ", chained to the upstream proxy" if network["upstream_proxy"] else ""
        lines.append(f"  network: {mode}: {what} through the egress proxy{upstream}; "
                     f"private addresses granted: {grants}")
    return lines


def summary(report: dict[str, Any]) -> str:
    """The report as a few lines a person reads: layers, then each promise and its keeper."""
    lock, filt = report["landlock"], report["seccomp"]
    capped = f" (capped by --landlock-abi; host: {lock['host_abi']})" \
        if lock["abi"] != lock["host_abi"] else ""
    uid = report["user_code_uid"]
    lines = [
        "layers on this host:",
        f"  seccomp:  {'available' if filt['available'] else 'NOT available: ' + filt['reason']}",
        *_filter_lines(filt.get("rules")),
        f"  Landlock: ABI {lock['abi']}{capped}" if lock["abi"] else
        f"  Landlock: NOT available{capped}",
        *_network_lines(report["network"]),
        f"  audit record (refused calls, egress connections): {report['audit_log']}"
        + ("" if report["policy"].get("audit_log") else " (the default; --audit-log PATH "
           "chooses another)"),
        f"  user code runs as: uid {uid} ({_user_name(uid)})" if report["uid"] != 0
        or report["policy"].get("run_as") != "auto" else
        f"  user code runs as: a uid of its own per kernel from {report['policy']['uid_range']}",
        "files user code may reach besides the system and the interpreter:",
        *(f"  {line}" for line in paths.describe_grants(
            report["policy"]["read_paths"], report["policy"]["write_paths"],
            cwd_mode=report["policy"]["grant_cwd"])),
        *(f"  but {warning}" for warning in report["warnings"]),
        "promises of this policy, and what keeps them:",
    ]
    for item in report["promises"]:
        if item["enforced_by"]:
            lines.append(f"  ok       {item['promise']}: {' + '.join(item['enforced_by'])}")
        elif item["waived_by"]:
            lines.append(f"  waived   {item['promise']}: by {item['waived_by']}")
        else:
            lines.append(f"  MISSING  {item['promise']}: needs {' or '.join(item['needs'])}; "
                         f"waive with {item['waiver']}")
    if (network_problem := _network_problem(report["network"])):
        lines.append(f"  MISSING  {network_problem}")
    if "service" in report:
        lines += _service_lines(report["service"])
    service_problems = len(report.get("service", {}).get("problems", ()))
    lines.append("the kernel will start" if len(report["problems"]) == service_problems else
                 "the kernel will refuse to start (see MISSING above)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """`python -m sandbox_kernel.check POLICY_JSON`: the problems of that policy, as JSON.

    The service asks this of a fresh interpreter when a policy's kernels fail to start, so its
    /ready can say why (the kernel's own refusal went to the log); the probes fork, which the
    service's threads make unsafe in its own process.
    """
    print(json.dumps(host_report(SandboxPolicy(**json.loads(argv[0])))["problems"]))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
