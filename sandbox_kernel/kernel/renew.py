"""What a forked process makes again of the IPython shell its parent built: per process parts.

A shell built once (by a fork server for its kernels to adopt, kernel/prebuilt.py; by a pool's
zygote for its one-shot processes, kernel/oneshot.py and kernel/lean.py) holds directories,
namespaces, a history and hooks that belong to the process that runs code in it. `renew` makes
them again; the shell's classes, magics and hooks stay as built. A mixin over IPython's
InteractiveShell, with no ipykernel import: the lean one-shot shell has none.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell as _Shell
else:
    _Shell = object  # a mixin: the shell class it is mixed into is InteractiveShell


class Renewable(_Shell):
    """InteractiveShell mixin: make again the parts of a shell that are per process."""

    def renew(self, profile_dir: Any = None, user_module: Any = None,
              user_ns: Any = None, history: str = "new") -> None:
        """Make again every part of this shell that is per process: IPython and profile dirs,
        working and home dirs, compiler, environment, namespaces and sys.modules['__main__'],
        history, %store's database, the logger, builtins, prompts, display hook (a one-shot
        kernel forked from the process that built its shell calls this too, kernel/oneshot.py).

        history "new": a manager of its own; "reset": the one this shell has, cleared and on a
        new session (a one-shot kernel's: in memory, made by its zygote, which stores nothing).
        """
        server_parts = list(self.configurables)
        server_history, server_hook = self.history_manager, self.displayhook
        self.init_ipython_dir(None)
        self.init_profile_dir(profile_dir)
        self.init_instance_attrs()  # compiler, cwd, temporary files
        self.init_environment()
        self.init_create_namespaces(user_module, user_ns)
        self.save_sys_module_state()
        self.init_sys_modules()
        if history == "reset":
            self.history_manager.reset(new_session=True)  # type: ignore[union-attr]
        else:
            self.init_history()
        self.init_encoding()
        self.init_pushd_popd_magic()  # home and directory stack
        self._renew_store_and_logger()
        self.init_user_ns()
        self.init_builtins()
        self.Completer.namespace = self.user_ns
        self.Completer.global_namespace = self.user_global_ns
        self.sys_excepthook = sys.excepthook
        self.init_prompts()
        self.init_displayhook()  # its _, __, ___ go into the new namespace
        made_again = {id(server_history): self.history_manager, id(server_hook): self.displayhook}
        self.configurables = [made_again.get(id(part), part) for part in server_parts]

    def _renew_store_and_logger(self) -> None:
        """%store's database and %logstart's logger, from the profile and home dirs made
        again: an IPython that builds them on first use (9.18: `_db`, `_logger`) builds them
        there; an eager one (8.x, 9.8) built them where this shell was built."""
        if hasattr(self, "_db"):
            self._db = None
        else:
            self.db = type(self.db)(os.path.join(self.profile_dir.location, "db"))  # type: ignore[union-attr]
        if hasattr(self, "_logger"):
            self._logger = None
        else:
            self.init_logger()  # type: ignore[attr-defined]  # an eager IPython's only
