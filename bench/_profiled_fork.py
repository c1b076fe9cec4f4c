"""Profile what a fork-served kernel does after the fork, up to serving; print it as JSON.

Usage: python -I _profiled_fork.py. A fork server (in this process, no socket traffic) imports
what it always imports; a forked child then runs `become_kernel` with a connection file of its
own, under cProfile, until the application's initialize() returns; it writes the profile to a
descriptor opened before the sandbox closed everything else, and exits without serving.
"""

import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # bench's modules must not shadow anything the kernel imports

from jupyter_client.connect import write_connection_file

import sandbox_kernel.kernel.app
from sandbox_kernel.launch.forkserver import Server

_MIN_SECONDS = 0.0001
_MAX_FUNCTIONS = 120  # the costliest, cumulatively: the relay passes 64 KiB at once
_PIECE = 1500  # characters of the profile per line


MARKER = "BENCH-PROFILE "


def _profiled_main(argv: list[str] | None = None) -> None:
    log = os.dup(2)  # the pipe to the reaper, before ipykernel puts a capture pipe on fd 2
    started = time.perf_counter()
    profile = cProfile.Profile()
    app = sandbox_kernel.kernel.app.SandboxKernelApp.instance()
    profile.enable()
    app.initialize(argv)
    profile.disable()
    functions = [[path, line, name, own, cumulative, []]
                 for (path, line, name), (_cc, _nc, own, cumulative, _callers)
                 in pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
                 if cumulative >= _MIN_SECONDS]
    functions.sort(key=lambda entry: -entry[4])
    blob = json.dumps({"seconds": time.perf_counter() - started,
                       "functions": functions[:_MAX_FUNCTIONS]})
    # fd 2 reaches the launcher through the reaper, which relays lines of at most 2 KiB
    # (docs/SECURITY.md, "The launcher's stdio"): the profile goes out in numbered pieces.
    pieces = [blob[i:i + _PIECE] for i in range(0, len(blob), _PIECE)]
    with os.fdopen(log, "wb") as stream:
        for number, piece in enumerate(pieces):
            stream.write(f"\n{MARKER}{number} {len(pieces)} {piece}\n".encode())
    os._exit(0)


def marked_lines(server: Server, directory: str, name: str, marker: str,
                 in_child: Callable[[], None] = lambda: None) -> list[str]:
    """Fork one kernel from server (its stderr a pipe to us) and return, once it has exited,
    what follows the marker on each line it wrote (the reaper relays whole lines)."""
    connection, _ = write_connection_file(os.path.join(directory, f"{name}.json"),
                                          ip="127.0.0.1", key=b"bench")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        in_child()
        os.close(read_end)
        server.become_kernel(["-f", connection], {}, [0, 1, write_end])  # the pipe as stderr
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 1 << 16):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    text = b"".join(chunks).decode(errors="replace")
    # The relay may put a prefix before the marker.
    return [line.split(marker, 1)[1] for line in text.splitlines() if marker in line]


def run() -> None:
    """Fork one profiled kernel and print its profile."""
    directory = tempfile.mkdtemp()
    server = Server(os.path.join(directory, "server.sock"))
    server.prepare()
    server.bind()
    sandbox_kernel.kernel.app.main = _profiled_main
    pieces = {}
    for line in marked_lines(server, directory, "kernel", MARKER):
        number, total, piece = line.split(" ", 2)
        pieces[int(number)] = piece
    if pieces and len(pieces) == int(total):
        print("".join(pieces[number] for number in range(len(pieces))))


if __name__ == "__main__":
    run()
