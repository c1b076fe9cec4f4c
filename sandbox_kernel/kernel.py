"""The sandboxed IPython kernel: ipykernel's kernel plus what the sandbox reports and refuses."""

from __future__ import annotations

from typing import Any

from ipykernel.ipkernel import IPythonKernel
from traitlets import Dict

from . import __version__

DEBUGGER_REFUSED = ("debugging is not available in the sandbox: the debugger runs debugpy's "
                    "adapter as a subprocess, and the sandbox forbids creating processes")


class SandboxKernel(IPythonKernel):
    """An IPython kernel that runs inside the sandbox its application set up."""

    implementation = "sandbox_kernel"
    implementation_version = __version__

    sandbox_info = Dict(help="Effective policy and active layers, set by the application.")

    @property
    def banner(self) -> str:  # type: ignore[override]
        return super().banner + "\nsandbox-kernel: no processes; network off unless allowed.\n"

    @property
    def kernel_info(self) -> dict[str, Any]:
        info = super().kernel_info
        info["supported_features"] = [f for f in info["supported_features"] if f != "debugger"]
        info["sandbox"] = self.sandbox_info
        return info

    async def do_debug_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Refuse every debug request with a reason, instead of starting debugpy."""
        return {
            "type": "response",
            "request_seq": msg.get("seq", 0),
            "success": False,
            "command": msg.get("command", ""),
            "message": DEBUGGER_REFUSED,
        }
