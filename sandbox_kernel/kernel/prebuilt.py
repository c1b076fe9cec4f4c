"""The IPython shell a fork server builds once, for each of its kernels to adopt.

A fork-served kernel spent ~16 ms of CPU in init_kernel, most of it building ipykernel's
ZMQInteractiveShell: ~30 configurables (prefilter checkers and handlers, formatters, magics,
aliases, completer, traceback printers) that are the same in every kernel and hold no user
state. The server builds that shell in `prepare` (`prebuild_shell`); the first shell a forked
kernel asks for is the server's, adopted: everything per kernel is made again there
(`ZMQInteractiveShell.adopt`): its kernel, config and parent, IPython and profile dirs, working
and home dirs, compiler, environment, namespaces and sys.modules['__main__'], history (a new
in-memory database: no sqlite connection crosses a fork, the server's is closed before any
fork), %store's database and the logger (from those dirs, or on first use), builtins,
prompts, display hook, excepthook, warning filters, atexit handlers. ipykernel then rebinds
the session and IOPub socket of the display hook and publisher as for any shell.

The server's shell never ran code and never became the singleton. A kernel whose configuration
sets anything on a class the shell is made of (--InteractiveShell.*, --PlainTextFormatter.*, a
magics class...) or asks for another compiler builds its own shell, as without a server.

The server's build changes process state outside the shell; all of it is put back
(`_ProcessState`) and what a kernel needs of it is made again by `adopt`. The class keeps
ipykernel's name: libraries tell a notebook from a terminal by `type(get_ipython()).__name__`.
"""

from __future__ import annotations

import atexit
import builtins
import os
import shutil
import sys
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ipykernel import zmqshell
from traitlets import HasTraits

from .renew import Renewable

_MISSING = object()
_SYS_NAMES = ("displayhook", "excepthook", "stdin", "stdout", "stderr", "ps1", "ps2")


@dataclass
class _ProcessState:
    """What building a shell changes outside it, as it was before."""

    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    builtins: dict[str, Any] = field(default_factory=lambda: dict(vars(builtins)))
    main: Any = field(default_factory=lambda: sys.modules.get("__main__", _MISSING))
    sys_attrs: dict[str, Any] = field(
        default_factory=lambda: {name: getattr(sys, name, _MISSING) for name in _SYS_NAMES})
    path: list[str] = field(default_factory=lambda: list(sys.path))
    warning_filters: list[Any] = field(default_factory=lambda: list(warnings.filters))
    cwd: str = field(default_factory=os.getcwd)

    def restore(self) -> None:
        """Put every piece back as it was."""
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        _restore_dict(vars(builtins), self.builtins)
        _restore_item(sys.modules, "__main__", self.main)
        for name, value in self.sys_attrs.items():
            if value is _MISSING:
                if hasattr(sys, name):
                    delattr(sys, name)
            else:
                setattr(sys, name, value)
        sys.path[:] = self.path
        _warning_filters()[:] = self.warning_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]  # drop the cached verdicts
        os.chdir(self.cwd)


def _warning_filters() -> list[Any]:
    """The warnings module's filter list, which it lets callers edit in place."""
    return warnings.filters  # type: ignore[return-value]  # typeshed: a Sequence


def _restore_dict(target: dict[str, Any], saved: dict[str, Any]) -> None:
    """Make target equal saved again, entry by entry (the same dict object stays)."""
    for name in set(target) - set(saved):
        del target[name]
    for name, value in saved.items():
        if target.get(name, _MISSING) is not value:
            target[name] = value


def _restore_item(target: dict[str, Any], name: str, value: Any) -> None:
    if value is _MISSING:
        target.pop(name, None)
    else:
        target[name] = value


