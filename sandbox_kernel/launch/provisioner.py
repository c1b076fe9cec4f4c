"""A jupyter_client kernel provisioner that gets kernels from the fork server.

Chosen by a kernelspec's `metadata.kernel_provisioner` (`sandbox-kernel install` writes it), so
JupyterLab, Kernel Gateway, nbclient, papermill and `Sandbox` get fork-served kernels without any
change on their side. The forked kernel stands in for LocalProvisioner's Popen object, so polling,
waiting, interrupting (a signal: the kernelspec's interrupt mode), restarting and killing go
through LocalProvisioner unchanged. When no fork server can be had, the kernel starts cold.
A kernel's secrets (secrets.py) and the upstream proxy's credentials reach its companion in a
sealed vault (confine/vault.py) that the kernel passes on unread.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
from typing import Any

from jupyter_client.provisioning import LocalProvisioner
from traitlets import Bool, Float, Int, List, Unicode

from .. import secrets
from ..confine.environment import READY_VAR
from ..confine.vault import VAULT_VAR
from ..policy import from_kernel_argv
from . import forkserver

NAME = "sandbox-fork-provisioner"
SHUTDOWN_WATCH = 1.0  # seconds a requested shutdown is watched before jupyter_client polls
KILL_WATCH = 5.0  # as long as jupyter_client waits for a killed kernel
LISTEN_TIMEOUT = 30.0  # seconds launch_kernel waits for the kernel's sockets at most


class ForkServerProvisioner(LocalProvisioner):  # type: ignore[misc]
    """LocalProvisioner whose kernels are forked from a preloaded server instead of exec'd.

    launch_kernel returns once the kernel's sockets listen (the kernel says so on a pipe, see
    kernel/app.py), so that every client's first connection succeeds: a client that connects
    to a port not bound yet waits out libzmq's reconnect interval, 100 ms unless it set its
    own, which is what jupyter_server, nbclient and Kernel Gateway paid on every start.
    """

    cold_start = Bool(False, help="Start every kernel cold (exec a new interpreter) instead of "
                      "forking it from the fork server.").tag(config=True)
    preload = List(Unicode(), help="Modules the fork server imports before forking kernels, "
                   "e.g. ['numpy', 'pandas'].").tag(config=True)
    max_forks = Int(forkserver.DEFAULT_MAX_FORKS, help="Kernels one fork server forks before a "
                    "fresh server (new hash seed and address layout) replaces it."
                    ).tag(config=True)
    max_age = Float(forkserver.DEFAULT_MAX_AGE, help="Seconds a fork server forks kernels before "
                    "a fresh one replaces it.").tag(config=True)
    idle = Float(forkserver.DEFAULT_IDLE, help="Seconds a fork server without kernels or requests "
                 "waits before it exits.").tag(config=True)
    listen_timeout = Float(LISTEN_TIMEOUT, help="Seconds launch_kernel waits for the kernel's "
                           "sockets to listen before it returns anyway (the client then "
                           "retries its connections).").tag(config=True)

    fork_served = False

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        """Fork the kernel from the server (else start it cold); return once it listens."""
        read_end, write_end = os.pipe()
        try:
            info = await self._launch(cmd, kwargs, write_end)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the kernel holds its own copy; EOF once it has none
        await _until_listening(read_end, self.listen_timeout)
        return info

    async def _launch(self, cmd: list[str], kwargs: dict[str, Any], ready: int) -> Any:
        env = dict(kwargs.get("env") or os.environ)
        cmd, sealed = self._seal_secrets(cmd, env)
        try:
            return await self._launch_with(cmd, {**kwargs, "env": env}, ready, sealed)
        finally:
            if sealed is not None:  # the kernel (or its request) has its own copy now
                os.close(sealed)

    async def _launch_with(self, cmd: list[str], kwargs: dict[str, Any], ready: int,
                           sealed: int | None) -> Any:
        if not self.cold_start:
            try:
                process = await asyncio.to_thread(self._fork, cmd, kwargs, ready, sealed)
            except forkserver.ForkServerError as exc:
                _say_once(self.log, f"sandbox-kernel: starting kernels cold: {exc}")
            else:
                self.process, self.pid, self.pgid = process, process.pid, process.pid  # type: ignore[assignment]
                self.cwd = kwargs.get("cwd", pathlib.Path.cwd())
                self.fork_served = True
                return self.connection_info
        self.fork_served = False
        env = kwargs["env"]
        env[READY_VAR] = str(ready)
        pass_fds = (*kwargs.get("pass_fds", ()), ready)
        if sealed is not None:
            env[VAULT_VAR] = str(sealed)
            pass_fds += (sealed,)
        return await super().launch_kernel(cmd, **{**kwargs, "env": env, "pass_fds": pass_fds})

    def _seal_secrets(self, cmd: list[str], env: dict[str, str]) -> tuple[list[str], int | None]:
        """The kernel's command, with its secrets' placeholders, and its vault (or None).

        The values (from env or the secrets file) go into the vault alone: they are taken out
        of env, which the kernel (or its request to the fork server) gets; user code finds
        each placeholder in its environment, set once it is confined (the policy's env). The
        placeholders are the same for a restarted kernel: its kernel id stays.
        """
        placeholders, sealed = secrets.seal_for(from_kernel_argv(list(cmd)), env,
                                                str(self.kernel_id))
        return [*cmd, *placeholders], sealed

    async def wait(self) -> int | None:
        """As LocalProvisioner's, but woken by the kernel's end instead of polling every 0.1 s."""
        await self._watch_exit(None)
        return await super().wait()  # type: ignore[no-any-return]

    async def shutdown_requested(self, restart: bool = False) -> None:
        """Watch for the kernel's exit before jupyter_client starts polling for it.

        KernelManager.finish_shutdown checks every 0.1 s whether the kernel is gone, and a
        fork-served kernel exits within milliseconds of the request: without this, every
        shutdown took 100 ms more than it needed. A kernel that has not exited after
        SHUTDOWN_WATCH seconds gets jupyter_client's usual sequence (wait, SIGTERM, SIGKILL).
        """
        await super().shutdown_requested(restart=restart)
        await self._watch_exit(SHUTDOWN_WATCH)

    async def kill(self, restart: bool = False) -> None:
        """SIGKILL the kernel, and return once it is gone (jupyter_client polls every 0.1 s)."""
        await super().kill(restart=restart)
        await self._watch_exit(KILL_WATCH)

    async def _watch_exit(self, timeout: float | None) -> None:
        """Until a fork-served kernel has ended (at most timeout seconds); cold ones: no wait."""
        process = self.process
        if not isinstance(process, forkserver.ForkedKernel):
            return
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while process.poll() is None:
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                return
            news = asyncio.Event()
            watched = process.exit_fd()  # the server's report, or the pidfd once it is gone
            loop.add_reader(watched, news.set)
            try:
                await asyncio.wait_for(news.wait(), left)
            except asyncio.TimeoutError:
                return
            finally:
                loop.remove_reader(watched)

    def _fork(self, cmd: list[str], kwargs: dict[str, Any], ready: int,
              sealed: int | None = None) -> forkserver.ForkedKernel:
        argv = _kernel_argv(cmd)
        env = dict(kwargs.get("env") or os.environ)
        # The server kills a kernel whose launcher hangs up: no parent poller needed (it would
        # end the kernel when the server, its real parent, is replaced).
        env.pop("JPY_PARENT_PID", None)
        client = forkserver.ForkServerClient(
            python=cmd[0], preload=self.preload, max_forks=self.max_forks,
            max_age=self.max_age, idle=self.idle)
        stdio = forkserver.stdio_fds(kwargs.get("stdout"), kwargs.get("stderr"))
        try:
            return client.spawn(argv, env, stdio, kwargs.get("cwd"), ready=ready, sealed=sealed)
        finally:
            os.close(stdio[0])


_said: set[str] = set()


def _say_once(log: Any, line: str) -> None:
    """Log why kernels start cold once per process and reason, not on every start."""
    if line not in _said:
        _said.add(line)
        log.warning(line)


async def _until_listening(read_end: int, timeout: float) -> None:
    """Until the kernel writes to (or, having ended, closes) its ready pipe; then close it."""
    loop = asyncio.get_running_loop()
    heard = asyncio.Event()
    loop.add_reader(read_end, heard.set)
    try:
        await asyncio.wait_for(heard.wait(), timeout)
    except asyncio.TimeoutError:
        pass  # a slow kernel: its clients reconnect until it listens, as without the pipe
    finally:
        loop.remove_reader(read_end)
        os.close(read_end)


def _kernel_argv(cmd: list[str]) -> list[str]:
    """The kernel's own arguments in `python -I -m sandbox_kernel ARGS`; else no fork."""
    try:
        start = cmd.index("sandbox_kernel") + 1
    except ValueError:
        start = 0
    if start < 3 or cmd[start - 2] != "-m":
        raise forkserver.ForkServerError(
            f"the kernelspec's argv {cmd[:4]} does not run `python -m sandbox_kernel`")
    return [os.path.expanduser(arg) for arg in cmd[start:]]
