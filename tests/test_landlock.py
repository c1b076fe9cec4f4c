"""Tests for sandbox_kernel.confine.landlock.

Landlock can never be lifted, so every restricted scenario runs in a child interpreter that
applies the rules, tries operations and prints one JSON line. Outcomes are "ok" or
[exception type name, errno name].
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox_kernel.confine.landlock import LandlockError, LandlockRules, abi_version, existing

REPO = str(Path(__file__).resolve().parents[1])
ABI = abi_version()
DENIED = ["PermissionError", "EACCES"]  # what Landlock returns for file-system and TCP denials
SCOPE_DENIED = ["PermissionError", "EPERM"]  # what it returns for scoped IPC (signals, sockets)

pytestmark = pytest.mark.skipif(ABI == 0, reason="Landlock is not supported or is disabled here")

# Everything the child needs is imported before apply(); the system dirs are granted anyway so
# that late imports and shared libraries keep working.
PRELUDE = """
import errno, json, os, socket, sys, threading
from sandbox_kernel.confine import landlock as ll

P = json.loads(sys.argv[1])
SYSTEM = ll.existing([sys.prefix, sys.base_prefix, "/usr", "/lib", "/lib64", "/etc"])

def attempt(fn):
    try:
        fn()
    except OSError as exc:
        return [type(exc).__name__, errno.errorcode.get(exc.errno, exc.errno)]
    return "ok"

def read(path):
    with open(path) as f:
        return f.read()

def write(path, text):
    with open(path, "w") as f:
        f.write(text)
"""


def run_child(body: str, **params: Any) -> Any:
    """Run PRELUDE + body in a fresh interpreter and return the JSON it prints last."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body), json.dumps(params)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def needs_abi(version: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(ABI < version, reason=f"needs Landlock ABI >= {version}, have {ABI}")


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    """A read-only, a read-write, a second read-write and a non-granted dir, each with a file."""
    paths = {}
    for name in ("ro", "rw", "rw2", "other"):
        d = tmp_path / name
        d.mkdir()
        (d / "file.txt").write_text(f"{name} data")
        paths[name] = str(d)
    return paths


@pytest.fixture
def tcp_server() -> Iterator[int]:
    """A TCP listener on 127.0.0.1 in this (unrestricted) process; yields its port."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_abi_version() -> None:
    assert ABI >= 1
    assert abi_version() == ABI


def test_existing_filters_missing_paths(tmp_path: Path) -> None:
    present = str(tmp_path)
    missing = str(tmp_path / "missing")
    assert existing([present, missing, present]) == (present, present)
    assert existing([]) == ()


def test_landlock_error_is_oserror() -> None:
    assert issubclass(LandlockError, OSError)
    assert LandlockRules() == LandlockRules((), (), (), False, True, True)


def test_struct_layouts_match_uapi() -> None:
    from sandbox_kernel.confine import landlock

    assert ctypes.sizeof(landlock._RulesetAttr) == 24
    assert ctypes.sizeof(landlock._PathBeneathAttr) == 12  # packed in the UAPI header
    assert ctypes.sizeof(landlock._NetPortAttr) == 16


# Expected handled rights per ABI; an ABI newer than the module knows gets ABI 7's rights.
FS_RIGHTS_BY_ABI = {1: 13, 2: 14, 3: 15, 4: 15, 5: 16, 6: 16, 7: 16, 99: 16}


@pytest.mark.parametrize("simulated_abi", sorted(FS_RIGHTS_BY_ABI))
def test_best_effort_on_older_and_newer_abis(dirs: dict[str, str], simulated_abi: int) -> None:
    # The running kernel accepts rulesets built for any older ABI, so pretending the kernel
    # offers ABI N checks the masking and the struct size sent for every ABI.
    if simulated_abi > ABI and simulated_abi <= 7:
        pytest.skip(f"kernel offers ABI {ABI}")
    result = run_child(
        """
        ll._host_abi = lambda: P["abi"]
        report = ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["ro"],), read_write=(P["rw"],),
                                           bind_tcp_ports=(1234,)))
        report["read_other"] = attempt(lambda: read(P["other"] + "/file.txt"))
        report["write_rw"] = attempt(lambda: write(P["rw"] + "/new.txt", "x"))
        print(json.dumps(report))
        """,
        abi=simulated_abi,
        **dirs,
    )
    assert result["abi"] == simulated_abi
    assert len(result["fs_rights"]) == FS_RIGHTS_BY_ABI[simulated_abi]
    assert ("refer" in result["fs_rights"]) == (simulated_abi >= 2)
    assert ("truncate" in result["fs_rights"]) == (simulated_abi >= 3)
    assert ("ioctl_dev" in result["fs_rights"]) == (simulated_abi >= 5)
    if simulated_abi >= 4:
        assert result["net"] == {
            "bind_tcp_ports": [1234],
            "bind_tcp": "restricted",
            "connect_tcp": "denied",
        }
    else:
        assert result["net"]["connect_tcp"] == "unrestricted (ABI < 4)"
    expected_scopes = ["abstract_unix_socket", "signal"] if simulated_abi >= 6 else []
    assert result["scopes"] == expected_scopes
    assert result["read_other"] == DENIED
    assert result["write_rw"] == "ok"


def test_read_only_grant(dirs: dict[str, str]) -> None:
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["ro"],)))
        print(json.dumps({
            "read": read(P["ro"] + "/file.txt"),
            "list": sorted(os.listdir(P["ro"])),
            "create": attempt(lambda: write(P["ro"] + "/new.txt", "x")),
            "overwrite": attempt(lambda: write(P["ro"] + "/file.txt", "x")),
            "mkdir": attempt(lambda: os.mkdir(P["ro"] + "/sub")),
            "unlink": attempt(lambda: os.unlink(P["ro"] + "/file.txt")),
            "read_other": attempt(lambda: read(P["other"] + "/file.txt")),
            "list_other": attempt(lambda: os.listdir(P["other"])),
        }))
        """,
        **dirs,
    )
    assert result == {
        "read": "ro data",
        "list": ["file.txt"],
        "create": DENIED,
        "overwrite": DENIED,
        "mkdir": DENIED,
        "unlink": DENIED,
        "read_other": DENIED,
        "list_other": DENIED,
    }
    assert Path(dirs["ro"], "file.txt").read_text() == "ro data"


