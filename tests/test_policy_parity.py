"""Every policy setting means the same on every path: a differential test over the policy.

For each policy below, one probe reads the confinement from inside user code (identity,
filters, limits, priority, environment, the files it can see, read and write, the network it
has, the policy the kernel reports) through every face that runs code: a ZMQ kernel (the
reference), `Sandbox(one_shot=True)`, `sandbox-kernel run`, the service's dify route and
native one-shot execute, and the MCP server's fresh runs. All start in the same folder, as a
user's command or service would. Each face gets one kernel or pool per policy; the probe is
one run, so the whole matrix costs a few kernel starts per policy.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.policy import SandboxPolicy
from tests import mcp_clients
from tests.helpers import write_keys
from tests.packages import make_wheel
from tests.service.helpers import DIFY_KEY, RUN, Server, http

KEY = "parity-key-0123456789abcdef"
SECRET_VALUE = "sk-parity-9f8e7d6c5b4a"

PROBE = r'''
def main():
    import errno, json, os, resource, socket, sys, sysconfig
    preloaded = sorted(name for name in ("rtpkg", "numpy", "pandas") if name in sys.modules)

    def outcome(call):
        try:
            got = call()
            return got if isinstance(got, (str, list)) else "allowed"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))
        except Exception as exc:
            return type(exc).__name__

    def write(path):
        with open(path, "w") as file:
            file.write("probe")
        os.unlink(path)

    def connect():
        with socket.create_connection(("127.0.0.1", PORT), 2):
            pass

    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines()
                  if ":\t" in line)
    cwd = os.getcwd()
    here = ("the launch folder" if cwd == FOLDER
            else "the scratch" if cwd == os.environ.get("HOME") else cwd)
    kernel = get_ipython().kernel
    policy = dict(kernel.sandbox_info["policy"])
    return {
        "working directory": here,
        "read data.csv by its relative name": outcome(lambda: open("data.csv").read()),
        "listing of the working directory": outcome(
            lambda: sorted(os.listdir(".")) if here == "the launch folder" else "scratch"),
        "write in the working directory": outcome(lambda: write("probe-written")),
        "read the read grant": outcome(lambda: open(READ + "/r.txt").read()),
        "write the read grant": outcome(lambda: write(READ + "/new")),
        "write the write grant": outcome(lambda: write(WRITE + "/new")),
        "read beside the grants": outcome(lambda: open(OUTSIDE).read()),
        "read /etc/shadow": outcome(lambda: open("/etc/shadow").read()),
        "list /root": outcome(lambda: os.listdir("/root")),
        "seccomp": status["Seccomp"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
        "cap_eff": status["CapEff"].strip(),
        "uid is its own": os.getuid() not in (0, 65534) and os.getuid() == os.getgid(),
        "rlimits": {name: resource.getrlimit(getattr(resource, name))
                    for name in ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CORE", "RLIMIT_FSIZE",
                                 "RLIMIT_NOFILE", "RLIMIT_CPU", "RLIMIT_NPROC",
                                 "RLIMIT_NICE", "RLIMIT_RTPRIO")},
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "environment names": sorted(name for name in os.environ
                                    if not name.startswith(("JPY_", "SANDBOX_KERNEL_"))),
        "PROBE_SET": os.environ.get("PROBE_SET"),
        "PROBE_PASSED": os.environ.get("PROBE_PASSED"),
        "PROBE_TOKEN holds the value": os.environ.get("PROBE_TOKEN") == SECRET,
        "PROBE_TOKEN is set": "PROBE_TOKEN" in os.environ,
        "new socket": outcome(lambda: socket.socket().close()),
        "connect to the host's loopback": outcome(connect),
        "proxy variables": sorted(name for name in os.environ if name.endswith("_PROXY")),
        "policy": policy,
        "interpreter": sys.prefix,
        "preloaded": preloaded,
        "the runtime's package": outcome(lambda: __import__("rtpkg").VERSION),
        "write the interpreter's packages": outcome(
            lambda: write(sysconfig.get_paths()["purelib"] + "/probe")),
    }
'''


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """The launch folder with its data, a read grant, a write grant, and a file beside them."""
    base = tmp_path_factory.mktemp("parity")
    folder, read, write = base / "project", base / "read", base / "write"
    for made in (folder, read, write):
        made.mkdir()
        made.chmod(0o777)  # the host would let user code write: only the grants decide
    (folder / "data.csv").write_text("month,sales\n1,10\n")
    (read / "r.txt").write_text("granted")
    (base / "outside.txt").write_text("never granted")
    return {"FOLDER": str(folder), "READ": str(read), "WRITE": str(write),
            "OUTSIDE": str(base / "outside.txt")}


@pytest.fixture(scope="module")
def listener():
    """A port on the host's loopback that no kernel may reach."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


