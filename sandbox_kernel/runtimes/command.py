"""`sandbox-kernel runtime create|list|show|update|remove`: the operator's commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import policy
from . import manage
from .store import ROOT_VAR, Runtime, RuntimesError, find, names, root

FAILED = 1


def _create(args: argparse.Namespace) -> int:
    runtime = manage.create(
        args.name, Path(args.requirements), policy.from_arguments(args),
        base_python=args.python, preload=[] if args.no_preload else args.preload,
        user=args.user, prefix=sys.prefix if args.sys_prefix else args.prefix,
        display_name=args.display_name, cold_start=args.cold_start)
    print(f"Created runtime {runtime.name} ({len(runtime.frozen())} packages, with "
          f"{runtime.installer}) in {runtime.build_dir()}")
    _print_preloads(runtime)
    print(f"Installed kernelspec {runtime.kernel_name} in {runtime.kernelspec}")
    return 0


def _update(args: argparse.Namespace) -> int:
    before = find(args.name).frozen()
    preload = ([] if args.no_preload else manage.INSTALLED if args.preload_installed
               else args.preload)
    runtime = manage.update(args.name, Path(args.requirements) if args.requirements else None,
                            preload=preload, force=args.force)
    after = runtime.frozen()
    changes = [f"- {line}" for line in before if line not in after] + \
              [f"+ {line}" for line in after if line not in before]
    print(f"Updated runtime {runtime.name} to build {runtime.build} in {runtime.build_dir()}"
          + (":" if changes else " (no package changed)"))
    for line in changes:
        print(f"  {line}")
    _print_preloads(runtime)
    return 0


def _print_preloads(runtime: Runtime) -> None:
    """What the build preloads (and what it costs), and each installed module it skipped."""
    if not runtime.preload:
        print("Preloads nothing" + (" (--no-preload)" if runtime.preload_from == "none" else ""))
    else:
        total = sum(int(module.get("rss_kb", 0)) for module in runtime.preload_modules.values())
        print(f"Preloads {', '.join(runtime.preload)} ("
              + ("what it installs" if runtime.preload_from == manage.INSTALLED else "--preload")
              + f"; {total / 1024:.0f} MB imported together at most)")
    for name, why in runtime.preload_skipped.items():
        print(f"  not preloaded: {name}: {why}")


def _remove(args: argparse.Namespace) -> int:
    runtime = manage.remove(args.name, force=args.force)
    print(f"Removed runtime {runtime.name} and its kernelspec {runtime.kernel_name}")
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = [manage.summary(find(name)) for name in names()]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f"No runtimes in {root()}; `sandbox-kernel runtime create NAME -r "
              "requirements.txt` builds one")
    for row in rows if not args.json else []:
        print(f"{row['name']}\tkernelspec {row['kernel_name']}\tbuild {row['build']}\t"
              f"{row['packages']} packages\t{row['kernels']} kernels running")
    return 0


def _show(args: argparse.Namespace) -> int:
    print(json.dumps(find(args.name).as_dict(), indent=2))
    return 0


def _handle(handler):  # type: ignore[no-untyped-def]
    """A runtime failure is one line on stderr and exit status 1."""
    def run(args: argparse.Namespace) -> int:
        try:
            return int(handler(args))
        except RuntimesError as exc:
            print(f"sandbox-kernel runtime {args.action}: {exc}", file=sys.stderr)
            return FAILED
    return run


def _modules(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The `runtime` subcommand and its actions."""
    top = commands.add_parser(
        "runtime", help="build and manage the package environments kernels run on",
        description="A runtime is a virtual environment with the operator's packages and this "
        "sandbox, plus a kernelspec sandbox-NAME whose kernels run on it (read-only to them). "
        f"Runtimes live in ${ROOT_VAR} or this environment's "
        "share/sandbox-kernel/runtimes.")
    actions = top.add_subparsers(dest="action", required=True)

    create = actions.add_parser("create", help="build a runtime and install its kernelspec")
    create.add_argument("name", help="the runtime's name; its kernelspec is sandbox-NAME")
    create.add_argument("-r", "--requirements", required=True, metavar="FILE",
                        help="pip requirements file: the packages (and versions) it has")
    create.add_argument("--python", metavar="PATH",
                        help="the interpreter to build it from (default: this one)")
    create.add_argument("--display-name", help="shown in JupyterLab's launcher (default: "
                        "'Python 3 (sandbox: NAME)')")
    chosen = create.add_mutually_exclusive_group()
    chosen.add_argument("--preload", metavar="MODULES", type=_modules, default=None,
                        help="comma-separated modules its fork servers import before forking "
                        "kernels (e.g. numpy,pandas), instead of the default: every top-level "
                        "module the requirements install that imports cleanly")
    chosen.add_argument("--no-preload", action="store_true",
                        help="preload nothing: every kernel imports what it uses itself")
    create.add_argument("--cold-start", action="store_true",
                        help="start its kernels cold instead of from the fork server")
    where = create.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="kernelspec in the user's Jupyter "
                       "data dir")
    where.add_argument("--sys-prefix", action="store_true",
                       help="kernelspec in this Python environment's share/jupyter")
    where.add_argument("--prefix", metavar="P", help="kernelspec in P/share/jupyter")
    policy.add_arguments(create)
    create.set_defaults(handler=_handle(_create))

    upd = actions.add_parser(
        "update", help="rebuild a runtime (new kernels get the new packages)",
        description="Build a new environment from the requirements file (the one given, else "
        "the one recorded) and point the kernelspec at it. Refused while kernels run on the "
        "runtime unless --force; running kernels then keep the old environment.")
    upd.add_argument("name")
    upd.add_argument("-r", "--requirements", metavar="FILE",
                     help="a new requirements file (default: the recorded one)")
    chosen = upd.add_mutually_exclusive_group()
    chosen.add_argument("--preload", metavar="MODULES", type=_modules,
                        help="replace the modules its fork servers preload (default: as "
                        "before: what it installs, or the list it was given)")
    chosen.add_argument("--preload-installed", action="store_true",
                        help="preload what it installs again (the default of create)")
    chosen.add_argument("--no-preload", action="store_true", help="preload nothing")
    upd.add_argument("--force", action="store_true",
                     help="update even while kernels run on it (they keep their environment)")
    upd.set_defaults(handler=_handle(_update))

    rem = actions.add_parser("remove", help="remove a runtime and its kernelspec")
    rem.add_argument("name")
    rem.add_argument("--force", action="store_true",
                     help="remove even while kernels run on it (their next imports may fail)")
    rem.set_defaults(handler=_handle(_remove))

    lst = actions.add_parser("list", help="the runtimes there are")
    lst.add_argument("--json", action="store_true", help="as one JSON array")
    lst.set_defaults(handler=_handle(_list))

    show = actions.add_parser("show", help="one runtime's record, requirements and packages "
                              "(JSON)")
    show.add_argument("name")
    show.set_defaults(handler=_handle(_show))