def test_read_only_file_rule(dirs: dict[str, str]) -> None:
    # A rule on a file (not a dir) must carry only file rights, or the kernel says EINVAL.
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["ro"] + "/file.txt",),
                                  read_write=(P["rw"] + "/file.txt",)))
        print(json.dumps({
            "read": read(P["ro"] + "/file.txt"),
            "write_rw_file": attempt(lambda: write(P["rw"] + "/file.txt", "new")),
            "list_parent": attempt(lambda: os.listdir(P["ro"])),
            "create_sibling": attempt(lambda: write(P["rw"] + "/sibling.txt", "x")),
        }))
        """,
        **dirs,
    )
    assert result == {
        "read": "ro data",
        "write_rw_file": "ok",
        "list_parent": DENIED,
        "create_sibling": DENIED,
    }


def test_read_write_grant(dirs: dict[str, str]) -> None:
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM, read_write=(P["rw"],)))
        d = P["rw"]
        print(json.dumps({
            "create": attempt(lambda: write(d + "/a.txt", "hello world")),
            "rename": attempt(lambda: os.rename(d + "/a.txt", d + "/b.txt")),
            "truncate": attempt(lambda: os.truncate(d + "/b.txt", 5)),
            "content": read(d + "/b.txt"),
            "mkdir": attempt(lambda: os.mkdir(d + "/sub")),
            "symlink": attempt(lambda: os.symlink("b.txt", d + "/link")),
            "delete": attempt(lambda: os.unlink(d + "/b.txt")),
            "rmdir": attempt(lambda: os.rmdir(d + "/sub")),
            "list": sorted(os.listdir(d)),
        }))
        """,
        **dirs,
    )
    assert result == {
        "create": "ok",
        "rename": "ok",
        "truncate": "ok",
        "content": "hello",
        "mkdir": "ok",
        "symlink": "ok",
        "delete": "ok",
        "rmdir": "ok",
        "list": ["file.txt", "link"],
    }


@needs_abi(2)
def test_cross_directory_rename_and_link(dirs: dict[str, str]) -> None:
    # Into a read-only dir the kernel answers EACCES, not EXDEV: the destination lacks MAKE_REG
    # as well as REFER, and Landlock documents that EACCES wins over EXDEV when both apply.
    # Out of a read-only dir fails on the missing REMOVE_FILE. Between two read-write dirs
    # (REFER granted on both, same rights) the move is allowed.
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["ro"],), read_write=(P["rw"], P["rw2"])))
        src = P["rw"] + "/file.txt"
        print(json.dumps({
            "rename_into_ro": attempt(lambda: os.rename(src, P["ro"] + "/moved.txt")),
            "link_into_ro": attempt(lambda: os.link(src, P["ro"] + "/linked.txt")),
            "rename_out_of_ro": attempt(lambda: os.rename(P["ro"] + "/file.txt", P["rw"] + "/x")),
            "link_into_rw2": attempt(lambda: os.link(src, P["rw2"] + "/linked.txt")),
            "rename_into_rw2": attempt(lambda: os.rename(src, P["rw2"] + "/moved.txt")),
        }))
        """,
        **dirs,
    )
    assert result == {
        "rename_into_ro": DENIED,
        "link_into_ro": DENIED,
        "rename_out_of_ro": DENIED,
        "link_into_rw2": "ok",
        "rename_into_rw2": "ok",
    }
    assert sorted(os.listdir(dirs["ro"])) == ["file.txt"]


@needs_abi(3)
def test_truncate_in_read_only_dir(dirs: dict[str, str]) -> None:
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["ro"],)))
        print(json.dumps({"truncate": attempt(lambda: os.truncate(P["ro"] + "/file.txt", 0))}))
        """,
        **dirs,
    )
    assert result == {"truncate": DENIED}
    assert Path(dirs["ro"], "file.txt").read_text() == "ro data"


