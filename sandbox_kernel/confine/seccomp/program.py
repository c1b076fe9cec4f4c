"""Plumbing: the rules compiled to the BPF programs a kernel loads, and compiled ahead of time.

libseccomp compiles each filter to a BPF program. A fork server compiles them once for all its
kernels (precompile): the denylist names no process and is kept as it is; the allowlist, which
names the kernel's pid, is compiled for a placeholder pid, and each kernel writes its own pid
into the instructions found to hold it (Template.for_pid).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import rules as _rules
from .rules import LANDLOCK_TRUNCATE_ABI, Rule, allowlist_rules, denylist_rules
from .syscall import INSTRUCTION_SIZE, SeccompError, available, sc, tsync_flags

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
    assert sc is not None
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
    assert sc is not None
    return sc.NOTIFY if notify else sc.ERRNO(errno.EPERM)


@functools.cache
def denylist(allow_network: bool) -> bytes:
    """The denylist program, compiled once per process (it names no process): a fork server's
    kernels load the server's copy."""
    assert sc is not None
    return export(compile_rules(denylist_rules(allow_network), sc.ALLOW))


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


# The templates precompile() made, by (allow_network, truncate, notify). Only a process that
# forks kernels makes them: for a single kernel, two compiles would cost more than its own one.
templates: dict[tuple[bool, bool, bool], Template | None] = {}


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
        for truncate in (False, True):
            # What the rules keep, and their description: each kernel states both.
            abi = LANDLOCK_TRUNCATE_ABI if truncate else 0
            _rules.keeps("processes", allow_network, abi)
            for notify in (False, True):
                _rules.describe(allow_network, notify, landlock_abi=abi)
            for notify in (False, True):
                settings = (allow_network, truncate, notify)
                if settings not in templates:
                    templates[settings] = allowlist_template(*settings)
    tsync_flags()
