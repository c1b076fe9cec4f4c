"""The `sandbox-kernel` command: install the kernelspec, run code in a sandbox, check the host."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

from traitlets import TraitError

from . import __version__, advice, check, client, flags, install, policy, secrets
from .check import SERVICE_VARIABLES
from .launch import eg_kernelspec
from .launch.forkserver.pools import PROCESSES
from .launch.oneshot import OneShotUnavailable

CODE_FAILED = 1  # run: the code, its main() or the kernel under it failed
USAGE_ERROR = 2
KERNEL_FAILED = 3  # run: the kernel did not start (e.g. the host lacks a layer the policy needs)
INTERRUPTED = 130  # run: Ctrl-C, what a shell reports for SIGINT
SIGPIPE_STATUS = 141  # stdout's reader left (`| head`): what a shell reports for SIGPIPE
RUN_TIMEOUT = 60.0  # run: seconds the code may run unless --timeout says otherwise (0: none)
MAX_SAVED_DISPLAYS = 100  # run --save-displays: files written at most (user code picks the count)


class UsageError(Exception):
    """A command line that cannot be carried out; the message says why."""


class _NotStarted(Exception):
    """The kernel of `run` did not start; the message says why."""


def _install(args: argparse.Namespace) -> int:
    prefix = sys.prefix if args.sys_prefix else args.prefix
    effective = policy.from_arguments(args)
    # Refusals name this command, in this scope: another scope's kernelspec may shadow it.
    effective.changed_with = advice.install_command(args.name, install.DEFAULT_NAME, args.user,
                                                    args.prefix, args.sys_prefix)
    effective.declared_secrets()  # refused now, not at the kernel's start, when unusable
    path = install.install(effective, name=args.name,
                           display_name=args.display_name, user=args.user, prefix=prefix,
                           cold_start=args.cold_start, preload=args.preload,
                           enterprise_gateway=args.enterprise_gateway,
                           eg_spec=eg_kernelspec.from_arguments(args))
    print(install.installed_message(path, args.name, args.user, args.prefix, args.sys_prefix,
                                    args.display_name))
    if effective.upstream_proxy != secrets.without_credentials(effective.upstream_proxy):
        print(f"sandbox-kernel install: the upstream proxy's credentials are not in the "
              f"kernelspec (kernels could read them): set {secrets.UPSTREAM_VAR} to the whole "
              "URL in the environment of the Jupyter server that starts it", file=sys.stderr)
    for warning in [*install.shadowing(path, args.name),
                    *check.write_warnings(effective, cwd=None)]:
        print(f"sandbox-kernel install: warning: {warning}", file=sys.stderr)
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install.uninstall(name=args.name, user=args.user, prefix=prefix)
    print(f"Removed kernelspec {args.name} from {path}")
    return 0


def _check(args: argparse.Namespace) -> int:
    effective = policy.from_arguments(args)
    report = check.host_report(effective)
    if args.service or check.wants_service(os.environ):
        report["service"] = check.service_report(effective, os.environ)
        report["problems"] += report["service"]["problems"]
    print(json.dumps(report, indent=2) if args.json else check.summary(report))
    for problem in report["problems"]:
        print(f"sandbox-kernel check: cannot enforce: {problem}", file=sys.stderr)
    for warning in report["warnings"]:
        print(f"sandbox-kernel check: warning: {warning}", file=sys.stderr)
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
    timeout_source = "sandbox-kernel run --timeout"
    if args.timeout is None:
        args.timeout = f"{RUN_TIMEOUT:g}"
        timeout_source = f"sandbox-kernel run's default --timeout {RUN_TIMEOUT:g}"
    effective = policy.from_arguments(args)
    effective.changed_with = advice.RUN  # refusals name run's flags (advice.py)
    effective.declared_secrets()  # refused before any kernel starts, when unusable
    if args.save_displays:
        try:
            Path(args.save_displays).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {args.save_displays}: {exc.strerror or exc}") from None
    sandbox = client.Sandbox(kernel_name=None, policy=effective, cold_start=args.cold_start,
                             preload=args.preload, timeout_source=timeout_source, one_shot=True,
                             one_shot_process=args.one_shot_process)
    try:
        execution = _run_once(sandbox, code, inputs, effective.timeout, args.json)
    except KeyboardInterrupt:
        print("sandbox-kernel run: interrupted (Ctrl-C); the kernel was stopped", file=sys.stderr)
        return INTERRUPTED
    except _NotStarted as exc:  # the kernel's own reason is already on stderr
        print(f"sandbox-kernel run: the kernel did not start: {exc}", file=sys.stderr)
        return KERNEL_FAILED
    saved, unsaved = _save_displays(execution, args.save_displays, args.max_saved_displays)
    _report(execution, saved, as_json=args.json)
    if unsaved:
        print(f"sandbox-kernel run: the code made {len(execution.displays):,} displays; "
              f"--save-displays wrote the first {args.max_saved_displays:,} and not the other "
              f"{unsaved:,} (raise --max-saved-displays to keep more)", file=sys.stderr)
        return CODE_FAILED
    return CODE_FAILED if execution.error else 0


def _save_displays(execution: client.Execution, directory: str | None,
                   limit: int) -> tuple[list[str], int]:
    """Write at most limit displays (one file each) to directory; the paths, and how many were
    left unwritten: user code chooses how many displays it makes, the operator how many files."""
    if not directory:
        return [], 0
    kept = dataclasses.replace(execution, displays=execution.displays[:limit])
    return kept.save_displays(directory), len(execution.displays) - len(kept.displays)


def _run_once(sandbox: client.Sandbox, code: str, inputs: dict | None, timeout: float,
              as_json: bool) -> client.Execution:
    """Start the kernel, run the code once, shut the kernel down."""
    try:
        try:
            sandbox.start()
        except RuntimeError as exc:
            raise _NotStarted(str(exc)) from None
        echo = None if as_json else _echo
        try:
            execution = sandbox.run(code, inputs, timeout=timeout or None, on_stdout=echo,
                                    on_stderr=echo)
        except OneShotUnavailable as exc:  # no one-shot kernel could start for this policy
            raise _NotStarted(str(exc)) from None
    except BaseException:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up
        sandbox.close(now=True)  # nothing of a one-shot kernel is worth waiting for
        raise
    sandbox.close()
    return execution


def _add_location(command: argparse.ArgumentParser) -> None:
    """Where a kernelspec goes: the options install and uninstall share."""
    where = command.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="the user's Jupyter data dir")
    where.add_argument("--sys-prefix", action="store_true",
                       help="this Python environment's share/jupyter (for virtualenvs and conda)")
    where.add_argument("--prefix", metavar="P", help="P/share/jupyter")
    command.add_argument("--name", default=install.DEFAULT_NAME, help="kernelspec name")


def _positive(text: str) -> int:
    """A whole number of at least 1, for argparse."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    top = argparse.ArgumentParser(prog="sandbox-kernel", description=__doc__)
    top.add_argument("--version", action="version", version=__version__)
    sub = top.add_subparsers(dest="command", required=True)

    inst = sub.add_parser("install", help="install the kernelspec so Jupyter can start the kernel")
    _add_location(inst)
    inst.add_argument("--display-name", metavar="TEXT",
                      help="name shown in JupyterLab's launcher (default: "
                      f"\"{install.default_display_name('NAME')}\", and "
                      f"\"{install.DEFAULT_DISPLAY_NAME}\" for --name {install.DEFAULT_NAME})")
    flags.add_arguments(inst)
    eg_kernelspec.add_arguments(inst)
    inst.set_defaults(handler=_install)

    uninst = sub.add_parser("uninstall", help="remove a kernelspec that install wrote",
                            description="Remove the kernelspec NAME from where `install` with "
                            "the same --user/--sys-prefix/--prefix wrote it.")
    _add_location(uninst)
    uninst.set_defaults(handler=_uninstall)

    run_cmd = sub.add_parser(
        "run", help="run a Python file in a fresh sandbox and print its main()'s result",
        description="Run FILE in a fresh sandboxed kernel. If it defines main(), main(**inputs) "
        "is called and its dict printed as JSON on stdout; the code's own output goes to stderr.",
        epilog=f"time limit: {RUN_TIMEOUT:g} s unless --timeout says otherwise (--timeout 0: "
        f"none). exit status: 0 success; {CODE_FAILED} the code or main() failed, or the "
        f"kernel died or timed out; {USAGE_ERROR} usage error; {KERNEL_FAILED} the kernel did "
        f"not start; {INTERRUPTED} interrupted by Ctrl-C")
    run_cmd.add_argument("file", metavar="FILE|-", help="the Python file to run; - reads stdin")
    run_cmd.add_argument("--inputs", metavar="JSON|@FILE",
                         help="main()'s arguments as a JSON object, or @file.json holding one "
                         "(default: main() with no arguments, if FILE defines it)")
    run_cmd.add_argument("--json", action="store_true",
                         help="print the whole execution (result, stdout, stderr, displays, "
                         "error, usage) as one JSON object on stdout, and nothing on stderr")
    run_cmd.add_argument("--save-displays", metavar="DIR",
                         help="write each display (chart, HTML, ...) to DIR as display-N.EXT")
    run_cmd.add_argument("--max-saved-displays", metavar="N", type=_positive,
                         default=MAX_SAVED_DISPLAYS,
                         help="most files --save-displays writes; past it the run fails, saying "
                         f"so (default {MAX_SAVED_DISPLAYS})")
    run_cmd.add_argument("--one-shot-process", choices=PROCESSES, default=None,
                         help="the process the run gets: 'shell', the lean one on IPython's "
                         "shell (the default, unless SANDBOX_ONE_SHOT_PROCESS says), or "
                         "'kernel', the ipykernel one-shot kernel (a fallback)")
    flags.add_arguments(run_cmd)  # --timeout among them: the kernel's and the client's limit
    run_cmd.set_defaults(handler=_run)

    check = sub.add_parser("check", help="what this host supports and the effective policy")
    check.add_argument("--json", action="store_true",
                       help="print the whole report as one JSON object, for machines")
    check.add_argument("--service", action="store_true",
                       help="also check what `serve` would run (each network policy "
                       "ENABLE_NETWORK serves, SANDBOX_RUNTIME, the directories it writes); "
                       f"on by itself where any of {', '.join(SERVICE_VARIABLES)} "
                       "is set, as in the service's image")
    policy.add_arguments(check)
    check.set_defaults(handler=_check)

    from .service import serve  # argparse and traitlets only: the server extra loads on use

    serve.add_parser(sub)

    from .mcp import command as mcp_command  # argparse only: the MCP SDK loads on use

    mcp_command.add_parser(sub)

    from .runtimes import command as runtime_command

    runtime_command.add_parser(sub)

    # Parsed by launch/eg.py itself (see main()); listed here for --help.
    sub.add_parser("eg-launch", add_help=False,
                   help="start a sandboxed kernel for Jupyter Enterprise Gateway (its launcher)")
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sandbox-kernel` console script."""
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["eg-launch"]:  # EG's own argument forms, parsed by the launcher
        from .launch import eg

        return eg.main(given[1:])
    args = parser().parse_args(policy.spell_bare_flags(list(given)))
    try:
        status = int(args.handler(args))
        sys.stdout.flush()  # a reader that left is heard here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        return _reader_left()
    except (install.InstallError, TraitError, FileNotFoundError, UsageError) as exc:
        print(f"sandbox-kernel {args.command}: {exc}", file=sys.stderr)
        return USAGE_ERROR


def _reader_left() -> int:
    """Stdout's reader closed the pipe (`... | head -1`): end quietly, as a tool killed by
    SIGPIPE would, rather than with a traceback. What is still buffered goes to /dev/null, so
    the interpreter's own flush at exit fails no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_STATUS