def test_thread_started_after_apply_is_restricted(dirs: dict[str, str]) -> None:
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["ro"],)))
        out = {}
        def worker():
            out["other"] = attempt(lambda: read(P["other"] + "/file.txt"))
            out["ro"] = attempt(lambda: read(P["ro"] + "/file.txt"))
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        print(json.dumps(out))
        """,
        **dirs,
    )
    assert result == {"other": DENIED, "ro": "ok"}


def test_refuses_when_several_threads(dirs: dict[str, str]) -> None:
    result = run_child(
        """
        stop = threading.Event()
        t = threading.Thread(target=stop.wait)
        t.start()
        try:
            ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["ro"],)))
            error = None
        except ll.LandlockError as exc:
            error = str(exc)
        stop.set()
        t.join()
        with open("/proc/self/status") as f:
            nnp = [line.split()[1] for line in f if line.startswith("NoNewPrivs:")][0]
        print(json.dumps({
            "error": error,
            "still_unrestricted": attempt(lambda: read(P["other"] + "/file.txt")),
            "no_new_privs": nnp,
        }))
        """,
        **dirs,
    )
    assert result["error"] is not None
    assert "2 threads" in result["error"]
    assert "calling thread" in result["error"]
    # Refusal happens before anything irreversible.
    assert result["still_unrestricted"] == "ok"
    assert result["no_new_privs"] == "0"


def test_missing_path_is_named(dirs: dict[str, str], tmp_path: Path) -> None:
    missing = str(tmp_path / "does-not-exist")
    result = run_child(
        """
        try:
            ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["missing"],), read_write=(P["rw"],)))
            error = None
        except ll.LandlockError as exc:
            error = {"str": str(exc), "errno": exc.errno, "filename": exc.filename}
        print(json.dumps({
            "error": error,
            "still_unrestricted": attempt(lambda: read(P["other"] + "/file.txt")),
        }))
        """,
        missing=missing,
        **dirs,
    )
    error = result["error"]
    assert error is not None
    assert missing in error["str"]
    assert "does not exist" in error["str"]
    assert error["errno"] == 2  # ENOENT
    assert error["filename"] == missing
    assert result["still_unrestricted"] == "ok"


@pytest.mark.parametrize("swapped", ["grant", "parent"])
def test_exact_grant_swapped_for_a_link_is_refused(dirs: dict[str, str], tmp_path: Path,
                                                   swapped: str) -> None:
    """A grant checked for links (paths.check_grants) and then replaced by one, itself or a
    folder above it, before the rule is added: the rule is refused, never the link's target."""
    grant = tmp_path / "shared" / "ro"
    grant.mkdir(parents=True)
    victim = grant if swapped == "grant" else grant.parent
    victim.rename(tmp_path / "moved")
    target = Path(dirs["other"]) if swapped == "grant" else tmp_path / "elsewhere"
    (tmp_path / "elsewhere" / "ro").mkdir(parents=True)
    victim.symlink_to(target)
    result = run_child(
        """
        def apply(exact):
            try:
                ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["grant"],), exact=exact))
            except ll.LandlockError as exc:
                return [errno.errorcode[exc.errno], exc.filename, str(exc)]
            return "applied"
        print(json.dumps({
            "exact": apply((P["grant"],)),
            "still_unrestricted": attempt(lambda: read(P["other"] + "/file.txt")),
            "followed": apply(()),  # a system grant may be a link (/lib on merged-/usr hosts)
        }))
        """,
        grant=str(grant), **dirs,
    )
    code, filename, message = result["exact"]
    assert (code, filename) == ("ELOOP", str(grant))
    assert f"the grant now reaches {os.path.realpath(grant)} through a symbolic link" in message
    assert "grant a path no one else may change" in message
    assert result["still_unrestricted"] == "ok"
    assert result["followed"] == "applied"


