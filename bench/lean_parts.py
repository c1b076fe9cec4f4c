"""Where a lean one-shot process's CPU goes, part by part, straight from its zygote (no service).

Usage: python -I -m bench.lean_parts [RUNS] [--network]. This process becomes a pool's lean
zygote as launch/forkserver/lean_zygote.py makes one (the same preparation and build: a small
image; bench's own imports are a few stdlib modules), with a companion of its own
(confine/companion.py). For each of RUNS (default 200) it forks a pooled process that runs
zygote.py's `_become_pooled` exactly as a pool's does (every layer, one request), connects to
it as a caller, sends a Dify-shaped main() request and reads the answer. Each part of the child
is timed inside it (CPU: time.process_time; minor faults: getrusage), wrapped here before the
forks, and the child reports its parts as a line of its stdout. Its exit and teardown: the
child's whole CPU (wait4's rusage) minus what it measured. Medians are printed, as JSON with
--json.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # bench's modules must not shadow anything the kernel imports

from sandbox_kernel.confine import companion, environment, sequence
from sandbox_kernel.kernel import lean, messages, oneshot_io
from sandbox_kernel.kernel import oneshot_wire as wire
from sandbox_kernel.launch.forkserver import child, lean_zygote, zygote

MARKER = "BENCH-PARTS "
CODE = "def main(a: int, b: int) -> dict:\n    return {'result': a + b}\n"
PARTS: dict[str, list[float]] = {}  # in the child: label -> [cpu seconds, minor faults]
ZYGOTE_MODULES: set[str] = set()  # what the zygote had imported: the child reports the rest
# What the child's parts are, in order: (owner, attribute, label).
WRAPPED = (
    (environment, "prepare", "prepare (scratch, companion channel, fds)"),
    (companion, "register", "  of which: the companion's channel"),
    (child, "forget_environment", "forget the environment"),
    (child, "reseed", "reseed"),
    (lean.ProfileDir, "create_profile_dir_by_name", "profile dir"),
    (sequence.Confinement, "open_audit", "audit file"),
    (sequence.Confinement, "apply_identity", "identity"),
    (sequence.Confinement, "apply_network", "network namespace"),
    (sequence.Confinement, "check_promises", "promises"),
    (sequence.Confinement, "apply_landlock", "Landlock"),
    (sequence.Confinement, "before_threads", "before_threads (all of the above but prepare)"),
    (oneshot_io, "capture_fds", "capture fds"),
    (lean.LeanOneShot, "renew", "renew (ids, shell)"),
    (sequence.Confinement, "switch_user", "uid switch"),
    (sequence.Confinement, "apply_seccomp", "seccomp"),
    (lean.LeanOneShot, "hand_to_user_code", "hand to user code"),
    (lean.LeanOneShot, "confine", "confine (all layers)"),
    (oneshot_io, "take_connection", "take the connection"),
    (oneshot_io, "receive_request", "read the request"),
    (lean.LeanOneShot, "execute", "execute (messages, runner, cell, main())"),
)


def _sample() -> tuple[float, int]:
    return time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _wrap(owner: Any, name: str, label: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)
    is_async = name == "execute"

    def add(start: tuple[float, int]) -> None:
        cpu, faults = _sample()
        total = PARTS.setdefault(label, [0.0, 0])
        total[0] += cpu - start[0]
        total[1] += faults - start[1]

    if is_async:
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = _sample()
            try:
                return await original(*args, **kwargs)
            finally:
                add(start)
        setattr(owner, name, timed_async)
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = _sample()
        if not PARTS:  # the child's first part: what it spent since the fork
            PARTS["the fork's return in the child"] = [start[0], start[1]]
        try:
            return original(*args, **kwargs)
        finally:
            add(start)
    if isinstance(owner, type) and isinstance(vars(owner).get(name), staticmethod):
        setattr(owner, name, staticmethod(timed))
    elif isinstance(owner, type) and isinstance(vars(owner).get(name), classmethod):
        setattr(owner, name, classmethod(lambda cls, *a, **k: timed(*a, **k)))
    else:
        setattr(owner, name, timed)


def _report_before_finishing() -> None:
    """In the child: its parts as one stdout line of the run, before the run's last records."""
    finish = oneshot_io.finish_run

    def reporting(channel: Any, conn: Any, request: Any) -> Any:
        cpu, faults = _sample()
        PARTS["child until the answer"] = [cpu, faults]
        imported = sorted(set(sys.modules) - ZYGOTE_MODULES)
        sys.stdout.write(MARKER + json.dumps({**PARTS, "imported": imported}) + "\n")
        return finish(channel, conn, request)
    oneshot_io.finish_run = reporting  # type: ignore[assignment]


