"""Which paths user code may read and write: the input of the Landlock layer."""

from __future__ import annotations

import functools
import importlib.machinery
import os
import pwd
import stat
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from .landlock import existing

# What the interpreter, the C libraries and the scientific stack read at run time. Optional:
# whichever exist on this host are granted read-only. Not /etc as a whole (shadow, ssh keys),
# not /etc/ssl or /etc/pki as a whole (private keys, readable by a uid-0 kernel as their owner),
# not /proc as a whole (other processes), not /sys/fs/cgroup.
SYSTEM_READ_ONLY = (
    "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/opt/conda",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/timezone", "/etc/ssl/certs", "/etc/ssl/openssl.cnf", "/etc/ca-certificates",
    "/etc/pki/tls/certs", "/etc/pki/ca-trust", "/etc/pki/tls/openssl.cnf", "/etc/fonts",
    "/etc/matplotlibrc", "/etc/mime.types", "/etc/nsswitch.conf", "/etc/hosts",
    "/etc/resolv.conf", "/etc/gai.conf", "/etc/host.conf", "/etc/services", "/etc/protocols",
    "/etc/os-release", "/etc/passwd", "/etc/group", "/etc/locale.alias", "/etc/xdg",
    "/dev/urandom", "/dev/random", "/dev/zero",
    "/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/loadavg", "/proc/version",
    "/proc/sys/kernel/osrelease", "/proc/sys/vm/overcommit_memory",
    "/sys/devices/system/cpu",
)
SYSTEM_READ_WRITE = ("/dev/null", "/dev/full")
# Where runtimes live (runtimes/store.py): $SANDBOX_KERNEL_RUNTIMES, else this data directory of
# the environment, which is inside its prefix (granted whole). Each runtime there keeps the
# operator's requirements file (an index URL with its token) and record; a kernel may read only
# its own runtime's build, never the rest (`hidden_runtimes`).
RUNTIMES_VAR = "SANDBOX_KERNEL_RUNTIMES"
RUNTIMES_DATA = os.path.join("share", "sandbox-kernel", "runtimes")


def interpreter_paths() -> list[str]:
    """The running interpreter's prefixes, stdlib, site-packages and import path.

    Worked out once per process (some 200 realpath calls): the kernel asks twice, and the fork
    server asks once, after its imports, for all its kernels (sys.path is inherited as it is).
    """
    return list(_interpreter_paths())


@functools.cache
def _interpreter_paths() -> tuple[str, ...]:
    candidates = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))]
    candidates += [value for key, value in sysconfig.get_paths().items() if key != "scripts"]
    roots = [os.path.realpath(p) for p in candidates]
    candidates += import_path_grants([entry for entry in sys.path if entry], roots)
    candidates += editable_finder_paths()
    candidates += site_hook_files()
    return tuple(existing(dict.fromkeys(os.path.realpath(p) for p in candidates)))


def site_hook_files() -> list[str]:
    """The sitecustomize/usercustomize the interpreter ran at start, where they are links:
    Debian's /usr/lib/python3.X/sitecustomize.py is one into /etc/python3.X. The folder of
    the link is granted, its target (made real with the rest) is not, and whatever reads a
    loaded module's source (autoreload, inspect, tracebacks) was refused it."""
    files = (getattr(sys.modules.get(name), "__file__", None)
             for name in ("sitecustomize", "usercustomize"))
    return [file for file in files if isinstance(file, str) and os.path.islink(file)]


