"""`sandbox-kernel mcp`: its flags, and starting the server (the SDK is imported on use)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from .. import flags, policy
from ..client.tools import ToolLimits
from ..extras import install_hint
from ..launch import preload
from ..launch.forkserver.pools import PROCESSES
from . import configs
from .bridge import Header, Redacting, Upstream, bridge_problem, with_headers
from .config import McpConfig

DESCRIPTION = """An MCP server that runs Python for agents in sandboxed kernels. Over stdio by \
default (what Claude Desktop, Claude Code, Cursor and VS Code launch); with --http, Streamable \
HTTP at http://HOST:PORT/mcp for holders of the keys in --keys (the service's keys file)."""


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _size(text: str) -> int:
    try:
        return policy.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _upstream(text: str) -> Upstream:
    try:
        return Upstream.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _header(text: str) -> Header:
    try:
        return Header.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `mcp` subcommand's parser."""
    command = sub.add_parser("mcp", help="serve sandboxed Python to agents over MCP",
                             description=DESCRIPTION)
    where = command.add_argument_group("transport")
    where.add_argument("--http", metavar="HOST:PORT", type=_host_port,
                       help="serve Streamable HTTP at /mcp instead of stdio")
    where.add_argument("--keys", metavar="FILE", help='with --http: the API keys file, '
                       '{"keys": [{"id", "key", "max_sessions"?}]} as for `serve`')
    where.add_argument("--print-tools", choices=("openai", "openai-chat", "mcp"),
                       help="print the tools' definitions as JSON (OpenAI Responses or Chat "
                       "Completions function tools, or MCP) and exit")
    where.add_argument("--print-config", choices=tuple(configs.FILES),
                       help="print the MCP config of that desktop agent or IDE for this install "
                       "(as examples/mcp/'s file, its command the full path of this "
                       "sandbox-kernel, which an app's PATH lacks) and exit")
    limits = command.add_argument_group("agents' limits")
    defaults = McpConfig()
    limits.add_argument("--pool-size", type=int, default=defaults.pool_size, metavar="N",
                        help="started ZMQ kernels kept ready for sessions (and for runs "
                        "without one when they take a ZMQ kernel; 0: start on demand)")
    limits.add_argument("--one-shot-pool-size", type=int, default=defaults.one_shot_pool_size,
                        metavar="N", help="one-shot kernels kept confined and waiting per "
                        "network setting for runs without a session, each used once (0: those "
                        "take a ZMQ kernel each)")
    limits.add_argument("--one-shot-process", choices=PROCESSES, default=None,
                        help="the process a run without a session gets: 'shell', the lean "
                        "one on IPython's shell (the default, unless SANDBOX_ONE_SHOT_PROCESS "
                        "says), or 'kernel', the ipykernel one-shot kernel (a fallback)")
    limits.add_argument("--patience", type=float, default=defaults.patience, metavar="S",
                        help="seconds a call waits for its run before answering with the "
                        "output so far and a run id for wait_run")
    limits.add_argument("--max-timeout", type=float, default=defaults.max_timeout, metavar="S",
                        help="the largest timeout a call may ask for")
    limits.add_argument("--max-sessions", type=int, default=defaults.max_sessions, metavar="N",
                        help="sessions open at once on this server")
    limits.add_argument("--max-sessions-per-key", type=int, metavar="N",
                        help="sessions one key may hold, unless its entry sets max_sessions "
                        "(default: all of --max-sessions for one key, else half)")
    limits.add_argument("--max-runs", type=int, default=defaults.max_runs, metavar="N",
                        help="runs without a session (each a fresh kernel, kept until its "
                        "timeout even when nobody collects it) at once on this server")
    limits.add_argument("--max-runs-per-key", type=int, metavar="N",
                        help="such runs one key may have at once (default: all of --max-runs "
                        "for one key, else half)")
    limits.add_argument("--session-idle-timeout", type=float, metavar="S",
                        default=defaults.session_idle_timeout,
                        help="seconds idle before a session is closed (0: never)")
    limits.add_argument("--max-text", type=int, default=defaults.max_text, metavar="CHARS",
                        help="characters of output a result carries (head and tail kept)")
    limits.add_argument("--max-file", type=_size, default=defaults.max_file_bytes,
                        metavar="SIZE", help="largest file read_file and write_file move")
    limits.add_argument("--embed-files", type=_size, default=defaults.embed_bytes,
                        metavar="SIZE", help="files a fresh run wrote up to SIZE come back "
                        "in its result")
    kept = command.add_argument_group("snapshots and pausing")
    kept.add_argument("--state-dir", metavar="DIR", default=os.environ.get("SANDBOX_STATE_DIR",
                                                                           ""),
                      help="directory of sealed snapshots and paused sessions (the server's "
                      "own MAC key is made in it, 0600); enables the snapshot tools. Env: "
                      "SANDBOX_STATE_DIR")
    kept.add_argument("--max-snapshot-size", type=_size, default=defaults.max_snapshot_size,
                      metavar="SIZE", help="largest snapshot the state dir keeps")
    kept.add_argument("--max-snapshots-per-key", type=int, metavar="N",
                      default=defaults.max_snapshots_per_key,
                      help="snapshots one key (over stdio, the client) keeps in --state-dir; "
                      "past it, snapshot_session is refused until one is deleted")
    kept.add_argument("--max-snapshot-bytes-per-key", type=_size, metavar="SIZE",
                      default=defaults.max_snapshot_bytes_per_key,
                      help="bytes those snapshots may hold in all (paused sessions are "
                      "bounded by the session limit and --max-snapshot-size instead)")
    kept.add_argument("--session-pause-after", type=float, metavar="S",
                      default=defaults.session_pause_after,
                      help="seconds idle before a session is snapshotted into --state-dir and "
                      "its kernel stopped; the next call naming it resumes it (0: never)")
    bridged = command.add_argument_group("tools from other MCP servers")
    bridged.add_argument("--tools-from", metavar="NAME=COMMAND|URL", type=_upstream,
                         action="append", default=[],
                         help="connect to this MCP server (a command started over stdio with "
                         "this server's environment, or a Streamable HTTP URL) and let "
                         "run_python's code call its tools, as `from sandbox_tools import "
                         "NAME__tool` (repeatable; see docs/mcp.md)")
    bridged.add_argument("--tools-header", metavar="NAME:Header-Name=ENV_VAR", type=_header,
                         action="append", default=[],
                         help="send this header to the --tools-from URL server NAME, its value "
                         "read from this server's environment variable ENV_VAR at start (a "
                         "token stays off the command line, out of the kernels and the logs; "
                         "repeatable)")
    tool_defaults = ToolLimits()
    bridged.add_argument("--tool-timeout", type=float, default=tool_defaults.timeout,
                         metavar="S", help="seconds one such call may take")
    bridged.add_argument("--tool-max-calls", type=int, default=tool_defaults.max_calls,
                         metavar="N", help="such calls one run may make")
    command.add_argument("--runtime", metavar="NAME", default="",
                         help="run kernels on this runtime (`sandbox-kernel runtime create`)")
    flags.add_arguments(command)
    command.set_defaults(handler=main)
    return command


