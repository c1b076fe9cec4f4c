"""The flags every face that starts kernels takes (install, run, serve, mcp), in one place.

cli.py, mcp/command.py and service/config.py all build their parsers from here, so a flag added
to `add_arguments` reaches every face at once; this module uses only the policy below it.
"""

from __future__ import annotations

import argparse

from . import policy


def module_list(text: str) -> list[str]:
    """`numpy, pandas` -> ["numpy", "pandas"], for argparse."""
    return [name.strip() for name in text.split(",") if name.strip()]


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """How kernels start: forked from a preloaded server (default) or cold."""
    group = parser.add_argument_group("kernel start-up")
    group.add_argument("--cold-start", action="store_true",
                       help="start each kernel as a new interpreter instead of forking it from "
                       "the fork server (slower; no state shared with a server at all)")
    group.add_argument("--preload", metavar="MODULES", type=module_list, default=[],
                       help="comma-separated modules the fork server imports before forking "
                       "kernels, so user code imports them for free (e.g. numpy,pandas)")


def add_arguments(parser: argparse.ArgumentParser, *, start_up: bool = True) -> None:
    """The kernels' flags: the sandbox policy, and (start_up) how kernels are started.

    `serve` passes start_up=False: its kernels start as its --runtime says.
    """
    if start_up:
        add_launch_arguments(parser)
    policy.add_arguments(parser)
