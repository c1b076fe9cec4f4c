"""A running service follows its runtime's update (#49): after `/dependencies/refresh` (or
`sandbox-kernel runtime update`), stateless runs take one-shot pools made on the new build, its
lean pool and its preload sets (recomputed from the new build's `preload`: a module the update
added is preloadable, one it removed is gone), on the lean one-shot process (the default); and
no run is lost to the change: one in flight finishes, none fails while the pools are replaced."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from sandbox_kernel.policy import SandboxPolicy
from sandbox_kernel.service.config import ServiceConfig
from sandbox_kernel.service.core import Service

from ..packages import make_wheel
from .helpers import DIFY_KEY, KEY_A, Server, auth, http

pytestmark = pytest.mark.timeout(900)
MODULES = ("upa", "upc", "upd")
# Which build the run's interpreter is, and which of the runtime's modules its zygote held.
PROBE = ("import sys\nprint(sys.prefix.rsplit('/', 1)[-1], "
         f"sorted(m for m in {MODULES!r} if m in sys.modules))\n")
HEAVY = "HEAVY = bytes(range(256)) * (48 * 1024)\n"  # 12 MB: above LIGHT_KB, a set of its own


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, keys_file):
    """Runtime `upd8` installing upa and upc (build 1) from local wheels, upd waiting beside
    them, and a server on it with one-shot pools of one process, one preload-set pool at most."""
    tmp_path = tmp_path_factory.mktemp("runtime-update")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in MODULES:
        make_wheel(wheels, name, "1.0", {f"{name}.py": HEAVY + f"NAME = {name!r}\n"})
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"--find-links {wheels}\nupa\nupc\n")
    environ = {**os.environ, "SANDBOX_KERNEL_RUNTIMES": str(tmp_path / "store")}
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "runtime", "create", "upd8",
                           "-r", str(requirements), "--user"], env=environ,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    server = Server(tmp_path, "--api-keys-file", str(keys_file), "--pool-size", "0",
                    "--one-shot-pool-size", "1", "--max-preload-pools", "1",
                    env={**environ, "SANDBOX_RUNTIME": "upd8"})
    server.requirements, server.environ, server.wheels = requirements, environ, wheels
    yield server
    server.stop()
    subprocess.run([sys.executable, "-m", "sandbox_kernel", "runtime", "remove", "upd8",
                    "--force"], env=environ, capture_output=True, check=False)


def execute(server: Server, code: str, timeout: float = 60) -> dict:
    """A stateless run's answer (native one-shot execute) of PROBE then code."""
    return http.post(server.url + "/api/v1/execute", headers=auth(KEY_A),
                     json={"code": PROBE + code, "timeout": 30}, timeout=timeout).json()


def probed(server: Server, code: str) -> str:
    """PROBE's line: the run's build and the runtime's modules its zygote held."""
    answer = execute(server, code)
    assert answer["error"] is None, answer
    return str(answer["stdout"]).splitlines()[0]


def eventually(server: Server, code: str, wanted: str) -> None:
    """The run lands on the pool wanted once that pool is had (meanwhile: the lean one)."""
    deadline, seen = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        seen.append(probed(server, code))
        if seen[-1] == wanted:
            return
        time.sleep(0.5)
    raise AssertionError(f"never {wanted}: {seen}\n{server.log.read_text()[-4000:]}")


class Load:
    """Runs sent one after another from a thread, each answer kept with when it came back."""

    def __init__(self, server: Server, code: str) -> None:
        self.server, self.code = server, code
        self.answers: list[tuple[float, dict]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self) -> None:
        while not self.done.is_set():
            try:
                answer = execute(self.server, self.code)
            except Exception as exc:  # a broken connection is a lost run too
                answer = {"detail": repr(exc)}
            self.answers.append((time.time(), answer))

    def stop(self) -> list[tuple[float, dict]]:
        self.done.set()
        self.thread.join(120)
        return self.answers


