"""libc through ctypes, loaded once per image: the layers' calls looked up once.

A fork server or a zygote calls `prepare`, so each process it forks finds every function
already made (a CDLL keeps each function object it made on first lookup): loading libc and
making a function per call cost each pooled process page faults and time for nothing.
"""

from __future__ import annotations

import ctypes
import functools

CALLS = ("mount", "unshare", "prctl", "syscall", "mallopt")  # what the layers call


@functools.cache
def libc() -> ctypes.CDLL:
    """This process's libc, errno kept for ctypes.get_errno."""
    return ctypes.CDLL(None, use_errno=True)


def prepare() -> None:
    """In a fork server or a zygote: libc loaded and the layers' functions made."""
    for name in CALLS:
        getattr(libc(), name)