def config_from(args: argparse.Namespace) -> McpConfig:
    """The server's settings from its flags (ValueError when a --tools-header cannot be
    used: its server is not a URL, or its variable is unset)."""
    effective = policy.from_arguments(args)
    effective.changed_with = "sandbox-kernel mcp"  # what refusals tell to change (advice.py)
    effective.declared_secrets()  # refused now, not at each kernel's start, when unusable
    return McpConfig(
        policy=effective, preload=list(args.preload), runtime=args.runtime,
        cold_start=args.cold_start, pool_size=max(0, args.pool_size),
        one_shot_pool_size=max(0, args.one_shot_pool_size),
        one_shot_process=args.one_shot_process or "",
        patience=max(1.0, args.patience), max_timeout=args.max_timeout,
        max_sessions=args.max_sessions, max_sessions_per_key=args.max_sessions_per_key,
        max_runs=max(1, args.max_runs), max_runs_per_key=args.max_runs_per_key,
        session_idle_timeout=args.session_idle_timeout, max_text=args.max_text,
        max_file_bytes=args.max_file, embed_bytes=args.embed_files,
        state_dir=args.state_dir, max_snapshot_size=args.max_snapshot_size,
        max_snapshots_per_key=max(1, args.max_snapshots_per_key),
        max_snapshot_bytes_per_key=max(1, args.max_snapshot_bytes_per_key),
        session_pause_after=max(0.0, args.session_pause_after),
        tools_from=with_headers(args.tools_from, args.tools_header, os.environ),
        tool_limits=ToolLimits(max_calls=max(1, args.tool_max_calls),
                               timeout=max(0.1, args.tool_timeout)))


