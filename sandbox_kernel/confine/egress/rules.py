"""What the egress proxy lets through: names on the allowlist, public or granted addresses.

The proxy resolves names itself and checks every address it would connect to, so a name that
resolves (or is rebound) to the host's loopback, a private network, a metadata service or any
address of the host itself (host.py) is refused unless the operator granted that address with
--allow-address. An IPv6 address that carries an IPv4 address (IPv4-mapped, IPv4-compatible,
6to4, NAT64, Teredo) is judged by the IPv4 address inside it too.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from . import host

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


_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_COMPATIBLE = ipaddress.ip_network("::/96")


def embedded_ipv4(address: IPAddress) -> list[tuple[str, ipaddress.IPv4Address]]:
    """The IPv4 addresses an IPv6 address carries, each with the form that carries it."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    found: list[tuple[str, ipaddress.IPv4Address]] = []
    if address.ipv4_mapped is not None:
        found.append(("IPv4-mapped", address.ipv4_mapped))
    if address.sixtofour is not None:
        found.append(("6to4", address.sixtofour))
    if address.teredo is not None:
        found += [("Teredo server", address.teredo[0]), ("Teredo client", address.teredo[1])]
    last32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if any(address in network for network in _NAT64):
        found.append(("NAT64", last32))
    if address in _COMPATIBLE and int(address) > 1:  # not :: and ::1, which are their own
        found.append(("IPv4-compatible", last32))
    return found


def never_reached(address: IPAddress) -> str | None:
    """Why an address is off limits unless granted ('a loopback address', ...); None if public.

    The ranges only, of the address or of an IPv4 address it carries (judged() says which);
    the host's own addresses are host.py's to tell.
    """
    judgement = judged(address, lambda candidate: False)
    return None if judgement is None else judgement[0]


def judged(address: IPAddress, is_own: Callable[[IPAddress], bool] = host.is_own
           ) -> tuple[str, str] | None:
    """(why the address is never reached, the form that carried it or ''); None if it may be.

    Each of the address and the IPv4 addresses it carries is judged by the ranges and by
    whether it is this host's own (asked last, as it costs a lookup).
    """
    candidates = [*embedded_ipv4(address), ("", address)]  # the most telling first
    for form, candidate in candidates:
        why = _range(candidate)
        if why is not None:
            return f"a {why} address", _carried(form, candidate)
    for form, candidate in candidates:
        try:
            own = is_own(candidate)
        except OSError as exc:  # fail closed: an address nobody can place is not reached
            return ("an address that may be this host's (its routes cannot be read: "
                    f"{exc.strerror or exc})", _carried(form, candidate))
        if own:
            return "an address of this host", _carried(form, candidate)
    return None


def _carried(form: str, inner: IPAddress) -> str:
    return f" ({form} of {inner})" if form else ""


def _range(address: IPAddress) -> str | None:
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
    is_own: Callable[[IPAddress], bool] = host.is_own  # whether an address is the host's

    @classmethod
    def parse(cls, mode: str, allow_hosts: list[str], allow_addresses: list[str],
              is_own: Callable[[IPAddress], bool] = host.is_own) -> EgressRules:
        """Rules from the policy's settings; RuleError names the entry it cannot read.

        is_own tells the host's own addresses: the proxy's default asks the host's routes; a
        check made inside a kernel (whose namespace is not the host's) passes its own.
        """
        if mode not in MODES:
            raise RuleError(f"network {mode!r}: choose one of {', '.join(MODES)}")
        return cls(mode, [parse_host_entry(entry) for entry in allow_hosts],
                   [parse_net(entry) for entry in allow_addresses], is_own)

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
        if any(grant.matches(address, port) for grant in self.grants):
            return None  # before the host's routes are asked: a grant needs no lookup
        judgement = judged(address, self.is_own)
        if judgement is None:
            return None
        kind, carried = judgement
        shown = f"[{address}]" if address.version == 6 else str(address)
        where = f"{host} resolves to {shown}" if str(address) != host.strip("[]") else shown
        return Refusal(f"{where}{carried}, {kind} the sandbox never reaches",
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
