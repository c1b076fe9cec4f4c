"""IPython's shell classes warmed in the fork server: one throwaway shell, built and undone.

A fork-served kernel builds ipykernel's ZMQInteractiveShell in init_kernel. Much of that build is
first-use work of the process, the same in every kernel: traitlets' per-class trait and default
caches, IPython's lazily imported modules (magics, completer, formatters), compiled patterns and
lexer look-ups. A fork server builds one shell before it forks and discards it; each kernel then
builds its own shell (nothing of the server's is adopted) with that work already done.

Why not hand the server's shell itself to each kernel: it would have to be rebound to the
kernel's config, session, sockets, profile, history and namespaces, and every object it reaches
audited for state one kernel could leave to the next; a warmed build keeps the kernel's shell
exactly what ipykernel makes, with the kernel's own configuration.

Everything the build changes outside the shell is put back (`_ProcessState`): the environment
variables ZMQInteractiveShell.init_environment writes, the names it adds to builtins,
sys.modules['__main__'], sys's hooks, streams and prompts, sys.path, the warning filters, its
atexit handler, the singleton, the profile directory (a temporary one, removed) and the history
database (in memory, closed). After the server's gc.collect() no object of the shell is left.
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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
        warnings.filters[:] = self.warning_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]  # drop the cached verdicts
        os.chdir(self.cwd)


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
def _state_restored() -> Iterator[None]:
    saved = _ProcessState()
    try:
        yield
    finally:
        saved.restore()


def warm_shell() -> weakref.ref[Any]:
    """Build ipykernel's shell once and undo it; a weak reference to check that it is gone.

    Built as IPythonKernel builds it (its shell and compiler classes, a profile directory,
    history in memory as SandboxKernelApp.init_kernel configures it), but never as the
    singleton: no later get_ipython() can find it.
    """
    from ipykernel.ipkernel import IPythonKernel
    from IPython.core.profiledir import ProfileDir
    from traitlets.config import Config

    shell_class: Any = IPythonKernel.shell_class.default_value
    compiler_class = IPythonKernel.compiler_class.default_value
    config = Config({"HistoryManager": {"hist_file": ":memory:"}})
    # mkdtemp, not TemporaryDirectory: its finalizer would register weakref's atexit hook.
    home = tempfile.mkdtemp(prefix="sandbox-kernel-warm-")
    try:
        with _state_restored():
            shell = shell_class(config=config, ipython_dir=home,
                                profile_dir=ProfileDir(location=os.path.join(home, "profile")),
                                compiler_class=compiler_class, kernel=None)
            try:
                shell.history_manager.close()
                atexit.unregister(shell.atexit_operations)
            finally:
                for cls in shell_class.__mro__:
                    if getattr(cls, "_instance", None) is shell:
                        cls._instance = None
            built = weakref.ref(shell)
            del shell
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return built
