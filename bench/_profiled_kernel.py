"""Start a kernel under cProfile and write its start-up profile to fd 2 as one JSON line.

Usage: python -I _profiled_kernel.py MODULE -f CONNECTION_FILE [kernel options]
The profile covers everything from interpreter start-up to the application's start(), i.e. the
imports, initialize() and every sandbox layer; the kernel then serves as usual.
"""

import cProfile
import json
import os
import pstats
import runpy
import sys
import time

MARKER = "BENCH-PROFILE "
_MIN_SECONDS = 0.0001  # functions and calls under 0.1 ms are noise for a start of hundreds of ms


def _emit(profile: cProfile.Profile, started: float, log: int) -> None:
    profile.disable()
    functions = [
        [path, line, name, own, cumulative,
         [[*caller, edge[3]] for caller, edge in callers.items() if edge[3] >= _MIN_SECONDS]]
        for (path, line, name), (_cc, _nc, own, cumulative, callers)
        in pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
        if cumulative >= _MIN_SECONDS
    ]
    blob = json.dumps({"seconds": time.perf_counter() - started, "functions": functions})
    with os.fdopen(log, "wb") as stream:
        stream.write(f"{MARKER}{blob}\n".encode())


def main() -> None:
    """Profile the named kernel module until its application starts serving."""
    started = time.perf_counter()
    # A copy of the launcher's stderr: ipykernel later points fd 2 itself at the frontend.
    log = os.dup(2)
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # bench's modules must not shadow anything the kernel imports
    module = sys.argv[1]
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    profile = cProfile.Profile()
    profile.enable()
    from ipykernel.kernelapp import IPKernelApp

    serve = IPKernelApp.start

    def start(self: IPKernelApp) -> None:
        _emit(profile, started, log)
        serve(self)

    IPKernelApp.start = start  # type: ignore[method-assign]  # subclasses reach it via super()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