POLICIES = {
    "defaults": {},
    "files, environment, limits and priority": dict(
        grant_cwd="rw", read_paths=["{READ}"], write_paths=["{WRITE}"],
        env={"PROBE_SET": "set"}, pass_env=["PROBE_PASSED"], memory_limit=900 << 20,
        cpu_limit=77, file_size_limit=7 << 20, open_files_limit=300, max_threads=99, nice=9,
        timeout=33, package_index="https://index.parity.test/simple"),
    "read-only folder": dict(grant_cwd="ro"),
    "another user": dict(run_as="nobody"),
    "network by host": dict(network="hosts", allow_hosts=["parity.example.test"]),
    "network on": dict(network="on"),
    "a secret": dict(network="hosts", allow_hosts=["api.parity.test"],
                     secrets=["PROBE_TOKEN=api.parity.test"]),
    "a runtime": dict(grant_cwd="ro"),  # and kernels on RUNTIME, with its module preloaded
}
ON_A_RUNTIME = {"a runtime"}
RUNTIME = "parity-rt"


def policy_kwargs(name: str, places: dict[str, str]) -> dict:
    """The policy's settings with the places filled in."""
    def fill(value):
        if isinstance(value, str):
            return value.format(**places)
        if isinstance(value, list):
            return [fill(item) for item in value]
        return value
    return {key: fill(value) for key, value in POLICIES[name].items()}


def flags_of(kwargs: dict) -> list[str]:
    """The command-line flags (run, serve and mcp share them) that make this policy."""
    traits = SandboxPolicy.class_traits(config=True)
    flags = []
    for name, value in kwargs.items():
        flag = "--" + traits[name].metadata["flag"]
        if isinstance(value, dict):
            flags += [part for key, item in value.items() for part in (flag, f"{key}={item}")]
        elif isinstance(value, list):
            flags += [part for item in value for part in (flag, item)]
        else:
            flags.append(f"{flag}={value}")
    return flags


def probe_code(places: dict[str, str], port: int, *, printed: bool = False) -> str:
    """The probe, its places bound; printed: it prints main()'s dict (for a route that runs
    code as a script and returns its output)."""
    head = "".join(f"{name} = {value!r}\n" for name, value in places.items())
    head += f"PORT = {port}\nSECRET = {SECRET_VALUE!r}\n"
    tail = "\nimport json\nprint(json.dumps(main()))\n" if printed else ""
    return head + PROBE + tail


def normalised(report: dict, name: str) -> dict:
    """What must be equal across paths: everything but the launcher's own choices the policy
    leaves open (where the audit record goes; the deadline, which each face defaults itself:
    `run`'s 60 s, the service's --worker-timeout; on a runtime, which of its modules the
    service's and the MCP server's stateless runs find loaded: they take the pool whose zygote
    holds what the code imports, once that pool is up, else the lean one, #49)."""
    report, settings = json.loads(json.dumps(report)), POLICIES[name]  # tuples as lists
    if name in ON_A_RUNTIME:  # test_the_probe_sees_each_setting checks a ZMQ kernel's
        report.pop("preloaded")
    report["policy"].pop("audit_log", None)
    if "timeout" not in settings:
        report["policy"].pop("timeout")
    if "run_as" in settings:  # a shared uid's thread bound counts the uid's tasks at start
        report["rlimits"].pop("RLIMIT_NPROC")  # (confine/limits.py): another kernel's differ
    for name in report["policy"]["env"]:  # a secret's placeholder: one of each kernel's own
        if report["policy"]["env"][name].startswith(f"sk-sandbox-{name}-"):
            report["policy"]["env"][name] = "a placeholder"
    return report


# --- the faces -------------------------------------------------------------------------------

@dataclass
class Launch:
    """What every face is started with: the policy's settings, the places, and the runtime
    its kernels run on (None: the interpreter the tests run on)."""

    settings: dict
    places: dict[str, str]
    runtime: dict | None = None

    def sandbox(self, **kwargs) -> Sandbox:
        on_runtime = {"python": self.runtime["python"], "preload": self.runtime["preload"]} \
            if self.runtime else {}
        return Sandbox(None, policy=SandboxPolicy(**self.settings), **on_runtime, **kwargs)

    def flags(self) -> list[str]:
        """serve's and mcp's flags: the policy's, and --runtime."""
        return flags_of(self.settings) + (["--runtime", RUNTIME] if self.runtime else [])


def on_zmq_kernel(launch, code):
    with contextlib.chdir(launch.places["FOLDER"]), launch.sandbox() as sb:
        ex = sb.run(code, inputs={})
    assert ex.error is None, ex.error
    return ex.result


def on_one_shot(launch, code):
    with contextlib.chdir(launch.places["FOLDER"]), launch.sandbox(one_shot=True) as sb:
        ex = sb.run(code, inputs={})
    assert ex.error is None, ex.error
    return ex.result