def test_exact_grant_without_links_applies(dirs: dict[str, str]) -> None:
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM + (P["ro"],), read_write=(P["rw"],),
                                  exact=(P["ro"], P["rw"])))
        print(json.dumps([read(P["ro"] + "/file.txt"), attempt(lambda: write(P["rw"] + "/n", "x")),
                          attempt(lambda: read(P["other"] + "/file.txt"))]))
        """,
        **dirs,
    )
    assert result == ["ro data", "ok", DENIED]


def test_invalid_port_rejected() -> None:
    result = run_child(
        """
        try:
            ll.apply(ll.LandlockRules(read_only=SYSTEM, bind_tcp_ports=(70000,)))
            error = None
        except ll.LandlockError as exc:
            error = str(exc)
        print(json.dumps({"error": error}))
        """
    )
    assert "70000" in result["error"]


@needs_abi(4)
@pytest.mark.parametrize("connect_tcp", [False, True])
def test_tcp_connect(tcp_server: int, connect_tcp: bool) -> None:
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM, connect_tcp=P["connect_tcp"]))
        with socket.socket() as s:
            print(json.dumps({"connect": attempt(lambda: s.connect(("127.0.0.1", P["port"])))}))
        """,
        port=tcp_server,
        connect_tcp=connect_tcp,
    )
    assert result == {"connect": "ok" if connect_tcp else DENIED}


@needs_abi(4)
def test_tcp_bind() -> None:
    allowed, other = free_port(), free_port()
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM, bind_tcp_ports=(P["allowed"],)))
        def bind(port):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        print(json.dumps({
            "allowed": attempt(lambda: bind(P["allowed"])),
            "other": attempt(lambda: bind(P["other"])),
            "ephemeral": attempt(lambda: bind(0)),  # port 0 is a port like any other
        }))
        """,
        allowed=allowed,
        other=other,
    )
    assert result == {"allowed": "ok", "other": DENIED, "ephemeral": DENIED}


@needs_abi(6)
@pytest.mark.parametrize("scope_signals", [True, False])
def test_signal_scope(scope_signals: bool) -> None:
    # Signal 0 only checks permission; no real signal is ever sent.
    result = run_child(
        """
        ll.apply(ll.LandlockRules(read_only=SYSTEM, scope_signals=P["scope"]))
        print(json.dumps({
            "parent": attempt(lambda: os.kill(os.getppid(), 0)),
            "self": attempt(lambda: os.kill(os.getpid(), 0)),
        }))
        """,
        scope=scope_signals,
    )
    assert result == {"parent": SCOPE_DENIED if scope_signals else "ok", "self": "ok"}


@needs_abi(6)
@pytest.mark.parametrize("scope_abstract_unix", [True, False])
def test_abstract_unix_scope(scope_abstract_unix: bool) -> None:
    name = "\0sandbox-kernel-test-" + uuid.uuid4().hex
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(name)
        server.listen(1)
        result = run_child(
            """
            ll.apply(ll.LandlockRules(read_only=SYSTEM, scope_abstract_unix=P["scope"]))
            with socket.socket(socket.AF_UNIX) as s:
                print(json.dumps({"connect": attempt(lambda: s.connect(P["name"]))}))
            """,
            name=name,
            scope=scope_abstract_unix,
        )
    assert result == {"connect": SCOPE_DENIED if scope_abstract_unix else "ok"}


@needs_abi(7)
def test_report(dirs: dict[str, str]) -> None:
    result = run_child(
        """
        report = ll.apply(ll.LandlockRules(read_only=(P["ro"],), read_write=(P["rw"],),
                                           bind_tcp_ports=(8080, 80, 8080)))
        print(json.dumps(report))
        """,
        **dirs,
    )
    assert result["abi"] == ABI
    assert {
        "read_file",
        "read_dir",
        "execute",
        "write_file",
        "refer",
        "truncate",
        "ioctl_dev",
    } <= set(result["fs_rights"])
    assert len(result["fs_rights"]) == 16
    assert result["net"] == {
        "bind_tcp_ports": [80, 8080],
        "bind_tcp": "restricted",
        "connect_tcp": "denied",
    }
    assert result["scopes"] == ["abstract_unix_socket", "signal"]
    assert result["read_only"] == [dirs["ro"]]
    assert result["read_write"] == [dirs["rw"]]


@needs_abi(6)
def test_report_with_everything_allowed() -> None:
    result = run_child(
        """
        print(json.dumps(ll.apply(ll.LandlockRules(
            read_only=SYSTEM, connect_tcp=True, scope_signals=False, scope_abstract_unix=False))))
        """
    )
    assert result["net"]["connect_tcp"] == "allowed"
    assert result["scopes"] == []
