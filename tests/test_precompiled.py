"""What the fork server prepares once for all its kernels is what each kernel would have made.

The server compiles the seccomp denylists (they name no process) and works out the
interpreter's read grants before it forks; its kernels load and use those copies. These tests
prove the copies are the very program and list a kernel computes afresh, that the server
itself stays unfiltered, and that a fork-served kernel is confined by both filters.
"""

import errno
import tempfile
from pathlib import Path

import pyseccomp
import pytest

from sandbox_kernel.confine import paths, seccomp
from tests.helpers import RAW_SYSCALL, evaluate, ok

pytestmark = pytest.mark.skipif(seccomp.available() is not None, reason="no seccomp here")

MMAP = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "mmap")


def _bpf(compiled):
    with tempfile.TemporaryFile() as out:
        compiled.export_bpf(out)
        out.seek(0)
        return out.read()


@pytest.mark.parametrize("allow_network", [False, True])
def test_the_precompiled_denylist_is_the_program_compiled_afresh(allow_network):
    seccomp.precompile()
    kept = _bpf(seccomp._denylist(allow_network))
    fresh = _bpf(seccomp._compile(seccomp.denylist_rules(allow_network), pyseccomp.ALLOW))
    assert kept and kept == fresh
    other = _bpf(seccomp._denylist(not allow_network))
    assert other != kept  # the network setting picks its own program


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
