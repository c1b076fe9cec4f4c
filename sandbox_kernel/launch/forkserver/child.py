"""What every child of the fork server does first, before it is a kernel of its own.

A ZMQ kernel (server.py, forked per request) and a pooled one-shot kernel (zygote.py, forked
from a pool's zygote) both start from a process that imported everything once: each makes
its random state its own and forgets what preloaded modules derived from the server's
environment. Both sides import this module; neither imports the other's privates.
"""

from __future__ import annotations

import sys


def reseed() -> None:
    """What user code can observe of the server's random state: made per kernel."""
    import random
    import tempfile

    random.seed()
    tempfile.tempdir = None
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def forget_environment() -> None:
    """Drop what preloaded modules derived from the server's environment at import time."""
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is not None:  # its config and cache dirs: the kernel's scratch, not the server's
        for name, fmt in (("get_configdir", "CONFIGDIR=%s"), ("get_cachedir", "CACHEDIR=%s")):
            uncached = getattr(matplotlib, name).__wrapped__
            setattr(matplotlib, name, matplotlib._logged_cached(fmt)(uncached))
