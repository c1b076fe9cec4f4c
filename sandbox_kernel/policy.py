"""The sandbox policy: every knob a kernel is started with, as traitlets and as CLI flags."""

from __future__ import annotations

import argparse
from typing import Any

from traitlets import Bool
from traitlets.config import Configurable


class SandboxPolicy(Configurable):
    """What untrusted code in one kernel may do."""

    allow_network = Bool(
        False,
        help="Let user code create inet/inet6 TCP and UDP sockets. Off: no new sockets at all.",
    ).tag(config=True, flag="allow-network")

    require_seccomp = Bool(
        True,
        help="Refuse to start when the seccomp filter cannot be loaded. Turning this off runs "
        "untrusted code without a system-call filter: only for hosts that cannot load one.",
    ).tag(config=True, flag="no-seccomp", flag_value=False)

    def as_dict(self) -> dict[str, Any]:
        """The effective policy as plain JSON-able values."""
        return {name: getattr(self, name) for name in self.trait_names(config=True)}

    def to_argv(self) -> list[str]:
        """Command-line options that recreate this policy in a kernel process."""
        argv = []
        for name, trait in sorted(self.traits(config=True).items()):
            value = getattr(self, name)
            if value != trait.default():
                argv.append(f"--SandboxPolicy.{name}={value!r}")
        return argv


def app_flags() -> dict[str, tuple[dict[str, Any], str]]:
    """traitlets flags (`--allow-network`, ...) for the kernel application."""
    flags = {}
    for name, trait in SandboxPolicy.class_traits(config=True).items():
        flag = trait.metadata.get("flag")
        if flag:
            value = trait.metadata.get("flag_value", True)
            flags[flag] = ({"SandboxPolicy": {name: value}}, trait.help)
    return flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the policy flags to an argparse parser (install and run share them)."""
    group = parser.add_argument_group("sandbox policy")
    for name, trait in SandboxPolicy.class_traits(config=True).items():
        flag = trait.metadata.get("flag")
        if flag:
            action = "store_false" if trait.metadata.get("flag_value") is False else "store_true"
            group.add_argument(f"--{flag}", dest=name, action=action, default=trait.default(),
                               help=trait.help)


def from_arguments(args: argparse.Namespace) -> SandboxPolicy:
    """Build a validated policy from parsed argparse flags."""
    names = SandboxPolicy.class_trait_names(config=True)
    return SandboxPolicy(**{name: getattr(args, name) for name in names if hasattr(args, name)})
