"""What a read-only root leaves a launcher: a fork server that cannot be set up is a cold start
with one log line, and the uid locks go where root can write."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sandbox_kernel.confine import privileges

TWO_KERNELS = textwrap.dedent("""
    import logging, sys
    from sandbox_kernel.client import Sandbox
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")
    for _ in range(2):
        with Sandbox(None) as sandbox:
            print(sandbox.manager.provisioner.fork_served, sandbox.run("print(6 * 7)").stdout,
                  end="")
""")


def test_a_fork_server_that_cannot_be_set_up_is_a_cold_start_said_once(tmp_path):
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    (runtime / "sandbox-kernel").write_text("")  # where its directory goes: mkdir fails
    done = subprocess.run([sys.executable, "-c", TWO_KERNELS], capture_output=True, text=True,
                          env={**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False 42\nFalse 42\n"  # both ran, both cold
    said = [line for line in done.stderr.splitlines() if "starting kernels cold" in line]
    assert said == [f"sandbox-kernel: starting kernels cold: cannot use {runtime}/sandbox-kernel: "
                    "File exists; set JUPYTER_RUNTIME_DIR to a writable directory"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid locks are root's")
def test_the_uid_lock_dir_is_configurable_and_checked(tmp_path):
    chosen = tmp_path / "locks"
    assert privileges.lock_dir(str(chosen)) == chosen
    assert chosen.stat().st_mode & 0o777 == 0o700
    uid, lock = privileges.allocate(range(265000, 265010), locks=str(chosen))
    try:
        assert (chosen / f"{uid}.lock").exists()
    finally:
        os.close(lock)
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(privileges.PrivilegeError, match=r"cannot make --uid-lock-dir .*file/x"):
        privileges.lock_dir(str(blocked / "x"))
    os.chmod(chosen, 0o755)  # others could plant locks: refused, not used
    with pytest.raises(privileges.PrivilegeError, match="only root can use"):
        privileges.lock_dir(str(chosen))


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid locks are root's")
def test_without_a_writable_run_the_locks_go_to_tmp(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(privileges, "LOCK_DIR", str(blocked / "uids"))  # cannot be made
    assert str(privileges.lock_dir()) == privileges.FALLBACK_LOCK_DIR


def _check(*flags: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", "check", *flags],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_check_checks_what_serve_would_run(tmp_path):
    done = _check(ENABLE_NETWORK="false", JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "what `sandbox-kernel serve` would run here:" in lines
    assert "  offline kernels: the kernel will start" in lines
    assert not any(line.startswith("  network kernels") for line in lines)  # not served
    assert f"  writes connection files and fork server in {tmp_path / 'runtime'}" in lines


def test_check_names_a_directory_the_service_cannot_write(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    done = _check("--service", JUPYTER_RUNTIME_DIR=str(blocked / "runtime"))
    assert done.returncode == 1
    assert (f"sandbox-kernel check: cannot enforce: cannot write JUPYTER_RUNTIME_DIR "
            f"{blocked / 'runtime'} (Not a directory), where the kernels' connection files go: "
            "set JUPYTER_RUNTIME_DIR to a writable directory") in done.stderr
    assert "the service would serve nothing: /ready stays 503" in done.stdout
