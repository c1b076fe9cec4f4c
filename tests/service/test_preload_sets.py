"""Stateless runs on a runtime that preloads what it installs (#49): a run importing nothing
takes the lean pool (its zygote holds none of the runtime's modules), a run importing some
takes the pool of the cheapest preload set holding them (launch/imports.py, read without
running the code), at most --max-preload-pools such pools at once; a session's kernel starts
with every preload loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ..packages import make_wheel
from .helpers import KEY_A, Server, auth, http

pytestmark = pytest.mark.timeout(900)
PROBE = ("import sys\nprint(sorted(m for m in ('psa', 'psb', 'psc') if m in sys.modules))\n")


@pytest.fixture(scope="module")
def preloading(tmp_path_factory, keys_file):
    """Runtime `sets` (psb loads psa; psc alone), built with no --preload flag, and a server
    on it keeping one preload-set pool at the most."""
    base = tmp_path_factory.mktemp("preload-sets")
    wheels = base / "wheels"
    wheels.mkdir()
    # 12 MB each: above launch/imports.py's LIGHT_KB, so each root is a set of its own
    heavy = "HEAVY = bytes(range(256)) * (48 * 1024)\n"
    make_wheel(wheels, "psa", "1.0", {"psa/__init__.py": heavy + "A = 1\n"})
    make_wheel(wheels, "psb", "1.0", {"psb/__init__.py": "import psa\nB = 2\n"},
               requires=("psa",))
    make_wheel(wheels, "psc", "1.0", {"psc.py": heavy + "C = 3\n"})
    requirements = base / "requirements.txt"
    requirements.write_text(f"--find-links {wheels}\npsb\npsc\n")
    environ = {**os.environ, "SANDBOX_KERNEL_RUNTIMES": str(base / "store")}
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "runtime", "create", "sets",
                           "-r", str(requirements), "--user"], env=environ,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Preloads psa, psb, psc (what it installs;" in done.stdout
    server = Server(base, "--api-keys-file", str(keys_file), "--pool-size", "0",
                    "--one-shot-pool-size", "1", "--max-preload-pools", "1",
                    env={**environ, "SANDBOX_RUNTIME": "sets"})
    yield server
    server.stop()
    subprocess.run([sys.executable, "-m", "sandbox_kernel", "runtime", "remove", "sets",
                    "--force"], env=environ, capture_output=True, check=False)


def run(server: Server, code: str) -> str:
    """The stdout of a stateless run of PROBE then code."""
    answer = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A),
                       json={"code": PROBE + code}, timeout=60).json()
    assert answer["error"] is None, answer
    return str(answer["stdout"])


def loaded(server: Server, code: str) -> str:
    """What of the runtime's modules were in sys.modules when the run's code began."""
    return run(server, code).splitlines()[0]


def eventually(server: Server, code: str, wanted: str) -> None:
    """The run lands on the set's pool once that pool is had (the first ones: the lean pool)."""
    deadline, seen = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        seen.append(loaded(server, code))
        if seen[-1] == wanted:
            return
        assert seen[-1] == "[]", seen  # meanwhile: the lean pool, never another set's
        time.sleep(0.5)
    raise AssertionError(f"never on {wanted}: {seen}\n{server.log.read_text()[-3000:]}")


def test_a_run_importing_nothing_takes_the_lean_pool(preloading):
    assert loaded(preloading, "print('psa psb psc')") == "[]"
    assert loaded(preloading, "def main():\n    return {'a': 1}\n") == "[]"


def test_a_run_takes_the_pool_of_the_set_holding_its_imports(preloading):
    eventually(preloading, "import psc\n", "['psc']")
    assert loaded(preloading, "def main():\n    import psc\n    return {}\n") == "['psc']"
    assert '"event":"one_shot_pool_ready"' in preloading.log.read_text()
    assert '"preload":["psc"]' in preloading.log.read_text()
    # from psa: the only set holding psa is psb's root set; one pool at the most: psc's goes
    eventually(preloading, "from psa import A\n", "['psa', 'psb']")
    assert '"event":"one_shot_pool_retired"' in preloading.log.read_text()
    eventually(preloading, "import importlib\nimportlib.import_module('psc')\n", "['psc']")


@pytest.mark.parametrize("code", [
    "m = __import__('ps' + 'c')\n",
    "exec('import psc as m')\n",
    "name = 'psc'\nimport importlib\nm = importlib.import_module(name)\n",
    "#" * (300 * 1024) + "\nimport psc as m\n",  # past what is read
])
def test_imports_not_read_statically_run_on_the_lean_pool_and_still_work(preloading, code):
    eventually(preloading, "import psc\n", "['psc']")  # psc's pool is there to be chosen
    assert run(preloading, code + "print(m.C)") == "[]\n3\n"


def test_a_session_on_the_runtime_starts_with_every_preload(preloading):
    created = http.post(preloading.url + "/api/v1/sessions", headers=auth(KEY_A), json={},
                        timeout=120)
    assert created.status_code in (200, 201), created.text
    url = preloading.url + "/api/v1/sessions/" + created.json()["id"]
    try:
        ran = http.post(url + "/execute", headers=auth(KEY_A), json={"code": PROBE},
                        timeout=120).json()
        assert ran["stdout"] == "['psa', 'psb', 'psc']\n", ran
    finally:
        http.delete(url, headers=auth(KEY_A), timeout=60)
