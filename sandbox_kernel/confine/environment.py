"""The kernel's environment: re-execute with an allowlisted one before anything else runs.

Clearing os.environ later would not be enough: /proc/self/environ keeps what the process was
started with, and a Jupyter server hands its own environment (tokens, cloud keys) to kernels.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import reaper, scratch, vault
from .limits import DEFAULT_MEMORY_LIMIT, parse_size

SCRATCH_VAR = "SANDBOX_KERNEL_SCRATCH"
REAPER_VAR = "SANDBOX_KERNEL_REAPER"  # fd of the channel to the reaper (see reaper.py)
# fd of a pipe on which the kernel tells its launcher that its sockets listen (then closes it)
READY_VAR = "SANDBOX_KERNEL_READY"
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# Passed through when set: locale and time zone, what ipykernel reads from its launcher, and
# numerical-library settings some hosts need for correct results (never credentials).
PASSED_THROUGH = (
    "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_TIME", "LC_COLLATE",
    "LC_MONETARY", "LC_MESSAGES", "TZ", "JPY_PARENT_PID", "JPY_SESSION_NAME",
    "JPY_INTERRUPT_EVENT", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS",
)

# What the dynamic loader, libc or the interpreter act on when a process starts (glibc's list of
# variables it ignores in setuid programs, Python's, OpenSSL's module loading) and this package's
# own: refused in --env and --pass-env unless the operator says --allow-loader-env.
LOADER_PREFIXES = ("LD_", "PYTHON", "MALLOC_", "GLIBC_", "SANDBOX_KERNEL_", "OPENSSL_")
LOADER_NAMES = ("GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
                "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR")
ALLOW_LOADER_FLAG = "--allow-loader-env"

_ALLOW_LOADER_OPTIONS = (ALLOW_LOADER_FLAG, "--SandboxPolicy.allow_loader_env")
_PASS_OPTIONS = ("--SandboxPolicy.pass_env", "--pass-env")
_SIZE_OPTIONS = ("--SandboxPolicy.scratch_size", "--scratch-size")
_FILES_OPTIONS = ("--SandboxPolicy.scratch_files", "--scratch-files")
_MEMORY_OPTIONS = ("--SandboxPolicy.memory_limit", "--memory-limit")


def _option_values(argv: Sequence[str], names: Sequence[str]) -> list[str]:
    """Values of `--name=value` and `--name value` options, in order."""
    values = []
    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if name in names:
            if sep:
                values.append(value)
            elif i + 1 < len(argv):
                values.append(argv[i + 1])
    return values


def acts_on_start(name: str) -> bool:
    """Whether the dynamic loader, libc or the interpreter act on this variable at start-up."""
    return name.upper().startswith(LOADER_PREFIXES) or name.upper() in LOADER_NAMES


def refused_names(env: Mapping[str, str], pass_env: Sequence[str],
                  allow_loader_env: bool) -> str | None:
    """Why a policy's --env / --pass-env cannot be used, naming the flag that allows it; or None."""
    if allow_loader_env:
        return None
    names = sorted({name for name in [*env, *pass_env] if acts_on_start(name)})
    if not names:
        return None
    return (f"--env/--pass-env {', '.join(names)}: the dynamic loader or the interpreter acts on "
            f"{'this variable' if len(names) == 1 else 'these variables'}; to set "
            f"{'it' if len(names) == 1 else 'them'} for user code anyway, add "
            f"{ALLOW_LOADER_FLAG}")


def _loader_env_allowed(argv: Sequence[str]) -> bool:
    values = _option_values(argv, _ALLOW_LOADER_OPTIONS[1:])
    return ALLOW_LOADER_FLAG in argv or (bool(values) and values[-1].lower() == "true")


def inherited(argv: Sequence[str], current: Mapping[str, str]) -> dict[str, str]:
    """What a kernel takes from its launcher's environment: PASSED_THROUGH and --pass-env names.

    The fork server's clients send no more than this (launch/forkserver/client.py): whatever
    else a launcher holds (API keys, tokens) must never be in a kernel's memory, not even in
    the request that asked for the kernel.
    """
    passed = list(PASSED_THROUGH) + [
        name for name in _option_values(argv, _PASS_OPTIONS)
        if not acts_on_start(name) or _loader_env_allowed(argv)]
    return {name: current[name] for name in passed if name in current}


