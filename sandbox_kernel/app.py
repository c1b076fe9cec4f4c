"""The kernel application: ipykernel's start-up sequence with the sandbox layers put in place."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from ipykernel.kernelapp import IPKernelApp, kernel_flags
from traitlets import Dict, Instance, Type, default

from . import denials, seccomp
from .kernel import SandboxKernel
from .policy import SandboxPolicy, app_flags


class SandboxKernelApp(IPKernelApp):
    """IPKernelApp that loads the seccomp filter once the ZMQ sockets are bound."""

    name = "sandbox-kernel"
    description = "A Jupyter kernel for untrusted Python code."
    classes = [*IPKernelApp.classes, SandboxKernel, SandboxPolicy]  # noqa: RUF012
    flags = Dict({**kernel_flags, **app_flags()})

    kernel_class = Type(SandboxKernel, klass="ipykernel.kernelbase.Kernel",
                        help="The kernel class to run.").tag(config=True)
    policy = Instance(SandboxPolicy, help="The effective sandbox policy.")
    layers = Dict(help="What each sandbox layer did in this process.")

    @default("policy")
    def _default_policy(self) -> SandboxPolicy:
        return SandboxPolicy(parent=self)

    def initialize(self, argv: Any = None) -> None:
        """Bind sockets and start ipykernel's threads, then confine every thread."""
        super().initialize(argv)
        if self.subapp is not None:
            return
        self.init_seccomp()
        denials.install(self.policy.allow_network)
        self.kernel.sandbox_info = {"policy": self.policy.as_dict(), "layers": dict(self.layers)}

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
        # sys.stderr now goes to the frontend; the launcher's log is file descriptor 2.
        os.write(2, f"sandbox-kernel: refusing to start: {reason}\n".encode())
        os._exit(3)


def main(argv: list[str] | None = None) -> None:
    """Run the sandboxed kernel (what the kernelspec's argv starts)."""
    app = SandboxKernelApp.instance()
    app.initialize(argv if argv is not None else sys.argv[1:])
    app.start()
