"""Kernelspecs that make the sandbox kernel an Enterprise Gateway remote kernel.

`sandbox-kernel install --enterprise-gateway {kubernetes,docker,distributed}` writes a kernel.json
naming EG's process proxy. For `distributed` (EG starts the launcher itself, locally or over
ssh) the argv is `sandbox-kernel eg-launch` with the policy. For `kubernetes` and `docker` the
argv runs EG's own launch_kubernetes.py / launch_docker.py on EG's side (from EG's kernelspecs,
placed in scripts/ next to what we write); in the container, the image runs
`sandbox-kernel eg-launch`. For kubernetes we also write scripts/kernel-pod.yaml.j2 (the
hardened pod EG's script renders), kernel-networkpolicy.yaml (to apply once) and
seccomp-profile.json (a stricter Localhost profile than the pod's default, for --network off
kernels only: it refuses unshare).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from string import Template
from typing import Any

from traitlets import Int, TraitError, Unicode, validate
from traitlets.config import Configurable

from ..confine import seccomp
from ..policy import SandboxPolicy
from .eg import POLICY_VARIABLE

PROCESS_PROXIES = {
    "kubernetes": "enterprise_gateway.services.processproxies.k8s.KubernetesProcessProxy",
    "docker": "enterprise_gateway.services.processproxies.docker_swarm.DockerSwarmProcessProxy",
    "distributed": "enterprise_gateway.services.processproxies.distributed."
                   "DistributedProcessProxy",
}
EG_LAUNCH_SCRIPTS = {"kubernetes": "launch_kubernetes.py", "docker": "launch_docker.py"}
# EG substitutes these in argv; eg-launch accepts exactly these spellings.
EG_ARGV = ["--RemoteProcessProxy.kernel-id", "{kernel_id}",
           "--RemoteProcessProxy.port-range", "{port_range}",
           "--RemoteProcessProxy.response-address", "{response_address}",
           "--RemoteProcessProxy.public-key", "{public_key}",
           "--RemoteProcessProxy.spark-context-initialization-mode", "none"]
TEMPLATES = Path(__file__).with_name("eg_templates")
# Where deploy/enterprise-gateway/README.md has operators install deploy/service/seccomp.json,
# relative to the kubelet's seccomp directory (/var/lib/kubelet/seccomp).
NODE_PROFILE = "Localhost:profiles/sandbox-kernel.json"
MAX_POD_ID = 2**31 - 1  # what Kubernetes accepts for runAsUser and runAsGroup


class EnterpriseGatewaySpec(Configurable):
    """How the kernel is deployed under Enterprise Gateway (what the kernelspec fixes)."""

    image = Unicode(
        "sandbox-kernel:latest", help="Kernel image (deploy/enterprise-gateway/Dockerfile) for "
        "kubernetes and docker; fixed here, never taken from the client's KERNEL_IMAGE.",
    ).tag(config=True, flag="image", metavar="IMAGE")
    namespace = Unicode(
        "enterprise-gateway", help="Namespace of the kernel pods and their NetworkPolicy "
        "(run EG with kernel.shareGatewayNamespace=true, or kernels in this namespace).",
    ).tag(config=True, flag="k8s-namespace", metavar="NS")
    uid = Int(1000, help="Non-root uid (and gid) the kernel pod runs as.").tag(
        config=True, flag="k8s-uid", metavar="UID")
    cpu_limit = Unicode("1", help="Pod CPU limit unless KERNEL_CPUS_LIMIT says otherwise.").tag(
        config=True, flag="k8s-cpu-limit", metavar="CPU")
    memory_limit = Unicode(
        "2Gi", help="Pod memory limit unless KERNEL_MEMORY_LIMIT says otherwise.",
    ).tag(config=True, flag="k8s-memory-limit", metavar="QUANTITY")
    ephemeral_storage_limit = Unicode(
        "2Gi", help="Pod ephemeral-storage limit unless KERNEL_EPHEMERAL_STORAGE_LIMIT says "
        "otherwise.",
    ).tag(config=True, flag="k8s-ephemeral-storage-limit", metavar="QUANTITY")
    scratch_size = Unicode(
        "1Gi", help="sizeLimit of the emptyDir on /tmp that holds the kernel's scratch.",
    ).tag(config=True, flag="k8s-scratch-size", metavar="QUANTITY")
    # The default needs deploy/service/seccomp.json on every node (deploy/enterprise-gateway/
    # README.md): a runtime's default profile refuses the unshare a network kernel makes.
    seccomp_profile = Unicode(
        NODE_PROFILE, help="Pod seccomp profile: Localhost:<path in the kubelet's seccomp "
        "directory>, by default the runtime's default profile plus unshare(CLONE_NEWUSER|"
        "CLONE_NEWNET) (deploy/service/seccomp.json, installed on every node), which network "
        "kernels need; or RuntimeDefault (containerd >= 1.6 and Docker's default allow seccomp, "
        "prctl and landlock_*, but refuse unshare: only --network off kernels start).",
    ).tag(config=True, flag="k8s-seccomp-profile", metavar="PROFILE")
    port_range = Unicode(
        "40000..41000", help="EG's port range (EG_PORT_RANGE, at least 1000 ports), for the "
        "NetworkPolicy.",
    ).tag(config=True, flag="eg-port-range", metavar="LOW..HIGH")
    response_port = Int(8877, help="EG's response port (EG_RESPONSE_PORT), for the "
                        "NetworkPolicy.").tag(config=True, flag="eg-response-port", metavar="N")

    @validate("uid")
    def _non_root_uid(self, proposal: dict[str, Any]) -> int:
        """Refused here, at install: the pod's runAsNonRoot would refuse uid 0 only at each
        kernel start, and EG (EG_PROHIBITED_UIDS/GIDS) refuses uid and gid 0 too."""
        uid = proposal["value"]
        if not 0 < uid <= MAX_POD_ID:
            raise TraitError(f"--k8s-uid {uid}: the kernel pod runs as this uid and gid, which "
                             f"must be from 1 to {MAX_POD_ID}, never root's 0 (EG and the "
                             "pod's runAsNonRoot refuse it); the image's user is 1000")
        return int(uid)

    def seccomp_stanza(self) -> dict[str, str]:
        """The pod's seccompProfile object."""
        kind, _, path = self.seccomp_profile.partition(":")
        if kind == "RuntimeDefault" and not path:
            return {"type": "RuntimeDefault"}
        if kind == "Localhost" and path:
            return {"type": "Localhost", "localhostProfile": path}
        raise ValueError(f"--k8s-seccomp-profile {self.seccomp_profile!r}: use RuntimeDefault "
                         "or Localhost:<profile path relative to the kubelet's seccomp dir>")


