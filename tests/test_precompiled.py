"""What the fork server prepares once for all its kernels is what each kernel would have made.

The server compiles the seccomp denylists (they name no process) and the allowlist for a
placeholder pid, and works out the interpreter's read grants before it forks; its kernels load
and use those copies, writing their own pid into the allowlist. A lean zygote (a fresh
interpreter) is handed the server's programs in its pool spec and loads them without libseccomp.
These tests prove the copies are the very programs and list a kernel computes afresh (for every
setting and for pids that equal any constant of the filter), handed over or not, that the
filters a process holds are those programs, that the server itself stays unfiltered, and that a
fork-served kernel is confined by both filters.
"""

import ctypes
import errno
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pyseccomp
import pytest

from sandbox_kernel.confine import paths, seccomp
from sandbox_kernel.confine.seccomp import program as bpf
from tests.helpers import RAW_SYSCALL, evaluate, ok

pytestmark = pytest.mark.skipif(seccomp.available() is not None, reason="no seccomp here")

MMAP = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "mmap")
PID_MAX_LIMIT = 4194304  # the largest pid_max Linux accepts
SETTINGS = list(itertools.product((False, True), (0, 7), (False, True)))


def _bpf(compiled):
    with tempfile.TemporaryFile() as out:
        compiled.export_bpf(out)
        out.seek(0)
        return out.read()


@pytest.mark.parametrize("allow_network", [False, True])
def test_the_precompiled_denylist_is_the_program_compiled_afresh(allow_network):
    seccomp.precompile()
    kept = bpf.denylist(allow_network)
    fresh = _bpf(bpf.compile_rules(seccomp.denylist_rules(allow_network), pyseccomp.ALLOW))
    assert kept and kept == fresh
    other = bpf.denylist(not allow_network)
    assert other != kept  # the network setting picks its own program


def _compiled_allowlist(pid, allow_network, landlock_abi, notify):
    default = pyseccomp.NOTIFY if notify else pyseccomp.ERRNO(errno.EPERM)
    return _bpf(bpf.compile_rules(seccomp.allowlist_rules(pid, allow_network, landlock_abi),
                                 default))


def _constants(program):
    """Every value an instruction of the program carries that could be a pid."""
    return {k for _, _, _, k in bpf.INSTRUCTION.iter_unpack(program) if k <= PID_MAX_LIMIT}


@pytest.mark.parametrize(("allow_network", "landlock_abi", "notify"), SETTINGS)
def test_the_allowlist_with_a_pid_written_in_is_the_program_compiled_for_it(
        allow_network, landlock_abi, notify):
    seccomp.precompile()
    template = bpf.templates[allow_network, landlock_abi >= 3, notify]
    assert template is not None and template.floor == 0 and template.pid_offsets
    # Pids equal to a constant of the filter (syscall numbers, fcntl commands, prctl options,
    # F_SETOWN, errno actions, jump offsets...) are where libseccomp could merge or reorder.
    pids = (_constants(template.program) | {1, 2, 8, 32767, 32768, PID_MAX_LIMIT - 1,
                                            PID_MAX_LIMIT}
            | set(random.Random(12).sample(range(1, PID_MAX_LIMIT + 1), 40))) - {0}
    for pid in sorted(pids):
        assert pid > template.floor  # written in, not compiled
        patched = bpf.allowlist(pid, allow_network, landlock_abi, notify)
        assert patched == _compiled_allowlist(pid, allow_network, landlock_abi, notify), pid


@pytest.mark.parametrize("notify", [False, True])
def test_pid_zero_is_compiled_because_libseccomp_merges_it_with_the_rules_for_zero(notify):
    seccomp.precompile()
    template = bpf.templates[False, True, notify]
    assert template is not None
    assert template.for_pid(0) != _compiled_allowlist(0, False, 7, notify)
    assert bpf.allowlist(0, False, 7, notify) == _compiled_allowlist(0, False, 7, notify)


# A process handed the server's programs (a lean zygote): it answers with what it would load.
HANDED = """
import json, sys
from sandbox_kernel.confine import seccomp
from sandbox_kernel.confine.seccomp import program
seccomp.adopt(json.load(sys.stdin))
pids, settings = {pids}, {settings}
print(json.dumps({{
    "available": seccomp.available(),
    "denylists": [program.denylist(net).hex() for net in (False, True)],
    "allowlists": [[program.allowlist(pid, *setting).hex() for pid in pids]
                   for setting in settings],
    "libseccomp": sorted(name for name in sys.modules if "seccomp" in name and "." not in name)
                  + [line.split()[-1] for line in open("/proc/self/maps") if "libseccomp" in line],
}}))
"""


