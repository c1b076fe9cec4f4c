"""The sandbox policy: every knob a kernel is started with, as traitlets and as CLI flags.

Each configurable trait may carry a `flag` tag: the name of its command-line option, shared by
the kernel application (traitlets), `sandbox-kernel install` and `sandbox-kernel run` (argparse).
"""

from __future__ import annotations

import argparse
from typing import Any

from traitlets import Bool, Dict, Float, Int, List, TraitError, Unicode
from traitlets.config import Configurable

from .confine.limits import DEFAULT_MEMORY_LIMIT, parse_size
from .confine.paths import check_grants
from .confine.privileges import DEFAULT_UID_RANGE
from .confine.scratch import AUTO_SIZE, DEFAULT_SCRATCH_FILES, DEFAULT_SCRATCH_SIZE


class ByteSize(Int):  # type: ignore[type-arg]
    """An integer number of bytes that also accepts 512M / 2G on the command line."""

    def from_string(self, s: str) -> int:
        if s.strip() == "-1" and self.default_value == -1:  # "choose for me", where it may
            return -1
        try:
            return parse_size(s)
        except ValueError as exc:
            raise TraitError(str(exc)) from None


class SandboxPolicy(Configurable):
    """What untrusted code in one kernel may do."""

    allow_network = Bool(
        False,
        help="Let user code create inet/inet6 TCP and UDP sockets. Off: no new sockets at all.",
    ).tag(config=True, flag="allow-network")

    read_paths = List(
        Unicode(), help="Extra paths user code may read (repeatable). Each must exist.",
    ).tag(config=True, flag="read-path", metavar="PATH")

    write_paths = List(
        Unicode(), help="Extra paths user code may read and write (repeatable). Each must exist.",
    ).tag(config=True, flag="write-path", metavar="PATH")

    env = Dict(
        value_trait=Unicode(), key_trait=Unicode(),
        help="Environment variables to set for user code (repeatable NAME=VALUE), applied once "
        "it is confined. Names the dynamic loader or the interpreter act on (LD_*, PYTHON*, "
        "GCONV_PATH, MALLOC_*, ...) are refused unless --allow-loader-env.",
    ).tag(config=True, flag="env", metavar="NAME=VALUE")

    pass_env = List(
        Unicode(), help="Variables to pass through from the launching environment (repeatable). "
        "Names the dynamic loader or the interpreter act on are refused unless "
        "--allow-loader-env.",
    ).tag(config=True, flag="pass-env", metavar="NAME")

    allow_loader_env = Bool(
        False, help="Accept --env and --pass-env names the dynamic loader, libc or the "
        "interpreter act on (LD_PRELOAD, PYTHONPATH, GCONV_PATH, ...). --env values still "
        "apply only once user code is confined.",
    ).tag(config=True, flag="allow-loader-env")

    memory_limit = ByteSize(
        DEFAULT_MEMORY_LIMIT,
        help="Most memory the kernel may hold, its scratch tmpfs included: the scratch takes "
        "--scratch-size out of it and the heap (RLIMIT_DATA, plus no shared anonymous memory) "
        "gets the rest; 0 for no limit. Accepts 512M, 2G.",
    ).tag(config=True, flag="memory-limit", metavar="SIZE")

    cpu_limit = Int(
        0, help="CPU seconds the kernel may use over its whole life (RLIMIT_CPU); 0 for none.",
    ).tag(config=True, flag="cpu-limit", metavar="SECONDS")

    file_size_limit = ByteSize(
        2**30, help="Largest file user code may write (RLIMIT_FSIZE); 0 for no limit.",
    ).tag(config=True, flag="file-size-limit", metavar="SIZE")

    scratch_size = ByteSize(
        AUTO_SIZE,
        help="Most bytes all files in the scratch directory may hold, as a private tmpfs "
        "(needs root; elsewhere only --file-size-limit bounds each file), taken out of "
        f"--memory-limit. -1 (default): a quarter of the memory limit, at most "
        f"{DEFAULT_SCRATCH_SIZE // 2**30} GiB. 0: no tmpfs.",
    ).tag(config=True, flag="scratch-size", metavar="SIZE")

    scratch_files = Int(
        DEFAULT_SCRATCH_FILES,
        help="Most files and directories the scratch tmpfs may hold (its inodes cost the host "
        "kernel memory outside every limit, ~1 KiB each).",
    ).tag(config=True, flag="scratch-files", metavar="N")

    open_files_limit = Int(
        1024, help="Most file descriptors open at once (RLIMIT_NOFILE).",
    ).tag(config=True, flag="open-files-limit", metavar="N")

    max_threads = Int(
        512, help="Most threads the kernel process may run at once (RLIMIT_NPROC of the uid "
        "user code runs as); past it, starting a thread raises RuntimeError. 0 for no bound.",
    ).tag(config=True, flag="max-threads", metavar="N")

    landlock_abi = Int(
        -1, help="Act as if the host's Landlock ABI were at most N (0: as if it had none), to "
        "see how the sandbox behaves on older hosts; never more than the host offers. "
        "-1: the host's.",
    ).tag(config=True, flag="landlock-abi", metavar="N")

    timeout = Float(
        0.0, help="Default seconds one execution may run before it is interrupted; 0 for none. "
        "A request's metadata.sandbox.timeout overrides it.",
    ).tag(config=True, flag="timeout", metavar="SECONDS")

    max_output_bytes = ByteSize(
        2**20, help="Stream output kept per execution; beyond it output is dropped and one "
        "marker says how much. 0 for no cap.",
    ).tag(config=True, flag="max-output", metavar="SIZE")

    max_result_bytes = ByteSize(
        16 * 2**20, help="Largest main() result, in bytes of JSON; past it the call fails with "
        "InvalidResult (the kernel) or ResultTooLarge (the client, whatever the kernel sends). "
        "0 for no limit.",
    ).tag(config=True, flag="max-result", metavar="SIZE")

    run_as = Unicode(
        "auto", help="When started as root, whom user code runs as: 'auto' (a uid of the "
        "kernel's own from --uid-range), a user name or UID[:GID] (shared by every kernel "
        "started so), or 'root' (uid 0 with every capability dropped: only on purpose).",
    ).tag(config=True, flag="run-as", metavar="USER")

    uid_range = Unicode(
        DEFAULT_UID_RANGE, help="When started as root with --run-as auto, the uids (each "
        "also the gid) kernels take one each of: FIRST-LAST. Ids of accounts, groups and "
        "/etc/subuid ranges are skipped.",
    ).tag(config=True, flag="uid-range", metavar="FIRST-LAST")

    max_threads = Int(
        512, help="Most threads user code may run at once; more fail with RuntimeError "
        "(RLIMIT_NPROC when the kernel has a uid of its own).",
    ).tag(config=True, flag="max-threads", metavar="N")

    audit_log = Unicode(
        "", help="Append one JSON line per system call the filter refused (kernel id, call, "
        "arguments) to this file, written by the kernel's unconfined reaper; user code cannot "
        "reach it. Denials also go to the launcher's log either way.",
    ).tag(config=True, flag="audit-log", metavar="PATH")

    require_landlock = Bool(
        True,
        help="Refuse to start when Landlock cannot be applied. Turning this off runs untrusted "
        "code with no file-system confinement: only for hosts without Landlock.",
    ).tag(config=True, flag="no-landlock", flag_value=False,
          flag_help="Start even without Landlock: untrusted code then has NO file-system "
          "confinement (it may read and write whatever the kernel's user can). Only for hosts "
          "without Landlock.")

    require_seccomp = Bool(
        True,
        help="Refuse to start when the seccomp filter cannot be loaded. Turning this off runs "
        "untrusted code without a system-call filter: only for hosts that cannot load one.",
    ).tag(config=True, flag="no-seccomp", flag_value=False,
          flag_help="Start even without the seccomp filter: untrusted code may then create "
          "processes, open sockets and make any system call. Only for hosts that cannot load "
          "a filter.")

    def as_dict(self) -> dict[str, Any]:
        """The effective policy as plain JSON-able values."""
        return {name: getattr(self, name) for name in self.trait_names(config=True)}

    def to_argv(self) -> list[str]:
        """Command-line options that recreate this policy in a kernel process."""
        argv = []
        for name, trait in sorted(self.traits(config=True).items()):
            value = getattr(self, name)
            if value == trait.default():
                continue
            if isinstance(value, dict):
                argv += [f"--SandboxPolicy.{name}={key}={item}" for key, item in value.items()]
            elif isinstance(value, list):
                argv += [f"--SandboxPolicy.{name}={item}" for item in value]
            else:
                argv.append(f"--SandboxPolicy.{name}={value}")
        return argv


