"""What a forking process (the fork server, a pool's zygote) does so its children copy less.

A child copies each page of its parent's heap it writes to (~3 us of CPU a page), and merely
reading a Python object writes its reference count. Work every kernel repeats over objects the
imports left scattered across the heap thus copies a page per object. Done once here, before
the children exist, such work finds its objects on a few pages, or finds its result made.
"""

from __future__ import annotations

import fnmatch
import sys

# IPython's init_code, in every kernel, globs the profile's startup directory for these
# (InteractiveShellApp._run_startup_files); fnmatch compiles a pattern once per process.
STARTUP_PATTERNS = ("*.py", "*.ipy")


def share_kernel_start() -> None:
    """Prepare what each kernel's start repeats alike: see the functions it calls."""
    compact_modules()
    for pattern in STARTUP_PATTERNS:
        fnmatch.filter((), pattern)  # compiled and cached here, for every child


def compact_modules() -> None:
    """What every kernel reads of every loaded module, laid out next to each other."""
    compact_module_names()
    compact_module_files()


def compact_module_files() -> None:
    """Give each module a __file__ string laid out next to the others.

    ipykernel's IPythonKernel.__init__, in every kernel, lists the __file__ of every module
    (for its debugger, which the sandbox refuses), writing the reference count of each: ~900
    paths the imports left on as many pages. The new strings are equal, and a module's code
    objects keep their own file names.
    """
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if type(path) is str:
            try:
                module.__file__ = (path + ".")[:-1]  # a new str: str(path) and path[:] are path
            except (AttributeError, TypeError):  # a module object that refuses it
                continue


def compact_module_names() -> None:
    """Give sys.modules keys laid out next to each other.

    IPython's init_code ends with set(sys.modules), which writes the reference count of each
    of ~900 module names: strings the imports left on ~500 different pages, each one copied
    by every kernel (1.5 ms of its CPU; 0.2 ms once the names are together). The new keys are
    equal strings, so every lookup finds its module; each module keeps its own __name__.
    """
    for name in list(sys.modules):
        module = sys.modules.pop(name)
        sys.modules[(name + ".")[:-1]] = module  # a new str: str(name) and name[:] are name
