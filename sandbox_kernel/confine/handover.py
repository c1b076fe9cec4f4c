"""The channel from a kernel to its reaper: requests that carry descriptors, before user code.

A SOCK_SEQPACKET socketpair: one message is one JSON request with the descriptors it hands
over (the uid lock to hold; the seccomp listener and audit file to serve), or one asking for
an answer (the certificate of the kernel's CA, made in the reaper). The kernel closes
its end before user code runs, which tells the reaper every handover is done.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

MAX_MESSAGE = 4096
MAX_FDS = 4


def hand_over(channel: int, request: dict[str, Any], fds: list[int]) -> None:
    """Kernel side: send the reaper a request and descriptors it keeps from now on."""
    # The channel's kind given, and the caller's fd borrowed rather than dup'd: no system call
    # but the send (a socket made from a bare fd asks the kernel its family, type and protocol).
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, 0, fileno=channel)
    try:
        socket.send_fds(sock, [json.dumps(request).encode()], fds)
    finally:
        sock.detach()


def ask(channel: int, request: dict[str, Any], limit: int = 16384) -> bytes:
    """Kernel side: send the reaper a request and wait for its one answer (b"" if none)."""
    with socket.socket(fileno=os.dup(channel)) as sock:
        sock.send(json.dumps(request).encode())
        return sock.recv(limit)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Reaper side: the next request and its descriptors; None once the kernel closed its end.

    A request that is not a JSON object reads as {} (its descriptors then get closed).
    """
    try:
        message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    except OSError:
        return None
    if not message:
        return None
    try:
        request = json.loads(message)
    except ValueError:
        request = {}
    return (request if isinstance(request, dict) else {}), fds