def allowed(scratch_dir: str, argv: Sequence[str], current: Mapping[str, str]) -> dict[str, str]:
    """The kernel's environment before it is confined: the allowlist, --pass-env, the scratch.

    Not the policy's --env: those values are user code's, set by apply_policy_env once it is
    confined, never in the environment of the unconfined start-up (which runs as root).
    """
    env = {
        "PATH": SAFE_PATH,
        "LANG": "C.UTF-8",
        "HOME": scratch_dir,
        "TMPDIR": scratch_dir,
        "IPYTHONDIR": os.path.join(scratch_dir, ".ipython"),
        "MPLCONFIGDIR": os.path.join(scratch_dir, ".config", "matplotlib"),
        "XDG_CACHE_HOME": os.path.join(scratch_dir, ".cache"),
        "XDG_CONFIG_HOME": os.path.join(scratch_dir, ".config"),
    }
    env.update(inherited(argv, current))
    env[SCRATCH_VAR] = scratch_dir
    for name in (REAPER_VAR, READY_VAR):
        if name in current:
            env[name] = current[name]
    return env


def apply_policy_env(env: Mapping[str, str]) -> None:
    """Set the policy's --env for user code: call only once the process is confined."""
    os.environ.update(env)


def ensure_clean(argv: Sequence[str]) -> str:
    """Return the scratch dir once the environment is exactly the allowed one; else re-exec."""
    current = os.environ.get(SCRATCH_VAR, "")
    if scratch.is_own(current) and dict(os.environ) == allowed(current, argv, os.environ):
        return current
    env = prepare(argv, os.environ)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("unreachable: execve returned")


def scratch_bounds(argv: Sequence[str]) -> tuple[int, int]:
    """The scratch tmpfs's size and file count the kernel's argv asks for (or their defaults)."""
    def last(names: Sequence[str], default: int, parse: Any = parse_size) -> int:
        values = _option_values(argv, names)
        return int(parse(values[-1])) if values else default

    memory = last(_MEMORY_OPTIONS, DEFAULT_MEMORY_LIMIT)
    size = scratch.planned_size(last(_SIZE_OPTIONS, scratch.AUTO_SIZE, _size_or_auto), memory)
    return size, last(_FILES_OPTIONS, scratch.DEFAULT_SCRATCH_FILES, int)


def kernel_name(argv: Sequence[str]) -> str:
    """The kernel's id as Jupyter named it (its connection file's name), else its pid.

    The same id as the audit record's (kernel/app.py kernel_id): the reaper marks the kernel's
    log lines with it.
    """
    files = _option_values(argv, ("-f", "--f", "--IPKernelApp.connection_file"))
    name = os.path.splitext(os.path.basename(files[-1]))[0] if files else ""
    return name.removeprefix("kernel-") or str(os.getpid())


def _size_or_auto(text: str) -> int:
    return scratch.AUTO_SIZE if text.strip() == str(scratch.AUTO_SIZE) else parse_size(text)


def ready_pipe(current: Mapping[str, str]) -> int | None:
    """The launcher's ready pipe (READY_VAR names its write end), if it gave one."""
    text = current.get(READY_VAR, "")
    if not text.isdigit():
        return None
    try:
        is_pipe = stat.S_ISFIFO(os.fstat(int(text)).st_mode)
    except OSError:
        return None
    return int(text) if is_pipe and int(text) > 2 else None


def prepare(argv: Sequence[str], current: Mapping[str, str],
            companion: Callable[[str], int] | None = None,
            kept: Sequence[int] = ()) -> dict[str, str]:
    """Scratch, its reaper and quota, no inherited descriptors: the kernel's environment.

    Shared by the re-exec above and the fork server's children (launch/forkserver/server.py).
    The launcher's ready pipe (READY_VAR) is the one inherited descriptor kept: the kernel
    writes to it and closes it once its sockets listen, before any user code runs (kernel/app.py).
    The launcher's vault (vault.VAULT_VAR) goes to the reaper, unread, and is closed here.
    A one-shot kernel registers with its server's companion instead of forking a reaper:
    companion(scratch_dir) returns the channel; kept: its other descriptors (pool listener...).
    """
    ready = ready_pipe(current)
    sealed = vault.inherited(current)  # handed on unread to the reaper, closed here below
    scratch_dir = scratch.create()
    # From here on fds 0-2 are no longer the launcher's.
    keep = reaper.start(scratch_dir, kernel_name(argv), sealed) if companion is None \
        else companion(scratch_dir)
    scratch.mount_quota(scratch_dir, *scratch_bounds(argv))
    # Descriptors the launcher let us inherit (open files, sockets) are not for user code.
    low = 3
    for fd in sorted({keep, ready or keep, *kept}):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 65536)
    env = allowed(scratch_dir, argv, {k: v for k, v in current.items() if k != READY_VAR})
    env[REAPER_VAR] = str(keep)
    if ready is not None:
        env[READY_VAR] = str(ready)
    return env


PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                   "all_proxy", "PIP_PROXY")


def proxy_variables(url: str) -> dict[str, str]:
    """What points HTTP clients at the egress proxy (requests, httpx, urllib, pip, aiohttp with
    trust_env, curl), and no bypass list: nothing else is reachable from the namespace."""
    return {**dict.fromkeys(PROXY_VARIABLES, url), "NO_PROXY": "", "no_proxy": ""}
