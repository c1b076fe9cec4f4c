"""What the egress proxy lets through: names on the allowlist, public or granted addresses.

The proxy resolves names itself and checks every address it would connect to, so a name that
resolves (or is rebound) to the host's loopback, a private network or a metadata service is
refused unless the operator granted that address with --allow-address.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MODES = ("off", "hosts", "on")
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


class RuleError(ValueError):
    """An allowlist or grant entry that cannot be understood."""


def _split_port(entry: str) -> tuple[str, int | None]:
    """'name', 'name:443', '[::1]:443', '10.0.0.0/8:5432' -> (host part, port or None)."""
    if entry.startswith("["):
        host, sep, rest = entry[1:].partition("]")
        if not sep:
            raise RuleError(f"{entry!r}: missing ']'")
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise RuleError(f"{entry!r}: expected ':PORT' after ']'")
        return host, _port(entry, rest[1:])
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, _port(entry, port)
    return entry, None  # a bare IPv6 address or CIDR has several colons and no port


def _port(entry: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise RuleError(f"{entry!r}: the port must be a number from 1 to 65535")
    return int(text)


def normal_name(name: str) -> str:
    """A host name lower-cased without its trailing dot; RuleError unless it is a DNS name."""
    name = name.strip().lower().rstrip(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise RuleError(f"{name!r} is not a host name")
    return name


def parse_address(text: str) -> IPAddress | None:
    """text as an IP address ('[::1]' too), or None when it is a name."""
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


@dataclass(frozen=True)
class NameRule:
    """An exact name or a `*.example.com` wildcard (any depth below it, not the apex)."""

    name: str
    wildcard: bool
    port: int | None

    def matches(self, host: str, port: int) -> bool:
        """Whether this rule allows host:port (host already normalised)."""
        if self.port is not None and self.port != port:
            return False
        if self.wildcard:
            return host.endswith("." + self.name)
        return host == self.name


@dataclass(frozen=True)
class NetRule:
    """An address or CIDR, optionally one port of it."""

    network: IPNetwork
    port: int | None

    def matches(self, address: IPAddress, port: int) -> bool:
        """Whether this rule covers address:port."""
        return (address.version == self.network.version and address in self.network
                and (self.port is None or self.port == port))


def parse_net(entry: str) -> NetRule:
    """'10.0.0.5', '10.0.0.0/8:5432', '[fd00::/8]:443' as a NetRule; RuleError otherwise."""
    host, port = _split_port(entry.strip())
    try:
        network = ipaddress.ip_network(host, strict=False)
    except ValueError:
        raise RuleError(f"{entry!r} is not an address or CIDR (e.g. 10.0.0.5, "
                        "10.0.0.0/8, [fd00::1]:443)") from None
    return NetRule(network, port)


def parse_host_entry(entry: str) -> NameRule | NetRule:
    """One --allow-host entry: a name, `*.name`, or an address/CIDR, each with optional :PORT."""
    host, port = _split_port(entry.strip())
    if parse_address(host) is not None or "/" in host:
        return parse_net(entry)
    wildcard = host.startswith("*.")
    return NameRule(normal_name(host[2:] if wildcard else host), wildcard, port)


def never_reached(address: IPAddress) -> str | None:
    """Why an address is off limits unless granted (loopback, private, ...); None if public."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "loopback"
    if address.is_link_local or address == ipaddress.ip_address("fd00:ec2::254"):
        return "link-local (cloud metadata)"
    if address.is_private or address.is_reserved or address.is_multicast \
            or address.is_unspecified or not address.is_global:
        return "private or reserved"
    return None


@dataclass(frozen=True)
class Refusal:
    """Why a destination is refused, and the setting that would allow it."""

    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.reason}; {self.fix}"


@dataclass
class EgressRules:
    """The network policy the proxy applies for one kernel."""

    mode: str = "off"
    hosts: list[NameRule | NetRule] = field(default_factory=list)
    grants: list[NetRule] = field(default_factory=list)

    @classmethod
    def parse(cls, mode: str, allow_hosts: list[str], allow_addresses: list[str]
              ) -> EgressRules:
        """Rules from the policy's settings; RuleError names the entry it cannot read."""
        if mode not in MODES:
            raise RuleError(f"network {mode!r}: choose one of {', '.join(MODES)}")
        return cls(mode, [parse_host_entry(entry) for entry in allow_hosts],
                   [parse_net(entry) for entry in allow_addresses])

    def check_name(self, host: str, port: int) -> Refusal | None:
        """Whether the policy lets user code ask for host:port (before resolving it)."""
        if self.mode == "off":
            return Refusal(f"{host}:{port}: the network is off",
                           "start the kernel with --network hosts --allow-host NAME")
        if self.mode == "on":
            return None
        address = parse_address(host)
        if address is not None and (refusal := self.check_address(host, address, port)):
            return refusal  # the address is the reason, not the list
        for rule in self.hosts:
            if isinstance(rule, NameRule) and address is None and rule.matches(host, port):
                return None
            if isinstance(rule, NetRule) and address is not None \
                    and rule.matches(address, port):
                return None
        entry = f"[{host}]" if address is not None and address.version == 6 else host
        return Refusal(f"{host}:{port} is not on the allowlist",
                       f"allow it with --allow-host {entry} (or {entry}:{port})")

    def check_address(self, host: str, address: IPAddress, port: int) -> Refusal | None:
        """Whether the proxy may connect to address:port (what host resolved to)."""
        why = never_reached(address)
        if why is None or any(grant.matches(address, port) for grant in self.grants):
            return None
        shown = f"[{address}]" if address.version == 6 else str(address)
        where = f"{host} resolves to {shown}" if str(address) != host.strip("[]") else shown
        return Refusal(f"{where}, a {why} address the sandbox never reaches",
                       f"grant it with --allow-address {shown}:{port} (only for a service "
                       "meant for user code)")


@dataclass(frozen=True)
class Upstream:
    """A proxy the egress proxy chains to (host, port, optional basic credentials)."""

    host: str
    port: int
    authorization: str | None = None

    @classmethod
    def parse(cls, url: str) -> Upstream:
        """'http://[user:pass@]host:port' as an Upstream; ValueError when it is not one."""
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream proxy {url!r}: expected http://HOST:PORT")
        authorization = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            authorization = "Basic " + base64.b64encode(pair.encode()).decode()
        return cls(parts.hostname, parts.port or 3128, authorization)