def _handed(handover, code):
    made = subprocess.run([sys.executable, "-I", "-c", code], input=json.dumps(handover),
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)


def test_a_process_handed_the_programs_loads_the_very_programs_without_libseccomp():
    pids = [1, 2, 8, 317, 4242, 32768, PID_MAX_LIMIT]
    seen = _handed(seccomp.handover(), HANDED.format(pids=pids, settings=SETTINGS))
    assert seen["available"] is None and seen["libseccomp"] == []
    assert seen["denylists"] == [_bpf(bpf.compile_rules(seccomp.denylist_rules(network),
                                                        pyseccomp.ALLOW)).hex()
                                 for network in (False, True)]
    for setting, programs in zip(SETTINGS, seen["allowlists"], strict=True):
        assert programs == [_compiled_allowlist(pid, *setting).hex() for pid in pids], setting


def test_a_handed_over_reason_is_the_processes_reason_and_installing_is_refused():
    code = ("import json, sys\nfrom sandbox_kernel.confine import seccomp\n"
            "seccomp.adopt(json.load(sys.stdin))\n"
            "try:\n    seccomp.install(1, False)\nexcept seccomp.SeccompError as exc:\n"
            "    print(json.dumps([seccomp.available(), str(exc)]))\n")
    reason = "libseccomp is not usable (the test's reason)"
    assert _handed({"available": reason}, code) == [reason, reason]


def test_a_handed_over_template_must_put_the_pid_on_a_comparison():
    template = bpf.templates.get((False, True, False)) or (seccomp.precompile() or
                                                           bpf.templates[False, True, False])
    program = bpf._encoded(template.program)
    assert bpf._handed_template(program, list(template.pid_offsets), 0) == template
    for offsets in ([], [0], [len(template.program) + 4], [template.pid_offsets[0] + 1]):
        with pytest.raises(ValueError, match="pid offsets"):
            bpf._handed_template(program, offsets, 0)
    with pytest.raises(ValueError, match="BPF program of 3 bytes"):
        bpf._handed_template(bpf._encoded(b"\x00" * 3), [4], 0)


def _instructions(*ks, code=bpf.JEQ_K):
    return b"".join(bpf.INSTRUCTION.pack(code, 1, 2, k) for k in ks)


def test_the_placeholder_is_located_only_where_it_is_the_only_difference():
    first, second = bpf.PLACEHOLDERS
    assert bpf.pid_offsets(_instructions(7, first, 9, first),
                                _instructions(7, second, 9, second)) == (12, 28)
    refused = [
        (_instructions(7, 9), _instructions(7, 9)),  # no pid at all
        (_instructions(7, first), _instructions(7, second, 9)),  # other lengths
        (_instructions(7, first), _instructions(8, second)),  # another instruction differs
        (_instructions(first, first), _instructions(first, second)),  # a placeholder kept
        (_instructions(first, code=0x25), _instructions(second, code=0x25)),  # not JEQ: JGT
    ]
    for one, other in refused:
        assert bpf.pid_offsets(one, other) is None


@pytest.mark.parametrize("templates", [{}, {(False, True, True): None}],
                         ids=["not prepared", "placeholder not located"])
def test_kernels_compile_their_own_allowlist_without_a_template(templates, monkeypatch):
    monkeypatch.setattr(bpf, "templates", templates)
    assert bpf.allowlist(4242, False, 7, True) == _compiled_allowlist(4242, False, 7, True)


def test_a_placeholder_that_cannot_be_located_leaves_no_template(monkeypatch):
    monkeypatch.setattr(bpf, "pid_offsets", lambda first, second: None)
    assert bpf.allowlist_template(False, True, True) is None


def test_a_program_larger_than_the_export_pipe_is_refused_not_hung():
    huge = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for value in range(8200):  # an 8-byte instruction a rule: more than a pipe's 64 KiB
        huge.add_rule(pyseccomp.ERRNO(errno.EPERM), "ioctl", pyseccomp.Arg(1, pyseccomp.EQ, value))
    with pytest.raises(seccomp.SeccompError, match="through a pipe of"):
        bpf.export(huge)


