"""Snapshot and restore of a session's state: time and size for numpy and pandas state.

For each size (1 MB, 100 MB, 1 GB by default) and kind (a numpy array; a pandas DataFrame of
float columns), a fresh kernel builds the state, `Sandbox.snapshot()` takes it (inside the kernel,
then read and sealed by the caller) and a second fresh kernel `restore()`s it; the restored
state is checked equal. Timed on the caller's side, kernel start-up excluded. Beside them: the
kernel's resident memory just before it closes (all of it goes back when it ends: a paused
session holds the snapshot's bytes on disk instead), and E2B's published figures (~4 s per GiB
to pause, ~1 s to resume).

    python -m bench.snapshot [--sizes 1M,100M,1G] [--kinds numpy,pandas] [--out FILE]
    python -m bench.snapshot --serializers   # the measurement behind kernel/snapshot.py's choice

The 1 GB rows run in kernels with --memory-limit 6G and --max-result 128M (a snapshot moves in
chunks of at most 64 MiB, each as a main() result within --max-result; at the default 16 MiB
the chunks are 12 MiB). Absolute times drift with the machine's load: compare rows of one run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from sandbox_kernel.client import Sandbox
from sandbox_kernel.policy import SandboxPolicy

SIZES = {"1M": 2**20, "100M": 100 * 2**20, "1G": 2**30}
E2B = "~4 s/GiB pause, ~1 s resume (E2B's published figures)"
BUILD = {
    "numpy": "import numpy as np\nstate = np.random.default_rng(0).random({n} // 8)",
    "pandas": ("import numpy as np, pandas as pd\n"
               "state = pd.DataFrame(np.random.default_rng(0).random(({n} // 64, 8)), "
               "columns=list('abcdefgh'))"),
}
CHECK = {
    "numpy": "bool((state == np.random.default_rng(0).random({n} // 8)).all())",
    "pandas": ("state.equals(pd.DataFrame(np.random.default_rng(0).random(({n} // 64, 8)), "
               "columns=list('abcdefgh')))"),
}


def _policy(size: int) -> SandboxPolicy:
    memory = max(2 * 2**30, 6 * size)
    return SandboxPolicy(memory_limit=memory, max_result_bytes=128 * 2**20)


def _resident(sandbox: Sandbox) -> int:
    """The kernel process's resident bytes (VmRSS)."""
    pid = sandbox.manager.provisioner.pid
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _ok(execution):
    if execution.error is not None:
        raise RuntimeError(f"{execution.error.name}: {execution.error.value}")
    return execution


def row(kind: str, label: str) -> dict[str, float | int | str]:
    """Snapshot and restore of `kind` state of size `label`: seconds, bytes, memory."""
    size = SIZES[label]
    with Sandbox(None, policy=_policy(size)) as source:
        _ok(source.run(BUILD[kind].format(n=size)))
        started = time.perf_counter()
        taken = source.snapshot(max_size=0)
        pause = time.perf_counter() - started
        resident = _resident(source)
    with Sandbox(None, policy=_policy(size)) as target:
        started = time.perf_counter()
        target.restore(taken)
        resume = time.perf_counter() - started
        if _ok(target.run(CHECK[kind].format(n=size))).text != "True":
            raise RuntimeError(f"the restored {kind} state differs")
    gib = len(taken.data) / 2**30
    return {"kind": kind, "size": label, "bytes": len(taken.data), "pause": pause,
            "resume": resume, "pause_per_gib": pause / gib, "resident": resident}


def copy_seconds(size: int = 2**30) -> float:
    """Seconds this machine takes to fill and copy size bytes once (bytearray, then bytes):
    the yardstick a row's time is read against on a machine shared with other work."""
    started = time.perf_counter()
    bytes(bytearray(size))
    return time.perf_counter() - started


def table(rows: list[dict[str, float | int | str]], copy: float) -> str:
    """The rows as a markdown table, with the machine's own copy time beside them."""
    lines = ["| state | snapshot bytes | snapshot (pause) s | s per GiB | restore (resume) s "
             "| kernel RSS given back at close |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} {r['size']} | {r['bytes']:,} | {r['pause']:.3f} "
                     f"| {r['pause_per_gib']:.2f} | {r['resume']:.3f} "
                     f"| {int(r['resident']) / 2**20:,.0f} MiB |")
    lines.append(f"| reference: allocate and copy 1 GiB once in the caller, this run | "
                 f"| {copy:.3f} | {copy:.2f} | | |")
    lines.append("| E2B (published) | | | ~4 | ~1 | |")
    return "\n".join(lines)


SESSION = """
import numpy as np, pandas as pd
from sklearn.linear_model import LogisticRegression
rng = np.random.default_rng(0)
array = rng.random(100 * 2**20 // 8)
frame = pd.DataFrame(rng.random((2**20, 4)), columns=list("abcd"))
frame["label"] = pd.Categorical(rng.choice(["x", "y", "z"], 2**20))
model = LogisticRegression(max_iter=200).fit(rng.random((2000, 8)), rng.integers(0, 2, 2000))
def make_adder(n):
    return lambda x: x + n
class Point:
    def __init__(self, x):
        self.x = x
values = {"array": array, "frame": frame, "model": model, "closure": make_adder(5),
          "instance": Point(3), "records": [{"i": i, "s": str(i)} for i in range(100_000)]}
"""


def _dumps_with(name: str):
    import pickle

    def out_of_band(value):
        buffers: list = []
        return module.dumps(value, protocol=5, buffer_callback=buffers.append), buffers

    module = pickle if name == "pickle" else __import__(name)
    return out_of_band


def serializers(repeat: int = 3) -> str:
    """Median seconds to pickle (protocol 5, out-of-band buffers) each value, per library;
    "fails" where the library cannot (pickle: what the session defined in __main__)."""
    import importlib.util
    import pickle
    import statistics
    import types

    session = types.ModuleType("__main__")  # as in a kernel: the session's names live here
    exec(compile(SESSION, "<session>", "exec"), session.__dict__)
    values = session.__dict__["values"]
    names = [name for name in ("cloudpickle", "dill", "pickle")
             if importlib.util.find_spec(name) is not None]
    lines = ["| value | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, value in values.items():
        cells = []
        for name in names:
            dumps = _dumps_with(name)
            try:
                times = []
                for _ in range(repeat):
                    started = time.perf_counter()
                    stream, buffers = dumps(value)
                    pickle.loads(stream, buffers=buffers)  # noqa: S301  (our own objects)
                    times.append(time.perf_counter() - started)
                cells.append(f"{statistics.median(times) * 1000:.1f} ms")
            except Exception as exc:
                cells.append(f"fails ({type(exc).__name__})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the rows and print (and with --out write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,100M,1G")
    parser.add_argument("--kinds", default="numpy,pandas")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serializers", action="store_true",
                        help="time cloudpickle, dill and pickle on session values instead")
    args = parser.parse_args(argv)
    if args.serializers:
        print(serializers())
        return
    copy = copy_seconds()
    rows = [row(kind, label) for label in args.sizes.split(",")
            for kind in args.kinds.split(",")]
    text = table(rows, copy)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