def _flagged() -> list[tuple[str, Any]]:
    return [(name, trait) for name, trait in SandboxPolicy.class_traits(config=True).items()
            if trait.metadata.get("flag")]


def _flag_help(trait: Any) -> str:
    """What the flag does; differs from the trait's help when the flag turns the trait off."""
    return str(trait.metadata.get("flag_help", trait.help))


def app_flags() -> dict[str, tuple[dict[str, Any], str]]:
    """traitlets flags (`--allow-network`, `--no-seccomp`) for the kernel application."""
    return {trait.metadata["flag"]: ({"SandboxPolicy": {name: trait.metadata.get(
                "flag_value", True)}}, _flag_help(trait))
            for name, trait in _flagged() if isinstance(trait, Bool)}


def app_aliases() -> dict[str, str]:
    """traitlets aliases (`--read-path P`, `--timeout S`, ...) for the kernel application."""
    return {trait.metadata["flag"]: f"SandboxPolicy.{name}"
            for name, trait in _flagged() if not isinstance(trait, Bool)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the policy flags to an argparse parser (install, run and check share them)."""
    group = parser.add_argument_group("sandbox policy")
    for name, trait in _flagged():
        option, help_text = f"--{trait.metadata['flag']}", _flag_help(trait)
        if isinstance(trait, Bool):
            action = "store_false" if trait.metadata.get("flag_value") is False else "store_true"
            group.add_argument(option, dest=name, action=action, default=None, help=help_text)
        else:
            repeatable = isinstance(trait, (List, Dict))
            group.add_argument(option, dest=name, action="append" if repeatable else "store",
                               default=None, metavar=trait.metadata.get("metavar"),
                               help=help_text)


def from_arguments(args: argparse.Namespace) -> SandboxPolicy:
    """A validated policy from argparse flags, grants made absolute.

    Raises TraitError for a bad value and FileNotFoundError for a grant that does not exist.
    """
    values: dict[str, Any] = {}
    for name, trait in _flagged():
        given = getattr(args, name, None)
        if given is None:
            continue
        if isinstance(trait, Dict):
            values[name] = dict(_name_value(item) for item in given)
        elif name in ("read_paths", "write_paths"):
            values[name] = check_grants(given)
        elif isinstance(trait, (List, Bool)):
            values[name] = given
        else:
            values[name] = trait.from_string(given)
    return SandboxPolicy(**values)


def _name_value(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise TraitError(f"expected NAME=VALUE, got {item!r}")
    return name, value
