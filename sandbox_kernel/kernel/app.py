"""The kernel application: ipykernel's start-up sequence with the sandbox layers put in place.

1. clean environment and the reaper, which keeps the launcher's stdio (environment.ensure_clean,
   run by __main__ before the heavy imports)
2. scratch as cwd, rlimits, audit file, identity       } in init_sockets, while exactly one
   (a uid of its own; a view of the interpreter)      } thread exists
   the channels' listening sockets bound, then a       }
   network namespace of its own (netns.py) and the     }
   egress listener in it, handed to the reaper         }
3. Landlock                                            }
4. IPKernelApp hands the bound listeners to libzmq and starts its threads (all of them in the
   private namespace); the uid is switched (before the namespace instead, where root may not
   make one: the kernel's own uid makes it in a user namespace, see enter_namespace)
5. seccomp with TSYNC, into every thread; its listener (and the audit file) go to the reaper
6. start(): user code runs only from here on
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from ..confine import (
    audit,
    denials,
    environment,
    handover,
    landlock,
    limits,
    netns,
    paths,
    privileges,
    promises,
    scratch,
    seccomp,
)
from ..confine.environment import (
    READY_VAR,
    REAPER_VAR,
    SCRATCH_VAR,
    apply_policy_env,
    ready_pipe,
    refused_names,
)
from ..confine.errors import ConfinementError
from ..confine.tally import Tally
from ..policy import SandboxPolicy, app_aliases, app_flags
from .kernel import SandboxKernel, skip_unshown_records
from .parser_cache import PrebuiltParser

# ipykernel's IOPub pipe carries output of forked children, which cannot exist in this kernel;
# Landlock refuses the random port it would bind, and that is fine. Set here, on import, so that
# a fork server's kernels find the filter (and its compiled pattern) ready.
warnings.filterwarnings("ignore", message="Couldn't bind IOPub Pipe")

EGRESS_PORT = 3128  # the egress proxy, on the loopback of the kernel's own namespace


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
    layers = DictTrait(help="What each sandbox layer did in this process.")
    file_access = Instance(denials.FileAccess, allow_none=True,
                           help="The grants, for explaining file errors to the user.")
    launcher_stderr = 2
    prebound: ClassVar[dict[int, socket.socket]] = {}  # port -> listener, until libzmq takes it
    reaper_channel: int | None = None  # handovers to the reaper, closed before user code runs
    ready_pipe: int | None = None  # the launcher's: told when the sockets listen, then closed
    told_listening = False
    switched = False  # user code's uid taken already (enter_namespace)
    connection_read_as_root: dict[str, Any] | None = None  # the file, read before that switch
    audit_file: int | None = None
    refusals: Tally | None = None  # the reaper's count of refused calls, read-only here

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
        """The last layers, once every thread exists: the uid switch, then seccomp."""
        # Switching user only now: ipykernel re-reads its root-only connection file
        # (unless the network namespace needed the switch first: enter_namespace).
        if not self.switched:
            privileges.switch(self.layers["privileges"], self.layers["scratch"]["path"])
        self.init_seccomp()

    def hand_to_user_code(self) -> None:
        """Confined: drop the handovers, set the policy's environment and what explains refusals."""
        self.close_handovers()
        apply_policy_env(self.policy.env)  # user code's variables, now that it is confined
        denials.install(self.policy.allow_network,
                        proxy=bool(self.layers.get("network", {}).get("egress")),
                        launcher=self.policy.changed_with)
        self.kernel.file_access = self.file_access
        self.kernel.usage.refusals = self.refusals
        # changed_with is how its launcher words advice, not what confines the kernel
        policy = {name: value for name, value in self.policy.as_dict().items()
                  if name != "changed_with"}
        self.kernel.sandbox_info = {"policy": policy, "layers": dict(self.layers)}

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
        existing = self.connection_read_as_root
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
        """Scratch, limits, privileges and Landlock, while this is the only thread."""
        scratch_dir = os.environ.get(SCRATCH_VAR, "")
        if not scratch.is_own(scratch_dir):
            raise scratch.ScratchError("no private scratch directory: start the kernel with "
                                       "`python -I -m sandbox_kernel`, which creates one")
        try:
            launch_dir = os.getcwd()
        except OSError:  # started in a directory that is gone
            launch_dir = ""
        os.chdir(scratch_dir)
        size, files = scratch.quotas(scratch_dir)
        self.layers["scratch"] = {"path": scratch_dir, "quota": size, "files": files}
        channel = os.environ.get(REAPER_VAR, "")
        self.reaper_channel = int(channel) if channel.isdigit() else None
        self.ready_pipe = ready_pipe(os.environ)
        os.environ.pop(READY_VAR, None)
        policy = self.policy
        refusal = refused_names(policy.env, policy.pass_env, policy.allow_loader_env)
        if refusal:  # the reason names the flag that allows these variables
            raise ConfinementError(refusal, layer="environment")
        cwd = self.init_cwd_grant(launch_dir)
        try:
            granted = (paths.check_grants(policy.read_paths, "--read-path"),
                       paths.check_grants(policy.write_paths, "--write-path"))
            read_grants, write_grants = granted[0] + cwd["read"], granted[1] + cwd["write"]
            self.init_audit(scratch_dir, write_grants)
            self.init_identity([scratch_dir, *read_grants, *write_grants], write_grants)
            heap = limits.heap_limit(policy.memory_limit, self.layers["scratch"]["quota"])
            self.layers["limits"] = limits.apply(
                heap, policy.cpu_limit, policy.file_size_limit,
                policy.open_files_limit, policy.max_threads, self.layers["privileges"]["uid"],
                policy.nice)
        except (OSError, ValueError) as exc:  # a grant, limit or audit file the host refuses
            raise ConfinementError(str(exc), layer="set-up") from exc
        self.init_network()
        self.init_promises()
        read_only = paths.read_only(read_grants, *self.channel_files())
        read_write = paths.read_write(write_grants, scratch_dir)
        self.init_landlock(read_only, read_write, (*granted[0], *granted[1]))
        if cwd["path"]:  # after the view and Landlock: the path as user code will see it
            os.chdir(cwd["path"])
        # Jupyter starts a kernel in its notebook's folder: remembered to explain open("x.csv").
        self.file_access = (
            denials.FileAccess.granted(read_only + read_write, read_write, scratch_dir, launch_dir,
                                       self.layers["privileges"].get("covered", ()))
            if self.layers["landlock"]["active"]
            else denials.FileAccess(False, scratch=scratch_dir, launch_dir=launch_dir))
        self.layers["files"] = paths.describe_grants(
            *granted, cwd["path"], policy.grant_cwd, self.layers["cwd"]["refused"] or "") \
            if self.layers["landlock"]["active"] else [
                "everything this kernel's uid may reach: no file-system confinement "
                f"({self.layers['landlock'].get('reason', 'Landlock is off')})"]
        self.file_access = dataclasses.replace(
            self.file_access, cwd_mode=self.policy.grant_cwd,
            cwd_refused=self.layers["cwd"]["refused"] or "", launcher=self.policy.changed_with)

    def init_cwd_grant(self, launch_dir: str) -> dict[str, Any]:
        """The folder the kernel started in, granted as --grant-cwd asks (unless unsafe)."""
        mode = self.policy.grant_cwd
        refused = paths.cwd_refusal(launch_dir, self.abs_connection_file,
                                    self.audit_path) if mode else None
        path = os.path.realpath(launch_dir) if mode and not refused else ""
        self.layers["cwd"] = {"mode": mode, "path": path or None, "started_in": launch_dir,
                              "refused": refused}
        return {"path": path, "read": [path] if path and mode == "ro" else [],
                "write": [path] if path and mode == "rw" else []}

    def channel_files(self) -> list[str]:
        """The files the channels need read: the connection file (a one-shot kernel has none)."""
        return [self.abs_connection_file]

    def channel_ports(self) -> dict[str, int]:
        """The TCP ports the channels bind, by name; none over ipc (or in a one-shot kernel)."""
        if self.transport != "tcp":
            return {}
        return {"shell": self.shell_port, "iopub": self.iopub_port, "stdin": self.stdin_port,
                "control": self.control_port, "hb": self.hb_port}

    def init_network(self) -> None:
        """Bind the channels here, then move into a network namespace of the kernel's own.

        Every thread made from here on (ipykernel's, libzmq's, user code's) is born in the
        private namespace; the channels' listeners stay in the launcher's (see netns.py).
        """
        policy = self.policy
        channels = self.channel_ports()
        if channels:
            try:
                listeners = netns.prebind(self.ip, channels)
            except netns.NamespaceError as exc:
                raise ConfinementError(str(exc), layer="network") from exc
            for name, listener in listeners.items():
                setattr(self, f"{name}_port", listener.getsockname()[1])
            self.prebound.update({lsn.getsockname()[1]: lsn for lsn in listeners.values()})
            # All five listen now: a client that connects waits in their backlogs until libzmq
            # takes them over, so its connections and first request overlap the rest of the
            # start instead of following it.
            self.tell_listening()
        try:
            layer = self.enter_namespace()
        except netns.NamespaceError as exc:
            if policy.network != "off":
                raise ConfinementError(
                    f"network {policy.network}: {exc.strerror}. Without a namespace of its own "
                    "user code could reach the host's loopback and other kernels: "
                    f"{netns.NAMESPACE_FIX}", layer="network") from exc
            self.layers["network"] = {"active": False, "mode": "off", "reason": exc.strerror}
            return
        layer["mode"] = policy.network
        if policy.network != "off":
            layer["egress"] = self.init_egress()
        if layer["owner"] != "root":
            # A new user namespace grants every capability in it, bounding set included.
            privileges.drop_bounding_set()
            netns.drop_capabilities()
        self.layers["network"] = layer

    def enter_namespace(self) -> dict[str, Any]:
        """Enter a network namespace of the kernel's own; return netns.enter's description.

        Root makes it where root may (a host; a container with CAP_SYS_ADMIN). Where root may
        not (a container without it), a kernel that takes a uid of its own switches to it now
        and makes it inside a user namespace of its own, which a container's seccomp profile
        can allow alone: unshare(CLONE_NEWUSER|CLONE_NEWNET), nothing wider (deploy/service).
        """
        try:
            return netns.enter()
        except netns.NamespaceError:
            planned = self.layers["privileges"]
            # A uid of its own only: the maps need /proc/self, which a shared uid keeps closed.
            if os.geteuid() != 0 or not planned.get("own"):
                raise
        # ipykernel re-reads the root-only connection file after this: read it while we can
        # (a one-shot kernel has none: channel_files() is empty).
        if self.channel_files():
            with open(self.abs_connection_file) as file:
                self.connection_read_as_root = json.load(file)
        privileges.switch(planned, self.layers["scratch"]["path"])
        self.switched = True
        return netns.enter()

    def init_egress(self) -> dict[str, Any]:
        """The egress listener on the namespace's loopback, served by the reaper from outside."""
        policy = self.policy
        if self.reaper_channel is None:
            raise ConfinementError(f"network {policy.network} needs the reaper to serve the "
                                   "egress proxy: start the kernel with `python -I -m "
                                   "sandbox_kernel`", layer="network")
        try:
            netns.loopback_up()
            listener = netns.egress_listener(EGRESS_PORT)
        except OSError as exc:
            raise ConfinementError(f"network {policy.network}: cannot set up the egress "
                                   f"listener: {exc}", layer="network") from exc
        settings = {"kernel": self.kernel_id, "mode": policy.network,
                    "allow_hosts": policy.allow_hosts,
                    "allow_addresses": policy.allow_addresses,
                    "upstream_proxy": policy.upstream_proxy,
                    "upstream_ca": policy.upstream_ca}
        files = [listener.fileno()]
        if self.audit_file is not None:
            files.append(self.audit_file)
        try:
            handover.hand_over(self.reaper_channel, {"egress": settings}, files)
        finally:
            listener.close()
        url = f"http://127.0.0.1:{EGRESS_PORT}"
        os.environ.update(environment.proxy_variables(url))
        if policy.secrets or policy.secrets_file:
            self.trust_kernel_ca()
        return {"proxy": url, "allow_hosts": policy.allow_hosts,
                "allow_addresses": policy.allow_addresses,
                "upstream_proxy": bool(policy.upstream_proxy)}

    def trust_kernel_ca(self) -> None:
        """Trust the CA the companion made for this kernel's secrets (egress/trust.py)."""
        from ..confine.egress.trust import trust_variables

        assert self.reaper_channel is not None
        certificate = handover.ask(self.reaper_channel, {"ca": True})
        if certificate != b"none":  # none: the launcher had no value for any secret
            try:
                os.environ.update(trust_variables(certificate,
                                                  self.layers["scratch"]["path"]))
            except (OSError, ValueError) as exc:
                raise ConfinementError(f"secrets: cannot trust the kernel's CA: {exc}",
                                       layer="network") from exc

    def init_promises(self) -> None:
        """Refuse to start unless every promise of the policy is kept by some layer here."""
        policy = self.policy
        host = promises.Host(
            landlock_abi=landlock.abi_version(policy.landlock_abi),
            landlock_on=policy.require_landlock, seccomp_reason=seccomp.available(),
            seccomp_on=policy.require_seccomp, allow_network=policy.allow_network,
            max_threads=policy.max_threads, memory_limit=policy.memory_limit,
            uid=self.layers["privileges"]["uid"])
        judged = promises.evaluate(host)
        promises.require(judged)
        self.layers["promises"] = [promise.as_dict() for promise in judged]

    def init_landlock(self, read_only: list[str], read_write: list[str],
                      exact: tuple[str, ...] = ()) -> None:
        """Restrict files, TCP ports and IPC scopes (fail closed); exact: the policy's grants,
        whose rules must reach them through no symbolic link (see paths.check_grants)."""
        if not self.policy.require_landlock:
            self.layers["landlock"] = {"active": False, "reason": "off by policy (--no-landlock)"}
            return
        rules = landlock.LandlockRules(
            read_only=tuple(read_only), read_write=tuple(read_write),
            bind_tcp_ports=tuple(self.channel_ports().values()),
            connect_tcp=self.policy.allow_network, abi_cap=self.policy.landlock_abi,
            exact=exact)
        self.layers["landlock"] = {"active": True, **landlock.apply(rules)}

    def init_identity(self, reachable: list[str], writable: list[str]) -> None:
        """Decide whom user code runs as; the reaper keeps the uid until the kernel is gone.

        reachable: what user code must reach besides the interpreter (scratch and grants);
        writable: the write grants, where a uid's files may outlive its kernel.
        """
        policy = self.policy
        if policy.run_as == "auto" and os.geteuid() == 0 and self.reaper_channel is None:
            raise privileges.PrivilegeError(
                "a uid of the kernel's own needs the reaper to hold it: start the kernel with "
                "`python -I -m sandbox_kernel`, or choose --run-as USER")
        # Root re-reads the connection file after this (ipykernel's write_connection_file).
        planned, lock = privileges.plan(policy.run_as, policy.uid_range, reachable,
                                        self.channel_files(), writable,
                                        policy.uid_lock_dir)
        if lock is not None:
            assert self.reaper_channel is not None
            try:
                handover.hand_over(self.reaper_channel, {"hold": f"uid {planned['uid']}"}, [lock])
            finally:
                os.close(lock)
        self.layers["privileges"] = planned

    @property
    def audit_path(self) -> str:
        """The audit file: --audit-log, or the default one (`check` names it)."""
        return self.policy.audit_log or audit.default_path()

    def init_audit(self, scratch_dir: str, write_grants: list[str]) -> None:
        """Open the audit file now, as the launching user, for the reaper to keep.

        An --audit-log that cannot be opened refuses the start; the default one that cannot
        leaves the record on the launcher's log, as the reaper then says on every line.
        """
        given = self.policy.audit_log
        path = os.path.realpath(self.audit_path) if self.audit_path else ""
        self.layers["audit"] = {"recorder": "reaper", "audit_log": path or None,
                                "kernel": self.kernel_id}
        if not path:
            return
        for writable in map(os.path.realpath, (scratch_dir, *write_grants)):
            if os.path.commonpath([path, writable]) == writable:
                raise ValueError(f"the audit log {path} is inside {writable}, which user code "
                                 "may write: choose --audit-log PATH outside the scratch and "
                                 "every --write-path")
        if self.reaper_channel is None:
            if given:
                raise ValueError("--audit-log needs the reaper: start the kernel with "
                                 "`python -I -m sandbox_kernel`")
            self.layers["audit"]["audit_log"] = None
            return
        try:
            self.audit_file = audit.open_log(path, make_folder=not given)
        except OSError as exc:
            if given:
                raise ValueError(f"cannot open --audit-log {path}: {exc.strerror}") from None
            self.layers["audit"].update(audit_log=None, reason=f"the default audit log {path} "
                                        f"cannot be opened ({exc.strerror}): set --audit-log")

    def init_seccomp(self) -> None:
        """Load the filter into all threads now that the sockets exist (fail closed).

        With a reaper, the calls the filter refuses wait for the reaper's answer, and it records
        them; the kernel keeps no copy of the listener.
        """
        if not self.policy.require_seccomp:
            self.layers["seccomp"] = {"active": False, "reason": "off by policy (--no-seccomp)"}
            return
        landlock_layer = self.layers["landlock"]
        abi = landlock_layer["abi"] if landlock_layer["active"] else 0
        self.wait_for_heartbeat()
        notify = self.reaper_channel is not None
        tally_fd = None
        try:
            # The reaper counts what it refuses here, for each execution's usage (tally.py).
            tally_fd = Tally.create() if notify else None
            self.refusals = None if tally_fd is None else Tally(tally_fd, writable=False)
            listener = seccomp.install(os.getpid(), self.policy.allow_network,
                                      landlock_abi=abi, notify=notify)
            if listener is not None:
                self.hand_listener(listener, tally_fd)
        except OSError as exc:  # the count's memfd, or the handover to the reaper
            raise seccomp.SeccompError("preparing the reaper's answers to refused calls "
                                       f"failed: {exc}") from exc
        finally:
            if tally_fd is not None:
                os.close(tally_fd)
        self.layers["seccomp"] = {"active": True,
                                  **seccomp.describe(self.policy.allow_network, notify,
                                                     landlock_abi=abi)}

    def hand_listener(self, listener: int, tally_fd: int | None = None) -> None:
        """Give the reaper the seccomp listener, the refusal count and the audit file."""
        assert self.reaper_channel is not None
        counted = [] if tally_fd is None else [tally_fd]
        files = [listener, *counted] + ([self.audit_file] if self.audit_file is not None else [])
        settings = {"kernel": self.kernel_id, "uid": os.getuid(), "tally": bool(counted)}
        try:
            handover.hand_over(self.reaper_channel, {"audit": settings}, files)
        finally:
            os.close(listener)

    @property
    def kernel_id(self) -> str:
        """The id Jupyter gave this kernel (its connection file's name), for the audit record."""
        name = os.path.splitext(os.path.basename(self.connection_file))[0]
        return name.removeprefix("kernel-") or str(os.getpid())

    def tell_listening(self) -> None:
        """Tell the launcher's ready pipe, once, that every channel accepts connections."""
        if self.ready_pipe is not None and not self.told_listening:
            self.told_listening = True
            try:
                os.write(self.ready_pipe, b"listening\n")
            except OSError:
                pass  # the launcher stopped waiting: nothing to tell

    def close_handovers(self) -> None:
        """Close the channel to the reaper, the audit file and the log dup: user code is next.

        The launcher's ready pipe hears first that every socket listens, unless the prebound
        TCP listeners told it already (init_network): its clients' first connections succeed,
        instead of waiting out libzmq's 100 ms reconnect interval after connecting to a port
        not bound yet.
        """
        self.tell_listening()
        for fd in (self.reaper_channel, self.audit_file, self.launcher_stderr, self.ready_pipe):
            if fd is not None and fd > 2:
                os.close(fd)
        self.reaper_channel = self.audit_file = self.ready_pipe = None
        self.launcher_stderr = 2

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
