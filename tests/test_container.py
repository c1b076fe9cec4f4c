"""The shipped containers, as an operator runs them, on Debian's own Docker: deploy/service/
Dockerfile built unchanged and run with exactly deploy/service/compose.yaml's settings (read
from the file); and deploy/enterprise-gateway/Dockerfile's kernel image run with the security
settings of the pod Enterprise Gateway renders from our template (read from the rendered pod).

The public image registry is out of reach here, so the base is a stand-in for the Dockerfile's
default (debootstrap bookworm with python3, python3-venv and libseccomp2, `docker import`),
handed over as the Dockerfile's BASE build argument; made once per machine and reused. The
image build reaches the package index the way this machine's pip does: its index settings and
CA bundle go to the build as build secrets, never into a layer of the image.

In CI (CI=true) the test fails when Docker cannot run; elsewhere it skips, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from .ci_tools import unavailable
from .test_enterprise_gateway_launcher import (
    connect_client,
    execute,
    launch_with_eg,
    send_request,
)

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "deploy" / "service"
DOCKER = "/usr/bin/docker"  # Debian's: /usr/local/bin/docker may be another, client-only one
BASE = "sandbox-kernel-test-base:bookworm"
IMAGE = "sandbox-kernel-service:test"
# In the pip.conf handed to the build; fixed, so that a cached layer was built with it too.
MARKER = "sandbox-kernel test build: pip settings"
BASE_PACKAGES = "python3,python3-venv,python-is-python3,libseccomp2,ca-certificates"
RUN = "/v1/sandbox/run"
# The first test builds the base and the image (minutes on a fresh machine; cached after).
pytestmark = pytest.mark.timeout(1800)


def _docker_problem() -> str | None:
    if not os.access(DOCKER, os.X_OK):
        return f"{DOCKER} is missing (apt-get install docker.io; .ci/run does)"
    answer = subprocess.run([DOCKER, "info", "--format", "{{.ServerVersion}}"],
                            capture_output=True, text=True, timeout=60)
    if answer.returncode != 0:
        return f"the Docker daemon does not answer: {answer.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def say(request):
    """Progress lines on the terminal while the long steps run (pytest captures the rest)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def say(line: str) -> None:
        with capture.global_and_fixture_disabled():
            print(f"[container test {time.strftime('%H:%M:%S')}] {line}", flush=True)
    return say


@pytest.fixture(scope="module")
def docker():
    problem = _docker_problem()
    if problem:
        unavailable(f"Docker cannot run: {problem}")


def _docker(*args: str, timeout: float = 600, check: bool = True,
            **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout,
                          **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])} failed:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
    return done