def _inside(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def import_path_grants(entries: Iterable[str], roots: Iterable[str]) -> list[str]:
    """What to grant for each sys.path entry: the entry, or only its packages and modules.

    An entry outside the interpreter's own directories was added by a .pth file, which is how
    an editable install (hatchling, flit, setuptools' compat mode) exposes a source checkout:
    granting the entry would hand user code the whole checkout (.git, .env). Its importable
    children are what imports need.
    """
    roots = list(roots)
    grants: list[str] = []
    for entry in entries:
        real = os.path.realpath(entry)
        if _inside(real, roots) or not os.path.isdir(real):
            grants.append(real)
        else:
            grants += importable_children(real)
    return grants


def importable_children(directory: str) -> list[str]:
    """The packages (with __init__.py) and modules directly in directory; no dot-files."""
    suffixes = tuple(importlib.machinery.all_suffixes())
    found = []
    for entry in os.scandir(directory):
        name = entry.name
        if name.startswith(".") or not name.partition(".")[0].isidentifier():
            continue
        package = entry.is_dir() and os.path.isfile(os.path.join(entry.path, "__init__.py"))
        if package or (entry.is_file() and name.endswith(suffixes)):
            found.append(entry.path)
    return sorted(found)


def editable_finder_paths() -> list[str]:
    """Package directories mapped by setuptools' editable finders (not on sys.path at all)."""
    paths = []
    for finder in sys.meta_path:
        module = sys.modules.get(getattr(finder, "__module__", "") or "")
        mapping = getattr(module, "MAPPING", None)
        if module is not None and module.__name__.startswith("__editable__") \
                and isinstance(mapping, dict):
            paths += [str(path) for path in mapping.values()]
    return paths


def own_proc_dir() -> str:
    """/proc/<pid> of this process (what /proc/self and /proc/thread-self resolve into)."""
    return f"/proc/{os.getpid()}"


def hidden_runtimes() -> list[str]:
    """The runtime stores a kernel must not read: each prefix's data directory of runtimes,
    $SANDBOX_KERNEL_RUNTIMES, and the store of the runtime this interpreter is a build of
    (<store>/<name>/builds/<N>): the kernel keeps its own build, granted as its prefix."""
    candidates = [os.path.join(prefix, RUNTIMES_DATA) for prefix in
                  (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)]
    candidates += [os.environ.get(RUNTIMES_VAR) or ""]
    build = Path(os.path.realpath(sys.prefix))
    if build.parent.name == "builds" and (build.parent.parent / "runtime.json").is_file():
        candidates.append(str(build.parents[2]))
    return list(dict.fromkeys(os.path.realpath(path) for path in candidates
                              if path and os.path.isdir(path)))


# Configuration inside the system and interpreter grants that no kernel needs and operators put
# credentials in: pip's (an index URL with its token), npm's, Jupyter's config and kernelspecs.
HIDDEN_SYSTEM = ("/etc/xdg/pip", "/usr/local/etc", "/usr/local/share/jupyter",
                 "/usr/share/jupyter", "/etc/jupyter")
HIDDEN_IN_PREFIX = ("pip.conf", os.path.join("etc", "pip.conf"), os.path.join("etc", "jupyter"),
                    os.path.join("share", "jupyter"))


def hidden_configs() -> list[str]:
    """pip's, npm's and Jupyter's configuration below the grants: never granted to a kernel.

    pip reads its site configuration from /etc/xdg/pip and the interpreter's prefix, and
    finds it unreadable as if it were absent; Jupyter's config and kernelspecs are read by
    the launcher, never by the kernel it started.
    """
    prefixes = dict.fromkeys((sys.prefix, sys.base_prefix, sys.exec_prefix,
                              sys.base_exec_prefix))
    candidates = [*HIDDEN_SYSTEM, *(os.path.join(prefix, name) for prefix in prefixes
                                    for name in HIDDEN_IN_PREFIX)]
    return list(dict.fromkeys(os.path.realpath(path) for path in candidates
                              if os.path.lexists(path)))


def around(grants: Iterable[str], hidden: Iterable[str]) -> list[str]:
    """The grants with the hidden directories left out.

    Landlock only adds rights: a grant of a directory covers everything below it, and nothing
    inside can be taken back. So a grant holding a hidden directory is replaced by its
    children, down the path to the hidden one, every sibling granted whole. Symbolic links
    among them are left out (access through one is checked on its target, which is granted
    where it was before). Grants inside a hidden directory (the kernel's own build) stay.
    """
    hidden = [path.rstrip("/") or "/" for path in hidden]

    def holds(directory: str, path: str) -> bool:
        return path == directory or path.startswith(directory.rstrip("/") + "/")

    def split(directory: str) -> list[str]:
        if directory in hidden:
            return []
        kept: list[str] = []
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_symlink():
                    continue
                if any(holds(entry.path, path) for path in hidden):
                    kept += split(entry.path)
                else:
                    kept.append(entry.path)
        return kept

    result: list[str] = []
    for grant in grants:
        if any(holds(grant, path) for path in hidden):
            result += split(grant)
        else:
            result.append(grant)
    return result


def read_only(extra: Iterable[str], *connection_files: str) -> list[str]:
    """Everything granted read-only: system, interpreter (without the runtime stores beside
    the kernel's own build, nor pip's and Jupyter's configuration), this process's /proc,
    the connection file (a one-shot kernel has none), grants."""
    granted = [*system_read_only(), own_proc_dir(), *map(os.path.realpath, connection_files),
               *extra]
    return list(dict.fromkeys(granted))


def system_read_only() -> list[str]:
    """The system's and the interpreter's read-only grants, the hidden directories left out.

    Worked out once per import path and runtime store, as interpreter_paths is: a pool's
    zygote works it out for every one-shot kernel it forks (it lists directories: ~1 ms).
    """
    return list(_system_read_only(tuple(sys.path), os.environ.get(RUNTIMES_VAR, "")))


@functools.cache
def _system_read_only(search_path: tuple[str, ...], runtimes: str) -> tuple[str, ...]:
    # Keyed by what its inputs read: sys.path (interpreter_paths) and $SANDBOX_KERNEL_RUNTIMES.
    return tuple(around([*existing(SYSTEM_READ_ONLY), *interpreter_paths()],
                        [*hidden_runtimes(), *hidden_configs()]))


def read_write(extra: Iterable[str], scratch_dir: str) -> list[str]:
    """Everything granted read-write: the scratch, /dev/null, grants."""
    return list(dict.fromkeys([scratch_dir, *existing(SYSTEM_READ_WRITE), *extra]))


class GrantError(ValueError):
    """A grant that cannot be granted as named; the message names it and the fix."""


def check_grants(paths: Iterable[str], flag: str = "granted path") -> list[str]:
    """The policy's grants as absolute paths without `..`, each checked to exist and to reach
    its file through no symbolic link (flag: the option that names them, for the errors).

    A missing grant is a FileNotFoundError naming it; one that is or passes through a link
    is a GrantError. A link is refused rather than followed: whoever may change it (user
    code of an earlier kernel with a write grant above it, another user of a shared folder)
    would choose what the next kernel grants. The kernel checks again as it adds the
    Landlock rule (landlock.LandlockRules.exact), so a link swapped in since is refused too.
    """
    return [_real_grant(path, flag) for path in paths]


def _real_grant(path: str, flag: str) -> str:
    # getcwd() is the physical working directory: a relative grant adds only its own parts.
    absolute = os.path.join(os.getcwd(), os.path.expanduser(path))
    current = "/"
    for part in absolute.split("/"):
        if part in ("", "."):
            continue
        if part == "..":  # no link so far: the named parent is the real one
            if not os.path.isdir(current):
                raise FileNotFoundError(f"granted path does not exist: {path}")
            current = os.path.dirname(current)
            continue
        current = os.path.join(current, part)
        try:
            is_link = stat.S_ISLNK(os.lstat(current).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"granted path does not exist: {path}") from None
        except OSError as exc:
            raise GrantError(f"{flag} {path} cannot be reached: {exc.strerror} at {current}; "
                             "make it reachable, or grant another path") from None
        if is_link:
            raise GrantError(_link_refusal(path, absolute, current, flag))
    return current


def _link_refusal(path: str, absolute: str, link: str, flag: str) -> str:
    where = "is" if os.path.normpath(absolute) == link else "passes through"
    try:
        target = os.readlink(link)
    except OSError:  # changed meanwhile
        target = "?"
    return (f"{flag} {path} {where} the symbolic link {link} (-> {target}): a "
            "grant must name the real path, or whoever may change the link chooses what user "
            f"code reaches; grant {os.path.realpath(absolute)} instead, if that is what you mean")


CWD_MODES = {"ro": "read-only", "rw": "read-write"}


def cwd_refusal(folder: str, connection_file: str, audit_log: str = "") -> str | None:
    """Why the folder a kernel started in must not be granted to it; None when it may be.

    Landlock grants a folder with everything below it: a folder that holds Jupyter's runtime
    directory (the server's token, other kernels' keys) or the operator's audit log would hand
    those over, and `/` would hand over the whole host.
    """
    if not folder:
        return "the kernel was started in a folder that no longer exists"
    real = os.path.realpath(folder)
    if real == "/":
        return "the kernel was started in /, and granting it would grant the whole host"
    kept = {"Jupyter's runtime directory (the connection files of every kernel)":
            os.path.dirname(os.path.realpath(connection_file)),
            "the home directory of the user who started it (keys, tokens, Jupyter's files)":
            _launching_users_home()}
    if audit_log:
        kept["the audit log"] = os.path.realpath(audit_log)
    for what, path in kept.items():
        if _inside(path, [real]):
            return f"the folder {real} holds {what}, which user code must never see"
    return None


def cwd_not_granted(mode: str, refused: str) -> str:
    """Why a kernel that --grant-cwd asked to start in a folder is refused to its caller.

    A notebook's kernel starts without the grant and explains each refused open; a run that
    asked for the folder is refused instead, since its reads would fail and its writes land
    in a scratch that is removed.
    """
    return (f"--grant-cwd={mode} could not grant the folder the run started in: {refused}; "
            "start it from a folder that holds only the data it needs, or grant files by "
            "absolute path with --read-path (--write-path to write)")


def _launching_users_home() -> str:
    """The home of the uid that started the kernel (HOME is the scratch by now)."""
    try:
        return os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        return "/"  # no account: nothing is inside "/" but "/" itself, refused above


def describe_grants(read: Iterable[str], write: Iterable[str], cwd: str = "",
                    cwd_mode: str = "", cwd_refused: str = "") -> list[str]:
    """What user code may reach besides the system and the interpreter, one line each."""
    granted_cwd = bool(cwd_mode and not cwd_refused)
    lines = [f"scratch ({'' if granted_cwd else 'working directory, '}HOME and temp, removed "
             "with the kernel): read-write"]
    if granted_cwd and cwd:
        lines.append(f"{cwd} (the folder the kernel started in, its working directory: "
                     f"relative paths resolve there): {CWD_MODES[cwd_mode]}")
    elif cwd_mode and not cwd_refused:  # said before a kernel starts (check)
        lines.append("the folder the kernel starts in (the notebook's folder under Jupyter), "
                     f"its working directory: {CWD_MODES[cwd_mode]}")
    elif cwd_mode:
        lines.append(f"the folder the kernel started in: NOT granted ({cwd_refused}); "
                     "relative paths resolve in the scratch")
    lines += [f"{path}: read-only" for path in read]
    lines += [f"{path}: read-write" for path in write]
    return lines