SLEEP = "import time\ntime.sleep(2)\n"  # runs long enough that some are in flight at the move


def moved_under_load(server: Server, update, was: int, now: int) -> None:
    """Call update() while runs go on (short and long, on the lean pool and on upa's), until
    a run lands on build `now`; every run answered, none lost, some in flight at the move."""
    loads = [Load(server, code) for code in ("", "import upa\n", SLEEP, "import upa\n" + SLEEP)]
    update()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not probed(server, "").startswith(f"{now} "):
        time.sleep(0.2)
    time.sleep(3)  # the long runs that began before the move end after it
    answers = [answer for load in loads for answer in load.stop()]
    log = server.log.read_text()
    lost = [answer for _, answer in answers if "error" not in answer or answer["error"]]
    assert not lost, (lost[:3], len(answers), log[-4000:])
    moved = [json.loads(line) for line in log.splitlines()
             if '"event":"runtime_moved"' in line and f'"build":{now},' in line]
    assert len(moved) == 1, log[-4000:]
    at = datetime.datetime.fromisoformat(moved[0]["time"].replace("Z", "+00:00")).timestamp()
    finished_after = [answer for when, answer in answers
                      if when > at and answer["stdout"].startswith(f"{was} ")]
    assert finished_after, "no run was in flight on the old build when the service moved"


def test_the_service_follows_an_update_made_with_the_cli(runtime):
    """`sandbox-kernel runtime update` while the service runs: the service moves by itself."""
    assert probed(runtime, "") == "1 []"
    eventually(runtime, "import upc\n", "1 ['upc']")
    runtime.requirements.write_text(f"--find-links {runtime.wheels}\nupa\nupd\n")

    def update() -> None:
        done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "runtime", "update",
                               "upd8", "--force"], env=runtime.environ, capture_output=True,
                              text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
    moved_under_load(runtime, update, 1, 2)
    # Every pool on build 2: the lean one, and the sets of its preload (upd added, upc gone).
    assert probed(runtime, "") == "2 []"
    eventually(runtime, "import upd\n", "2 ['upd']")
    eventually(runtime, "import upa\n", "2 ['upa']")
    gone = execute(runtime, "import upc\n")
    assert gone["error"]["name"] == "ModuleNotFoundError", gone


def test_the_refresh_route_moves_the_service_to_the_rebuilt_runtime(runtime):
    runtime.requirements.write_text(f"--find-links {runtime.wheels}\nupa\nupc\n")

    def refresh() -> None:
        refreshed = http.get(runtime.url + "/v1/sandbox/dependencies/refresh?language=python3",
                             headers={"X-Api-Key": DIFY_KEY}, timeout=600)
        assert refreshed.json()["code"] == 0, refreshed.text
    moved_under_load(runtime, refresh, 2, 3)
    eventually(runtime, "import upc\n", "3 ['upc']")
    gone = execute(runtime, "import upd\n")
    assert gone["error"]["name"] == "ModuleNotFoundError", gone


class _Build:
    """A kernel source standing for one build of a runtime: its start may fail."""

    def __init__(self, build: int, fails: bool = False) -> None:
        self.build, self.fails, self.closed = build, fails, False

    async def start(self) -> None:
        if self.fails:
            raise RuntimeError("the new build's kernels cannot start")

    def health(self) -> dict:
        return {"offline": {"started": True}}

    async def close(self) -> None:
        self.closed = True


def test_a_move_that_fails_stops_the_new_builds_kernels_and_keeps_the_old_ones():
    old, new = _Build(1), _Build(2, fails=True)
    service = Service(ServiceConfig(one_shot_pool_size=0), SandboxPolicy(), source=old)
    service.make_source = lambda: new
    with pytest.raises(RuntimeError, match="cannot start"):
        asyncio.run(service.use_current_runtime())
    assert new.closed and not old.closed
    assert service.kernels.source is old
