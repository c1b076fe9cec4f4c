"""Runtimes: virtual environments an operator builds once, that kernels run on.

`sandbox-kernel runtime create NAME -r requirements.txt` builds one. store.py: where runtimes
live and what each records; build.py: the environment itself; in_use.py: which kernels run on
it; manage.py: create, update, remove and the kernelspec `sandbox-NAME`.
"""

from .manage import create, remove, summary, update
from .store import Runtime, RuntimesError, find, kernel_name, names, root

__all__ = ["Runtime", "RuntimesError", "create", "find", "kernel_name", "names", "remove",
           "root", "summary", "update"]
