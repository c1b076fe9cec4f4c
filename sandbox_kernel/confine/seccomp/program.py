"""Plumbing: the rules compiled to the BPF programs a kernel loads, and compiled ahead of time.

libseccomp compiles each filter to a BPF program. A fork server compiles them once for all its
kernels (precompile): the denylist names no process and is kept as it is; the allowlist, which
names the kernel's pid, is compiled for a placeholder pid, and each kernel writes its own pid
into the instructions found to hold it (Template.for_pid). A lean zygote, a fresh interpreter,
is handed the server's programs (handover, adopt): it loads them without ever importing
libseccomp, whose binding and compilation are ~0.9 MB its every fork would copy.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import itertools
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import rules as _rules
from . import syscall
from .rules import LANDLOCK_TRUNCATE_ABI, Rule, allowlist_rules, denylist_rules
from .syscall import INSTRUCTION_SIZE, SeccompError, available, libseccomp, tsync_flags

# struct sock_filter (linux/filter.h): code, jt, jf, k. A pid is compared by a
# BPF_JMP | BPF_JEQ | BPF_K instruction, in its k.
INSTRUCTION = struct.Struct("=HBBI")
assert INSTRUCTION.size == INSTRUCTION_SIZE
_K_OFFSET = 4
JEQ_K = 0x15
# Two values no process can have as its pid (pid_max is at most 2**22) that stand for the
# kernel's pid while the allowlist is compiled once for all kernels.
PLACEHOLDERS = (0x5EC0_1D00, 0x2BAD_F00D)


def compile_rules(rules: Iterable[Rule], default: int) -> Any:
    """A libseccomp filter of these rules over a default action."""
    sc = libseccomp()
    actions = {"allow": sc.ALLOW, "eperm": sc.ERRNO(errno.EPERM),
               "enosys": sc.ERRNO(errno.ENOSYS)}
    flt = sc.SyscallFilter(default)
    # Foreign architectures (i386 via int 0x80) and the x32 ABI kill the whole process.
    bad_arch = {"kill process": sc.KILL_PROCESS}[_rules.FOREIGN_ARCH]
    flt.set_attr(sc.Attr.ACT_BADARCH, bad_arch)
    # load() loads the exported program with these, as libseccomp's own load would; setting them
    # still makes libseccomp check that this Linux has TSYNC (and TSYNC_ESRCH to notify).
    flt.set_attr(sc.Attr.CTL_TSYNC, 1)
    flt.set_attr(sc.Attr.CTL_NNP, 1)
    for rule in rules:
        number = sc.resolve_syscall(sc.Arch.NATIVE, rule.syscall)
        if number < 0:  # not a syscall on this architecture (or unknown to this libseccomp)
            continue
        args = [sc.Arg(arg, sc.MASKED_EQ, mask, value) for arg, mask, value in rule.args]
        flt.add_rule(actions[rule.action], number, *args)
    return flt


def export(compiled: Any) -> bytes:
    """The BPF program libseccomp would load for a compiled filter."""
    # Through a pipe: pods refuse memfd_create, and a kernel started on its own compiles under
    # Landlock, which may refuse a file. The write end does not block, so a program larger than the
    # pipe (a loadable one is at most 32 KiB, a pipe holds 64 KiB unless the user's pipe quota
    # is spent) is cut short, which libseccomp does not notice, instead of hanging: a pipe that
    # came back full is refused.
    read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    with open(read_end, "rb", buffering=0) as source:
        with open(write_end, "wb", buffering=0) as sink:
            capacity = fcntl.fcntl(sink, fcntl.F_GETPIPE_SZ)
            compiled.export_bpf(sink)
        program = source.read(capacity) or b""  # all of it: nothing more can be written
    if not program or len(program) >= capacity or len(program) % INSTRUCTION.size:
        raise SeccompError(f"libseccomp exported a BPF program of {len(program)} bytes "
                           f"through a pipe of {capacity}")
    return program


def default_action(notify: bool) -> int:
    """The allowlist's verdict on every call it does not name: EPERM, or ask the listener."""
    sc = libseccomp()
    return int(sc.NOTIFY if notify else sc.ERRNO(errno.EPERM))