def _sdk_missing() -> str | None:
    try:
        import mcp.server.mcpserver  # noqa: F401
    except ImportError:
        return f"the MCP SDK is not installed: install the [mcp] extra: {install_hint('mcp')}"
    return None


def _print_config(name: str) -> int:
    """Print client `name`'s config for this install; say on stderr which preloads it lacks."""
    printed, missing = configs.for_this_install(name)
    print(json.dumps(printed, indent=2))
    if missing:
        names, them = " ".join(missing), "them" if len(missing) > 1 else "it"
        print(f"sandbox-kernel mcp: this config preloads no {', '.join(missing)} "
              f"(examples/mcp/'s does): this install cannot import {them}; to have {them} "
              f"preloaded, run {sys.executable} -m pip install {names} and print the config "
              "again", file=sys.stderr)
    return 0


def _preload_refusal(config: McpConfig) -> str | None:
    """Why the server cannot preload what --preload names on its kernels' Python, or None."""
    python = sys.executable
    if config.runtime:  # its own preloads were checked when it was built
        from ..runtimes import find

        python = str(find(config.runtime).python())
    return preload.refusal(python, config.preload)


def main(args: argparse.Namespace) -> int:
    """Run the server (or print the tools) as the flags say."""
    missing = _sdk_missing()
    if missing:
        print(f"sandbox-kernel mcp: {missing}", file=sys.stderr)
        return 2
    if args.runtime:
        from ..runtimes import RuntimesError, find

        try:
            find(args.runtime)
        except RuntimesError as exc:
            print(f"sandbox-kernel mcp: {exc}", file=sys.stderr)
            return 2
    if args.print_config:
        return _print_config(args.print_config)
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"sandbox-kernel mcp: {exc}", file=sys.stderr)
        return 2
    if config.session_pause_after and not config.state_dir:
        print("sandbox-kernel mcp: --session-pause-after needs --state-dir: a paused "
              "session's snapshot is kept there", file=sys.stderr)
        return 2
    if args.print_tools:
        from .openai import definitions

        try:
            print(json.dumps(definitions(config, args.print_tools), indent=2))
        except Exception as exc:
            return _stopped_by_bridge(exc)
        return 0
    refused = _preload_refusal(config)
    if refused:
        print(f"sandbox-kernel mcp: {refused}", file=sys.stderr)
        return 2
    # stdout is the protocol over stdio: every log line goes to stderr, one line per message
    # (file names and errors from user code are shown escaped).
    from ..confine.logrelay import PrintableFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Redacting(PrintableFormatter("sandbox-kernel mcp: %(message)s"),
                                   config.tools_from))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    from . import server

    if args.http is None:
        if args.keys:
            print("sandbox-kernel mcp: --keys is for --http (stdio serves the one client "
                  "that started it)", file=sys.stderr)
            return 2
        try:
            server.run_stdio(config)
        except Exception as exc:
            return _stopped_by_bridge(exc)
        return 0
    if not args.keys:
        print("sandbox-kernel mcp: --http needs --keys FILE: every request must carry one of "
              "its keys (see docs/mcp.md)", file=sys.stderr)
        return 2
    from ..hosting.keys import KeyFileError, load_keys

    try:
        keys = load_keys(args.keys)
    except KeyFileError as exc:
        print(f"sandbox-kernel mcp: {exc}", file=sys.stderr)
        return 2
    host, port = args.http
    try:
        server.run_http(config, host, port, keys)
    except Exception as exc:
        return _stopped_by_bridge(exc)
    return 0


def _stopped_by_bridge(exc: Exception) -> int:
    """Exit 2 saying which --tools-from server could not be used; re-raise anything else."""
    problem = bridge_problem(exc)
    if problem is None:
        raise exc
    print(f"sandbox-kernel mcp: {problem}", file=sys.stderr)
    return 2
