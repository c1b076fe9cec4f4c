"""The kernels' flags come from one module below every face (#32 item 15)."""

import argparse
import subprocess
import sys

import pytest

from sandbox_kernel import cli, flags


def _options(parser):
    return {option for action in parser._actions for option in action.option_strings}


def _subcommand(name):
    top = cli.parser()
    choices = next(action for action in top._actions
                   if isinstance(action, argparse._SubParsersAction)).choices
    return choices[name]


@pytest.mark.parametrize(("face", "start_up"), [("install", True), ("run", True),
                                                ("mcp", True), ("serve", False)])
def test_every_face_takes_every_kernel_flag(face, start_up):
    shared = argparse.ArgumentParser(add_help=False)
    flags.add_arguments(shared, start_up=start_up)
    assert _options(shared) - _options(_subcommand(face)) == set()
    assert ("--preload" in _options(shared)) is start_up


def test_the_mcp_face_builds_its_parser_without_the_cli():
    """mcp/command.py used to import cli.py inside add_parser, and cli.py imports it."""
    code = ("import argparse, sys\n"
            "from sandbox_kernel.mcp import command\n"
            "command.add_parser(argparse.ArgumentParser().add_subparsers())\n"
            "print('sandbox_kernel.cli' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout == "False\n"


def test_preload_reads_a_comma_separated_list():
    args = _subcommand("run").parse_args(["x.py", "--preload", "numpy, pandas,,"])
    assert (args.preload, args.cold_start) == (["numpy", "pandas"], False)


@pytest.mark.parametrize(("argv", "grant", "file"), [
    (["--grant-cwd", "job.py"], "ro", "job.py"),
    (["--grant-cwd", "rw", "job.py"], "rw", "job.py"),
    (["--grant-cwd=rw", "job.py"], "rw", "job.py"),
    (["job.py", "--grant-cwd"], "ro", "job.py"),
    (["--grant-cwd", "-"], "ro", "-"),
    (["--", "--grant-cwd"], None, "--grant-cwd"),
])
def test_a_bare_flag_before_the_file_leaves_the_file_alone(argv, grant, file):
    """`run --grant-cwd job.py` took job.py as the flag's value and refused it (not ro|rw)."""
    from sandbox_kernel.policy import spell_bare_flags

    args = _subcommand("run").parse_args(spell_bare_flags(argv))
    assert (args.grant_cwd, args.file) == (grant, file)