# What the launcher and the kernel's start-up need from the pod's profile on top of what the
# kernel's own filter allows user code: processes (the listener, the exec into the kernel, its
# clean re-exec, the scratch reaper), sockets (the kernel's and the comm port's listeners),
# installing the kernel's filter, watching and signalling the kernel, identity and limits
# (set-up as root), file modes of the scratch.
STARTUP_SYSCALLS = (
    "fork", "vfork", "execve", "socket", "socketpair", "bind", "listen", "prctl", "seccomp",
    "kill", "tgkill", "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "pidfd_open", "pidfd_send_signal", "prlimit64", "setrlimit", "get_robust_list",
    "sched_getaffinity", "sched_setaffinity", "sched_setparam", "sched_setscheduler",
    "sched_setattr", "setpriority", "ioprio_get", "capset",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
    "setfsuid", "setfsgid", "chmod", "fchmod", "fchmodat", "fchmodat2",
    # the refusal tally the kernel shares with its reaper (confine/tally.py), made before its
    # own filter refuses memfd
    "memfd_create",
)
# Namespace flags a clone() may not carry (what container runtimes refuse without
# CAP_SYS_ADMIN): NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
_CLONE_NAMESPACES = 0x7E020000
_ENOSYS = 38
_NEWEST_LANDLOCK_ABI = 7  # the kernel's filter allows the most on the newest Landlock


def _kernel_syscalls() -> set[str]:
    """Every call the kernel's own filter allows for some arguments (fcntl, connect, openat2...):
    the pod allows the call and the kernel's filter, stacked under it, narrows the arguments."""
    rules = seccomp.allowlist_rules(1, allow_network=True, landlock_abi=_NEWEST_LANDLOCK_ABI)
    return {rule.syscall for rule in rules if rule.action == "allow"} - {"clone", "clone3"}


