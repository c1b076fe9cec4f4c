"""Where a lean one-shot process's CPU goes, part by part, straight from its zygote (no service).

Usage: python -I -m bench.lean_parts [RUNS] [--network]. This process becomes a pool's lean
zygote as launch/forkserver/lean_zygote.py makes one (the same preparation and build: a small
image; bench's own imports are a few stdlib modules; the seccomp programs compiled in a
short-lived process, as a fork server hands them over), with a companion of its own
(confine/companion.py). For each of RUNS (default 200) it forks a pooled process that runs
zygote.py's `_become_pooled` exactly as a pool's does (every layer, one request), connects to
it as a caller, sends a Dify-shaped main() request and reads the answer. Each part of the child
is timed inside it (CPU: time.process_time; minor faults: getrusage), wrapped here before the
forks; the child adds its figures into memory it shares with this process (a few stores: no
message of its own, nothing serialized), up to its `os._exit`. Its exit and teardown: the
child's whole CPU (wait4's rusage) minus what it measured until then. Medians are printed, as
JSON with --json.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # bench's modules must not shadow anything the kernel imports

from sandbox_kernel.confine import companion, environment, sequence
from sandbox_kernel.kernel import lean, lean_shell, messages, oneshot_io
from sandbox_kernel.kernel import oneshot_wire as wire
from sandbox_kernel.launch.forkserver import child, lean_zygote, zygote

CODE = "def main(a: int, b: int) -> dict:\n    return {'result': a + b}\n"
FORK_RETURN = "the fork's return in the child"
UNTIL_ANSWER = "child until the answer"
FINISH = "the answer's end (streams, written files, done)"
EXIT = "exit and teardown (whole CPU after os._exit)"
WHOLE = "whole child (wait4)"
# The child's figures, in memory shared with this process: per label (WRAPPED's, then the
# child's own marks) its CPU seconds, minor faults and when it first ended (for the order).
SLOT = struct.Struct("ddq")
SHARED = mmap.mmap(-1, 1 << 16)
IMPORTED_AT = 1 << 15  # where the child writes the names of modules it imported (JSON)
LABELS: list[str] = []
ZYGOTE_MODULES = [0]  # how many modules the zygote had imported: the child reports the rest
# What the child's parts are, in order: (owner, attribute, label).
WRAPPED = (
    (environment, "prepare", "prepare (scratch, companion channel, fds)"),
    (companion, "register", "  of which: the companion's channel"),
    (child, "forget_environment", "forget the environment"),
    (child, "reseed", "reseed"),
    (sequence.Confinement, "open_audit", "audit file"),
    (sequence.Confinement, "apply_identity", "identity"),
    (sequence.Confinement, "apply_network", "network namespace"),
    (sequence.Confinement, "check_promises", "promises"),
    (sequence.Confinement, "apply_landlock", "Landlock"),
    (sequence.Confinement, "before_threads", "before_threads (all of the above but prepare)"),
    (oneshot_io, "capture_fds", "capture fds"),
    (lean_shell, "make_profile_dir", "  of which: the profile dir"),
    (lean.LeanOneShot, "renew", "renew (ids, shell, profile dir)"),
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


def _slot(label: str) -> int:
    if label not in LABELS:
        LABELS.append(label)
    return LABELS.index(label) * SLOT.size


def _add(slot: int, cpu: float, faults: int) -> None:
    """In the child: add to a label's figures (its first end numbers its place)."""
    was_cpu, was_faults, order = SLOT.unpack_from(SHARED, slot)
    if not order:
        order = SHARED[IMPORTED_AT - 1] = SHARED[IMPORTED_AT - 1] + 1
    SLOT.pack_into(SHARED, slot, was_cpu + cpu, was_faults + faults, order)


def _wrap(owner: Any, name: str, label: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)
    is_async = name == "execute"
    slot, first = _slot(label), _slot(FORK_RETURN)

    if is_async:
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = _sample()
            try:
                return await original(*args, **kwargs)
            finally:
                cpu, faults = _sample()
                _add(slot, cpu - start[0], faults - start[1])
        setattr(owner, name, timed_async)
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = _sample()
        if not SLOT.unpack_from(SHARED, first)[2]:  # the child's first part: since the fork
            _add(first, *start)
        try:
            return original(*args, **kwargs)
        finally:
            cpu, faults = _sample()
            _add(slot, cpu - start[0], faults - start[1])
    if isinstance(owner, type) and isinstance(vars(owner).get(name), staticmethod):
        setattr(owner, name, staticmethod(timed))
    elif isinstance(owner, type) and isinstance(vars(owner).get(name), classmethod):
        setattr(owner, name, classmethod(lambda cls, *a, **k: timed(*a, **k)))
    else:
        setattr(owner, name, timed)


