"""Which layer keeps each promise, for hosts this machine is not: every ABI, seccomp or not, uid 0.

The verdicts on this host are tried with real kernels in tests/test_abi.py; here the judgement
itself is checked for the hosts a test machine cannot be (no libseccomp, no Landlock).
"""

from __future__ import annotations

import os

import pytest

from sandbox_kernel.confine import limits
from sandbox_kernel.confine.promises import Host, Promise, evaluate, refusal


def host(**changes) -> Host:
    values = dict(landlock_abi=7, landlock_on=True, seccomp_reason=None, seccomp_on=True,
                  allow_network=False, max_threads=512, memory_limit=2**30, uid=1234)
    values.update(changes)
    return Host(**values)


def verdicts(**changes) -> dict[str, Promise]:
    return {p.name: p for p in evaluate(host(**changes))}


@pytest.mark.parametrize("abi", range(1, 8))
def test_every_promise_is_kept_at_every_abi_with_seccomp(abi):
    judged = evaluate(host(landlock_abi=abi))
    assert refusal(judged) is None
    assert all(p.enforced_by for p in judged)


def test_without_libseccomp_the_kernel_refuses_naming_the_flag():
    reason = refusal(evaluate(host(seccomp_reason="libseccomp is not usable")))
    assert reason is not None
    assert "processes: create none (threads only): MISSING, needs seccomp" in reason
    assert "libseccomp is not usable" in reason and "--no-seccomp" in reason
    # Landlock keeps the signal promise from ABI 6 on, so it is not missing there ...
    assert "other processes: signal none" not in reason
    # ... but below 6 nothing does.
    old = refusal(evaluate(host(landlock_abi=5, seccomp_reason="libseccomp is not usable")))
    assert "other processes: signal none: MISSING" in old
    assert "Landlock signal scope (ABI >= 6); this host: ABI 5" in old


def test_no_seccomp_waives_what_only_seccomp_keeps():
    judged = verdicts(seccomp_on=False, landlock_abi=2)
    assert judged["processes: create none (threads only)"].waived_by == "--no-seccomp"
    assert judged["files: read and write only the interpreter, scratch and grants"].enforced_by \
        == ["Landlock file rights"]
    truncation = judged["files: truncate none outside the grants"]
    assert truncation.enforced_by == [] and truncation.waived_by == "--no-seccomp"
    assert refusal(list(judged.values())) is None


def test_truncation_is_seccomps_below_abi_3():
    name = "files: truncate none outside the grants"
    for abi in (1, 2):
        assert verdicts(landlock_abi=abi)[name].enforced_by[0].startswith("seccomp: truncate(")
    assert verdicts(landlock_abi=3)[name].enforced_by == ["Landlock truncate"]


def test_no_landlock_refuses_unless_waived():
    assert "--no-landlock" in refusal(evaluate(host(landlock_abi=0)))
    assert refusal(evaluate(host(landlock_abi=0, landlock_on=False))) is None


def test_uid_0_has_no_thread_bound():
    reason = refusal(evaluate(host(uid=0)))
    assert reason is not None and "threads: at most 512: MISSING" in reason
    assert reason.endswith("to run without it on purpose: --max-threads 0")
    assert refusal(evaluate(host(uid=0, max_threads=0))) is None


def test_thread_bound_counts_the_uids_other_tasks():
    assert limits.tasks_of(os.getuid()) >= 1  # this very process
    unused = 54321  # a uid of its own: the bound is exactly the threads asked for
    assert limits.tasks_of(unused) == 0 and limits.thread_bound(10, unused) == 10


@pytest.mark.parametrize("abi", [4, 7])
def test_landlock_alone_never_keeps_the_network_off(abi):
    # Its TCP connect right misses sendto(MSG_FASTOPEN) and all of UDP: without the filter the
    # promise is waived, not claimed.
    network = verdicts(landlock_abi=abi, seccomp_on=False)["network: no connection out"]
    assert network.enforced_by == [] and network.waived_by == "--no-seccomp"


def test_every_layer_raises_the_one_confinement_error():
    from sandbox_kernel.confine import landlock, privileges, promises, scratch, seccomp, view
    from sandbox_kernel.confine.errors import ConfinementError

    layers = {landlock.LandlockError: "landlock", seccomp.SeccompError: "seccomp",
              privileges.PrivilegeError: "privileges", scratch.ScratchError: "scratch",
              view.ViewError: "view", promises.PromiseError: "promises"}
    for error, layer in layers.items():
        assert issubclass(error, ConfinementError) and error.layer == layer
    assert issubclass(landlock.LandlockError, OSError)  # callers may still read its errno
    assert landlock.LandlockError(1, "landlock_restrict_self failed").errno == 1


def test_a_refusal_names_the_layer_the_reason_and_the_waiver():
    from sandbox_kernel.confine import landlock, privileges, promises, seccomp

    assert seccomp.SeccompError("loading the seccomp filter failed: boom").refusal() == (
        "seccomp: loading the seccomp filter failed: boom. To run without a system-call filter "
        "on purpose, start the kernel with --no-seccomp")
    assert landlock.LandlockError(1, "x failed").refusal() == (
        "landlock: [Errno 1] x failed. To run without file-system confinement on purpose, "
        "start the kernel with --no-landlock")
    # A reason that already says its cure is printed as it is (no flag waives the layer).
    cure = "--run-as 0 is uid 0: say --run-as root to keep root"
    assert privileges.PrivilegeError(cure).refusal() == cure
    with pytest.raises(promises.PromiseError) as raised:
        promises.require(evaluate(host(landlock_abi=0)))
    assert raised.value.refusal().startswith("cannot keep these promises on this host: files:")
    assert raised.value.refusal().endswith("to run without it on purpose: --no-landlock")
    promises.require(evaluate(host()))  # kept: nothing raised
