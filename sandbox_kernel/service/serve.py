"""`sandbox-kernel serve`: run the service under uvicorn."""

from __future__ import annotations

import argparse
import ctypes
import logging
import sys
from typing import Any

from traitlets import TraitError

from .. import policy
from ..confine.logrelay import PrintableFormatter
from ..extras import install_hint
from . import config as service_config

KEEP_ALIVE_SECONDS = 75  # as nginx's keepalive_timeout
DESCRIPTION = ("Serve sandboxed kernels over HTTP: dify-sandbox's API at /v1/sandbox/* and the "
               "native API at /api/v1/* (schema at /docs and /openapi.json). Each setting is "
               "also read from the environment variable named in its help. Network access is "
               "decided per request (--enable-network allows it), not by --allow-network.")


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `serve` subcommand to the CLI's subcommands."""
    serve = commands.add_parser("serve", help="serve sandboxed kernels over HTTP "
                                "(dify-sandbox compatible)", description=DESCRIPTION)
    service_config.add_arguments(serve)
    serve.set_defaults(handler=run)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BLOCK = 256 * 1024  # bytes: blocks this large get pages of their own, unmapped when freed


def return_large_blocks() -> bool:
    """Make the C allocator give a large block's memory back to the system when it is freed.

    glibc raises its mmap threshold each time a large mapped block is freed, after which blocks
    of that size come from the heap and stay in the process when freed: each 13 MB result a
    request passed on left ~13 MB of RSS behind, run after run. A fixed threshold turns that
    adjustment off. True if it was set (glibc); other C libraries keep their own policy.
    """
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK))
    except (OSError, AttributeError):
        return False


def _logging(level: str) -> None:
    # Every handler here writes the message alone: where a call was made from is never shown,
    # and looking it up (sys._getframe, a walk up the stack) was half of each access line's
    # cost. The logging HOWTO's "Optimization" section names this switch.
    logging._srcfile = None  # type: ignore[attr-defined]
    handler = logging.StreamHandler(sys.stderr)
    # Each message is one JSON object; others (an exception's text) kept to one printable line.
    handler.setFormatter(PrintableFormatter("%(message)s"))
    for name in ("sandbox_kernel.service", "sandbox_kernel.service.access",
                 "sandbox_kernel.hosting"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(level.upper())


def run(args: argparse.Namespace) -> int:
    """Start the service and serve until SIGINT/SIGTERM; 0 after a clean shutdown."""
    try:
        import uvicorn

        from .app import create_app
        from .connections import protocol
    except ImportError as exc:
        print(f"sandbox-kernel serve: {exc.name} is missing: install the [server] extra: "
              f"{install_hint('server')}", file=sys.stderr)
        return 2
    from ..hosting.keys import KeyFileError
    from ..hosting.network import with_network

    if getattr(args, "allow_network", None):
        raise TraitError("serve decides network access per request: --enable-network lets a "
                         "request ask for it; drop --allow-network")
    config = service_config.from_arguments(args)
    effective = policy.from_arguments(args)
    effective.changed_with = "sandbox-kernel serve"  # what refusals tell to change (advice.py)
    with_network(effective, True).declared_secrets()  # for its network kernels: refused now
    _logging(config.log_level)
    return_large_blocks()
    try:
        app = create_app(config, effective)
    except KeyFileError as exc:
        print(f"sandbox-kernel serve: {exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, access_log=False,
        # Past the grace period the service answers its runs itself (Service.begin_shutdown);
        # uvicorn cancels what is left only a few seconds after that.
        timeout_graceful_shutdown=int(config.shutdown_grace) + 5,
        # Requests are bounded by the service's admission; connections by connections.py
        # (uvicorn's limit_concurrency counted idle sockets and let them lock requests out).
        http=protocol(config.head_timeout, config.max_idle_connections),
        # Longer than clients keep an idle connection (httpx, Dify's client: 5 s), so the client
        # closes first: a server closing at the same moment races a request sent on it, which
        # the client sees as a reset (1 in 4,492 soak runs at uvicorn's 5 s).
        timeout_keep_alive=KEEP_ALIVE_SECONDS))
    _tell_on_exit(server, app.state.service)
    _warn_about_keys(config)
    server.run()
    return 0


def _warn_about_keys(config: service_config.ServiceConfig) -> None:
    """Say loudly, before serving, when the keys let anyone in or leave a route off."""
    from ..hosting.keys import dify_key, insecure_key_warning
    from .access import json_line

    warning = insecure_key_warning(dify_key(config.api_key, config.api_keys_file),
                                   config.api_keys_file, config.host)
    if warning:
        logging.getLogger("sandbox_kernel.service").warning(
            json_line(event="insecure_keys", warning=warning))
        print(f"\n{'!' * 78}\nsandbox-kernel serve: WARNING: {warning}\n{'!' * 78}\n",
              file=sys.stderr, flush=True)


def _tell_on_exit(server: Any, service: Any) -> None:
    """Let the service hear of SIGTERM/SIGINT as soon as uvicorn does."""
    handle_exit = server.handle_exit

    def on_exit(sig: int, frame: Any) -> None:
        service.begin_shutdown()
        handle_exit(sig, frame)

    server.handle_exit = on_exit