def pod_seccomp_profile() -> dict[str, Any]:
    """A Localhost seccomp profile (OCI/Docker JSON) for kernel pods: deny by default.

    Stricter than the pod's default (deploy/service/seccomp.json): everything else it refuses
    stays refused (mount, unshare, bpf, keyrings, ptrace, io_uring...), so only --network off
    kernels start under it.
    """
    allowed = sorted(_kernel_syscalls() | set(STARTUP_SYSCALLS))
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"],
        "syscalls": [
            {"names": allowed, "action": "SCMP_ACT_ALLOW"},
            {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": _CLONE_NAMESPACES, "valueTwo": 0,
                       "op": "SCMP_CMP_MASKED_EQ"}]},
            # glibc falls back from clone3 to clone on ENOSYS (clone3's flags are in memory).
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS},
        ],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --enterprise-gateway flag and the deployment settings, for `install`."""
    group = parser.add_argument_group("Enterprise Gateway")
    group.add_argument("--enterprise-gateway", choices=sorted(PROCESS_PROXIES),
                       help="write a kernelspec for Jupyter Enterprise Gateway's process proxy")
    for name, trait in EnterpriseGatewaySpec.class_traits(config=True).items():
        group.add_argument(f"--{trait.metadata['flag']}", dest=f"eg_{name}", default=None,
                           metavar=trait.metadata["metavar"], help=trait.help)


def from_arguments(args: argparse.Namespace) -> EnterpriseGatewaySpec:
    """The deployment settings given on the command line (validated by traitlets)."""
    values: dict[str, Any] = {}
    for name, trait in EnterpriseGatewaySpec.class_traits(config=True).items():
        given = getattr(args, f"eg_{name}", None)
        if given is not None:
            try:
                values[name] = trait.from_string(given)
            except ValueError:  # int("abc"): say which flag wants a number
                raise TraitError(f"--{trait.metadata['flag']} {given!r}: expected a whole "
                                 "number") from None
    return EnterpriseGatewaySpec(**values)


def kernel_json(kind: str, policy: SandboxPolicy, display_name: str, spec: EnterpriseGatewaySpec,
                kernel_dir: str) -> dict[str, Any]:
    """kernel.json for EG's process proxy `kind`; kernel_dir is where EG will find it."""
    metadata: dict[str, Any] = {"process_proxy": {"class_name": PROCESS_PROXIES[kind]},
                                "sandbox_kernel": {"policy": policy.as_dict()}}
    document: dict[str, Any] = {"display_name": display_name, "language": "python",
                                "interrupt_mode": "signal", "metadata": metadata, "env": {}}
    if kind == "distributed":
        document["argv"] = [sys.executable, "-I", "-m", "sandbox_kernel", "eg-launch",
                            *EG_ARGV, *policy.to_argv()]
        return document
    metadata["process_proxy"]["config"] = {"image_name": spec.image}
    document["argv"] = ["python", f"{kernel_dir}/scripts/{EG_LAUNCH_SCRIPTS[kind]}", *EG_ARGV]
    if kind == "docker":
        document["env"] = {POLICY_VARIABLE: shlex.join(policy.to_argv())}
    return document


def _render(name: str, **values: Any) -> str:
    as_yaml = {key: json.dumps(value) for key, value in values.items()}  # JSON scalars are YAML
    return Template((TEMPLATES / name).read_text()).substitute(as_yaml)


def pod_template(policy: SandboxPolicy, spec: EnterpriseGatewaySpec) -> str:
    """kernel-pod.yaml.j2 with the install-time values filled in (Jinja left for EG)."""
    return _render(
        "kernel-pod.yaml.j2", namespace=spec.namespace, uid=spec.uid, gid=spec.uid,
        seccomp_profile=spec.seccomp_stanza(), image=spec.image, policy_args=policy.to_argv(),
        cpu_request="100m", memory_request="256Mi", ephemeral_storage_request="256Mi",
        cpu_limit=spec.cpu_limit, memory_limit=spec.memory_limit,
        ephemeral_storage_limit=spec.ephemeral_storage_limit, scratch_size=spec.scratch_size)


def network_policy(spec: EnterpriseGatewaySpec) -> str:
    """The NetworkPolicy for kernel pods: EG in on the port range, out to EG's response port."""
    low, _, high = spec.port_range.partition("..")
    if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high) <= 65535):
        raise ValueError(f"--eg-port-range {spec.port_range!r}: use LOW..HIGH, the value of "
                         "EG_PORT_RANGE (a NetworkPolicy cannot follow 0..0, any port)")
    return _render("kernel-networkpolicy.yaml", namespace=spec.namespace, port_low=int(low),
                   port_high=int(high), response_port=spec.response_port)


def check(kind: str, spec: EnterpriseGatewaySpec) -> None:
    """Raise ValueError, naming the flag, for settings that cannot produce a valid kernelspec."""
    if kind == "kubernetes":
        spec.seccomp_stanza()
        network_policy(spec)


def write(directory: Path, kind: str, policy: SandboxPolicy, display_name: str,
          spec: EnterpriseGatewaySpec, kernel_dir: str) -> None:
    """Write the EG kernelspec's files into directory (installed afterwards as kernel_dir)."""
    document = kernel_json(kind, policy, display_name, spec, kernel_dir)
    (directory / "kernel.json").write_text(json.dumps(document, indent=2))
    if kind == "kubernetes":
        scripts = directory / "scripts"
        scripts.mkdir()
        (scripts / "kernel-pod.yaml.j2").write_text(pod_template(policy, spec))
        (directory / "kernel-networkpolicy.yaml").write_text(network_policy(spec))
        profile = json.dumps(pod_seccomp_profile(), indent=2) + "\n"
        (directory / "seccomp-profile.json").write_text(profile)
