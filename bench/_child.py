"""One request of the process-per-request model: filter this process, call main(), print JSON.

Started as `python -I _child.py` with {"code": ..., "inputs": {...}} on stdin; it loads the same
seccomp filter the kernel loads before running the request's code.
"""

import json
import os
import sys

from sandbox_kernel.confine import seccomp


def serve() -> None:
    """Read the request, confine this process, run main(**inputs), write its result."""
    request = json.load(sys.stdin)
    seccomp.install(os.getpid(), allow_network=False)
    namespace: dict = {}
    exec(compile(request["code"], "<request>", "exec"), namespace)
    json.dump(namespace["main"](**request["inputs"]), sys.stdout)


if __name__ == "__main__":
    serve()