# Loads both filters (from another thread too) and waits, as a kernel would, to be inspected.
FILTERED_CHILD = """
import json, os, sys, threading
from sandbox_kernel.confine import seccomp
if {prepared} == "precompiled":  # as a fork server does: the pid is written in the allowlist
    seccomp.precompile()
elif {prepared} == "handed":  # as a lean zygote is: the server's programs, no libseccomp
    seccomp.adopt(json.loads(sys.stdin.readline()))
done = threading.Event()
threading.Thread(target=done.wait).start()
listener = seccomp.install(os.getpid(), {allow_network}, landlock_abi={landlock_abi},
                           notify={notify})
print(listener is not None and os.readlink(f"/proc/self/fd/{{listener}}"),
      "pyseccomp" in sys.modules, flush=True)
sys.stdin.read()
"""
PTRACE_ATTACH, PTRACE_DETACH, PTRACE_SECCOMP_GET_FILTER = 16, 17, 0x420C


def _loaded_filters(pid):
    """The BPF programs a stopped, attached process holds, oldest first (needs root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    programs = []
    for index in itertools.count():
        count = libc.ptrace(ctypes.c_long(PTRACE_SECCOMP_GET_FILTER), ctypes.c_long(pid),
                            ctypes.c_long(index), None)
        if count < 0:
            code = ctypes.get_errno()
            if code == errno.ENOENT:
                return programs
            pytest.skip(f"cannot read a process's seccomp filters here: {os.strerror(code)}")
        buffer = ctypes.create_string_buffer(count * bpf.INSTRUCTION.size)
        libc.ptrace(ctypes.c_long(PTRACE_SECCOMP_GET_FILTER), ctypes.c_long(pid),
                    ctypes.c_long(index), buffer)
        programs.append(buffer.raw)


def _attached(pid):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(ctypes.c_long(PTRACE_ATTACH), ctypes.c_long(pid), None, None) != 0:
        pytest.skip(f"cannot trace a child here: {os.strerror(ctypes.get_errno())}")
    os.waitpid(pid, 0)
    return libc


@pytest.mark.parametrize(("allow_network", "notify"), [(False, True), (True, False)])
@pytest.mark.parametrize("prepared", ["precompiled", "handed", "compiled"])
def test_a_process_holds_exactly_the_programs_libseccomp_compiles(allow_network, notify, prepared):
    code = FILTERED_CHILD.format(allow_network=allow_network, landlock_abi=7, notify=notify,
                                 prepared=repr(prepared))
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        if prepared == "handed":
            child.stdin.write(json.dumps(seccomp.handover()) + "\n")
            child.stdin.flush()
        listener, imported = child.stdout.readline().rsplit(maxsplit=1)
        assert listener == ("anon_inode:seccomp notify" if notify else "False")
        assert imported == str(prepared != "handed")  # loaded without libseccomp when handed
        libc = _attached(child.pid)
        try:
            held = _loaded_filters(child.pid)
        finally:
            libc.ptrace(ctypes.c_long(PTRACE_DETACH), ctypes.c_long(child.pid), None, None)
        status = Path(f"/proc/{child.pid}/status").read_text()
    finally:
        child.kill()
        child.wait(timeout=30)
    # The denylist first: once the allowlist is in, seccomp() is refused.
    assert held == [_bpf(bpf.compile_rules(seccomp.denylist_rules(allow_network),
                                          pyseccomp.ALLOW)),
                    _compiled_allowlist(child.pid, allow_network, 7, notify)]
    assert "NoNewPrivs:\t1" in status


def test_precompiling_loads_nothing_into_the_server():
    seccomp.precompile()
    status = Path("/proc/self/status").read_text()
    assert "Seccomp:\t0" in status


def test_the_interpreter_grants_are_worked_out_once_and_not_shared_mutably():
    first = paths.interpreter_paths()
    first.append("/tampered")
    second = paths.interpreter_paths()
    assert "/tampered" not in second
    assert second == list(paths._interpreter_paths.__wrapped__())  # the same as afresh


@pytest.mark.parametrize("fixture", ["sandbox", "net_sandbox"])
def test_a_fork_served_kernel_is_confined_by_both_filters(fixture, request):
    sb = request.getfixturevalue(fixture)
    assert sb.manager.provisioner.fork_served
    status = evaluate(sb, "open('/proc/self/status').read()")
    assert "Seccomp:\t2" in status and "Seccomp_filters:\t2" in status
    ok(sb.run(RAW_SYSCALL))
    # A denylist rule (shared anonymous memory), and the allowlist's default for an unknown call.
    assert tuple(evaluate(sb, f"raw({MMAP}, 0, 4096, 3, 0x21, -1, 0)")) == (-1, errno.EPERM)
    assert tuple(evaluate(sb, "raw(1000)")) == (-1, errno.EPERM)