# The denylists, by allow_network: compiled once per process (they name no process), or
# handed over (adopt). A fork server's kernels load the server's copies.
denylists: dict[bool, bytes] = {}


def denylist(allow_network: bool) -> bytes:
    """The denylist program for this setting."""
    program = denylists.get(allow_network)
    if program is None:
        rules = denylist_rules(allow_network)
        program = denylists[allow_network] = export(compile_rules(rules, libseccomp().ALLOW))
    return program


@dataclass(frozen=True)
class Template:
    """The allowlist compiled for a placeholder pid, and where that pid sits in the program."""

    program: bytes
    pid_offsets: tuple[int, ...]  # byte offsets of the k fields that hold the pid
    # libseccomp sorts the values one argument is compared with and merges equal ones, so only
    # a pid above every other value compared where the pid is compiles like the placeholders.
    floor: int

    def for_pid(self, pid: int) -> bytes:
        """The program with pid written where the placeholder was."""
        program = bytearray(self.program)
        for offset in self.pid_offsets:
            struct.pack_into("=I", program, offset, pid)
        return bytes(program)


def _compared_with_pid(rules: list[Rule], pid: int) -> set[int]:
    """The other values the rules compare with an argument that is also compared with pid."""
    places = {(rule.syscall, arg) for rule in rules for arg, _, value in rule.args if value == pid}
    return {value for rule in rules for arg, _, value in rule.args
            if (rule.syscall, arg) in places and value != pid}


def pid_offsets(first: bytes, second: bytes) -> tuple[int, ...] | None:
    """Where the two placeholders sit in programs compiled for each, if they sit only there.

    Verified, not assumed: the programs differ in exactly the instructions that compare with
    the placeholder, each is the same comparison in both, and neither placeholder occurs
    anywhere else. Otherwise None: the pid cannot be patched in.
    """
    if len(first) != len(second):
        return None
    offsets = []
    pairs = zip(INSTRUCTION.iter_unpack(first), INSTRUCTION.iter_unpack(second), strict=True)
    for index, (one, other) in enumerate(pairs):
        if (one[3], other[3]) == PLACEHOLDERS and one[:3] == other[:3] and one[0] == JEQ_K:
            offsets.append(index * INSTRUCTION.size + _K_OFFSET)
        elif one != other or one[3] in PLACEHOLDERS or other[3] in PLACEHOLDERS:
            return None
    return tuple(offsets) if offsets else None


def allowlist_template(allow_network: bool, truncate: bool, notify: bool) -> Template | None:
    """The allowlist for these settings with a placeholder pid; None if the placeholder could not
    be located exactly (kernels then compile their own)."""
    landlock_abi = LANDLOCK_TRUNCATE_ABI if truncate else 0
    first, second = (export(compile_rules(allowlist_rules(placeholder, allow_network, landlock_abi),
                                          default_action(notify)))
                     for placeholder in PLACEHOLDERS)
    offsets = pid_offsets(first, second)
    rules = allowlist_rules(PLACEHOLDERS[0], allow_network, landlock_abi)
    floor = max(_compared_with_pid(rules, PLACEHOLDERS[0]), default=0)
    if offsets is None or min(PLACEHOLDERS) <= floor:
        return None
    return Template(first, offsets, floor)


# The templates precompile() made (or adopt() was handed), by (allow_network, truncate,
# notify). Only a process that forks kernels makes them: for a single kernel, two compiles
# would cost more than its own one.
Settings = tuple[bool, bool, bool]
templates: dict[Settings, Template | None] = {}
SETTINGS: tuple[Settings, ...] = tuple(itertools.product((False, True), (False, True),
                                                         (False, True)))


