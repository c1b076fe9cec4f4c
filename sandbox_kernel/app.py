"""The kernel application: ipykernel's start-up sequence with the sandbox layers put in place.

1. clean environment (environment.ensure_clean, run by __main__ before the heavy imports)
2. scratch as cwd, rlimits, privilege drop             } in init_sockets, while exactly one
3. Landlock                                            } thread exists
4. IPKernelApp binds the ZMQ sockets and starts its threads
5. seccomp with TSYNC, into every thread
6. start(): user code runs only from here on
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, NoReturn

from ipykernel.kernelapp import IPKernelApp, kernel_aliases, kernel_flags
from traitlets import Dict as DictTrait
from traitlets import DottedObjectName, Instance, Type, default

from .confine import denials, landlock, limits, paths, privileges, scratch, seccomp
from .confine.environment import SCRATCH_VAR
from .kernel import SandboxKernel
from .policy import SandboxPolicy, app_aliases, app_flags


class SandboxKernelApp(IPKernelApp):
    """IPKernelApp that confines its own process before any user code can run."""

    name = "sandbox-kernel"
    description = "A Jupyter kernel for untrusted Python code."
    classes = [*IPKernelApp.classes, SandboxKernel, SandboxPolicy]  # noqa: RUF012
    flags = DictTrait({**kernel_flags, **app_flags()})
    aliases = DictTrait({**kernel_aliases, **app_aliases()})

    kernel_class = Type(SandboxKernel, klass="ipykernel.kernelbase.Kernel",  # type: ignore[assignment]
                        help="The kernel class to run.").tag(config=True)
    outstream_class = DottedObjectName("sandbox_kernel.output.CappedOutStream",
                                       help="The stream class; it enforces the output cap.")
    policy = Instance(SandboxPolicy, help="The effective sandbox policy.")
    layers = DictTrait(help="What each sandbox layer did in this process.")
    launcher_stderr = 2

    @default("policy")
    def _default_policy(self) -> SandboxPolicy:
        return SandboxPolicy(parent=self)

    def initialize(self, argv: Any = None) -> None:
        """Confine, bind sockets and start ipykernel's threads, then filter every thread."""
        # The pipe carries output of forked children, which cannot exist here; Landlock refuses
        # the random port it would bind, and that is fine.
        warnings.filterwarnings("ignore", message="Couldn't bind IOPub Pipe")
        # ipykernel points file descriptor 2 at the frontend; keep the launcher's log.
        self.launcher_stderr = os.dup(2)
        super().initialize(argv)
        if self.subapp is not None:
            return
        # Switching user only now: ipykernel re-reads its root-only connection file above.
        privileges.switch(self.layers["privileges"], self.layers["scratch"]["path"])
        self.init_seccomp()
        denials.install(self.policy.allow_network)
        self.kernel.sandbox_info = {"policy": self.policy.as_dict(), "layers": dict(self.layers)}

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

    def init_confinement(self) -> None:
        """Scratch, limits, privileges and Landlock, while this is the only thread."""
        scratch_dir = os.environ.get(SCRATCH_VAR, "")
        if not scratch.is_own(scratch_dir):
            self.refuse_to_start("no private scratch directory: start the kernel with "
                                 "`python -I -m sandbox_kernel`, which creates one")
        os.chdir(scratch_dir)
        self.layers["scratch"] = {"path": scratch_dir, "quota": scratch.quota(scratch_dir)}
        policy = self.policy
        try:
            read_grants = paths.check_grants(policy.read_paths)
            write_grants = paths.check_grants(policy.write_paths)
            self.layers["limits"] = limits.apply(policy.memory_limit, policy.cpu_limit,
                                                 policy.file_size_limit, policy.open_files_limit)
            self.layers["privileges"] = privileges.plan(policy.run_as)
        except (OSError, ValueError, privileges.PrivilegeError) as exc:
            self.refuse_to_start(str(exc))
        self.init_landlock(paths.read_only(read_grants, self.abs_connection_file),
                           paths.read_write(write_grants, scratch_dir))

    def init_landlock(self, read_only: list[str], read_write: list[str]) -> None:
        """Restrict files, TCP ports and IPC scopes (fail closed)."""
        if not self.policy.require_landlock:
            self.layers["landlock"] = {"active": False, "reason": "off by policy (--no-landlock)"}
            return
        ports = (self.shell_port, self.iopub_port, self.stdin_port, self.hb_port,
                 self.control_port)
        rules = landlock.LandlockRules(
            read_only=tuple(read_only), read_write=tuple(read_write),
            bind_tcp_ports=tuple(ports) if self.transport == "tcp" else (),
            connect_tcp=self.policy.allow_network)
        try:
            self.layers["landlock"] = {"active": True, **landlock.apply(rules)}
        except landlock.LandlockError as exc:
            self.refuse_to_start(
                f"landlock: {exc}. To run without file-system confinement on purpose, start "
                "the kernel with --no-landlock")

    def init_seccomp(self) -> None:
        """Load the filter into all threads now that the sockets exist (fail closed)."""
        if not self.policy.require_seccomp:
            self.layers["seccomp"] = {"active": False, "reason": "off by policy (--no-seccomp)"}
            return
        try:
            seccomp.install(os.getpid(), self.policy.allow_network)
        except seccomp.SeccompError as exc:
            self.refuse_to_start(
                f"seccomp: {exc}. To run without a system-call filter on purpose, start the "
                "kernel with --no-seccomp")
        self.layers["seccomp"] = {"active": True, **seccomp.describe(self.policy.allow_network)}

    def refuse_to_start(self, reason: str) -> NoReturn:
        """Exit before any user code runs, with one line on the real stderr."""
        os.write(self.launcher_stderr, f"sandbox-kernel: refusing to start: {reason}\n".encode())
        os._exit(3)


def main(argv: list[str] | None = None) -> None:
    """Run the sandboxed kernel (what the kernelspec's argv starts)."""
    app = SandboxKernelApp.instance()
    app.initialize(argv if argv is not None else sys.argv[1:])
    app.start()
