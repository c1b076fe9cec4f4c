"""The kernel application: ipykernel's start-up sequence with the sandbox layers put in place.

The layers are confine/sequence.py's `Confinement`, one ordered procedure (a one-shot kernel
runs the same); this application calls its steps where ipykernel's start-up allows them and
keeps what is ipykernel's: the hooks, the sockets, the heartbeat.

1. clean environment and the reaper, which keeps the launcher's stdio (environment.ensure_clean,
   run by __main__ before the heavy imports)
2. scratch as cwd, rlimits, audit file, identity       } in init_sockets, while exactly one
   (a uid of its own; a view of the interpreter)      } thread exists
   the channels' listening sockets bound, then a       } (Confinement.before_threads)
   network namespace of its own (netns.py) and the     }
   egress listener in it, handed to the reaper         }
3. Landlock                                            }
4. IPKernelApp hands the bound listeners to libzmq and starts its threads (all of them in the
   private namespace); the uid is switched (before the namespace instead, where root may not
   make one: the kernel's own uid makes it in a user namespace, see enter_namespace)
5. seccomp with TSYNC, into every thread; its listener (and the audit file) go to the reaper
   (Confinement.finish, once the heartbeat's thread has bound its socket)
6. start(): user code runs only from here on (Confinement.hand_to_user_code just before)
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import stat
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar, NoReturn

import zmq
from ipykernel import kernelapp
from ipykernel.heartbeat import Heartbeat
from ipykernel.kernelapp import IPKernelApp, kernel_aliases, kernel_flags
from traitlets import Dict as DictTrait
from traitlets import DottedObjectName, Instance, Type, default

from ..confine.errors import ConfinementError
from ..confine.sequence import Channels, Confinement
from ..policy import SandboxPolicy, app_aliases, app_flags
from .kernel import SandboxKernel, skip_unshown_records
from .parser_cache import PrebuiltParser

# ipykernel's IOPub pipe carries output of forked children, which cannot exist in this kernel;
# Landlock refuses the random port it would bind, and that is fine. Set here, on import, so that
# a fork server's kernels find the filter (and its compiled pattern) ready.
warnings.filterwarnings("ignore", message="Couldn't bind IOPub Pipe")


class SandboxHeartbeat(Heartbeat):
    """ipykernel's heartbeat, bound to the listener made before the namespace move."""

    prebound: ClassVar[dict[int, socket.socket]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bound = threading.Event()

    def _try_bind_socket(self) -> Any:
        _use_prebound(self.socket, self.prebound, self.port)
        result = super()._try_bind_socket()
        self.bound.set()
        return result


@contextlib.contextmanager
def _kept_without_collection() -> Iterator[None]:
    """Start without the garbage collector, then keep what the start built out of its reach.

    The start builds the kernel's long-lived objects (the shell, the sockets' streams, the
    threads): the collector's passes over them while it runs found next to nothing to free
    (~200 objects) for ~0.9 ms of CPU. Frozen afterwards, they are never walked again either,
    as a fork server freezes what it imported (a cold kernel's full collections skip its
    imports too). User code runs with the collector as usual; jsonwire then never parks large
    inputs in the permanent generation, in a cold kernel as in a fork-served one.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _use_prebound(sock: zmq.Socket[Any], prebound: dict[int, socket.socket], port: int) -> None:
    """Let libzmq take the listener already bound to port (in the launcher's namespace)."""
    listener = prebound.pop(port, None)
    if listener is not None:
        sock.setsockopt(zmq.USE_FD, listener.detach())


class SandboxKernelApp(PrebuiltParser, IPKernelApp):
    """IPKernelApp that confines its own process before any user code can run."""

    name = "sandbox-kernel"
    description = "A Jupyter kernel for untrusted Python code."
    classes = [*IPKernelApp.classes, SandboxKernel, SandboxPolicy]  # noqa: RUF012
    flags = DictTrait({**kernel_flags, **app_flags()})
    aliases = DictTrait({**kernel_aliases, **app_aliases()})

    kernel_class = Type(SandboxKernel, klass="ipykernel.kernelbase.Kernel",  # type: ignore[assignment]
                        help="The kernel class to run.").tag(config=True)
    outstream_class = DottedObjectName("sandbox_kernel.kernel.output.CappedOutStream",
                                       help="The stream class; it enforces the output cap.")
    policy = Instance(SandboxPolicy, help="The effective sandbox policy.")
    launcher_stderr = 2
    prebound: ClassVar[dict[int, socket.socket]] = {}  # port -> listener, until libzmq takes it
    confinement: Confinement | None = None  # the layers applied (confine/sequence.py)

    @property
    def layers(self) -> dict[str, Any]:
        """What each sandbox layer did in this process."""
        assert self.confinement is not None, "init_confinement applies the layers"
        return self.confinement.layers

    @default("policy")
    def _default_policy(self) -> SandboxPolicy:
        return SandboxPolicy(parent=self)

    def initialize(self, argv: Any = None) -> None:
        """Confine, bind sockets and start ipykernel's threads, then filter every thread."""
        # ipykernel points file descriptor 2 at the frontend; keep the log pipe to the reaper
        # (never the launcher's own stderr: only the reaper holds that) for refuse_to_start.
        self.launcher_stderr = os.dup(2)
        try:
            with _kept_without_collection():
                super().initialize(argv)
                if self.subapp is not None:
                    return
                self.finish_confinement()
        except ConfinementError as exc:  # every layer's failure: the error names the fix
            self.refuse_to_start(exc.refusal())
        self.hand_to_user_code()

    def finish_confinement(self) -> None:
        """The last layers, once every thread exists: the uid switch, then seccomp once the
        heartbeat's thread has bound its socket (the filter refuses bind)."""
        # Switching user only now: ipykernel re-read its root-only connection file
        # (unless the network namespace needed the switch first: enter_namespace).
        assert self.confinement is not None
        self.confinement.finish(before_filter=self.wait_for_heartbeat)

    def hand_to_user_code(self) -> None:
        """Confined: drop the handovers and the log dup, give the kernel what explains
        refusals and counts them; user code is next."""
        confinement = self.confinement
        assert confinement is not None
        if self.launcher_stderr > 2:
            os.close(self.launcher_stderr)
        self.launcher_stderr = 2
        confinement.hand_to_user_code()
        runner = self.kernel.runner
        runner.file_access, runner.usage.refusals = confinement.file_access, confinement.refusals
        self.kernel.sandbox_info = confinement.info()

    def _configure_logging(self) -> None:
        """traitlets' logging set-up; then the logger drops records no handler shows."""
        super()._configure_logging()
        skip_unshown_records(self.log)

    def _ip_default(self) -> str:
        """Loopback, without the host scan behind jupyter_client's default.

        jupyter_client computes this default even when the connection file names the address:
        importing psutil and listing the host's interfaces cost 60 ms of every start.
        """
        if self.transport == "tcp":
            return "127.0.0.1"
        return super()._ip_default()  # type: ignore[no-any-return]

    def init_sockets(self) -> None:
        """Apply the single-threaded layers first: ipykernel starts threads from here on."""
        self.init_confinement()
        if self.transport == "tcp" and self.ip in ("127.0.0.1", "::1", "localhost"):
            # Loopback only, every message signed with the session key: not worth a warning on
            # every start (it lands in `sandbox-kernel run`'s output).
            self.log.addFilter(lambda record: "without encryption" not in record.getMessage())
        super().init_sockets()

    def init_kernel(self) -> None:
        """Create the kernel and its shell, with the input history kept in memory.

        IPython keeps history in an SQLite file of the profile (here in the scratch, removed
        with the kernel) written by a thread of its own: a file no later session can read, and
        a thread and a database on every start. In memory, `In`, `%history` and `_i` work
        as before for the kernel's own session. An explicit --HistoryManager.hist_file wins.
        """
        if "hist_file" not in self.config.HistoryManager:
            self.config.HistoryManager.hist_file = ":memory:"
        super().init_kernel()

    def init_control(self, context: Any) -> None:
        """Bind the control channel, without the debugger's loop-back connection.

        ipykernel connects a socket to its own shell port for the debugger, which this kernel
        refuses anyway; with the network off libzmq would retry that connection forever, and
        every retry is a refused socket() in the audit record.
        """
        super().init_control(context)
        self.debug_shell_socket.close(linger=0)
        self.debug_shell_socket = context.socket(zmq.DEALER)  # never connected

    def write_connection_file(self, **kwargs: Any) -> None:
        """ipykernel's, unless the launcher's file already says all of it.

        With CurveZMQ keys ipykernel compares its keys (bytes) with the file's (text), finds
        them different and rewrites a file that Landlock lets the kernel only read. A kernel
        that left root before this (enter_namespace) compares with what it read as root.
        """
        cf = self.abs_connection_file
        read = self.confinement.read_as_root.get(cf) if self.confinement is not None else None
        existing = None if read is None else json.loads(read)
        if existing is not None or (self.curve_publickey is not None and os.path.exists(cf)):
            if existing is None:
                with open(cf) as file:
                    existing = json.load(file)
            ours = {"key": self.session.key.decode(),
                    **{f"{name}_port": getattr(self, f"{name}_port")
                       for name in ("shell", "iopub", "stdin", "control", "hb")}}
            if self.curve_publickey is not None:
                ours.update(curve_publickey=self.curve_publickey.decode(),
                            curve_secretkey=(self.curve_secretkey or b"").decode())
            if all(existing.get(name) == value for name, value in ours.items()):
                return
        super().write_connection_file(**kwargs)

    def _try_bind_socket(self, s: zmq.Socket[Any], port: int) -> Any:
        """ipykernel's bind, on the listener bound before the namespace move when there is one."""
        _use_prebound(s, self.prebound, port)
        return super()._try_bind_socket(s, port)

    def init_heartbeat(self) -> None:
        """Start ipykernel's heartbeat, as SandboxHeartbeat: it binds the prebound listener.

        ipykernel names its Heartbeat class in its module and has no setting for it; the swap
        is made for this call only.
        """
        SandboxHeartbeat.prebound = self.prebound
        kernelapp.Heartbeat = SandboxHeartbeat  # type: ignore[misc]
        try:
            super().init_heartbeat()
        finally:
            kernelapp.Heartbeat = Heartbeat  # type: ignore[misc]

    def init_confinement(self) -> None:
        """Every layer due while this is the only thread (confine/sequence.py)."""
        self.confinement = Confinement(self.policy, self.channels(), self.kernel_id)
        self.confinement.before_threads()

    def channels(self) -> Channels:
        """What the channels need kept through the layers: the connection file, the ports."""
        return Channels(files=tuple(self.channel_files()), ports=self.channel_ports(),
                        ip=self.ip, connection_file=self.abs_connection_file,
                        bound=self.take_listeners)

    def channel_files(self) -> list[str]:
        """The files the channels need read: the connection file (a one-shot kernel has none)."""
        return [self.abs_connection_file]

    def channel_ports(self) -> dict[str, int]:
        """The TCP ports the channels bind, by name; none over ipc (or in a one-shot kernel)."""
        if self.transport != "tcp":
            return {}
        return {"shell": self.shell_port, "iopub": self.iopub_port, "stdin": self.stdin_port,
                "control": self.control_port, "hb": self.hb_port}

    def take_listeners(self, listeners: dict[str, socket.socket]) -> None:
        """The channels' listeners, bound before the namespace move: libzmq takes them."""
        for name, listener in listeners.items():
            setattr(self, f"{name}_port", listener.getsockname()[1])
        self.prebound.update({lsn.getsockname()[1]: lsn for lsn in listeners.values()})

    @property
    def kernel_id(self) -> str:
        """The id Jupyter gave this kernel (its connection file's name), for the audit record."""
        name = os.path.splitext(os.path.basename(self.connection_file))[0]
        return name.removeprefix("kernel-") or str(os.getpid())

    def wait_for_heartbeat(self, timeout: float = 10.0) -> None:
        """Wait until the heartbeat thread has bound its socket: the filter refuses bind()."""
        # ipykernel binds every other socket in this thread before it returns; the heartbeat
        # binds in its own thread, which may not have run yet.
        heartbeat = self.heartbeat
        if isinstance(heartbeat, SandboxHeartbeat):
            if not heartbeat.bound.wait(timeout):
                self.refuse_to_start(f"the heartbeat did not bind port {self.hb_port} within "
                                     f"{timeout:g} s")
            return
        deadline = time.monotonic() + timeout
        while not _listening(self.transport, self.ip, self.hb_port):
            if time.monotonic() > deadline:
                self.refuse_to_start(f"the heartbeat did not bind port {self.hb_port} within "
                                     f"{timeout:g} s")
            time.sleep(0.005)

    def leave(self) -> NoReturn:
        """After shutdown: ipykernel's own clean-up, then exit without finalising Python.

        Finalisation would run the user's atexit callbacks and __del__ methods (code that can
        stall the exit as long as it likes) and garbage-collect every module of the process:
        seconds of CPU on a loaded host before the kernel's process is gone.
        """
        # The control thread stops the main loop from inside shutdown_request, then still
        # publishes its "idle" status; close() stops IOPub first, and a control thread still
        # sending then blocks for good on the dead pipe (or libzmq aborts). Let it finish first.
        if self.control_thread is not None and self.control_thread.is_alive():
            self.control_thread.stop()
            self.control_thread.join()
        self.close()  # sockets closed, ipykernel's other threads stopped
        for stream in (sys.__stdout__, sys.__stderr__):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)

    def refuse_to_start(self, reason: str) -> NoReturn:
        """Exit before any user code runs, with one line on the real stderr."""
        os.write(self.launcher_stderr, f"sandbox-kernel: refusing to start: {reason}\n".encode())
        os._exit(3)


def _listening(transport: str, ip: str, port: int) -> bool:
    """Whether this process listens on this ZMQ endpoint (TCP port, or ipc path)."""
    if transport == "ipc":
        return os.path.exists(f"{ip}-{port}")
    for name in os.listdir("/proc/self/fd"):  # our own few descriptors, not the host's tables
        try:
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            probe = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile
            continue
        with probe:
            if (probe.family in (socket.AF_INET, socket.AF_INET6)
                    and probe.getsockname()[1] == port
                    and probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                return True
    return False


def main(argv: list[str] | None = None) -> None:
    """Run the sandboxed kernel (what the kernelspec's argv starts)."""
    app = SandboxKernelApp.instance()
    app.initialize(argv if argv is not None else sys.argv[1:])
    app.start()  # returns once a shutdown_request has stopped the event loop
    app.leave()