def on_one_shot_kernel(launch, code):
    """The ipykernel one-shot process, still selectable (the other faces take the default)."""
    with contextlib.chdir(launch.places["FOLDER"]), \
            launch.sandbox(one_shot=True, one_shot_process="kernel") as sb:
        ex = sb.run(code, inputs={})
    assert ex.error is None, ex.error
    return ex.result


def on_cli(launch, code):
    """`sandbox-kernel run` (which has no --runtime: it runs on the interpreter it is in)."""
    script = os.path.join(launch.places["FOLDER"], "..", "probe.py")
    with open(script, "w") as file:
        file.write(code)
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "run", script,
                           *flags_of(launch.settings)], cwd=launch.places["FOLDER"],
                          capture_output=True, text=True, timeout=120, env=launcher_env())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


LAUNCHER_VARIABLES = {"PROBE_PASSED": "passed", "PROBE_TOKEN": SECRET_VALUE,
                      "PROBE_HOST_ONLY": "kept out"}


def launcher_env() -> dict[str, str]:
    """The launcher's environment: one variable passed, one secret, one kept out."""
    return {**os.environ, **LAUNCHER_VARIABLES}


@pytest.fixture(scope="module")
def reports(places, listener, tmp_path_factory, request):
    """Each policy's probe report by face, made when a test first asks for the policy."""
    found: dict[str, dict[str, dict]] = {}

    def of(name: str) -> dict[str, dict]:
        if name not in found:
            runtime = request.getfixturevalue("runtime") if name in ON_A_RUNTIME else None
            launch = Launch(policy_kwargs(name, places), places, runtime)
            with pytest.MonkeyPatch.context() as patch:  # what the launcher's environment holds
                for variable, value in LAUNCHER_VARIABLES.items():
                    patch.setenv(variable, value)
                found[name] = all_faces(launch, listener, tmp_path_factory)
        return found[name]
    return of


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """Runtime RUNTIME, built by `sandbox-kernel runtime create` with rtpkg preloaded."""
    base = tmp_path_factory.mktemp("runtimes")
    make_wheel(base, "rtpkg", "1.0", {"rtpkg/__init__.py": "VERSION = '1.0'\n"})
    (base / "requirements.txt").write_text(f"--find-links {base}\nrtpkg==1.0\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SANDBOX_KERNEL_RUNTIMES", str(base / "store"))
        cli = [sys.executable, "-m", "sandbox_kernel", "runtime"]
        made = subprocess.run([*cli, "create", RUNTIME, "-r", str(base / "requirements.txt"),
                               "--preload", "rtpkg", "--user"], capture_output=True, text=True,
                              timeout=300)
        assert made.returncode == 0, made.stderr[-2000:]
        shown = json.loads(subprocess.run([*cli, "show", RUNTIME], capture_output=True,
                                          text=True, timeout=60, check=True).stdout)
        yield {"python": shown["python"], "preload": shown["preload"]}
        subprocess.run([*cli, "remove", RUNTIME, "--force"], capture_output=True, timeout=120)


def all_faces(launch, port, tmp_path_factory) -> dict[str, dict]:
    code = probe_code(launch.places, port)
    faces = [("zmq kernel", on_zmq_kernel), ("Sandbox(one_shot=True)", on_one_shot),
             ("Sandbox(one_shot=True, one_shot_process='kernel')", on_one_shot_kernel)]
    if launch.runtime is None:
        faces.append(("sandbox-kernel run", on_cli))
    by_face = {face: run(launch, code) for face, run in faces}
    by_face.update(service_reports(launch, port, tmp_path_factory))
    by_face.update(mcp_report(launch, code, tmp_path_factory))
    return by_face


def service_reports(launch, port, tmp_path_factory) -> dict[str, dict]:
    """The dify route and the native one-shot execute of a service started with the policy."""
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    write_keys(keys, [{"id": "parity", "key": KEY}])
    places = launch.places
    with contextlib.chdir(places["FOLDER"]):
        server = Server(tmp_path_factory.mktemp("serve"), "--api-keys-file", str(keys),
                        "--pool-size", "0", "--one-shot-pool-size", "1", *launch.flags(),
                        env=launcher_env())
    try:
        network = launch.settings.get("network", "off") != "off"
        dify = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, timeout=120,
                         json={"language": "python3", "preload": "", "enable_network": network,
                               "code": probe_code(places, port, printed=True)}).json()
        assert dify["code"] == 0 and not dify["data"]["error"], dify
        native = http.post(server.url + "/api/v1/execute", timeout=120,
                           headers={"Authorization": f"Bearer {KEY}"},
                           json={"code": probe_code(places, port), "inputs": {},
                                 "network": network_request(launch.settings)}).json()
        assert native["error"] is None, native
    finally:
        server.stop()
    return {"the dify route": json.loads(dify["data"]["stdout"].splitlines()[-1]),
            "the native one-shot execute": native["result"]}


