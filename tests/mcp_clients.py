"""The MCP SDK's own client, held open in a thread of its own and called synchronously, and
`sandbox-kernel mcp` over stdio and over Streamable HTTP, for tests/test_mcp*.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

SERVER = [sys.executable, "-m", "sandbox_kernel", "mcp"]
FLAGS = ["--patience", "3", "--pool-size", "1", "--max-text", "4000"]


class Connected:
    """An MCP Client, connected in a background event loop; every call waits for its answer."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._ready: concurrent.futures.Future[Client] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._holder = asyncio.run_coroutine_threadsafe(self._hold(connect), self.loop)
        self.client = self._ready.result(timeout=120)

    async def _hold(self, connect: Callable[[], Any]) -> None:
        self._stop = asyncio.Event()
        try:
            async with connect() as client:
                self._ready.set_result(client)
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    def call(self, make: Callable[[Client], Any], timeout: float = 120) -> Any:
        """Run make(client) (a coroutine) in the client's loop and return its result."""
        async def go() -> Any:
            return await make(self.client)

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(timeout)

    def tool(self, name: str, arguments: dict[str, Any] | None = None,
             timeout: float = 120) -> Any:
        return self.call(lambda c: c.call_tool(name, arguments or {}), timeout)

    def close(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        try:
            self._holder.result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def stdio(errlog: Path, *flags: str) -> Connected:
    """A client of a stdio server it started as a subprocess (its stderr to errlog)."""
    params = StdioServerParameters(command=SERVER[0], args=[*SERVER[1:], *FLAGS, *flags],
                                   env=dict(os.environ))
    log = errlog.open("w")
    return Connected(lambda: Client(stdio_client(params, errlog=log)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class HttpServer:
    """`sandbox-kernel mcp --http` in a subprocess on 127.0.0.1, stopped with SIGTERM."""

    def __init__(self, tmp: Path, keys: Path, *flags: str,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = tmp / f"mcp-{self.port}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [*SERVER, *FLAGS, "--http", f"127.0.0.1:{self.port}", "--keys", str(keys),
                 *flags], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"the MCP server did not listen:\n{self.log.read_text()}")

    def client(self, key: str) -> Connected:
        def connect() -> Client:
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"},
                                      timeout=httpx2.Timeout(30, read=300))
            return Client(streamable_http_client(self.url, http_client=http))

        return Connected(connect)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
