"""Row 10: the first import of a runtime's preloaded package, fork-served against cold.

A runtime (runtimes/) is built once, in a temporary directory, from a requirements file naming
the host's pandas; its kernels run on it. A fork-served kernel comes from a server that imported
pandas before forking (the runtime's --preload), so its first `import pandas` finds the module
in sys.modules; a cold kernel imports it from the runtime's read-only files. Timed inside the
kernel (perf_counter around the import), so neither start-up nor the client is in the figure.

    python -m bench.runtime_import [--repeat N]    # prints both medians and their ratio
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from sandbox_kernel.client import Sandbox

ROWS = (("runtime.fork", "11. First `import pandas` in a kernel on a runtime, fork-served "
         "(preloaded)"),
        ("runtime.cold", "11. First `import pandas` in a kernel on a runtime, started cold"))
MODULE = "pandas"
TIMED_IMPORT = (f"import time\nstarted = time.perf_counter()\nimport {MODULE}\n"
                "print(time.perf_counter() - started)")


def build_runtime(base: Path) -> tuple[str, list[str]]:
    """A runtime with the host's pandas, preloading it; its interpreter and preload list."""
    requirements = base / "requirements.txt"
    requirements.write_text(f"{MODULE}=={metadata.version(MODULE)}\n")
    environ = {**os.environ, "SANDBOX_KERNEL_RUNTIMES": str(base / "runtimes")}
    subprocess.run([sys.executable, "-m", "sandbox_kernel", "runtime", "create", "bench",
                    "-r", str(requirements), "--preload", MODULE, "--prefix", str(base)],
                   env=environ, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return str(base / "runtimes" / "bench" / "builds" / "1" / "bin" / "python"), [MODULE]


def first_import(python: str, preload: list[str], cold: bool) -> float:
    """Seconds the first `import pandas` takes in a fresh kernel on the runtime."""
    with Sandbox(None, python=python, preload=() if cold else preload, cold_start=cold) as sb:
        done = sb.run(TIMED_IMPORT)
        if done.error:
            raise RuntimeError(f"{done.error.name}: {done.error.value}")
        return float(done.stdout)


def measure(repeat: int, record: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Alternating fork-served and cold kernels, `repeat` of each after one warm-up each."""
    record = record if record is not None else {"runtime.fork": [], "runtime.cold": []}
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        python, preload = build_runtime(Path(tmp))
        for repetition in range(1 + repeat):  # the first starts the fork server
            for row, cold in (("runtime.fork", False), ("runtime.cold", True)):
                seconds = first_import(python, preload, cold)
                if repetition:
                    record[row].append(seconds)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    record = measure(args.repeat)
    fork, cold = (statistics.median(record[row]) for row, _ in ROWS)
    for (row, label), value in zip(ROWS, (fork, cold), strict=True):
        print(f"{row}\t{value * 1000:.2f} ms\t{label}")
    print(f"fork-served / cold: {fork / cold:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