def network_request(kwargs) -> dict:
    """The native execute's network field for the policy's network."""
    mode = kwargs.get("network", "off")
    return {"mode": mode, "allow_hosts": kwargs.get("allow_hosts", []) if mode == "hosts" else []}


def mcp_report(launch, code, tmp_path_factory) -> dict[str, dict]:
    """An MCP fresh run (run_python without a session) of a server started with the policy."""
    errlog = tmp_path_factory.mktemp("mcp") / "stderr.log"
    with contextlib.chdir(launch.places["FOLDER"]):
        mcp = mcp_clients.stdio(errlog, "--preload", "", *launch.flags())
    try:
        answer = mcp.tool("run_python", {"code": code, "inputs": {}})
    finally:
        mcp.close()
    data = answer.structured_content
    assert data.get("error") is None, (data, errlog.read_text())
    return {"MCP run_python": data["result"]}


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_face_reports_the_zmq_kernels_confinement(reports, name):
    by_face = {face: normalised(report, name) for face, report in reports(name).items()}
    reference = by_face.pop("zmq kernel")
    for face, report in by_face.items():
        differing = {key: (reference.get(key), report.get(key))
                     for key in reference.keys() | report.keys()
                     if reference.get(key) != report.get(key)}
        assert not differing, f"{face} differs from a ZMQ kernel under {name!r}: {differing}"


def test_the_probe_sees_each_setting(reports):
    """The probe reads what each policy sets (the matrix compares faces that all hold it)."""
    files = reports("files, environment, limits and priority")["zmq kernel"]
    assert files["working directory"] == "the launch folder"
    assert files["read data.csv by its relative name"] == "month,sales\n1,10\n"
    assert files["write in the working directory"] == "allowed"
    assert files["read the read grant"] == "granted"
    assert files["write the read grant"] == "EACCES"
    assert files["write the write grant"] == "allowed"
    assert files["read beside the grants"] in ("EACCES", "ENOENT")  # ENOENT: the view hides it
    assert files["PROBE_SET"] == "set" and files["PROBE_PASSED"] == "passed"
    assert "PROBE_HOST_ONLY" not in files["environment names"]
    assert files["nice"] == 9
    assert files["rlimits"]["RLIMIT_CPU"][0] == 77
    assert files["rlimits"]["RLIMIT_FSIZE"] == [7 << 20, 7 << 20]
    assert files["rlimits"]["RLIMIT_NOFILE"] == [300, 300]
    defaults = reports("defaults")["zmq kernel"]
    assert defaults["working directory"] == "the scratch"
    assert defaults["read data.csv by its relative name"] == "ENOENT"
    assert defaults["read the read grant"] == "EACCES"
    assert defaults["new socket"] == "EACCES" or defaults["new socket"] == "EPERM"
    assert reports("read-only folder")["zmq kernel"]["write in the working directory"] \
        == "EACCES"
    for name in ("network by host", "network on", "a secret"):
        assert reports(name)["zmq kernel"]["connect to the host's loopback"] != "allowed"
    secret = reports("a secret")["zmq kernel"]
    assert secret["PROBE_TOKEN is set"] and not secret["PROBE_TOKEN holds the value"]
    assert defaults["the runtime's package"] == "ModuleNotFoundError"
    on_runtime = reports("a runtime")["zmq kernel"]
    assert on_runtime["the runtime's package"] == "1.0" and on_runtime["preloaded"] == ["rtpkg"]
    assert on_runtime["interpreter"] != defaults["interpreter"]
    assert on_runtime["write the interpreter's packages"] in ("EACCES", "EROFS", "ENOENT")


@pytest.mark.parametrize("name", [name for name in POLICIES if name not in ON_A_RUNTIME])
def test_the_lean_process_reads_a_pools_argv_as_the_kernel_application_does(name):
    """A pool's argv (the policy's to_argv, launch/oneshot.py) gives the lean one-shot process
    (policy.from_kernel_argv, no ipykernel) the policy the kernel application parses from it."""
    from sandbox_kernel.kernel.oneshot import OneShotKernelApp
    from sandbox_kernel.policy import from_kernel_argv

    places = {"FOLDER": "/srv/f", "READ": "/srv/r", "WRITE": "/srv/w", "OUTSIDE": "/srv/o"}
    kwargs = policy_kwargs(name, places)
    argv = SandboxPolicy(**kwargs, changed_with="sandbox-kernel mcp").to_argv()
    app = OneShotKernelApp()  # not the singleton: parsed only
    app.parse_command_line(argv)
    assert from_kernel_argv(argv).as_dict() == app.policy.as_dict(), argv
    assert from_kernel_argv(argv).as_dict() != SandboxPolicy().as_dict()  # argv was read