@contextmanager
def _exit_handlers_taken() -> Iterator[list[Callable[[], Any]]]:
    """Collect the atexit handlers the shell's objects register, and unregister them after.

    Only bound methods of traitlets objects: a process-wide hook registered on the way (weakref's
    finalizers') stays, as it would after an import.
    """
    taken: list[Callable[[], Any]] = []
    register = atexit.register

    def recorded(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        if isinstance(getattr(func, "__self__", None), HasTraits) and not (args or kwargs):
            taken.append(func)
        return register(func, *args, **kwargs)

    atexit.register = recorded  # type: ignore[assignment]
    try:
        yield taken
    finally:
        atexit.register = register
        for func in taken:
            atexit.unregister(func)


@contextmanager
def _state_restored() -> Iterator[None]:
    saved = _ProcessState()
    try:
        yield
    finally:
        saved.restore()


ADOPTABLE = frozenset({"parent", "profile_dir", "user_module", "user_ns", "kernel",
                       "compiler_class"})  # what IPythonKernel passes to shell_class.instance
REBUILT = frozenset({"HistoryManager", "HistoryAccessor"})  # made per kernel with its config
WARM_PREFIX = "sandbox-kernel-prebuilt-"  # the server's temporary IPython dir, removed
PER_KERNEL = ("user_ns", "user_module", "history_manager", "displayhook", "display_trap",
              "compile", "builtin_trap", "profile_dir")  # made again by adopt


class ZMQInteractiveShell(Renewable, zmqshell.ZMQInteractiveShell):
    """ipykernel's shell; a fork-served kernel adopts the one its server built."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """The server's shell when it is pending and fits these arguments, else a new one."""
        shell = _take(cls, args, kwargs)
        return shell if shell is not None else super().__new__(cls, *args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if vars(self).pop("_adopting", False):
            self.adopt(**kwargs)
        else:
            super().__init__(*args, **kwargs)

    def adopt(self, parent: Any = None, profile_dir: Any = None, user_module: Any = None,
              user_ns: Any = None, kernel: Any = None, compiler_class: Any = None) -> None:
        """Make again, for this kernel, every part of the server's shell that is per kernel."""
        if parent is not None:
            self.parent = parent
            self.config = parent.config  # nothing in it for the shell's classes (_adoptable)
        self.kernel = kernel
        if "IPKernelApp" not in self.config:  # as ZMQInteractiveShell.__init__ (tqdm's probe)
            self.config.IPKernelApp.tqdm = _SERVER_BUILD.tqdm_marker
        self.renew(profile_dir, user_module, user_ns)
        for spec in reversed(_SERVER_BUILD.warning_filters):
            _warning_filters().insert(0, spec)
        warnings._filters_mutated()  # type: ignore[attr-defined]
        for handler in _SERVER_BUILD.exit_handlers:  # atexit_operations, as the build did
            atexit.register(handler)



@dataclass
class _ServerBuild:
    """The shell the server built and what adopting it needs."""

    shell: ZMQInteractiveShell | None = None
    sections: frozenset[str] = frozenset()  # config sections of every class it is made of
    warning_filters: list[Any] = field(default_factory=list)  # what its build added
    tqdm_marker: Any = None
    outcome: str = "no shell built in this process"  # what the first shell asked for got
    built: Callable[[], Any] = lambda: None  # weakly, the shell built (kept or not)
    exit_handlers: list[Callable[[], Any]] = field(default_factory=list)  # its own, taken back
    parts: dict[str, int] = field(default_factory=dict)  # id of each per-kernel part it had


_SERVER_BUILD = _ServerBuild()


def prebuild_shell() -> None:
    """In the fork server: build the shell kernels adopt, leaving no trace outside it.

    Built as IPythonKernel builds it (its compiler class, a profile directory, history in
    memory as SandboxKernelApp.init_kernel configures it), never as the singleton, in a
    temporary IPython dir that is removed; its history database is closed.
    """
    from ipykernel.ipkernel import IPythonKernel
    from IPython.core.profiledir import ProfileDir
    from traitlets.config import Config

    config = Config({"HistoryManager": {"hist_file": ":memory:"}})
    filters_before = list(warnings.filters)
    # mkdtemp, not TemporaryDirectory: its finalizer would register weakref's atexit hook.
    home = tempfile.mkdtemp(prefix=WARM_PREFIX)
    try:
        with _state_restored(), _exit_handlers_taken() as exit_handlers:
            shell = ZMQInteractiveShell(
                config=config, ipython_dir=home, kernel=None,
                profile_dir=ProfileDir(location=os.path.join(home, "profile")),
                compiler_class=IPythonKernel.compiler_class.default_value)
            added = [spec for spec in warnings.filters if spec not in filters_before]
            history = shell.history_manager
            assert history is not None
            # IPython 9 closes its manager; 8 has only the connection to close.
            getattr(history, "close", history.db.close)()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    _SERVER_BUILD.shell = shell
    _SERVER_BUILD.built = weakref.ref(shell)
    _SERVER_BUILD.sections = _config_sections(shell)
    _SERVER_BUILD.warning_filters = added
    _SERVER_BUILD.exit_handlers = exit_handlers  # they hold the shell
    _SERVER_BUILD.parts = {name: id(getattr(shell, name)) for name in PER_KERNEL}
    _SERVER_BUILD.tqdm_marker = config.IPKernelApp.get("tqdm")


def pending() -> ZMQInteractiveShell | None:
    """The server's shell, while no kernel has taken it (tests, the server's checks)."""
    return _SERVER_BUILD.shell


def outcome() -> str:
    """Whether this kernel adopted its server's shell, or why it built its own."""
    return _SERVER_BUILD.outcome


def server_parts(shell: Any) -> list[str]:
    """The per-kernel parts of an adopted shell that are still the server's (none, if sound).

    Compared by id: each new part is made while the server's is still referenced, so a new
    object cannot take an old one's address.
    """
    return [name for name, ident in _SERVER_BUILD.parts.items()
            if id(getattr(shell, name)) == ident]


def left_behind() -> bool:
    """Whether a shell the server built and did not keep is still alive (after gc.collect)."""
    built = _SERVER_BUILD.built()
    return built is not None and built is not _SERVER_BUILD.shell


def discard_prebuilt() -> None:
    """Forget the server's shell (a kernel that will not adopt it; tests)."""
    _SERVER_BUILD.shell = None


def _take(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The server's shell, once, if these are the arguments it can be adopted with."""
    shell, _SERVER_BUILD.shell = _SERVER_BUILD.shell, None
    if shell is None:
        return None
    if type(shell) is not cls or args or not _adoptable(shell, kwargs):
        _SERVER_BUILD.outcome = "built: its configuration or arguments concern the shell"
        return None
    _SERVER_BUILD.outcome = "adopted"
    vars(shell)["_adopting"] = True  # read (and dropped) by ZMQInteractiveShell.__init__
    return shell


def _adoptable(shell: ZMQInteractiveShell, kwargs: dict[str, Any]) -> bool:
    """Whether a kernel asking for a shell with these arguments gets what the server built."""
    if not set(kwargs) <= ADOPTABLE or kwargs.get("compiler_class") is not shell.compiler_class:
        return False
    parent = kwargs.get("parent")
    config = parent.config if parent is not None else {}
    # dict.get: a traitlets Config makes a section for every name it is asked for.
    return not any(dict.get(config, name) for name in _SERVER_BUILD.sections - REBUILT)


def _config_sections(shell: ZMQInteractiveShell) -> frozenset[str]:
    """The names of every configurable class of every object the shell is made of."""
    from traitlets.config import Configurable

    names: set[str] = set()
    seen: set[int] = set()
    todo: list[Any] = [shell]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        names.update(c.__name__ for c in type(obj).__mro__
                     if isinstance(c, type) and issubclass(c, Configurable))
        for value in (*vars(obj).values(), *getattr(obj, "_trait_values", {}).values()):
            items = value.values() if isinstance(value, dict) else (
                value if isinstance(value, (list, tuple, set)) else (value,))
            todo.extend(item for item in items if isinstance(item, Configurable))
    return frozenset(names)