def _debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources)."""
    sources = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"),
               *sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))]
    for path in sources:
        text = path.read_text() if path.exists() else ""
        found = (re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.M)
                 or re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)\s+bookworm", text, re.M))
        if found:
            return found.group(1)
    raise AssertionError("no Debian mirror in this machine's apt sources for debootstrap")


def _make_base(say) -> None:
    if _docker("image", "inspect", BASE, check=False).returncode == 0:
        say(f"stand-in base {BASE}: reused")
        return
    if not shutil.which("debootstrap"):
        raise AssertionError("debootstrap is missing (apt-get install debootstrap; .ci/run does)")
    say(f"stand-in base: debootstrap bookworm ({BASE_PACKAGES}); a few minutes")
    with tempfile.TemporaryDirectory(dir="/var/tmp") as target:
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}",
                        "bookworm", target, _debian_mirror()],
                       check=True, capture_output=True, timeout=1200)
        tar = subprocess.Popen(["tar", "-C", target, "-c", "."], stdout=subprocess.PIPE)
        _docker("import", "-", BASE, stdin=tar.stdout)
        assert tar.wait() == 0
    say(f"stand-in base {BASE}: made")


def _pip_settings(directory: Path) -> list[str]:
    """Build secrets giving the image build this machine's way to the package index: its
    index URLs (local file:// ones mean nothing inside the build) and its CA bundle."""
    listed = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True,
                            text=True).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        key = name.split(".", 1)[-1]
        settings[key] = value.strip().strip("'\"")
    for key in ("index-url", "extra-index-url", "trusted-host"):
        env = os.environ.get(f"PIP_{key.upper().replace('-', '_')}")
        if env:
            settings[key] = env
    lines = [f"# {MARKER}", "[global]", f"timeout = {settings.get('timeout', '120')}"]
    for key in ("index-url", "extra-index-url"):
        urls = [url for url in settings.get(key, "").split() if url.startswith(("http:", "https:"))]
        if urls:
            lines.append(f"{key} = {' '.join(urls)}")
    if settings.get("trusted-host"):
        lines.append(f"trusted-host = {settings['trusted-host']}")
    conf = directory / "pip.conf"
    conf.write_text("\n".join(lines) + "\n")
    secrets = ["--secret", f"id=pip.conf,src={conf}"]
    bundle = (settings.get("cert") or os.environ.get("PIP_CERT")
              or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE"))
    if bundle and Path(bundle).is_file():
        secrets += ["--secret", f"id=ca.pem,src={bundle}"]
    return secrets


def _build(say, tmp: Path, dockerfile: Path = SERVICE / "Dockerfile", image: str = IMAGE,
           *options: str) -> None:
    shown = dockerfile.relative_to(ROOT)
    say(f"image: docker build -f {shown} {' '.join(options)} (BASE = the stand-in); cached "
        "layers are reused, a fresh build takes minutes")
    started = time.monotonic()
    before = _docker("image", "inspect", "-f", "{{.Id}}", image, check=False).stdout.strip()
    _docker("build", "--build-arg", f"BASE={BASE}", *_pip_settings(tmp), *options,
            "-f", str(dockerfile), "-t", image, str(ROOT),
            timeout=1800, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    if before and before != _docker("image", "inspect", "-f", "{{.Id}}", image).stdout.strip():
        _docker("rmi", before, check=False)  # the last run's image: ~800 MB a run otherwise
    say(f"image {image}: built in {time.monotonic() - started:.0f} s")
    # Nothing of the build's pip settings is in the image: not its file, not its variables.
    assert MARKER not in _docker("history", "--no-trunc", image).stdout
    found = _docker("run", "--rm", "--user", "0", "--entrypoint", "sh", image, "-c",
                    f"grep -rlsF '{MARKER}' /etc /opt /root /usr/local /run; "
                    "env | grep ^PIP_; ls -A /run/secrets 2>/dev/null; true")
    assert found.stdout == "", found.stdout


def _substitute(value: str) -> str:
    """Compose's ${NAME:-default}, from the defaults alone (the test sets no variables)."""
    return re.sub(r"\$\{[A-Za-z_]+:-([^}]*)\}", r"\1", value)


def run_options(service: dict, host_port: int) -> list[str]:
    """`docker run` options for every setting of a compose service; an unknown one fails."""
    options: list[str] = []
    for key, value in service.items():
        if key in ("image", "build", "restart"):
            continue  # the test's image; built above; a test container must not come back
        if key == "environment":
            for name, setting in value.items():
                options += ["-e", f"{name}={_substitute(str(setting))}"]
        elif key == "ports":
            for mapping in value:
                *_, container = str(mapping).split(":")
                options += ["-p", f"127.0.0.1:{host_port}:{container}"]
        elif key == "user":
            options += ["--user", str(value)]
        elif key == "read_only":
            options += ["--read-only"] if value else []
        elif key == "tmpfs":
            for mount in value:
                options += ["--tmpfs", mount]
        elif key in ("cap_drop", "cap_add"):
            for cap in value:
                options += [f"--{key.replace('_', '-')}", cap]
        elif key == "security_opt":
            for item in value:
                name, sep, setting = item.partition(":" if item.startswith("no-new") else "=")
                if name == "seccomp" and setting not in ("unconfined",):
                    setting = str((SERVICE / setting).resolve())  # relative to the file
                options += ["--security-opt", f"{name}{sep}{setting}"]
        elif key == "volumes":  # the state dir: an anonymous volume, removed with the container
            for mount in value:
                options += ["--volume", mount.split(":", 1)[1]]
        elif key == "pids_limit":
            options += ["--pids-limit", str(value)]
        elif key == "mem_limit":
            options += ["--memory", str(value)]
        elif key == "stop_grace_period":
            options += ["--stop-timeout", str(int(str(value).rstrip("s")))]
        else:
            raise AssertionError(f"compose.yaml's {key!r} has no docker run option here: "
                                 "translate it, or the test would run something else")
    return options


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: `!reset VALUE` (an overlay's replacement) is that value."""


ComposeLoader.add_constructor("!reset", lambda loader, node: loader.construct_sequence(node))


def _compose_file(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)["services"]["sandbox"]


def _compose_service() -> dict:
    return _compose_file(SERVICE / "compose.yaml")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Container:
    """One container of the image, run detached with the given options."""

    def __init__(self, options: list[str], port: int) -> None:
        self.name = f"sandbox-kernel-test-{uuid.uuid4().hex[:8]}"
        self.url = f"http://127.0.0.1:{port}"
        _docker("run", "-d", "--name", self.name, *options, IMAGE)

    def logs(self) -> str:
        done = _docker("logs", "--tail", "60", self.name, check=False)
        return done.stdout + done.stderr

    def ready_state(self) -> tuple[int | None, dict]:
        try:
            answer = httpx.get(f"{self.url}/ready", timeout=5)
        except httpx.TransportError:
            return None, {}
        return answer.status_code, answer.json()

    def wait_answering(self, timeout: float = 120) -> list[tuple[int | None, dict]]:
        """Every /ready answer until one is 200 or the last is a settled 503."""
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen.append(self.ready_state())
            if seen[-1][0] == 200:
                return seen
            time.sleep(0.5)
        return seen

    def run(self, code: str, network: bool) -> dict:
        answer = httpx.post(self.url + RUN, headers={"X-Api-Key": "dify-sandbox"}, timeout=60,
                            json={"language": "python3", "code": code, "preload": "",
                                  "enable_network": network})
        assert answer.status_code == 200, answer.text
        return answer.json()

    def remove(self) -> None:
        _docker("rm", "-f", "-v", self.name, check=False)


@pytest.fixture(scope="module")
def image(docker, say, tmp_path_factory):
    started = time.monotonic()
    _make_base(say)
    _build(say, tmp_path_factory.mktemp("build"))
    yield IMAGE
    say(f"done in {time.monotonic() - started:.0f} s")


@pytest.fixture(scope="module")
def shipped(image, say):
    """The container as compose.yaml runs it, once /ready said 200."""
    port = _free_port()
    container = Container(run_options(_compose_service(), port), port)
    say(f"container {container.name}: started with compose.yaml's settings")
    try:
        container.answers = container.wait_answering()
        assert container.answers[-1][0] == 200, f"{container.answers[-1]}\n{container.logs()}"
        say("container: /ready 200")
        yield container
    finally:
        container.remove()


def test_check_passes_with_the_compose_settings(image):
    done = _docker("run", "--rm", *run_options(_compose_service(), _free_port()), IMAGE,
                   "check", check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "network kernels: the kernel will start" in done.stdout
    assert "the service's kernels will start" in done.stdout


def test_the_images_runtime_preloads_what_it_installs_and_a_pandas_node_runs_on_it(shipped):
    """No --preload in the Dockerfile: the runtime preloads what it installs (#49), and a run
    importing pandas lands, once its set's pool is up, on a zygote that holds pandas, while a
    run importing nothing stays on the lean one."""
    shown = json.loads(_docker("exec", shipped.name, "sandbox-kernel", "runtime", "show",
                               "default").stdout)
    assert shown["preload_from"] == "installed"
    assert {"jinja2", "requests", "numpy", "pandas", "matplotlib"} <= set(shown["preload"])
    probe = "import sys\nprint('pandas' in sys.modules)\n"
    deadline, seen = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        seen.append(shipped.run(probe + "import pandas\n", network=False)["data"]["stdout"])
        if seen[-1] == "True\n":
            break
        time.sleep(0.5)
    assert seen[-1] == "True\n", seen
    assert shipped.run(probe, network=False)["data"]["stdout"] == "False\n"


def test_ready_only_once_every_policy_started(shipped):
    status, state = shipped.answers[-1]
    assert status == 200 and state["ready"] is True
    # Stateless runs are one-shot kernels (--one-shot-pool-size's default): their pools too.
    assert state["policies"] == {"offline": {"started": True, "error": ""},
                                 "network": {"started": True, "error": ""},
                                 "offline one-shot": {"started": True, "error": None},
                                 "network one-shot": {"started": True, "error": None}}
    # Any answer before it said why it was not ready yet.
    for early_status, early in shipped.answers[:-1]:
        assert early_status in (None, 503) and (early_status is None or early["reason"])


@pytest.mark.parametrize("network", [False, True])
def test_dify_runs_with_and_without_network(shipped, network):
    answer = shipped.run("print('hello from', 6 * 7)", network)
    assert answer == {"code": 0, "message": "success",
                      "data": {"stdout": "hello from 42\n", "stderr": "", "error": "",
                               "exit_code": 0}}


PROBE = """
status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())
print(*(status[name].split()[0] for name in ('Seccomp', 'NoNewPrivs', 'CapEff', 'Uid')))
"""


@pytest.mark.parametrize("network", [False, True])
def test_a_run_is_confined_on_a_uid_of_its_own(shipped, network):
    first, second = (shipped.run(PROBE, network)["data"]["stdout"].split() for _ in range(2))
    assert first[:3] == ["2", "1", "0000000000000000"], first
    assert 200000 <= int(first[3]) <= 265535, first  # --uid-range's, never root's
    assert first[3] != second[3]  # a uid per kernel, not one for all


HOSTILE = """
import os, socket
for name, attempt in (("fork", os.fork),
                      ("service port", lambda: socket.create_connection(("127.0.0.1", 8194), 3)),
                      ("shadow", lambda: open("/etc/shadow").read())):
    try:
        attempt()
        print(name, "ALLOWED")
    except OSError as exc:
        print(name, type(exc).__name__, exc.errno)
"""


@pytest.mark.parametrize("network", [False, True])
def test_hostile_code_is_refused(shipped, network):
    lines = shipped.run(HOSTILE, network)["data"]["stdout"].splitlines()
    assert lines[0] == "fork PermissionError 1"
    assert lines[2] == "shadow PermissionError 13"
    # Offline: no socket at all. With the network: the kernel's own namespace has no route
    # to the service, and the egress proxy refuses loopback.
    assert lines[1] in ("service port PermissionError 1",
                        "service port ConnectionRefusedError 111",
                        "service port OSError 101"), lines
    assert "ALLOWED" not in "\n".join(lines)
    assert shipped.ready_state()[0] == 200  # the service is unharmed


def test_refreshing_the_dependencies_says_the_image_is_read_only(shipped):
    answer = httpx.get(shipped.url + "/v1/sandbox/dependencies/refresh?language=python3",
                       headers={"X-Api-Key": "dify-sandbox"}, timeout=60)
    assert answer.status_code == 200
    body = answer.json()
    assert body["code"] == -500 and body["message"].startswith(
        "the runtime default cannot be rebuilt here: Read-only file system (/opt/runtimes/")
    assert shipped.run("print(1)", False)["data"]["stdout"] == "1\n"  # still serving


# ---- The container's process limit -------------------------------------------------------
# Every thread of every process in the container takes one of its pids_limit task slots, and
# nothing else bounds them together: no cgroup of the service's own, and no capability to make
# one. So the bound is arithmetic (docs/deploy.md, "The container's process limit"): every
# kernel the service may hold at its own --max-threads (RLIMIT_NPROC of its uid, its own
# threads included), plus each kernel's reaper and the service's and fork servers' own tasks,
# must fit in pids_limit with room to spare.
# A ZMQ kernel's reaper (root, outside the kernel's RLIMIT_NPROC): its main thread, the log
# writer, the egress proxy's event loop, and asyncio's resolver threads (at most 32: the default
# executor's min(32, CPUs + 4)); a one-shot kernel's companion is shared and counted here too.
REAPER_TASKS = 35
# The service (its event loop, asyncio's and anyio's worker threads: at most 32 + 40) and the
# fork servers (a retiring one beside the new, each with its companion and its zygotes).
SERVICE_TASKS = 256
# What the arithmetic must leave over, at the least: kernels being torn down, and room for
# the estimate above to be wrong by a few kernels.
HEADROOM = 0.10


def _max_threads_of_the_image() -> int:
    """--max-threads of the Dockerfile's CMD (the kernels' RLIMIT_NPROC), or the default."""
    from sandbox_kernel.policy import SandboxPolicy

    (cmd,) = re.findall(r"^CMD (\[.*\])$", (SERVICE / "Dockerfile").read_text(), re.M)
    args = json.loads(cmd)
    if "--max-threads" in args:
        return int(args[args.index("--max-threads") + 1])
    return int(SandboxPolicy.max_threads.default_value)


def _service_setting(service: dict, name: str) -> int:
    """A ServiceConfig setting as the compose file's environment gives it, or its default."""
    from sandbox_kernel.service.config import ServiceConfig

    trait = ServiceConfig.class_traits()[name]
    given = service.get("environment", {}).get(trait.metadata["env"])
    return int(_substitute(str(given))) if given is not None else int(trait.default_value)


def kernels_at_most(service: dict) -> int:
    """Kernels the service may hold at once: every session's, both policies' pools of each
    kind, the pools of preload sets (as many as --max-preload-pools over both policies), and
    the runs executing (a run with its own allowlist gets a kernel of its own)."""
    return (_service_setting(service, "max_sessions")
            + 2 * _service_setting(service, "pool_size")
            + (2 + _service_setting(service, "max_preload_pools"))
            * _service_setting(service, "one_shot_pool_size")
            + _service_setting(service, "max_workers"))


@pytest.mark.parametrize("compose_file", ["compose.yaml", "dify/docker-compose.override.yaml"])
def test_the_process_limit_holds_every_kernel_at_its_thread_limit(compose_file):
    service = _compose_file(SERVICE / compose_file)
    max_threads = _max_threads_of_the_image()
    assert max_threads > 0, "--max-threads 0 bounds no kernel: the arithmetic cannot hold"
    needed = kernels_at_most(service) * (max_threads + REAPER_TASKS) + SERVICE_TASKS
    assert service["pids_limit"] >= needed * (1 + HEADROOM), (
        f"{compose_file}: pids_limit {service['pids_limit']} < {needed} tasks "
        f"({kernels_at_most(service)} kernels x ({max_threads} + {REAPER_TASKS}) + "
        f"{SERVICE_TASKS}) + {HEADROOM:.0%}: raise it, or lower --max-threads in the image")
    # docs/deploy.md states the same numbers.
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for number in (kernels_at_most(service), max_threads, REAPER_TASKS, SERVICE_TASKS,
                   service["pids_limit"]):
        assert re.search(rf"\b{number:,}\b|\b{number}\b", doc), number


# User code that starts threads until it may start no more, and keeps them.
THREAD_BOMB = """
import threading
hold = threading.Event()
started = 0
try:
    while True:
        threading.Thread(target=hold.wait, daemon=True).start()
        started += 1
except RuntimeError as exc:
    print(started, exc)
"""
# Code that needs a few threads of its own.
SOME_THREADS = """
import threading
done = []
threads = [threading.Thread(target=done.append, args=(n,)) for n in range(16)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(len(done))
"""


def _tasks(container: Container) -> list[tuple[int, int, int, int]]:
    """(pid, parent pid, real uid, threads) of every process in the container."""
    listing = _docker("exec", container.name, "python", "-c",
                      "import os\n"
                      "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
                      "    try:\n"
                      "        lines = open(f'/proc/{pid}/status').read().splitlines()\n"
                      "    except OSError:\n"
                      "        continue\n"
                      "    fields = dict(line.split(':', 1) for line in lines if ':' in line)\n"
                      "    print(pid, fields['PPid'].split()[0], fields['Uid'].split()[0],\n"
                      "          fields['Threads'].split()[0])\n").stdout
    return [tuple(map(int, line.split())) for line in listing.splitlines()]  # type: ignore


def test_a_thread_bomb_leaves_the_service_and_other_tenants_working(shipped, say):
    """One tenant's kernels at their thread limit (a native API session and a Dify run) take
    their RLIMIT_NPROC and no more: the service answers, and the other tenant still gets new
    kernels whose code may start threads."""
    max_threads = _max_threads_of_the_image()
    native = {"Authorization": "Bearer dify-sandbox"}  # the native API's one key (API_KEY)

    def execute(path: str, code: str, **body) -> dict:
        answer = httpx.post(shipped.url + path, headers=native, timeout=120,
                            json={"code": code, **body})
        assert answer.status_code == 200, answer.text
        return answer.json()

    def bounded_by_its_own_limit(stdout: str) -> None:
        started, _, error = stdout.strip().partition(" ")
        assert error == "can't start new thread", stdout
        # Stopped by its own RLIMIT_NPROC (its own threads count: 11 at start, ~20 once it has
        # run code), not by the container.
        assert max_threads - 32 <= int(started) < max_threads, (started, max_threads)

    session = httpx.post(shipped.url + "/api/v1/sessions", headers=native, timeout=120,
                         json={"network": False}).json()["id"]
    try:
        out = execute(f"/api/v1/sessions/{session}/execute", THREAD_BOMB)
        bounded_by_its_own_limit("".join(log["text"] for log in out["logs"]))
        say(f"thread bomb in a session: stopped at its --max-threads ({max_threads})")
        with ThreadPoolExecutor(1) as background:
            # The dify route's tenant: a run that bombs and holds its threads for a while.
            dify_bomb = background.submit(shipped.run, THREAD_BOMB + "\nhold.wait(10)\n", True)
            deadline = time.monotonic() + 30
            while sum(threads >= max_threads - 32 for *_, threads in _tasks(shipped)) < 2:
                assert not dify_bomb.done() and time.monotonic() < deadline, \
                    dify_bomb.result() if dify_bomb.done() else "the dify run never bombed"
                time.sleep(0.2)
            tasks = _tasks(shipped)
            say(f"both bombs holding: {sum(row[3] for row in tasks)} tasks in the container")
            assert httpx.get(shipped.url + "/health", timeout=10).status_code == 200
            # The native key, while the dify route's kernel is at its limit: a fresh one-shot
            # kernel of each policy and a new session, each starting threads of its own.
            for network in (False, True):
                out = execute("/api/v1/execute", SOME_THREADS, network=network)
                assert out["error"] is None and out["logs"][0]["text"] == "16\n", out
            other = httpx.post(shipped.url + "/api/v1/sessions", headers=native, timeout=120,
                               json={"network": True})
            assert other.status_code == 201, other.text
            out = execute(f"/api/v1/sessions/{other.json()['id']}/execute", SOME_THREADS)
            assert out["logs"][0]["text"] == "16\n", out
            # The dify route, while the session's kernel is at its limit: more runs than its
            # pools hold, so that kernels are forked meanwhile.
            for network in (False, True, False, True, False, True):
                answer = shipped.run(SOME_THREADS, network)
                assert answer["data"]["stdout"] == "16\n", answer
            bounded_by_its_own_limit(dify_bomb.result()["data"]["stdout"])
        # What the arithmetic assumes of the root side, measured here: each reaper and the
        # service and fork servers together are well within their share.
        kernels = {pid for pid, _, uid, _ in tasks if uid >= 200000}
        reapers = [threads for _, parent, uid, threads in tasks
                   if uid == 0 and parent in kernels]
        own = sum(threads for _, parent, uid, threads in tasks
                  if uid == 0 and parent not in kernels)
        assert reapers and max(reapers) <= REAPER_TASKS and own <= SERVICE_TASKS // 2, tasks
        httpx.delete(shipped.url + f"/api/v1/sessions/{other.json()['id']}", headers=native,
                     timeout=60)
    finally:
        httpx.delete(shipped.url + f"/api/v1/sessions/{session}", headers=native, timeout=60)
    assert shipped.ready_state()[0] == 200


# ---- docs/deploy.md's compose steps, run by Compose itself ---------------------------------

def _compose_command() -> tuple[list[str], str]:
    """Compose v2 (`docker compose`) where the plugin is installed, else Debian 12's
    docker-compose 1.29 (Debian has no Compose v2); its version too."""
    v2 = subprocess.run([DOCKER, "compose", "version", "--short"], capture_output=True,
                        text=True, timeout=60)
    if v2.returncode == 0:
        return [DOCKER, "compose"], v2.stdout.strip()
    v1 = shutil.which("docker-compose")
    if v1:
        found = subprocess.run([v1, "version", "--short"], capture_output=True, text=True,
                               timeout=60)
        return [v1], found.stdout.strip()
    unavailable("no Compose: neither `docker compose` (Compose v2, Docker's compose plugin) nor "
                "docker-compose (apt-get install docker-compose) is installed")


def _inspected(container: str) -> dict:
    return json.loads(_docker("inspect", container).stdout)[0]


def test_compose_runs_the_documented_steps_with_every_setting(image, say):
    """docs/deploy.md's steps 2 and 3 as written (from deploy/service), with the Compose this
    machine has; the container Compose made has every setting of compose.yaml."""
    compose, version = _compose_command()
    project = f"sandbox-kernel-test-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    env = {**os.environ, "SANDBOX_IMAGE": IMAGE, "SANDBOX_HOST_PORT": str(port)}

    def run(*args: str, cwd: Path = SERVICE, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([*compose, "-p", project, *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 or not check, done.stdout + done.stderr
        return done

    say(f"compose: {' '.join(compose)} {version}, from deploy/service")
    try:
        done = run("run", "--rm", "sandbox", "check")
        assert "the service's kernels will start" in done.stdout, done.stdout
        if compose[0] != DOCKER:
            # 1.29 reads seccomp.json relative to the working directory: from the repository
            # root it stops before starting anything, naming the file (docs/deploy.md says so).
            done = run("-f", "deploy/service/compose.yaml", "run", "--rm", "sandbox", "check",
                       cwd=ROOT, check=False)
            assert done.returncode != 0 and "Error reading seccomp profile" in done.stderr \
                and "seccomp.json" in done.stderr, done.stdout + done.stderr
        run("up", "-d")
        (container,) = run("ps", "-q", "sandbox").stdout.split()
        shipped = Container.__new__(Container)
        shipped.name, shipped.url = container, f"http://127.0.0.1:{port}"
        answers = shipped.wait_answering()
        assert answers[-1][0] == 200, f"{answers[-1]}\n{shipped.logs()}"
        assert shipped.run("print(6 * 7)", True)["data"]["stdout"] == "42\n"
        say("compose up: /ready 200, a run with the network answered")
        # Every setting reached the container: none was dropped on the way.
        settings, made = _compose_service(), _inspected(container)
        host, config = made["HostConfig"], made["Config"]
        assert host["PidsLimit"] == settings["pids_limit"]
        assert host["Memory"] == 8 * 2**30 and settings["mem_limit"] == "8g"
        assert host["CapDrop"] == settings["cap_drop"]
        assert sorted(host["CapAdd"]) == sorted(settings["cap_add"])
        assert host["ReadonlyRootfs"] is settings["read_only"] is True
        assert host["Privileged"] is False
        assert host["Tmpfs"] == dict(mount.split(":", 1) for mount in settings["tmpfs"])
        assert host["RestartPolicy"]["Name"] == settings["restart"]
        assert host["PortBindings"] == {"8194/tcp": [{"HostIp": "127.0.0.1",
                                                      "HostPort": str(port)}]}
        options = dict(option.replace(":", "=", 1).split("=", 1) if option.startswith("no-new")
                       else option.split("=", 1) for option in host["SecurityOpt"])
        assert options["no-new-privileges"] == "true"
        profile = options["seccomp"]
        profile = json.loads(profile if profile.lstrip().startswith("{")
                             else (SERVICE / profile).read_text())
        assert profile == json.loads((SERVICE / "seccomp.json").read_text())
        assert config["User"] == settings["user"]
        assert config["StopTimeout"] == int(settings["stop_grace_period"].rstrip("s"))
        environment = dict(item.split("=", 1) for item in config["Env"])
        for name, value in settings["environment"].items():
            assert environment[name] == _substitute(str(value)), name
        (state,) = [mount for mount in made["Mounts"]
                    if mount["Destination"] == "/var/lib/sandbox-kernel"]
        assert state["Type"] == "volume" and state["RW"] is True, state
    finally:
        run("down", "-v", "--timeout", "5", check=False)


def test_every_documented_docker_build_turns_buildkit_on():
    """The Dockerfiles' build secrets need BuildKit, which Debian 12's Docker (20.10) has off:
    without DOCKER_BUILDKIT=1 there, the build stops at `RUN --mount` ("the --mount option
    requires BuildKit"). Every `docker build` command a reader may copy says it."""
    places = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
              *sorted(path for path in (ROOT / "deploy").rglob("*") if path.is_file()
                      and (path.name == "Dockerfile" or path.suffix in (".md", ".yaml")))]
    bare = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in places
            for line in path.read_text().splitlines()
            if re.match(r"^[#\s]*(?:sudo\s+)?docker build\b", line)]
    assert not bare, "docker build without DOCKER_BUILDKIT=1:\n" + "\n".join(bare)
    assert "DOCKER_BUILDKIT=1 docker build -f deploy/service/Dockerfile" in \
        (ROOT / "docs" / "deploy.md").read_text()  # where the image's build is documented


def test_without_the_seccomp_profile_it_is_not_ready_and_check_says_why(image, say):
    """The runtime's default seccomp profile in place of the shipped one: network kernels
    cannot make their namespace, so the service must not call itself ready."""
    service = _compose_service()
    service["security_opt"] = [item for item in service["security_opt"]
                               if not item.startswith("seccomp")]
    port = _free_port()
    options = run_options(service, port)
    done = _docker("run", "--rm", *options, IMAGE, "check", check=False)
    assert done.returncode == 1, done.stdout
    assert "network kernels (ENABLE_NETWORK=true): network on: no network namespace" in \
        done.stdout
    assert "deploy/service/seccomp.json" in done.stdout
    container = Container(options, port)
    try:
        answers = container.wait_answering(timeout=45)
        assert all(status in (None, 503) for status, _ in answers), answers[-1]
        status, state = answers[-1]
        assert status == 503 and state["policies"]["offline"]["started"] is True
        assert state["policies"]["network"]["started"] is False
        assert "network kernels: " in state["reason"] and "namespace" in state["reason"]
        say("container without the profile: /ready 503, naming the network kernels")
    finally:
        container.remove()


def test_the_dify_overlay_hardens_the_container_the_same_way():
    overlay = _compose_file(SERVICE / "dify" / "docker-compose.override.yaml")
    shipped = _compose_service()
    for key in ("user", "read_only", "tmpfs", "cap_drop", "cap_add", "pids_limit", "mem_limit"):
        assert overlay[key] == shipped[key], key
    # The same profile: the overlay names it relative to Dify's docker/ directory (the project
    # directory Compose v2 resolves it against), where every place that shows how to add the
    # overlay copies deploy/service/seccomp.json under that name. There is one profile in this
    # checkout, no copy of it beside the overlay to drift apart.
    profile = [item for item in overlay["security_opt"] if item.startswith("seccomp")]
    assert profile == ["seccomp=sandbox-kernel-seccomp.json"]
    assert not (SERVICE / "dify" / "sandbox-kernel-seccomp.json").exists()
    for where in (ROOT / "docs" / "dify.md", ROOT / "README.md",
                  SERVICE / "dify" / "docker-compose.override.yaml"):
        assert re.search(r"cp \S*deploy/service/seccomp\.json \S*sandbox-kernel-seccomp\.json\b",
                         where.read_text()), where
    assert overlay["environment"]["JUPYTER_RUNTIME_DIR"] == shipped["environment"].get(
        "JUPYTER_RUNTIME_DIR", "/run/jupyter")


# ---- Enterprise Gateway's kernel pod ------------------------------------------------------
# deploy/enterprise-gateway/Dockerfile's `kernel` image, run with the securityContext of the pod
# `install --enterprise-gateway kubernetes` renders (read from that YAML), and started the way
# a pod starts: the pod's command and args, EG's variables, EG's own ResponseManager receiving.

EG = ROOT / "deploy" / "enterprise-gateway"
KERNEL_IMAGE = "sandbox-kernel:test"
# Where deploy/enterprise-gateway/README.md has the operator install each Localhost profile
# (relative to the kubelet's seccomp directory): the service's profile, not a copy of it.
NODE_PROFILES = {"profiles/sandbox-kernel.json": SERVICE / "seccomp.json"}
# What EG's launch_kubernetes.py puts in the kernel pod's environment for the launcher.
EG_VARIABLES = ("KERNEL_ID", "PORT_RANGE", "RESPONSE_ADDRESS", "PUBLIC_KEY")
# Pod settings that need no `docker run` option, with the only value they may have (a
# container has no API token, no service variables, and comes back only if told).
POD_AS_DOCKER = {"restartPolicy": "Never", "automountServiceAccountToken": False,
                 "enableServiceLinks": False, "hostNetwork": False, "hostPID": False,
                 "hostIPC": False}


def _quantity(value: str) -> str:
    """A Kubernetes quantity (2Gi, 512Mi) as Docker and tmpfs spell it."""
    return re.sub(r"([KMG])i$", lambda unit: unit.group(1).lower(), value)


def _security_options(context: dict, options: list[str]) -> None:
    """`docker run` options for a pod's or container's securityContext; unknown keys fail."""
    for key, value in context.items():
        if key == "runAsNonRoot":
            assert value is True
        elif key in ("runAsUser", "runAsGroup"):
            continue  # below, together
        elif key == "privileged":
            assert value is False  # docker run's default
        elif key == "allowPrivilegeEscalation":  # allowed is docker run's default
            options += [] if value else ["--security-opt", "no-new-privileges:true"]
        elif key == "readOnlyRootFilesystem":
            options += ["--read-only"] if value else []
        elif key == "capabilities":
            options += [f"--cap-{verb}={cap}" for verb in ("drop", "add")
                        for cap in value.get(verb, [])]
        elif key == "seccompProfile":
            if value["type"] == "Localhost":
                profile = NODE_PROFILES[value["localhostProfile"]]
                options += ["--security-opt", f"seccomp={profile}"]
            else:  # the runtime's default: Docker's too
                assert value == {"type": "RuntimeDefault"}, value
        else:
            raise AssertionError(f"securityContext {key!r} has no docker run option here")
    if "runAsUser" in context:
        assert context["runAsUser"] != 0
        options += ["--user", f"{context['runAsUser']}:{context.get('runAsGroup', 0)}"]


def pod_run(pod: dict) -> tuple[list[str], list[str]]:
    """`docker run` options and command for a kernel pod; a setting not translated fails."""
    spec = pod["spec"]
    (container,) = spec["containers"]
    options: list[str] = []
    for key, value in spec.items():
        if key in POD_AS_DOCKER:
            assert value == POD_AS_DOCKER[key], (key, value)
        elif key not in ("securityContext", "containers", "volumes"):
            raise AssertionError(f"the pod's {key!r} has no docker run option here")
    # The container's securityContext wins over the pod's, key by key, as in Kubernetes.
    _security_options({**spec.get("securityContext", {}),
                       **container.get("securityContext", {})}, options)
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    for key, value in container.items():
        if key in ("name", "image", "imagePullPolicy", "command", "args", "securityContext"):
            continue
        if key == "env":
            options += [f"--env={item['name']}={item['value']}" for item in value]
        elif key == "resources":
            limits = value["limits"]
            cpus = str(limits["cpu"])  # "1", or millicores: "500m"
            cpus = str(int(cpus[:-1]) / 1000) if cpus.endswith("m") else cpus
            options += ["--cpus", cpus, "--memory", _quantity(limits["memory"])]
        elif key == "volumeMounts":
            for mount in value:
                empty_dir = volumes[mount["name"]]["emptyDir"]  # the only kind it may use
                options += ["--tmpfs", f"{mount['mountPath']}:size="
                            f"{_quantity(empty_dir['sizeLimit'])},mode=1777"]
        else:
            raise AssertionError(f"the container's {key!r} has no docker run option here")
    return options, [*container["command"], *container.get("args", [])]


@pytest.fixture(scope="module")
def kernel_image(docker, say, tmp_path_factory):
    _make_base(say)
    _build(say, tmp_path_factory.mktemp("kernel-build"), EG / "Dockerfile", KERNEL_IMAGE,
           "--target", "kernel")
    return KERNEL_IMAGE


@pytest.fixture(scope="module")
def kernel_pod(tmp_path_factory):
    """The pod EG's launch_kubernetes.py renders from the kernelspec install writes, for
    network kernels (--network on) of the test's kernel image."""
    from .test_enterprise_gateway_kernelspec import CLIENT_ENV, render_like_eg

    prefix = tmp_path_factory.mktemp("eg-kernelspec")
    subprocess.run([sys.executable, "-m", "sandbox_kernel", "install",
                    "--prefix", str(prefix), "--name", "sandbox_kubernetes",
                    "--enterprise-gateway", "kubernetes", "--image", KERNEL_IMAGE,
                    "--network", "on", "--timeout", "60"],
                   check=True, capture_output=True, timeout=120)
    scripts = prefix / "share" / "jupyter" / "kernels" / "sandbox_kubernetes" / "scripts"
    (pod,) = render_like_eg(scripts, CLIENT_ENV)  # a client's hostile KERNEL_* values too
    return pod


@contextlib.contextmanager
def pod_kernel(eg_python, pod: dict, log: Path):
    """The kernel pod as a container: the pod's command and args under its security settings,
    EG's variables from launch_kubernetes.py, EG's ResponseManager receiving the payload.

    On the host's network (the test's stand-in for the pod's, so that EG's receiver and client
    on 127.0.0.1 reach it); the kernel makes a namespace of its own inside either way.
    """
    options, command = pod_run(pod)
    name = f"sandbox-kernel-pod-{uuid.uuid4().hex[:8]}"
    wrapper = (DOCKER, "run", "--rm", "--name", name, "--network", "host",
               *(f"--env={variable}" for variable in EG_VARIABLES), *options,
               pod["spec"]["containers"][0]["image"])
    try:
        with launch_with_eg(eg_python, log, wrapper, policy=(), as_container=True,
                            command=tuple(command)) as launch:
            yield launch
    finally:
        _docker("rm", "-f", name, check=False)


# /proc/self/status's confinement lines and the network namespace, as user code sees them.
POD_PROBE = PROBE + "import os\nprint(os.readlink('/proc/self/ns/net'))\n"


def test_the_check_pod_passes_on_this_node(kernel_image):
    """deploy/enterprise-gateway/check-pod.yaml as it stands (its image: the test's)."""
    options, command = pod_run(yaml.safe_load((EG / "check-pod.yaml").read_text()))
    done = _docker("run", "--rm", *options, kernel_image, *command, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "network namespace per kernel: available (user namespace)" in done.stdout
    assert "the kernel will start" in done.stdout


def test_a_network_kernel_runs_confined_in_the_pod(kernel_image, kernel_pod, eg_python,
                                                    tmp_path):
    with pod_kernel(eg_python, kernel_pod, tmp_path / "launcher.log") as launch:
        kc = connect_client(launch["info"])
        try:
            network = kc.sandbox_info["layers"]["network"]
            assert kc.sandbox_info["policy"]["network"] == "on"
            out = execute(kc, POD_PROBE)
            seccomp_mode, no_new_privs, effective, uid, namespace = out["stdout"].split()
            assert (seccomp_mode, no_new_privs, effective) == ("2", "1", "0000000000000000"), out
            assert uid == str(kernel_pod["spec"]["securityContext"]["runAsUser"])
            # A namespace of the kernel's own, made in a user namespace (no root in the pod).
            assert network["owner"] == "user namespace" and network["active"], network
            assert namespace == network["namespace"] != network["launcher"], network
            port = launch["info"]["comm_port"]
            send_request(port, {"signum": 0})  # EG's liveness poll
            out = execute(kc, "import time\nfor _ in range(600):\n    time.sleep(0.1)",
                          on_busy=lambda: (time.sleep(1), send_request(port, {"signum": 2})))
            assert out["error"] is not None and out["error"][0] == "KeyboardInterrupt", out
            # EG's shutdown: a shutdown_request first (then the pod is deleted). The kernel is
            # the container's pid 1, which ignores the comm port's SIGTERM and SIGKILL.
            kc.shutdown()
            assert launch["launcher"].wait(timeout=30) == 0
        finally:
            kc.stop_channels()


def test_without_the_pods_profile_a_network_kernel_refuses_naming_why(kernel_image, kernel_pod,
                                                                      eg_python, tmp_path):
    """The runtime's default profile in place of the shipped one (RuntimeDefault, Docker's
    default): unshare is refused, so the network kernel must not start, and must say why."""
    pod = json.loads(json.dumps(kernel_pod))
    for context in (pod["spec"]["securityContext"],
                    pod["spec"]["containers"][0]["securityContext"]):
        context["seccompProfile"] = {"type": "RuntimeDefault"}
    options, _ = pod_run(pod)
    assert not any(option.startswith("seccomp=") for option in options)
    _, check_command = pod_run(yaml.safe_load((EG / "check-pod.yaml").read_text()))
    done = _docker("run", "--rm", *options, kernel_image, *check_command, check=False)
    assert done.returncode == 1, done.stdout
    assert "MISSING  network on: no network namespace here" in done.stdout
    log = tmp_path / "launcher.log"
    with pod_kernel(eg_python, pod, log) as launch:
        assert launch["launcher"].wait(timeout=60) != 0
    text = log.read_text()
    assert "refusing to start: network on: no network namespace: " in text, text
    # The fix, named: the profile to give the pod, and how (deploy/enterprise-gateway/README.md).
    assert "unshare(CLONE_NEWUSER|CLONE_NEWNET), deploy/service/seccomp.json, a pod's " \
        "Localhost profile as deploy/enterprise-gateway/README.md installs it" in text, text
    assert "seccomp.json" in done.stdout and "deploy/enterprise-gateway/README.md" in done.stdout
