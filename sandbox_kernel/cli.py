"""The `sandbox-kernel` command: install the kernelspec, check the host."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__, install, policy, seccomp

USAGE_ERROR = 2


def _install(args: argparse.Namespace) -> int:
    prefix = sys.prefix if args.sys_prefix else args.prefix
    try:
        path = install.install(policy.from_arguments(args), name=args.name,
                               display_name=args.display_name, user=args.user, prefix=prefix)
    except install.InstallError as exc:
        print(f"sandbox-kernel install: {exc}", file=sys.stderr)
        return USAGE_ERROR
    print(f"Installed kernelspec {args.name} in {path}")
    return 0


def _check(args: argparse.Namespace) -> int:
    effective = policy.from_arguments(args)
    reason = seccomp.available()
    report = {
        "seccomp": {"available": reason is None, "reason": reason},
        "policy": effective.as_dict(),
    }
    print(json.dumps(report, indent=2))
    return 1 if reason and effective.require_seccomp else 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    top = argparse.ArgumentParser(prog="sandbox-kernel", description=__doc__)
    top.add_argument("--version", action="version", version=__version__)
    sub = top.add_subparsers(dest="command", required=True)

    inst = sub.add_parser("install", help="install the kernelspec so Jupyter can start the kernel")
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="the user's Jupyter data dir")
    where.add_argument("--sys-prefix", action="store_true",
                       help="this Python environment's share/jupyter (for virtualenvs and conda)")
    where.add_argument("--prefix", metavar="P", help="P/share/jupyter")
    inst.add_argument("--name", default=install.DEFAULT_NAME, help="kernelspec name")
    inst.add_argument("--display-name", default=install.DEFAULT_DISPLAY_NAME,
                      help="name shown in JupyterLab's launcher")
    policy.add_arguments(inst)
    inst.set_defaults(handler=_install)

    check = sub.add_parser("check", help="what this host supports and the effective policy")
    policy.add_arguments(check)
    check.set_defaults(handler=_check)
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sandbox-kernel` console script."""
    args = parser().parse_args(argv)
    return int(args.handler(args))
