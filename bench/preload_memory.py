"""`python -m bench.preload_memory RUNTIME`: what each preload set's one-shot pool costs in memory.

For the lean set and each set a run of the import mix is given (launch/imports.py's choice for
`import jinja2`, `import requests`, `import numpy`, `import pandas`, `import matplotlib.pyplot`),
a pool of --size one-shot kernels is had from the fork server of the runtime's Python and that
set, and the memory of the server, the pool's zygote and its waiting processes is read from
/proc/PID/smaps_rollup: RSS, PSS (shared pages split between their sharers) and USS (pages of the
process alone). What a set's pool adds to the machine is its processes' USS plus the pages they
share only among themselves: the sum of their PSS (the other processes of the machine share none
of a server's preloaded pages). Each server is stopped afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from sandbox_kernel.launch.forkserver import ForkServerClient
from sandbox_kernel.launch.forkserver.zygote import NAME as ZYGOTE_NAME
from sandbox_kernel.launch.imports import PreloadSets
from sandbox_kernel.launch.oneshot import OneShotPool
from sandbox_kernel.policy import SandboxPolicy
from sandbox_kernel.runtimes import find

NODES = {"nothing": "def main():\n    return {'a': 1}\n", "jinja2": "import jinja2",
         "requests": "import requests", "numpy": "import numpy", "pandas": "import pandas",
         "matplotlib.pyplot": "import matplotlib.pyplot"}
RESULTS = Path(__file__).parent / "results" / "preload-memory.md"


def rollup(pid: int) -> dict[str, int]:
    """kB of Rss, Pss and USS (Private_Clean + Private_Dirty) of a process."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            values[name] = int(rest.split()[0])
    return {"rss": values["Rss"], "pss": values["Pss"],
            "uss": values["Private_Clean"] + values["Private_Dirty"]}


def children(pid: int) -> list[int]:
    """The direct children of pid."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def measure(python: str, preload: tuple[str, ...], size: int
            ) -> tuple[float, dict[str, list[dict[str, int]]]]:
    """Have the set's pool, let it fill, read its processes' memory."""
    pool = OneShotPool(SandboxPolicy(), size, python=python, preload=preload)
    started = time.monotonic()
    pool.path = pool.ask()
    server = ForkServerClient(python=python, preload=preload).server_pid()
    assert server is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        kids = children(server)
        zygotes = [pid for pid in kids
                   if Path(f"/proc/{pid}/comm").read_bytes().strip() == ZYGOTE_NAME]
        waiting = [pid for pid in kids if pid not in zygotes]
        if zygotes and len(waiting) >= size:
            break
        time.sleep(0.2)
    ready = time.monotonic() - started
    time.sleep(1.0)  # the waiting processes confined and idle
    parts = {"server": [rollup(server)], "zygote": [rollup(pid) for pid in zygotes],
             "waiting": [rollup(pid) for pid in waiting]}
    ForkServerClient(python=python, preload=preload).stop_server()
    return ready, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runtime")
    parser.add_argument("--size", type=int, default=2, help="one-shot kernels per pool")
    args = parser.parse_args()
    record = find(args.runtime)
    sets = PreloadSets.from_record(record.preload, record.preload_modules)
    chosen: dict[tuple[str, ...], list[str]] = {}
    for node, code in NODES.items():
        chosen.setdefault(sets.choose(code), []).append(node)
    rows = []
    for preload, nodes in chosen.items():
        ready, measured = measure(str(record.python()), preload, args.size)
        total = sum(part["pss"] for parts in measured.values() for part in parts)

        def one(key: str, what: str, measured: dict = measured) -> int:
            return measured[key][0][what] // 1024 if measured[key] else 0
        rows.append(f"| {', '.join(nodes)} | {', '.join(preload) or '(lean)'} | "
                    f"{one('server', 'rss')} / {one('server', 'uss')} | "
                    f"{one('zygote', 'rss')} / {one('zygote', 'uss')} | "
                    f"{one('waiting', 'rss')} / {one('waiting', 'uss')} | "
                    f"{total // 1024} | {ready:.1f} |")
        print(rows[-1], flush=True)
    load = os.getloadavg()
    text = (f"# One-shot pools per preload set: memory (runtime {args.runtime}, "
            f"{len(record.preload)} preloaded modules, pool size {args.size})\n\n"
            f"`python -m bench.preload_memory {args.runtime}`, {time.strftime('%Y-%m-%d')}, "
            f"load average {load[0]:.1f}, Python {sys.version.split()[0]}. MB; RSS / USS per "
            "process; total = the PSS of the server, its zygote and the waiting processes "
            "(what the pool adds to the machine).\n\n"
            "| nodes | preload set | server RSS / USS | zygote RSS / USS | each waiting RSS / "
            "USS | pool total PSS | ready in s |\n|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