def allowlist(pid: int, allow_network: bool, landlock_abi: int, notify: bool) -> bytes:
    """The allowlist program for this pid: the template with the pid written in, or compiled."""
    template = templates.get((allow_network, landlock_abi >= LANDLOCK_TRUNCATE_ABI, notify))
    if template is not None and pid > template.floor:
        return template.for_pid(pid)
    rules = allowlist_rules(pid, allow_network, landlock_abi)
    return export(compile_rules(rules, default_action(notify)))


def precompile() -> None:
    """Compile, before a fork server forks, what every kernel would otherwise compile again:
    both denylists and the allowlist's templates for every setting. Nothing is loaded here:
    the server itself stays unfiltered."""
    if available() is not None:
        return
    for allow_network in (False, True):
        denylist(allow_network)
    for settings in SETTINGS:
        if settings not in templates:
            templates[settings] = allowlist_template(*settings)
    tsync_flags()
    _describe_every_setting()


def _describe_every_setting() -> None:
    """What the rules keep, and their description, for every setting: each kernel states both
    (pure Python, read once before the forks)."""
    for allow_network in (False, True):
        for abi in (0, LANDLOCK_TRUNCATE_ABI):
            _rules.keeps("processes", allow_network, abi)
            for notify in (False, True):
                _rules.describe(allow_network, notify, landlock_abi=abi)


def _encoded(program: bytes) -> str:
    return base64.b64encode(program).decode("ascii")


def _decoded(text: str) -> bytes:
    program = base64.b64decode(text, validate=True)
    if not program or len(program) % INSTRUCTION.size:
        raise ValueError(f"a handed-over BPF program of {len(program)} bytes")
    return program


def _handed_template(program: str, offsets: list[int], floor: int) -> Template:
    template = Template(_decoded(program), tuple(int(offset) for offset in offsets), int(floor))
    size = len(template.program)
    if not template.pid_offsets or any(
            offset % INSTRUCTION.size != _K_OFFSET or offset >= size
            for offset in template.pid_offsets):
        raise ValueError(f"handed-over pid offsets {template.pid_offsets} do not fall on the k "
                         f"fields of a program of {size} bytes")
    return template


def handover() -> dict[str, Any]:
    """What precompile() made and found out, as JSON, for a process that is to load these
    programs without libseccomp: a fork server puts it in a lean zygote's pool spec."""
    reason = available()
    if reason is not None:
        return {"available": reason}
    precompile()
    return {
        "available": None,
        "seccomp": syscall.seccomp_number(),
        "tsync_flags": tsync_flags(),
        "denylists": [[allow_network, _encoded(denylist(allow_network))]
                      for allow_network in (False, True)],
        "templates": [[*settings, None if template is None else
                       [_encoded(template.program), list(template.pid_offsets), template.floor]]
                      for settings, template in templates.items()],
    }


def adopt(handed: dict[str, Any]) -> None:
    """Load, from now on, the programs another process compiled (handover()), and take its
    findings: this process imports neither pyseccomp nor libseccomp for them. ValueError (or
    KeyError, TypeError) when what was handed is not such a thing."""
    told = {"available": handed["available"]}
    if handed["available"] is None:
        told.update(seccomp=int(handed["seccomp"]), tsync_flags=int(handed["tsync_flags"]))
        handed_denylists = {bool(net): _decoded(program) for net, program in handed["denylists"]}
        handed_templates = {(bool(allow_network), bool(truncate), bool(notify)):
                            None if template is None else _handed_template(*template)
                            for allow_network, truncate, notify, template in handed["templates"]}
        denylists.update(handed_denylists)
        templates.update(handed_templates)
    syscall.told.update(told)
    for cached in (available, syscall.seccomp_number, tsync_flags):
        cached.cache_clear()
    if handed["available"] is not None:
        return
    _describe_every_setting()
    if any(templates.get(settings) is None for settings in SETTINGS):
        # An allowlist without a template is compiled by each kernel for its pid, as a fork
        # server's kernels do: with libseccomp loaded now, not imported by a confined kernel.
        libseccomp()