def _request() -> bytes:
    msgs = messages.Messages()
    msg = msgs.msg("execute_request", {"code": CODE, "silent": False, "store_history": True,
                                       "user_expressions": {}, "allow_stdin": False,
                                       "stop_on_error": True},
                   metadata={"sandbox": {"inputs": {"a": 1, "b": 2}}})
    return wire.record(wire.REQUEST, wire.pack_frames(messages.serialize(msg)))


def _call(path: str) -> dict[str, Any]:
    """Be the caller: connect, send the request, read to DONE; the child's reported parts."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    conn.sendall(_request())
    records, parts, done = wire.Records(), None, False
    while not done:
        data = conn.recv(1 << 16)
        if not data:
            break
        for kind, payload in records.feed(data):
            if kind == wire.MESSAGE:
                _, frames = messages.split_identities(wire.unpack_frames(payload))
                msg = messages.deserialize(frames)
                text = msg["content"].get("text", "") if msg["msg_type"] == "stream" else ""
                for line in text.splitlines():
                    if line.startswith(MARKER):
                        parts = json.loads(line[len(MARKER):])
            done = done or kind == wire.DONE
    conn.close()
    if parts is None:
        raise RuntimeError("the pooled process reported no parts (see its stderr)")
    return parts


def run(runs: int, network: bool) -> dict[str, Any]:
    argv = ["--SandboxPolicy.network=on"] if network else []
    env = {name: value for name, value in os.environ.items() if name in ("PATH", "LANG")}
    lean_zygote.prepare()
    process = zygote._build(argv, env, lean.build)
    process.server_pid = os.getpid()  # the forks' parent here: they die with this process
    rss_kb = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    companion_pid, registry = companion.start(lambda: None)
    path = os.path.join(tempfile.mkdtemp(prefix="sandbox-kernel-bench-lean-"), "pool.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    for owner, name, label in WRAPPED:
        _wrap(owner, name, label)
    _report_before_finishing()
    ZYGOTE_MODULES.update(sys.modules)
    samples: list[dict[str, Any]] = []
    try:
        for _ in range(runs):
            taken_read, taken_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(taken_read)
                zygote._become_pooled(process, listener, registry, taken_write, argv, env,
                                      os.getuid(), [])
            os.close(taken_write)
            parts = _call(path)
            imported = parts.pop("imported")
            _, _, usage = os.wait4(pid, 0)
            os.close(taken_read)
            whole = usage.ru_utime + usage.ru_stime
            parts["exit and teardown (whole CPU minus the measured)"] = [
                whole - parts["child until the answer"][0],
                usage.ru_minflt - parts["child until the answer"][1]]
            parts["whole child (wait4)"] = [whole, usage.ru_minflt]
            samples.append(parts)
    finally:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
        os.kill(companion_pid, 9)
        os.waitpid(companion_pid, 0)
    medians = {label: {"cpu_ms": round(1000 * statistics.median(s[label][0] for s in samples), 3),
                       "minor_faults": statistics.median(s[label][1] for s in samples)}
               for label in samples[0]}
    return {"runs": runs, "network": network, "zygote_rss_kb": rss_kb, "parts": medians,
            "imported_in_the_child": imported}


def main(argv: list[str]) -> None:
    out = sys.__stdout__  # sys.stdout is the zygote's captured stream once it is built
    runs = int(next((arg for arg in argv if arg.isdigit()), "200"))
    result = run(runs, "--network" in argv)
    if "--json" in argv:
        print(json.dumps(result, indent=2), file=out, flush=True)
        return
    print(f"lean one-shot process, {result['runs']} runs, network "
          f"{'on' if result['network'] else 'off'}; zygote RSS {result['zygote_rss_kb']} kB",
          file=out, flush=True)
    print(f"  imported in the child: {', '.join(result['imported_in_the_child']) or 'none'}",
          file=out)
    for label, median in result["parts"].items():
        print(f"  {label:55s} {median['cpu_ms']:8.3f} ms  {median['minor_faults']:7.0f} faults",
              file=out, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
