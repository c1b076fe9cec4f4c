"""What a run or session asks of the network, and the one rule that makes it a policy.

Both faces take a network choice (off, on, or only some hosts) and both turn it into a kernel's
policy here: `with_network` is the only place the operator's policy is narrowed for a kernel
(an operator's allowlist is narrowed by a caller's, never widened; the operator's secrets go
only to kernels that may reach their hosts; egress is chained to the deployment's proxy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..policy import SandboxPolicy


@dataclass(frozen=True)
class NetworkChoice:
    """What a run or session asked of the network: off, on, or only the names in hosts."""

    mode: str = "off"
    hosts: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.mode != "off"


Network = bool | NetworkChoice
Secrets = Mapping[str, Any] | None  # a caller's {NAME: {"value": ..., "hosts": [...]}}


def split(network: Network) -> tuple[bool, tuple[str, ...] | None]:
    """(network at all, the allowlist when only some hosts), from a bool or a NetworkChoice."""
    if isinstance(network, NetworkChoice):
        return bool(network), network.hosts if network.mode == "hosts" else None
    return bool(network), None


def policy_name(network: Network) -> str:
    """The name metrics and sessions give a kernel's network: offline, network or hosts."""
    allowed, hosts = split(network)
    return "hosts" if hosts is not None else "network" if allowed else "offline"


def with_network(base: SandboxPolicy, network: bool, upstream_proxy: str = "",
                 hosts: tuple[str, ...] | None = None) -> SandboxPolicy:
    """The base policy with the network off, on (any public host) or only hosts, egress
    chained to the deployment's upstream proxy when there is one.

    When the operator's policy says --network hosts, network kernels get the operator's
    allowlist, and a caller's own list keeps only the names on it.
    """
    values = base.as_dict()
    values.pop("allow_network", None)  # an alias of network; network decides
    if base.network == "hosts":  # the operator's allowlist: a request narrows it, never widens
        hosts = tuple(base.allow_hosts) if hosts is None else \
            tuple(host for host in hosts if host in base.allow_hosts)
    values["network"] = "off" if not network else "hosts" if hosts is not None else "on"
    if hosts is not None:
        values["allow_hosts"] = list(hosts)
    if network and upstream_proxy:
        values["upstream_proxy"] = upstream_proxy
    if not network:  # the operator's secrets are for network kernels only
        values.update(secrets=[], secrets_file="")
    elif hosts is not None:  # and for the hosts a request keeps
        values["secrets"] = [entry for entry in base.secrets
                             if entry.partition("=")[2].strip() in hosts]
    return SandboxPolicy(**values)


def network_record(network: Network) -> dict[str, Any]:
    """A session's network as the store keeps it."""
    if isinstance(network, NetworkChoice):
        return {"mode": network.mode, "hosts": list(network.hosts)}
    return {"mode": "on" if network else "off", "hosts": []}


def network_of(record: Any) -> NetworkChoice:
    """The network a stored record ran on (a bare bool: what the MCP server once stored)."""
    if isinstance(record, bool):
        return NetworkChoice("on" if record else "off")
    return NetworkChoice(record["mode"], tuple(record["hosts"]))
