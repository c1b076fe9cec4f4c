"""/ready tells the truth: 200 only once a kernel of every policy served has started and
answered, with or without a pool; a policy whose kernels cannot start keeps it 503, named.

A root without CAP_SYS_ADMIN (the service's lot in a container) with --run-as root cannot give
a network kernel its namespace (no uid of its own to make one in a user namespace), while its
offline kernels start: the network policy alone fails, as in a container whose seccomp profile
refuses unshare.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from .helpers import DIFY_KEY, RUN, free_port, http

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv (util-linux)")


def _serve_without_sys_admin(tmp_path, pool_size: str):
    port = free_port()
    env = {**os.environ, "API_KEY": DIFY_KEY, "SANDBOX_PORT": str(port),
           # A fork server of its own: one started with every capability would fork kernels
           # that have CAP_SYS_ADMIN.
           "JUPYTER_RUNTIME_DIR": tempfile.mkdtemp(prefix="rt", dir=tmp_path.parents[2])}
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(
        ["setpriv", "--bounding-set", "-sys_admin", sys.executable, "-m", "sandbox_kernel",
         "serve", "--host", "127.0.0.1", "--pool-size", pool_size, "--run-as", "root",
         "--max-threads", "0", "--scratch-size", "0"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def _settled(url: str, process, timeout: float = 60) -> tuple[int, dict]:
    """/ready once the offline policy has had its start, and the network one its failure and
    `check`'s diagnosis of it."""
    deadline = time.monotonic() + timeout
    answers = []
    while time.monotonic() < deadline:
        assert process.poll() is None
        try:
            answer = http.get(f"{url}/ready", timeout=5)
        except Exception:
            time.sleep(0.2)
            continue
        answers.append(answer.status_code)
        state = answer.json()
        if state.get("policies", {}).get("offline", {}).get("started") and \
                "sandbox-kernel check" in state["policies"]["network"]["error"]:
            assert 200 not in answers, answers
            return answer.status_code, state
        time.sleep(0.2)
    raise AssertionError(f"never settled: {answers}")


@pytest.mark.parametrize("pool_size", ["0", "1"])
def test_a_policy_that_cannot_start_keeps_the_service_not_ready(tmp_path, pool_size):
    process, url = _serve_without_sys_admin(tmp_path, pool_size)
    try:
        status, state = _settled(url, process)
        assert status == 503 and state["ready"] is False
        assert state["policies"]["offline"] == {"started": True, "error": ""}
        assert state["policies"]["network"]["started"] is False
        assert state["reason"].startswith("network kernels: ")
        assert "namespace" in state["reason"] and "--network off" in state["reason"]
        assert state["pool"]["network"] == 0  # a failed start is never a ready kernel
        # The offline kernels do run meanwhile: the service is up, only not ready.
        answer = http.post(url + RUN, headers={"X-Api-Key": DIFY_KEY},
                           json={"language": "python3", "code": "print(6 * 7)"})
        assert (answer.json()["data"] or {}).get("stdout") == "42\n", answer.json()
    finally:
        process.terminate()
        process.wait(30)