def _mark_the_end() -> None:
    """In the child: the figures when the answer is complete (finish_run's start), and at
    os._exit (after the streams' rest, the written files and DONE); the modules imported."""
    finish, real_exit = oneshot_io.finish_run, os._exit
    until, end = _slot(UNTIL_ANSWER), _slot(FINISH)

    def reporting(channel: Any, conn: Any, request: Any) -> Any:
        _add(until, *_sample())
        if len(sys.modules) != ZYGOTE_MODULES[0]:  # new names come last in sys.modules
            names = json.dumps(list(sys.modules)[ZYGOTE_MODULES[0]:]).encode()[:IMPORTED_AT]
            SHARED[IMPORTED_AT:IMPORTED_AT + len(names)] = names
        return finish(channel, conn, request)

    def exiting(code: int) -> Any:
        _add(end, *_sample())
        real_exit(code)
    oneshot_io.finish_run = reporting  # type: ignore[assignment]
    os._exit = exiting  # type: ignore[assignment]


def _child_parts() -> tuple[dict[str, list[float]], list[str]]:
    """After the child's exit: its figures by label, in the order their parts first ended,
    and the modules it imported; the shared memory cleared for the next."""
    found = []
    for index, label in enumerate(LABELS):
        cpu, faults, order = SLOT.unpack_from(SHARED, index * SLOT.size)
        if order:
            found.append((order, label, [cpu, faults]))
    end = SHARED.find(b"\0", IMPORTED_AT)
    imported = json.loads(SHARED[IMPORTED_AT:end]) if end > IMPORTED_AT else []
    SHARED[:] = bytes(len(SHARED))
    return {label: figures for _, label, figures in sorted(found)}, imported


def _request() -> bytes:
    msgs = messages.Messages()
    msg = msgs.msg("execute_request", {"code": CODE, "silent": False, "store_history": True,
                                       "user_expressions": {}, "allow_stdin": False,
                                       "stop_on_error": True},
                   metadata={"sandbox": {"inputs": {"a": 1, "b": 2}}})
    return wire.record(wire.REQUEST, wire.pack_frames(messages.serialize(msg)))


def _call(path: str) -> None:
    """Be the caller: connect, send the request, read to DONE."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    conn.sendall(_request())
    records, done = wire.Records(), False
    while not done:
        data = conn.recv(1 << 16)
        if not data:
            break
        done = any(kind == wire.DONE for kind, _ in records.feed(data))
    conn.close()
    if not done:
        raise RuntimeError("the pooled process ended before DONE (see its stderr)")


def _server_programs() -> dict[str, Any]:
    """The seccomp programs a fork server hands its lean zygotes (seccomp.handover), compiled
    in a short-lived process: this one, like a real zygote, never loads libseccomp."""
    code = "import json; from sandbox_kernel.confine import seccomp; " \
           "print(json.dumps(seccomp.handover()))"
    made = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          check=True)
    return json.loads(made.stdout)  # type: ignore[no-any-return]


def run(runs: int, network: bool) -> dict[str, Any]:
    argv = ["--SandboxPolicy.network=on"] if network else []
    env = {name: value for name, value in os.environ.items() if name in ("PATH", "LANG")}
    lean_zygote.prepare(_server_programs())
    process = zygote._build(argv, env, lean.build)
    process.server_pid = os.getpid()  # the forks' parent here: they die with this process
    rss_kb = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    companion_pid, registry = companion.start(lambda: None)
    path = os.path.join(tempfile.mkdtemp(prefix="sandbox-kernel-bench-lean-"), "pool.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    for label in (FORK_RETURN, *(label for _, _, label in WRAPPED), UNTIL_ANSWER, FINISH):
        _slot(label)
    for owner, name, label in WRAPPED:
        _wrap(owner, name, label)
    _mark_the_end()
    ZYGOTE_MODULES[0] = len(sys.modules)
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
            _call(path)
            _, _, usage = os.wait4(pid, 0)
            os.close(taken_read)
            parts, imported = _child_parts()
            if FINISH not in parts:
                raise RuntimeError("the pooled process did not reach os._exit (see its stderr)")
            whole, at_exit = usage.ru_utime + usage.ru_stime, parts[FINISH]
            parts[FINISH] = [at_exit[0] - parts[UNTIL_ANSWER][0],
                             at_exit[1] - parts[UNTIL_ANSWER][1]]
            parts[EXIT] = [whole - at_exit[0], usage.ru_minflt - at_exit[1]]
            parts[WHOLE] = [whole, usage.ru_minflt]
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
