"""The kernel's environment: re-execute with an allowlisted one before anything else runs.

Clearing os.environ later would not be enough: /proc/self/environ keeps what the process was
started with, and a Jupyter server hands its own environment (tokens, cloud keys) to kernels.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from . import reaper, scratch
from .limits import parse_size

SCRATCH_VAR = "SANDBOX_KERNEL_SCRATCH"
REAPER_VAR = "SANDBOX_KERNEL_REAPER"  # fd of the channel to the reaper (see reaper.py)
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# Passed through when set: locale and time zone, what ipykernel reads from its launcher, and
# numerical-library settings some hosts need for correct results (never credentials).
PASSED_THROUGH = (
    "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_TIME", "LC_COLLATE",
    "LC_MONETARY", "LC_MESSAGES", "TZ", "JPY_PARENT_PID", "JPY_SESSION_NAME",
    "JPY_INTERRUPT_EVENT", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS",
)

_ENV_OPTIONS = ("--SandboxPolicy.env", "--env")
_PASS_OPTIONS = ("--SandboxPolicy.pass_env", "--pass-env")
_SIZE_OPTIONS = ("--SandboxPolicy.scratch_size", "--scratch-size")


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


def allowed(scratch_dir: str, argv: Sequence[str], current: Mapping[str, str]) -> dict[str, str]:
    """The whole environment user code gets: the allowlist, grants from argv, the scratch."""
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
    passed = list(PASSED_THROUGH) + _option_values(argv, _PASS_OPTIONS)
    env.update({name: current[name] for name in passed if name in current})
    for item in _option_values(argv, _ENV_OPTIONS):
        name, _, value = item.partition("=")
        env[name] = value
    env[SCRATCH_VAR] = scratch_dir
    if REAPER_VAR in current:
        env[REAPER_VAR] = current[REAPER_VAR]
    return env


def ensure_clean(argv: Sequence[str]) -> str:
    """Return the scratch dir once the environment is exactly the allowed one; else re-exec."""
    current = os.environ.get(SCRATCH_VAR, "")
    if scratch.is_own(current) and dict(os.environ) == allowed(current, argv, os.environ):
        return current
    env = prepare(argv, os.environ)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("unreachable: execve returned")


def prepare(argv: Sequence[str], current: Mapping[str, str]) -> dict[str, str]:
    """Scratch, its reaper and quota, no inherited descriptors: the kernel's environment.

    Shared by the re-exec above and the fork server's children (launch/forkserver.py).
    """
    scratch_dir = scratch.create()
    keep = reaper.start(scratch_dir)  # from here on fds 0-2 are no longer the launcher's
    sizes = _option_values(argv, _SIZE_OPTIONS)
    quota = parse_size(sizes[-1]) if sizes else scratch.DEFAULT_SCRATCH_SIZE
    scratch.mount_quota(scratch_dir, quota)
    # Descriptors the launcher let us inherit (open files, sockets) are not for user code.
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)
    env = allowed(scratch_dir, argv, current)
    env[REAPER_VAR] = str(keep)
    return env


PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                   "all_proxy", "PIP_PROXY")


def proxy_variables(url: str) -> dict[str, str]:
    """What points HTTP clients at the egress proxy (requests, httpx, urllib, pip, aiohttp with
    trust_env, curl), and no bypass list: nothing else is reachable from the namespace."""
    return {**dict.fromkeys(PROXY_VARIABLES, url), "NO_PROXY": "", "no_proxy": ""}
