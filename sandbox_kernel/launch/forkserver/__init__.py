"""The fork server: kernels forked from a process that has already imported everything.

A cold kernel spends most of its start-up importing IPython, ipykernel, zmq and their friends. The
fork server (server.py) is a long-lived, single-threaded process, one per interpreter and preload
set, that has done those imports once and forks a kernel per request; the launcher's side
(client.py) asks it for one and stands in for the kernel's Popen object; the server's pools of
one-shot kernels are pools.py's (each pool's zygote: zygote.py); protocol.py is what the two
sides share (the runtime directory, the server's key, the framing). docs/SECURITY.md's
fork-server section says what one server's kernels share and what they never receive.
"""

from .client import ForkedKernel, ForkServerClient, request_env, server_env, stdio_fds, stop_servers
from .protocol import (
    DEFAULT_IDLE,
    DEFAULT_MAX_AGE,
    DEFAULT_MAX_FORKS,
    ForkServerError,
    runtime_dir,
    server_key,
    thread_count,
)
from .server import KERNEL_IMPORTS, Server

__all__ = [
    "DEFAULT_IDLE", "DEFAULT_MAX_AGE", "DEFAULT_MAX_FORKS", "KERNEL_IMPORTS", "ForkServerClient",
    "ForkServerError", "ForkedKernel", "Server", "request_env", "runtime_dir", "server_env",
    "server_key", "stdio_fds", "stop_servers", "thread_count",
]
