"""The MCP server itself: the SDK's MCPServer with our tools and resources, over stdio or
Streamable HTTP; over HTTP every request carries a bearer key from the service's keys file."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from pydantic import AnyHttpUrl

from .. import __version__
from ..hosting.events import http_url
from ..hosting.keys import ApiKey, BearerKeys
from . import resources, tools
from .bridge import BridgeError
from .config import McpConfig
from .state import State

log = logging.getLogger("sandbox_kernel.mcp")

INSTRUCTIONS = """Runs Python in a sandbox: call run_python with code. Each call without a \
session gets a fresh sandbox; create_session keeps variables and files between calls. The \
sandbox has no subprocesses{network}; read the sandbox://policy resource for its limits and \
installed packages. Results come back as text plus structured content; charts as images."""


class KeyVerifier:
    """The SDK's TokenVerifier for the service's API keys: a key's id is its client id."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = BearerKeys(keys)

    async def verify_token(self, token: str) -> AccessToken | None:
        """The SDK's access token for a known API key; None refuses the request."""
        key = self.keys.find(f"Bearer {token}")
        if key is None:
            log.info("refused a request with an unknown API key")
            return None
        return AccessToken(token=token, client_id=key.id, scopes=[])


def build(config: McpConfig, keys: list[ApiKey] | None = None,
          url: str = "http://127.0.0.1") -> tuple[MCPServer, State]:
    """The server and its state; with keys, HTTP requests must carry one of them."""
    state = State(config, {key.id: key.max_sessions for key in keys or []})

    @contextlib.asynccontextmanager
    async def lifespan(_server: MCPServer) -> AsyncIterator[dict[str, Any]]:
        try:
            async with state.bridged():
                state.start()
                try:
                    yield {}
                finally:
                    await state.close()
        except BridgeError as exc:
            log.error("%s", exc)
            raise

    auth: dict[str, Any] = {}
    if keys is not None:
        # Keys, not OAuth: no resource_server_url, so the SDK neither serves a protected-resource
        # document nor names one in its 401s. Naming one (with this server as its authorization
        # server, which has no OAuth endpoints) sent OAuth-aware clients into a login that could
        # only fail, instead of telling their user the key is wrong. The issuer is required by
        # the SDK's settings and used for nothing else without an authorization server provider.
        auth = {"token_verifier": KeyVerifier(keys),
                "auth": AuthSettings(issuer_url=AnyHttpUrl(url), resource_server_url=None)}
    network = "" if config.policy.allow_network else " and no network"
    server = MCPServer("sandbox-kernel", title="Python sandbox", version=__version__,
                       instructions=INSTRUCTIONS.format(network=network), lifespan=lifespan,
                       log_level="WARNING", **auth)
    tools.register(server, state)
    resources.register(server, state)
    return server, state


def run_stdio(config: McpConfig) -> None:
    """Serve one client on stdin/stdout (what desktop agents and IDEs launch)."""
    server, _ = build(config)
    server.run("stdio")


def run_http(config: McpConfig, host: str, port: int, keys: list[ApiKey]) -> None:
    """Serve Streamable HTTP on host:port at /mcp, for holders of the keys."""
    import uvicorn

    url = http_url(host, port)
    server, _ = build(config, keys, url)
    app = server.streamable_http_app(host=host)

    class Announced(uvicorn.Server):
        """Says where it serves once it listens (uvicorn's own lines are off, at warning)."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                log.info("serving Streamable HTTP at %s/mcp", url)

    # h11 and asyncio, as before the [server] extra brought httptools and uvloop into the same
    # environments: h11 bounds a request head (16 KiB), httptools does not, and this server has
    # no guard of its own (the service's is service/connections.py).
    Announced(uvicorn.Config(app, host=host, port=port, log_level="warning", http="h11",
                             loop="asyncio")).run()
