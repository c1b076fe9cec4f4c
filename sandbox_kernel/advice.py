"""How to change a kernel's policy, said in the words of whoever started the kernel.

A refusal's explanation ends with the step that would allow it. That step depends on the
launcher: a kernelspec is reinstalled with the scope it was installed with (a `--user` one
after a `--sys-prefix` set-up would be shadowed by it and change nothing), `sandbox-kernel
run` takes the flag itself, a server is restarted with it, and a caller of the Python client
gives `SandboxPolicy(...)`. Each launcher says which it is in the policy's `changed_with`
(`SandboxPolicy.changed_with`); the kernel reads it here. Empty: a kernelspec installed before
the policy said so, whose scope is unknown.

Below confine/ (denials words its refusals with `change`), so it imports nothing of ours: the
policy's flags reach it from policy.py, which registers SandboxPolicy when it is imported
(`register`; every process that words a Python caller's advice holds a SandboxPolicy).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

INSTALL = "sandbox-kernel install"
# Flags after the file: before it, a bare `--grant-cwd` would take the file for its value.
RUN = "sandbox-kernel run FILE"
PYTHON = "SandboxPolicy"  # the launcher is a caller of the Python client
_policy: list[Any] = []  # SandboxPolicy, once policy.py registered it


def register(policy: Any) -> None:
    """Take the policy class whose configurable traits' `flag` tags name the flags."""
    _policy[:] = [policy]


def install_command(name: str, default_name: str, user: bool = False,
                    prefix: str | None = None, sys_prefix: bool = False) -> str:
    """The `sandbox-kernel install` command that writes the same kernelspec again."""
    scope = ["--user"] if user else ["--sys-prefix"] if sys_prefix else \
        ["--prefix", prefix] if prefix else []
    named = ["--name", name] if name != default_name else []
    return shlex.join([*INSTALL.split(), *scope, *named])


def change(launcher: str, flags: str, aside: tuple[str, str] | None = None) -> str:
    """The step that puts flags (`--grant-cwd=rw`) into the policy of the kernel launcher
    started; aside: other flags and what they would do instead, said in brackets."""
    launcher = launcher or INSTALL
    said = f"`{_form(launcher, flags)}`"
    if aside is not None:
        said += f" ({_form(launcher, aside[0], bare=True)} {aside[1]})"
    if launcher == PYTHON:
        return f"start the sandbox with {said}"
    if launcher.startswith(INSTALL):
        return f"reinstall the kernelspec with {said}, its other flags as before, and restart " \
            "the kernel"
    if launcher.startswith(RUN):
        return f"run it again with {said}"
    return f"restart the server with {said}"


def _form(launcher: str, flags: str, bare: bool = False) -> str:
    if launcher != PYTHON or not _policy:  # (no policy registered: its flags)
        return flags if bare else f"{launcher} {flags}"
    keywords = ", ".join(f"{name}={json.dumps(value)}" for name, value in _keywords(flags))
    return keywords if bare else f"SandboxPolicy({keywords})"


def _keywords(flags: str) -> list[tuple[str, Any]]:
    """SandboxPolicy's keyword arguments for command-line flags (`--read-path /x`)."""
    from traitlets import Bool, List

    by_flag = {trait.metadata["flag"]: (name, trait) for name, trait
               in _policy[0].class_traits(config=True).items() if trait.metadata.get("flag")}
    words, keywords = shlex.split(flags), {}  # type: ignore[var-annotated]
    while words:
        option, _, value = words.pop(0).removeprefix("--").partition("=")
        name, trait = by_flag[option]
        if isinstance(trait, Bool):
            keywords[name] = trait.metadata.get("flag_value", True)
            continue
        if not value:
            value = words.pop(0) if words and not words[0].startswith("--") \
                else trait.metadata["flag_const"]
        if isinstance(trait, List):
            keywords.setdefault(name, []).append(value)
        else:
            keywords[name] = value
    return list(keywords.items())
