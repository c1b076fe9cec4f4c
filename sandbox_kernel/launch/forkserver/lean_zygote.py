"""A pool's lean zygote: started fresh by the fork server, it forks lean one-shot processes.

The kernel-based zygote is forked from the fork server and so holds everything the server
imported (ipykernel, ZMQ, jupyter_client, the egress proxy's libraries: ~45 MB that each pooled
process pays for in copy-on-write faults and in its exit). The lean one (kernel/lean.py) cannot
be forked from there: the server forks, then this process is exec'd, `python -I -m
sandbox_kernel.launch.forkserver.lean_zygote`, and imports only what its processes need.

What the forked zygote inherits, this one is handed: the control socket (fd CONTROL_FD), the
pool's listener (LISTENER_FD), the companion's registry (REGISTRY_FD), fd 2 the server's log,
and, as the control socket's first message, the pool's argv and environment, the server's uid,
its preload (the modules a preload-set pool's code imports, launch/imports.py) and the seccomp
programs it compiled (seccomp.handover: this image never loads libseccomp). It then does what
the server does for its children once (the confinement's inputs precomputed: the interpreter's
paths, accounts) and serves zygote.py's protocol unchanged.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import socket
import sys
from typing import Any

from sandbox_kernel.confine import seccomp

from . import zygote

CONTROL_FD, LISTENER_FD, REGISTRY_FD = 3, 4, 5
MODULE = __name__


def main() -> None:
    """Read the pool's spec, prepare, import the preload, then serve as a zygote."""
    control = socket.socket(fileno=CONTROL_FD)
    listener = socket.socket(fileno=LISTENER_FD)
    try:
        spec = json.loads(control.recv(1 << 20))
        argv, env, server_uid = list(spec["argv"]), dict(spec["env"]), int(spec["server_uid"])
        preload = list(spec.get("preload", ()))
        programs = dict(spec["seccomp"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _say(f"no pool spec on the control socket: {exc}")
        os._exit(1)
    sys.modules["debugpy"] = None  # type: ignore[assignment]  # as in the server: refused
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            _say(f"cannot preload {name}: {exc}")
            os._exit(1)
    try:
        prepare(programs)
    except (ValueError, KeyError, TypeError) as exc:
        _say(f"the pool spec's seccomp programs cannot be loaded: {exc}")
        os._exit(1)
    from sandbox_kernel.kernel import lean

    zygote.serve(control, listener, REGISTRY_FD, argv, env, server_uid, build=lean.build)


# What every pooled process's start imports (zygote.py's _become_pooled, IPython's logger when
# the shell is renewed): imported once here, not in each process.
POOLED_IMPORTS = ("sandbox_kernel.confine.companion", "sandbox_kernel.confine.environment",
                  "sandbox_kernel.launch.forkserver.child", "IPython.core.logger")


def prepare(seccomp_programs: dict[str, Any]) -> None:
    """Policy-independent work every pooled process would repeat, done once (as the fork
    server's `prepare` does for its children): its imports, interpreter paths, accounts, and
    the seccomp programs the server compiled taken as this process's (seccomp.adopt)."""
    from sandbox_kernel.confine import paths, privileges

    for name in POOLED_IMPORTS:
        importlib.import_module(name)
    paths.interpreter_paths()
    privileges.prepare()
    seccomp.adopt(seccomp_programs)
    if os.geteuid() == 0:
        # The bounding set only limits what an execve could gain: this process never execs,
        # and each it forks inherits the empty set and checks it in one read (privileges.plan;
        # SECURITY.md). Where root may not drop it, each process tries and refuses as before.
        with contextlib.suppress(privileges.PrivilegeError):
            privileges.drop_bounding_set()


def exec_in_child(control: socket.socket, listener: socket.socket, registry: int) -> None:
    """In the server's forked child: put the three descriptors at their numbers (every other
    one closes on exec: Python makes descriptors non-inheritable) and become a lean zygote."""
    # Above the targets first: a descriptor at a target's number would be overwritten.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
             for fd in (control.fileno(), listener.fileno(), registry)]
    for target, fd in zip((CONTROL_FD, LISTENER_FD, REGISTRY_FD), moved, strict=True):
        os.dup2(fd, target)  # inheritable
    os.execv(sys.executable, [sys.executable, "-I", "-m", MODULE])  # noqa: S606  # ours


def send_spec(control: socket.socket, argv: list[str], env: dict[str, str],
              preload: list[str]) -> None:
    """In the server: the pool's spec, the lean zygote's first message (~35 kB, most of it the
    seccomp programs the server compiled in its `prepare`)."""
    control.send(json.dumps({"argv": argv, "env": env, "server_uid": os.getuid(),
                             "preload": preload, "seccomp": seccomp.handover()}).encode())


def _say(line: str) -> None:
    try:
        os.write(2, f"sandbox-kernel lean zygote: {line}\n".encode())
    except OSError:
        pass


if __name__ == "__main__":
    main()
