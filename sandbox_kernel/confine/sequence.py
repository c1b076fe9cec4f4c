"""The confinement sequence: every layer of a kernel process, in DESIGN.md §3's order.

One procedure for both kinds of kernel process: the ZMQ kernel's application (kernel/app.py)
runs it around ipykernel's start-up, a one-shot kernel (kernel/oneshot.py) in each pooled
process before its request. The process's transport says what its channels need kept through
the layers (`Channels`: files to read, TCP ports to bind in the launcher's namespace) and
calls the three steps at its own points:

1. `before_threads`, while exactly one thread exists: scratch as cwd, the environment refusal,
   the cwd grant, the audit file, the identity (a uid of its own, its lock to the companion;
   a view of the interpreter), rlimits and the CPU priority, the channels' listeners bound and
   then a network namespace of its own with the egress listener handed out, the promises
   check, Landlock.
2. `finish`, once every thread the transport starts exists: the uid switch (unless the
   namespace needed it first), then seccomp with TSYNC, its listener, the refusal tally and
   the audit file handed to the companion.
3. `hand_to_user_code`, just before user code: the handovers closed, the policy's environment
   set, the explained refusals installed.

What it leaves: `layers` (what each layer did, for kernel_info and the caller's checks),
`file_access` and `refusals` (what explains a refused open and counts refused calls for
usage). Any layer that cannot be put in place raises ConfinementError (errors.py). Nothing here
imports ipykernel, IPython, ZMQ or jupyter_client: a process confines itself without them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import (
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
from .environment import (
    READY_VAR,
    REAPER_VAR,
    SCRATCH_VAR,
    apply_policy_env,
    ready_pipe,
    refused_names,
)
from .errors import ConfinementError
from .tally import Tally

if TYPE_CHECKING:
    from ..policy import SandboxPolicy

EGRESS_PORT = 3128  # the egress proxy, on the loopback of the kernel's own namespace


def _keep_listeners(listeners: dict[str, socket.socket]) -> None:
    """A transport with no use for its prebound listeners: none are made (no ports)."""


@dataclasses.dataclass
class Channels:
    """What a process's transport needs kept through the layers.

    files: read after Landlock (a ZMQ kernel's connection file; a one-shot has none);
    ports: TCP ports bound by name before the namespace move (0: any free one), so that
    frontends reach them from the launcher's namespace; `bound` takes those listeners;
    connection_file: its folder is never granted as the cwd (Jupyter's runtime dir).
    """

    files: tuple[str, ...] = ()
    ports: dict[str, int] = dataclasses.field(default_factory=dict)
    ip: str = "127.0.0.1"
    connection_file: str = ""
    bound: Callable[[dict[str, socket.socket]], None] = _keep_listeners


class Confinement:
    """One process's confinement: the layers applied in order, and what they left."""

    def __init__(self, policy: SandboxPolicy, channels: Channels, kernel_id: str) -> None:
        self.policy, self.channels, self.kernel_id = policy, channels, kernel_id
        self.ports = dict(channels.ports)  # as bound (a port 0 becomes the one taken)
        self.layers: dict[str, Any] = {}
        self.file_access: denials.FileAccess | None = None
        self.refusals: Tally | None = None  # the companion's count of refused calls, read-only
        self.reaper_channel: int | None = None  # to the companion; closed before user code
        self.ready_pipe: int | None = None  # the launcher's: told when the sockets listen
        self.audit_file: int | None = None
        self.told_listening = False
        self.switched = False  # user code's uid taken already (enter_namespace)
        self.read_as_root: dict[str, bytes] = {}  # channel files, read before that switch

    @property
    def audit_path(self) -> str:
        """The audit file: --audit-log, or the default one (`check` names it)."""
        return self.policy.audit_log or audit.default_path()

    # --- 1. while exactly one thread exists -----------------------------------------------------

    def before_threads(self) -> None:
        """Scratch, limits, privileges, network and Landlock, while this is the only thread."""
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
        cwd = self.grant_cwd(launch_dir)
        try:
            granted = (paths.check_grants(policy.read_paths, "--read-path"),
                       paths.check_grants(policy.write_paths, "--write-path"))
            read_grants, write_grants = granted[0] + cwd["read"], granted[1] + cwd["write"]
            self.open_audit(scratch_dir, write_grants)
            self.apply_identity([scratch_dir, *read_grants, *write_grants], write_grants)
            heap = limits.heap_limit(policy.memory_limit, self.layers["scratch"]["quota"])
            self.layers["limits"] = limits.apply(
                heap, policy.cpu_limit, policy.file_size_limit,
                policy.open_files_limit, policy.max_threads, self.layers["privileges"]["uid"],
                policy.nice)
        except (OSError, ValueError) as exc:  # a grant, limit or audit file the host refuses
            raise ConfinementError(str(exc), layer="set-up") from exc
        self.apply_network()
        self.check_promises()
        read_only = paths.read_only(read_grants, *self.channels.files)
        read_write = paths.read_write(write_grants, scratch_dir)
        self.apply_landlock(read_only, read_write, (*granted[0], *granted[1]))
        if cwd["path"]:  # after the view and Landlock: the path as user code will see it
            os.chdir(cwd["path"])
        self.layers["files"] = paths.describe_grants(
            *granted, cwd["path"], policy.grant_cwd, self.layers["cwd"]["refused"] or "") \
            if self.layers["landlock"]["active"] else [
                "everything this kernel's uid may reach: no file-system confinement "
                f"({self.layers['landlock'].get('reason', 'Landlock is off')})"]
        # Jupyter starts a kernel in its notebook's folder: remembered to explain open("x.csv").
        access = (
            denials.FileAccess.granted(read_only + read_write, read_write, scratch_dir, launch_dir,
                                       self.layers["privileges"].get("covered", ()))
            if self.layers["landlock"]["active"]
            else denials.FileAccess(False, scratch=scratch_dir, launch_dir=launch_dir))
        self.file_access = dataclasses.replace(
            access, cwd_mode=policy.grant_cwd, cwd_refused=self.layers["cwd"]["refused"] or "",
            launcher=policy.changed_with)

    def grant_cwd(self, launch_dir: str) -> dict[str, Any]:
        """The folder the kernel started in, granted as --grant-cwd asks (unless unsafe)."""
        mode = self.policy.grant_cwd
        refused = paths.cwd_refusal(launch_dir, self.channels.connection_file,
                                    self.audit_path) if mode else None
        path = os.path.realpath(launch_dir) if mode and not refused else ""
        self.layers["cwd"] = {"mode": mode, "path": path or None, "started_in": launch_dir,
                              "refused": refused}
        return {"path": path, "read": [path] if path and mode == "ro" else [],
                "write": [path] if path and mode == "rw" else []}

    def open_audit(self, scratch_dir: str, write_grants: list[str]) -> None:
        """Open the audit file now, as the launching user, for the companion to keep.

        An --audit-log that cannot be opened refuses the start; the default one that cannot
        leaves the record on the launcher's log, as the companion then says on every line.
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

    def apply_identity(self, reachable: list[str], writable: list[str]) -> None:
        """Decide whom user code runs as; the companion keeps the uid until the kernel is gone.

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
                                        list(self.channels.files), writable,
                                        policy.uid_lock_dir)
        if lock is not None:
            assert self.reaper_channel is not None
            try:
                handover.hand_over(self.reaper_channel, {"hold": f"uid {planned['uid']}"}, [lock])
            finally:
                os.close(lock)
        self.layers["privileges"] = planned

    def apply_network(self) -> None:
        """Bind the channels here, then move into a network namespace of the process's own.

        Every thread made from here on (ipykernel's, libzmq's, user code's) is born in the
        private namespace; the channels' listeners stay in the launcher's (see netns.py).
        """
        policy = self.policy
        if self.ports:
            try:
                listeners = netns.prebind(self.channels.ip, self.ports)
            except netns.NamespaceError as exc:
                raise ConfinementError(str(exc), layer="network") from exc
            self.ports = {name: lsn.getsockname()[1] for name, lsn in listeners.items()}
            self.channels.bound(listeners)
            # All of them listen now: a client that connects waits in their backlogs until
            # libzmq takes them over, so its connections and first request overlap the rest
            # of the start instead of following it.
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
            layer["egress"] = self.hand_out_egress()
        if layer["owner"] != "root":
            # A new user namespace grants every capability in it, bounding set included.
            privileges.drop_bounding_set()
            netns.drop_capabilities()
        self.layers["network"] = layer

    def enter_namespace(self) -> dict[str, Any]:
        """Enter a network namespace of the process's own; return netns.enter's description.

        Root makes it where root may (a host; a container with CAP_SYS_ADMIN). Where root may
        not (a container without it), a process that takes a uid of its own switches to it now
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
        # ipykernel re-reads the root-only connection file after this: read it while we can.
        for path in self.channels.files:
            with open(path, "rb") as file:
                self.read_as_root[path] = file.read()
        privileges.switch(planned, self.layers["scratch"]["path"])
        self.switched = True
        return netns.enter()

    def hand_out_egress(self) -> dict[str, Any]:
        """The egress listener on the namespace's loopback, served by the companion outside."""
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
        from .egress.trust import trust_variables

        assert self.reaper_channel is not None
        certificate = handover.ask(self.reaper_channel, {"ca": True})
        if certificate != b"none":  # none: the launcher had no value for any secret
            try:
                os.environ.update(trust_variables(certificate,
                                                  self.layers["scratch"]["path"]))
            except (OSError, ValueError) as exc:
                raise ConfinementError(f"secrets: cannot trust the kernel's CA: {exc}",
                                       layer="network") from exc

    def check_promises(self) -> None:
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

    def apply_landlock(self, read_only: list[str], read_write: list[str],
                       exact: tuple[str, ...] = ()) -> None:
        """Restrict files, TCP ports and IPC scopes (fail closed); exact: the policy's grants,
        whose rules must reach them through no symbolic link (see paths.check_grants)."""
        if not self.policy.require_landlock:
            self.layers["landlock"] = {"active": False, "reason": "off by policy (--no-landlock)"}
            return
        rules = landlock.LandlockRules(
            read_only=tuple(read_only), read_write=tuple(read_write),
            bind_tcp_ports=tuple(self.ports.values()),
            connect_tcp=self.policy.allow_network, abi_cap=self.policy.landlock_abi,
            exact=exact)
        self.layers["landlock"] = {"active": True, **landlock.apply(rules)}

    # --- 2. once every thread exists ------------------------------------------------------------

    def finish(self, before_filter: Callable[[], None] = lambda: None) -> None:
        """The last layers: the uid switch, then seccomp.

        before_filter: the transport's last step the filter would refuse (the ZMQ heartbeat
        thread binds its socket), run only when a filter is loaded.
        """
        self.switch_user()
        self.apply_seccomp(before_filter)

    def switch_user(self) -> None:
        """Take user code's uid, unless the namespace needed it first (enter_namespace)."""
        # Only now, in a ZMQ kernel: ipykernel re-reads its root-only connection file first.
        if not self.switched:
            privileges.switch(self.layers["privileges"], self.layers["scratch"]["path"])
            self.switched = True

    def apply_seccomp(self, before_filter: Callable[[], None] = lambda: None) -> None:
        """Load the filter into all threads now that the sockets exist (fail closed).

        With a companion, the calls the filter refuses wait for its answer, and it records
        them; this process keeps no copy of the listener.
        """
        if not self.policy.require_seccomp:
            self.layers["seccomp"] = {"active": False, "reason": "off by policy (--no-seccomp)"}
            return
        landlock_layer = self.layers["landlock"]
        abi = landlock_layer["abi"] if landlock_layer["active"] else 0
        before_filter()
        notify = self.reaper_channel is not None
        tally_fd = None
        try:
            # The companion counts what it refuses here, for each execution's usage (tally.py).
            tally_fd = Tally.create() if notify else None
            self.refusals = None if tally_fd is None else Tally(tally_fd, writable=False)
            listener = seccomp.install(os.getpid(), self.policy.allow_network,
                                      landlock_abi=abi, notify=notify)
            if listener is not None:
                self.hand_listener(listener, tally_fd)
        except OSError as exc:  # the count's memfd, or the handover to the companion
            raise seccomp.SeccompError("preparing the reaper's answers to refused calls "
                                       f"failed: {exc}") from exc
        finally:
            if tally_fd is not None:
                os.close(tally_fd)
        self.layers["seccomp"] = {"active": True,
                                  **seccomp.describe(self.policy.allow_network, notify,
                                                     landlock_abi=abi)}

    def hand_listener(self, listener: int, tally_fd: int | None = None) -> None:
        """Give the companion the seccomp listener, the refusal count and the audit file."""
        assert self.reaper_channel is not None
        counted = [] if tally_fd is None else [tally_fd]
        files = [listener, *counted] + ([self.audit_file] if self.audit_file is not None else [])
        settings = {"kernel": self.kernel_id, "uid": os.getuid(), "tally": bool(counted)}
        try:
            handover.hand_over(self.reaper_channel, {"audit": settings}, files)
        finally:
            os.close(listener)

    # --- 3. just before user code ---------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """What a kernel tells of its confinement (kernel_info's `sandbox`): the policy, less
        how its launcher words advice (not what confines the kernel), and each layer."""
        policy = {name: value for name, value in self.policy.as_dict().items()
                  if name != "changed_with"}
        return {"policy": policy, "layers": dict(self.layers)}

    def hand_to_user_code(self) -> None:
        """Confined: drop the handovers, set the policy's environment and what explains refusals."""
        self.close_handovers()
        apply_policy_env(self.policy.env)  # user code's variables, now that it is confined
        denials.install(self.policy.allow_network,
                        proxy=bool(self.layers.get("network", {}).get("egress")),
                        launcher=self.policy.changed_with)

    def tell_listening(self) -> None:
        """Tell the launcher's ready pipe, once, that every channel accepts connections."""
        if self.ready_pipe is not None and not self.told_listening:
            self.told_listening = True
            try:
                os.write(self.ready_pipe, b"listening\n")
            except OSError:
                pass  # the launcher stopped waiting: nothing to tell

    def close_handovers(self) -> None:
        """Close the channel to the companion and the audit file: user code is next.

        The launcher's ready pipe hears first that every socket listens, unless the prebound
        TCP listeners told it already (apply_network): its clients' first connections succeed,
        instead of waiting out libzmq's 100 ms reconnect interval after connecting to a port
        not bound yet.
        """
        self.tell_listening()
        for fd in (self.reaper_channel, self.audit_file, self.ready_pipe):
            if fd is not None and fd > 2:
                os.close(fd)
        self.reaper_channel = self.audit_file = self.ready_pipe = None
