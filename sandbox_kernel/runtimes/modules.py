"""What a runtime preloads: the top-level modules of what it installs, each imported once at build.

By default a runtime's fork servers preload every top-level module of the distributions the
runtime installs beyond what every runtime holds (this sandbox and its dependencies, the
installer's seed packages): the names of each distribution's top_level.txt, else the packages
and modules its RECORD installs. Private names (`_x`), test packages and modules that do not
import cleanly are skipped, each with its reason. Every module kept is imported at build time in
a process of the runtime's Python that already holds the kernel's own imports (as a fork server
does), which also measures what importing it loads (other top-level modules) and adds to the
process's resident memory: launch/imports.py groups the modules by what they load, and the
service keeps one pool of one-shot kernels per group a run needs. Importing runs the packages'
code outside any sandbox, as `--preload` always has: they are the operator's own packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..launch.forkserver.client import server_env
from .store import RuntimesError

# Distributions every runtime has for its own sake: never preloaded by default (the kernel's own
# imports are the fork server's anyway).
ALWAYS_THERE = ("sandbox-kernel", "pip", "setuptools", "wheel", "uv")
TESTS = frozenset({"test", "tests", "testing", "conftest"})
IMPORT_TIMEOUT = 300  # s for every candidate's import together

# Run with the runtime's Python (-I): {"modules": {name: distribution}, "skipped": {name: why}}.
_DISCOVER = r"""
import importlib.metadata as md, json, re, sys
always = sys.argv[1:]
def norm(name): return re.sub(r"[-_.]+", "-", name).lower()
dists = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name:
        dists.setdefault(norm(name), dist)
base, todo = set(), [norm(name) for name in always]
while todo:  # what these require, transitively (extras' requirements left out)
    name = todo.pop()
    if name in base or name not in dists:
        continue
    base.add(name)
    for req in dists[name].requires or []:
        if "extra ==" in req.replace('extra==', 'extra =='):
            continue
        found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if found:
            todo.append(norm(found.group(0)))
modules, skipped = {}, {}
for key, dist in sorted(dists.items()):
    if key in base:
        continue
    text = dist.read_text("top_level.txt")
    names = set(text.split()) if text else set()
    if not text:
        for path in dist.files or []:
            parts = path.parts
            if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith(
                    (".dist-info", ".data", ".egg-info", ".pth")):
                continue
            if len(parts) == 1:
                if parts[0].endswith(".py"):
                    names.add(parts[0][:-3])
                elif parts[0].endswith((".so", ".pyd")):
                    names.add(parts[0].split(".")[0])
            elif parts[-1].endswith((".py", ".so")):
                names.add(parts[0])
    for name in sorted(names):
        top = name.replace("/", ".").split(".")[0]
        if not top.isidentifier():
            skipped[top] = "not an importable name"
        elif top.startswith("_"):
            skipped[top] = "a private module"
        elif top in {tests}:
            skipped[top] = "a test package"
        else:
            modules.setdefault(top, dist.metadata["Name"])
print(json.dumps({"modules": modules, "skipped": skipped}))
"""

# Run with the runtime's Python (-I) after discovery: the kernel's imports first (as in a fork
# server), then each module in a child forked from that state: one JSON line per module.
_PROBE = r"""
import importlib, json, os, signal, sys, time
for name in ("ipykernel.kernelapp", "ipykernel.ipkernel", "sandbox_kernel.kernel.app"):
    try:
        importlib.import_module(name)
    except Exception:
        pass
def rss():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0
for name in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        signal.alarm(120)
        before, start, began = set(sys.modules), rss(), time.perf_counter()
        try:
            importlib.import_module(name)
            threads = len(os.listdir("/proc/self/task"))
            loads = sorted({m.split(".")[0] for m in set(sys.modules) - before} | {name})
            out = {"name": name, "loads": loads, "rss_kb": rss() - start,
                   "seconds": round(time.perf_counter() - began, 3), "threads": threads}
        except BaseException as exc:
            out = {"name": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if chunks:
        print(b"".join(chunks).decode(), flush=True)
    else:
        print(json.dumps({"name": name, "error": f"its import ended the process ({status})"}),
              flush=True)
"""


@dataclass
class Module:
    """A preloaded module as measured at build time."""

    loads: list[str] = field(default_factory=list)  # top-level modules importing it loads
    rss_kb: int = 0  # resident memory its import adds to a process holding the kernel


@dataclass
class Preloads:
    """What a build preloads, what each costs, and the installed modules it skips and why."""

    modules: dict[str, Module] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def as_record(self) -> dict[str, object]:
        """The record's fields (runtime.json)."""
        return {"preload": sorted(self.modules),
                "preload_modules": {name: asdict(module)
                                    for name, module in sorted(self.modules.items())},
                "preload_skipped": dict(sorted(self.skipped.items()))}


def _python_json(python: Path, script: str, arguments: list[str], what: str) -> list[dict]:
    """Run script with the runtime's Python in a fork server's environment (one BLAS thread,
    its own matplotlib folder: server_env), each line of JSON it prints."""
    with tempfile.TemporaryDirectory(prefix="sandbox-kernel-preload-") as home:
        try:
            done = subprocess.run([str(python), "-I", "-c", script, *arguments],  # noqa: S603
                                  capture_output=True, text=True, timeout=IMPORT_TIMEOUT,
                                  check=False, stdin=subprocess.DEVNULL,
                                  env=server_env(os.environ, Path(home) / "home"))
        except subprocess.TimeoutExpired:
            raise RuntimesError(f"{what} took longer than {IMPORT_TIMEOUT} s") from None
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimesError(f"{what} failed: {last}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def installed(python: Path) -> tuple[list[str], dict[str, str]]:
    """The top-level modules the runtime's own distributions install, and the names skipped."""
    found = _python_json(python, _DISCOVER.replace("{tests}", repr(sorted(TESTS))),
                         list(ALWAYS_THERE), "listing the modules the runtime installs")[0]
    return sorted(found["modules"]), dict(found["skipped"])


def measure(python: Path, names: list[str], required: bool) -> Preloads:
    """Import each module as a fork server would; a failure is skipped with its reason, or,
    when the operator named the modules (required), fails the build."""
    result = Preloads()
    for row in _python_json(python, _PROBE, names, "importing the modules to preload"):
        name = row["name"]
        why = row.get("error") or (f"its import starts {row['threads'] - 1} thread(s): a fork "
                                   "server must stay single-threaded" if row["threads"] > 1
                                   else "")
        if why and required:
            raise RuntimesError(f"a module to preload does not import in the new environment: "
                                f"{name}: {why}; add its package to the requirements or drop "
                                "it from --preload")
        if why:
            result.skipped[name] = why
        else:
            result.modules[name] = Module(row["loads"], max(0, int(row["rss_kb"])))
    return result


def preloads(python: Path, given: list[str] | None) -> Preloads:
    """What the build at python preloads: the modules given (each must import), or by default
    (given is None) every module it installs that imports cleanly."""
    if given is not None:
        return measure(python, sorted(set(given)), required=True) if given else Preloads()
    names, skipped = installed(python)
    result = measure(python, names, required=False) if names else Preloads()
    result.skipped.update(skipped)
    return result
