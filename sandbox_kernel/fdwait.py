"""Waiting for a descriptor to become readable, whatever its number.

select.select refuses descriptors numbered 1024 or more (FD_SETSIZE): a service holding about a
hundred sessions passes that, and its waits failed with "filedescriptor out of range in
select()". poll has no such limit (and the kernel's seccomp allowlist permits it).
"""

from __future__ import annotations

import select
from typing import Any


def readable(fd: Any, timeout: float | None) -> bool:
    """Whether fd (a number or an object with fileno()) is readable, or has hung up, within
    timeout seconds (None: wait as long as it takes)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))
