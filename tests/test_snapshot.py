"""Snapshots of a session's user state (#34): made inside a sandboxed kernel (a DataFrame, an
array, a fitted model, a figure, closures, a session class), sealed by the caller, refused when
altered, owned by another or of another policy, and loaded only inside a fresh sandboxed
kernel, where a hostile payload meets the usual refusals."""

import asyncio
import json
import os
import pickle

import pytest

from sandbox_kernel.client import AsyncSandbox, Sandbox
from sandbox_kernel.client.snapshot import (
    Sealing,
    Snapshot,
    SnapshotError,
    open_sealed,
    seal,
)
from sandbox_kernel.kernel import snapshot as kernel_side

from .helpers import evaluate, ok

STATE = """
import numpy as np, pandas as pd, os, threading
from sklearn.linear_model import LinearRegression
frame = pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]})
array = np.arange(100_000, dtype=np.float64).reshape(1000, 100)
model = LinearRegression().fit(np.array([[0.0], [1.0], [2.0]]), np.array([1.0, 3.0, 5.0]))
def make_adder(n):
    def add(x):
        return x + n
    return add
add_five = make_adder(5)
square = lambda x: x * x
class Counter:
    def __init__(self):
        self.count = 0
    def bump(self):
        self.count += 1
        return self.count
counter = Counter()
counter.bump()
numbers = (i for i in range(3))
handle = open("notes.txt", "w")
lock = threading.Lock()
os.makedirs("work", exist_ok=True)
with open("work/data.csv", "w") as f:
    f.write("a,b\\n1,2\\n")
os.chdir("work")
_private = "kept"
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
figure, axes = plt.subplots()
axes.plot([1, 2, 3], [4, 5, 6])
"""

# What the restored kernel must show, as a literal evaluate() reads back.
CHECK = """(frame.equals(pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]})),
 bool((array == np.arange(100_000, dtype=np.float64).reshape(1000, 100)).all()),
 array.flags.writeable,
 [round(v, 6) for v in model.predict(np.array([[3.0]])).tolist()],
 add_five(1), square(7), counter.count, type(counter).__name__, np.__name__,
 open("data.csv").read(), os.path.relpath(os.getcwd(), os.path.expanduser("~")), _private,
 "numbers" in dir(), "handle" in dir(), "lock" in dir(),
 figure.axes[0].lines[0].get_ydata().tolist(), plt.__name__)"""
EXPECTED = (True, True, True, [7.0], 6, 49, 1, "Counter", "numpy", "a,b\n1,2\n", "work",
            "kept", False, False, False, [4, 5, 6], "matplotlib.pyplot")


@pytest.fixture(scope="module")
def snapshot(kernelspecs):
    """The snapshot of a session holding data-work state, taken and its kernel closed."""
    with Sandbox("sandbox") as source:
        ok(source.run(STATE))
        taken = source.snapshot(owner="tenant-a")
    return taken


def test_manifest_lists_saved_names_and_skips_generator_file_and_lock_with_reasons(snapshot):
    manifest = snapshot.manifest
    assert set(manifest["saved"]) >= {"frame", "array", "model", "add_five", "make_adder",
                                      "square", "Counter", "counter", "np", "pd", "os",
                                      "LinearRegression", "_private", "figure", "plt"}
    skipped = {entry["name"]: entry["reason"] for entry in manifest["skipped"]}
    assert skipped["numbers"].startswith("a generator (its running frame cannot be saved)")
    assert skipped["handle"] == "an open file (notes.txt): open it again after the restore"
    assert skipped["lock"].startswith("a lock")
    assert set(manifest["saved"]) & set(skipped) == set()
    assert {"path": "work/data.csv", "size": 8} in manifest["files"]
    assert {"path": "notes.txt", "size": 0} in manifest["files"]
    assert manifest["cwd"] == "work"
    assert manifest["policy"]["network"] == "off"
    assert manifest["bytes"] > 800_000  # the array's 800 kB travelled
    assert len(snapshot.key) == 32 and snapshot.owner == "tenant-a"


def test_restored_forks_have_equal_values_and_files_and_diverge_independently(
        snapshot, kernelspecs):
    async def second_fork():
        async with AsyncSandbox("sandbox", snapshot=snapshot) as fork:
            before = (await fork.run("counter.bump(), float(array[0, 0])")).text
            after = (await fork.run("counter.count, float(array[0, 0])")).text
            again = await fork.snapshot(owner="tenant-a")  # the awaited face, same body
            return fork.restored, before, after, again

    with Sandbox("sandbox", snapshot=snapshot) as first:
        assert set(first.restored["restored"]) == set(snapshot.manifest["saved"])
        assert first.restored["skipped"] == []
        assert evaluate(first, CHECK) == EXPECTED
        ok(first.run("counter.bump(); array[0, 0] = -1.0; frame.loc[0, 'a'] = 100"))
        restored, before, after, again = asyncio.run(second_fork())
        assert restored["restored"] == first.restored["restored"]
        assert again.manifest["saved"] == snapshot.manifest["saved"]
        assert again.manifest["skipped"] == []  # the generator, file and lock stayed behind
        assert (before, after) == ("(2, 0.0)", "(2, 0.0)")  # its own counter, not the first's
        assert evaluate(first, "counter.count, float(array[0, 0]), int(frame.loc[0, 'a'])") == (
            2, -1.0, 100)


