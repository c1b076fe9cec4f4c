"""Whether an address is this host's own, asked of the host's routing tables at each connection.

A global address on an interface (a VM's public IPv4, a cloud's IPv6) passes every range rule,
and a connection to it reaches whatever the host serves on 0.0.0.0. So the proxy asks the
kernel, over netlink, what `ip route get ADDRESS` asks (RTM_GETROUTE): the route connect()
would take. A route of type local, broadcast or anycast ends on this host: that covers every
address of every interface in both families, and addresses routed to the host as a whole
(`ip route add local 203.0.113.0/24 dev lo`), which a list of interface addresses would miss.
Asked for each connection (a few system calls), the answer follows interfaces and addresses as
they come and go; a list read at start would not. Written with the socket module: the netlink
libraries (pyroute2) are large for one request and one reply.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import socket
import struct

RTM_NEWROUTE, RTM_GETROUTE = 24, 26
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 0x2
RTA_DST = 1
RTN_LOCAL, RTN_BROADCAST, RTN_ANYCAST = 2, 3, 4
_HOST_TYPES = (RTN_LOCAL, RTN_BROADCAST, RTN_ANYCAST)
# No route at all (or a route that refuses): connect() would not reach the host either.
_NO_ROUTE = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EACCES, errno.EPERM, errno.EINVAL)
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_ROUTE = struct.Struct("=BBBBBBBBI")  # struct rtmsg; rtm_type is its 8th byte
_sequence = itertools.count(1)


def is_own(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a connection to address ends on this host; OSError when the host cannot say."""
    return route_type(address) in _HOST_TYPES


def route_type(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> int | None:
    """The type (RTN_*) of the route to address; None when there is no route to it."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    packed = address.packed
    body = (_ROUTE.pack(family, 8 * len(packed), 0, 0, 0, 0, 0, 0, 0)
            + struct.pack("=HH", 4 + len(packed), RTA_DST) + packed)
    sequence = next(_sequence) & 0xFFFFFFFF
    request = _HEADER.pack(_HEADER.size + len(body), RTM_GETROUTE, NLM_F_REQUEST, sequence, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       socket.NETLINK_ROUTE) as sock:
        sock.settimeout(2.0)
        sock.sendto(request + body, (0, 0))
        while True:
            reply = sock.recv(65536)
            if len(reply) < _HEADER.size + 4:
                raise OSError(errno.EPROTO, "short netlink reply")
            _length, kind, _flags, answered, _pid = _HEADER.unpack_from(reply)
            if answered == sequence:
                break
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", reply, _HEADER.size)[0]
        if code in _NO_ROUTE:
            return None
        raise OSError(code, f"route lookup: {errno.errorcode.get(code, code)}")
    if kind != RTM_NEWROUTE or len(reply) < _HEADER.size + _ROUTE.size:
        raise OSError(errno.EPROTO, f"unexpected netlink reply type {kind}")
    return reply[_HEADER.size + 7]
