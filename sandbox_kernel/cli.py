"""The `sandbox-kernel` command: install the kernelspec, run code in a sandbox, check the host."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

from traitlets import TraitError

from . import __version__, check, client, install, policy

CODE_FAILED = 1  # run: the code, its main() or the kernel under it failed
USAGE_ERROR = 2
KERNEL_FAILED = 3  # run: the kernel did not start (e.g. the host lacks a layer the policy needs)


class UsageError(Exception):
    """A command line that cannot be carried out; the message says why."""


def _install(args: argparse.Namespace) -> int:
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install.install(policy.from_arguments(args), name=args.name,
                           display_name=args.display_name, user=args.user, prefix=prefix)
    print(f"Installed kernelspec {args.name} in {path}")
    return 0


def _check(args: argparse.Namespace) -> int:
    report = check.host_report(policy.from_arguments(args))
    print(json.dumps(report, indent=2))
    for problem in report["problems"]:
        print(f"sandbox-kernel check: cannot enforce: {problem}", file=sys.stderr)
    return 1 if report["problems"] else 0


def _read_code(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    try:
        return Path(source).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror or exc}") from None


def _defines_main(code: str) -> bool:
    """Whether the code has a top-level `def main` (`run` then calls it even without --inputs)."""
    try:
        body = ast.parse(code).body
    except SyntaxError:
        return False  # the kernel will report it, with its line
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main"
               for node in body)


def _read_inputs(given: str | None, code: str) -> dict | None:
    """main()'s inputs from --inputs JSON or @file; without it {} if main exists, else None."""
    if given is None:
        return {} if _defines_main(code) else None
    text, origin = given, "--inputs"
    if given.startswith("@"):
        origin = given[1:]
        try:
            text = Path(origin).read_text()
        except OSError as exc:
            raise UsageError(f"cannot read {origin}: {exc.strerror or exc}") from None
    try:
        inputs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{origin} is not valid JSON: {exc}") from None
    if not isinstance(inputs, dict):
        raise UsageError(f"{origin} must be a JSON object of main()'s arguments by name, "
                         f"got {type(inputs).__name__}")
    return inputs


def _echo(text: str) -> None:
    """Pass the code's own output on to our stderr as it arrives."""
    sys.stderr.write(text)
    sys.stderr.flush()


def _report(execution: client.Execution, saved: list[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps({**execution.to_dict(), "saved_displays": saved}, indent=2))
        return
    for path in saved:
        print(f"sandbox-kernel run: saved {path}", file=sys.stderr)
    if execution.error:
        error = execution.error
        print("\n".join(error.traceback) or f"{error.name}: {error.value}", file=sys.stderr)
    elif execution.result is not None:
        print(json.dumps(execution.result, indent=2, ensure_ascii=False))


def _run(args: argparse.Namespace) -> int:
    code = _read_code(args.file)
    inputs = _read_inputs(args.inputs, code)
    effective = policy.from_arguments(args)
    if args.save_displays:
        try:
            Path(args.save_displays).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {args.save_displays}: {exc.strerror or exc}") from None
    sandbox = client.Sandbox(kernel_name=None, policy=effective)
    try:
        sandbox.start()
    except RuntimeError as exc:  # the kernel's own reason is already on stderr
        print(f"sandbox-kernel run: the kernel did not start: {exc}", file=sys.stderr)
        return KERNEL_FAILED
    echo = None if args.json else _echo
    try:
        execution = sandbox.run(code, inputs, timeout=effective.timeout or None,
                                on_stdout=echo, on_stderr=echo)
    except KeyboardInterrupt:
        return 130  # what a shell reports for Ctrl-C
    finally:
        sandbox.close()
    saved = execution.save_displays(args.save_displays) if args.save_displays else []
    _report(execution, saved, as_json=args.json)
    return CODE_FAILED if execution.error else 0


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

    run_cmd = sub.add_parser(
        "run", help="run a Python file in a fresh sandbox and print its main()'s result",
        description="Run FILE in a fresh sandboxed kernel. If it defines main(), main(**inputs) "
        "is called and its dict printed as JSON on stdout; the code's own output goes to stderr.",
        epilog=f"exit status: 0 success; {CODE_FAILED} the code or main() failed, or the "
        f"kernel died or timed out; {USAGE_ERROR} usage error; {KERNEL_FAILED} the kernel did "
        "not start")
    run_cmd.add_argument("file", metavar="FILE|-", help="the Python file to run; - reads stdin")
    run_cmd.add_argument("--inputs", metavar="JSON|@FILE",
                         help="main()'s arguments as a JSON object, or @file.json holding one "
                         "(default: main() with no arguments, if FILE defines it)")
    run_cmd.add_argument("--json", action="store_true",
                         help="print the whole execution (result, stdout, stderr, displays, "
                         "error) as one JSON object on stdout, and nothing on stderr")
    run_cmd.add_argument("--save-displays", metavar="DIR",
                         help="write each display (chart, HTML, ...) to DIR as display-N.EXT")
    policy.add_arguments(run_cmd)  # --timeout among them: the kernel's and the client's limit
    run_cmd.set_defaults(handler=_run)

    check = sub.add_parser("check", help="what this host supports and the effective policy")
    policy.add_arguments(check)
    check.set_defaults(handler=_check)

    from .service import serve  # argparse and traitlets only: the server extra loads on use

    serve.add_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sandbox-kernel` console script."""
    args = parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (install.InstallError, TraitError, FileNotFoundError, UsageError) as exc:
        print(f"sandbox-kernel {args.command}: {exc}", file=sys.stderr)
        return USAGE_ERROR