def test_a_snapshot_with_one_byte_altered_is_refused(snapshot, sandbox):
    for where in (0, len(snapshot.data) // 2, len(snapshot.data) - 1):
        altered = bytearray(snapshot.data)
        altered[where] ^= 1
        with pytest.raises(SnapshotError, match="seal does not match"):
            sandbox.restore(bytes(altered), snapshot.key, snapshot.owner)
    assert "frame" not in evaluate(sandbox, "dir()")


def test_another_owner_or_key_is_refused(snapshot, sandbox):
    with pytest.raises(SnapshotError, match="another owner or with another key"):
        sandbox.restore(snapshot, owner="tenant-b")
    with pytest.raises(SnapshotError, match="another owner or with another key"):
        sandbox.restore(snapshot, key=b"k" * 32)
    with pytest.raises(SnapshotError, match="over the limit of 1000 bytes"):
        sandbox.restore(snapshot, max_size=1000)
    assert "frame" not in evaluate(sandbox, "dir()")


def test_a_sandbox_whose_snapshot_is_refused_does_not_start(snapshot, kernelspecs):
    refused = Sandbox("sandbox", snapshot=snapshot, snapshot_owner="tenant-b")
    with pytest.raises(SnapshotError, match="another owner"):
        refused.start()
    assert not refused.manager.has_kernel and refused.restored is None


def test_a_snapshot_of_another_network_is_refused(snapshot, net_sandbox):
    with pytest.raises(SnapshotError, match="made on network 'off' and this kernel runs on "
                                            "'on'"):
        net_sandbox.restore(snapshot)


def _hostile(index_names, streams, key, owner="tenant-a", claims=None):
    """A sealed snapshot whose payload hostile code built (sealed with the tenant's own key, as
    any snapshot the tenant's kernel sent would be)."""
    index = {"names": index_names, "files": [], "packages": [], "cwd": ".",
             "parts": claims or [len(stream) for stream in streams]}
    head = json.dumps(index).encode()
    payload = (kernel_side.MAGIC + len(head).to_bytes(8, "big") + head + b"".join(streams))
    manifest = {"version": 1, "saved": [entry["name"] for entry in index_names], "skipped": [],
                "bytes": len(payload), "policy": {"network": "off", "allow_hosts": [],
                                                  "allow_addresses": [], "runtime": None}}
    return manifest, payload


class _System:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Popen:
    def __reduce__(self):
        import subprocess

        return (subprocess.Popen, (["/bin/sh", "-c", "id"],))


def test_hostile_payloads_run_only_inside_the_sandbox_with_the_usual_refusals(
        fresh_sandbox, tmp_path):
    marker = tmp_path / "pwned"  # on the host; "pwned" in the kernel's own scratch too
    streams = [pickle.dumps(_System(f"touch {marker} pwned")), pickle.dumps(_Popen()),
               pickle.dumps(41)]
    names = [{"name": name, "kind": "pickle", "stream": number, "buffers": []}
             for number, name in enumerate(("system", "popen", "plain"))]
    manifest, payload = _hostile(names, streams, b"")
    manifest["policy"] = fresh_sandbox._snapshot_policy()
    key = b"s" * 32
    report = fresh_sandbox.restore(seal(payload, manifest, key, "tenant-a"), key, "tenant-a")
    skipped = {entry["name"]: entry["reason"] for entry in report["skipped"]}
    assert skipped["popen"].startswith("cannot be loaded: PermissionError: [Errno 1]")
    assert report["restored"] == ["system", "plain"]
    # system(3) could not start its shell (glibc reports a failed spawn as exit status 127,
    # 127 << 8), and no shell ran: neither file exists.
    assert evaluate(fresh_sandbox, "import os\nsystem, plain, os.path.exists('pwned')") == (
        127 << 8, 41, False)
    assert not marker.exists()


@pytest.mark.parametrize("claims", [[10 * 2**30, 0, 0], [-1, 0, 0]])
def test_claimed_lengths_past_the_payload_are_refused_inside_the_kernel(fresh_sandbox, claims):
    streams = [pickle.dumps(1)]
    names = [{"name": "one", "kind": "pickle", "stream": 0, "buffers": []}]
    manifest, payload = _hostile(names, streams, b"", claims=claims)
    manifest["policy"] = fresh_sandbox._snapshot_policy()
    key = b"s" * 32
    with pytest.raises(SnapshotError, match=r"SnapshotRefused: the index claims -?\d+ bytes of "
                                            r"parts, the snapshot holds \d+"):
        fresh_sandbox.restore(seal(payload, manifest, key, "t"), key, "t")
    assert evaluate(fresh_sandbox, "1 + 1") == 2  # the kernel lives


def test_a_kernel_lying_about_its_snapshot_is_refused_and_a_huge_claim_never_allocated(
        fresh_sandbox):
    ok(fresh_sandbox.run("x = 1\nimport sandbox_kernel.kernel.snapshot as s\n"
                         "s._OPS['read'] = lambda **_: {}"))  # announces bytes, sends none
    with pytest.raises(SnapshotError, match=r"the kernel sent 0 bytes of the snapshot where "
                                            r"\d+ were asked for"):
        fresh_sandbox.snapshot()
    ok(fresh_sandbox.run("import sandbox_kernel.kernel.snapshot as s\n"
                         "s._OPS['take'] = lambda **_: {'bytes': 10 * 2**30}"))
    with pytest.raises(SnapshotError, match="is 10737418240 bytes, over the limit of "
                                            "2147483648 bytes"):
        fresh_sandbox.snapshot()


def _peak_rss() -> int:
    """This process's peak resident memory (VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        return int(status.read().split("VmHWM:")[1].split()[0]) * 1024


def test_a_claim_within_the_limit_costs_nothing_until_its_bytes_arrive(fresh_sandbox):
    """Issue #44 item 2: session code claims a 1000 MiB snapshot (under the 2 GiB limit) and
    sends none of it; the caller's memory grows with bytes that arrived, never with a claim."""
    ok(fresh_sandbox.run("import sandbox_kernel.kernel.snapshot as s\n"
                         "real = s._OPS['take']\n"
                         "s._OPS['take'] = lambda **kw: {**real(**kw), 'bytes': 1000 * 2**20}\n"
                         "s._OPS['read'] = lambda **_: {}"))
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak starts again from what is resident now
    before = _peak_rss()
    with pytest.raises(SnapshotError, match=r"the kernel sent 0 bytes of the snapshot where "
                                            r"\d+ were asked for"):
        fresh_sandbox.snapshot()
    grown = _peak_rss() - before
    assert grown < 100 * 2**20, f"the caller's peak memory grew {grown >> 20} MiB"
    assert evaluate(fresh_sandbox, "1 + 1") == 2  # the kernel lives


def test_a_sealing_takes_only_the_bytes_in_order_within_the_claim():
    key = b"k" * 32
    sealing = Sealing({"version": 1}, 6)
    sealing.take(0, [b"pay"])
    sealing.take(5, [b"X"])  # out of order: left out
    sealing.take(3, [b"lo", b"adXX"])  # the second piece runs past the claim: left out
    assert sealing.received == 5
    with pytest.raises(SnapshotError, match="sent 5 bytes of a 6-byte snapshot"):
        sealing.close(key, "o")
    sealing.take(5, [b"a"])
    assert sealing.close(key, "o") == seal(b"payloa", {"version": 1}, key, "o")


def test_sealed_claims_and_truncation_are_refused_without_a_kernel():
    key = b"k" * 32
    data = seal(b"payload", {"version": 1}, key, "o")
    assert open_sealed(data, key, "o") == ({"version": 1}, memoryview(b"payload"))
    with pytest.raises(SnapshotError, match="cut short"):
        open_sealed(data[:20], key, "o")
    huge = bytearray(data)
    huge[8:16] = (10 * 2**30).to_bytes(8, "big")  # a manifest claimed 10 GB long
    with pytest.raises(SnapshotError, match="seal does not match"):
        open_sealed(bytes(huge), key, "o")
    with pytest.raises(SnapshotError, match="needs a key"):
        open_sealed(data, b"", "o")
    assert isinstance(Snapshot(data, {}), Snapshot)


def test_pip_packages_are_installed_again_through_the_same_policy(tmp_path):
    from .packages import LocalIndex, make_wheel, write_simple_index
    from .test_pip import pip_policy

    files = tmp_path / "dist"
    files.mkdir()
    make_wheel(files, "snappkg", "2.0", {"snappkg/__init__.py": "class Box:\n    v = 7\n"})
    write_simple_index(files, tmp_path)
    with LocalIndex(tmp_path) as index:
        with Sandbox(None, policy=pip_policy(index)) as source:
            ok(source.run("%pip install snappkg"))
            ok(source.run("import snappkg as sp\nbox = sp.Box()"))
            taken = source.snapshot()
        assert taken.manifest["packages"] == [{"name": "snappkg", "version": "2.0"}]
        assert {"path": "session-packages"} not in taken.manifest["files"]
        assert not any(entry["path"].startswith("session-packages/")
                       for entry in taken.manifest["files"])
        with Sandbox(None, policy=pip_policy(index), snapshot=taken) as restored:
            assert restored.restored["packages"] == ["snappkg==2.0"]
            assert restored.restored["skipped"] == []
            assert evaluate(restored, "sp.__name__, box.v, type(box).__module__") == (
                "snappkg", 7, "snappkg")
