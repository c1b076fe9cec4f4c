"""`sandbox-kernel eg-launch` against Enterprise Gateway's own receiving side (no EG server).

EG's `ResponseManager`, run in EG's own virtualenv (tests/eg_receiver.py), gives a kernel id,
its public key and response address; the launcher runs as EG would start it; the payload must
decrypt there, and the kernel must then work over the decrypted connection info, answer the
comm port's signals, and end (scratch and connection file gone) on its shutdown request.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

SECRET = "eg-secret-token-7f3a"  # stands for EG's credentials in the launcher's environment
PORT_LOW, PORT_HIGH = 43000, 44999


def send_request(port: int, request: dict) -> None:
    """Send a comm-port request the way EG's RemoteProcessProxy does."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(json.dumps(request).encode())
        if request.get("shutdown"):
            sock.shutdown(socket.SHUT_WR)


def execute(kc: BlockingKernelClient, code: str, metadata: dict | None = None,
            timeout: float = 60, on_busy=None) -> dict:
    """Run code; collect its result, stdout and error up to the kernel's idle status."""
    msg = kc.session.msg("execute_request", {
        "code": code, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": False, "stop_on_error": False}, metadata=metadata or {})
    kc.shell_channel.send(msg)
    out: dict = {"result": None, "text": None, "stdout": "", "error": None}
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no idle within {timeout} s for {code!r}: {out}") from None
        if reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            continue
        kind, content = reply["msg_type"], reply["content"]
        if kind == "stream" and content["name"] == "stdout":
            out["stdout"] += content["text"]
        elif kind == "execute_result":
            out["result"] = content["data"].get("application/json")
            out["text"] = content["data"].get("text/plain")
        elif kind == "error":
            out["error"] = (content["ename"], content["evalue"])
        elif kind == "status" and content["execution_state"] == "busy" and on_busy:
            on_busy()
        elif kind == "status" and content["execution_state"] == "idle":
            return out


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def listener_of(kernel_pid: int) -> int:
    """The comm-port listener: the kernel's child still running the launcher's command line."""
    for child in children(kernel_pid):
        if b"eg-launch" in Path(f"/proc/{child}/cmdline").read_bytes():
            return child
    raise AssertionError(f"kernel {kernel_pid} has no comm-port listener child")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def launch_with_eg(eg_python, log: Path, wrapper: tuple[str, ...] = (),
                   policy: tuple[str, ...] = ("--SandboxPolicy.timeout=30",),
                   extra_env: dict[str, str] | None = None, as_container: bool = False,
                   command: tuple[str, ...] = (sys.executable, "-I", "-m", "sandbox_kernel",
                                               "eg-launch")):
    """Start eg-launch (command, under wrapper) as EG would and yield what EG's
    ResponseManager got.

    as_container: everything through the variables launch_kubernetes.py / launch_docker.py
    set in the container, and the image's bare command, as in a pod.
    """
    env = {**os.environ, "EG_RESPONSE_IP": "127.0.0.1"}
    receiver = subprocess.Popen([str(eg_python), str(Path(__file__).with_name("eg_receiver.py")),
                                 "90"], stdout=subprocess.PIPE, text=True, env=env)
    assert receiver.stdout is not None
    eg = json.loads(receiver.stdout.readline())
    launcher_env = {**os.environ, "EG_AUTH_TOKEN": SECRET, "KERNEL_USERNAME": "alice",
                    "PUBLIC_KEY": eg["public_key"], "LD_PRELOAD": "", "PYTHONPATH": "/nowhere",
                    **(extra_env or {})}
    argv = [*wrapper, *command]
    if as_container:
        launcher_env.update(KERNEL_ID=eg["kernel_id"], PORT_RANGE=f"{PORT_LOW}..{PORT_HIGH}",
                            RESPONSE_ADDRESS=eg["response_address"],
                            SANDBOX_KERNEL_EG_POLICY=" ".join(policy))
    else:  # the public key still comes from PUBLIC_KEY
        argv += ["--RemoteProcessProxy.kernel-id", eg["kernel_id"],
                 "--RemoteProcessProxy.port-range", f"{PORT_LOW}..{PORT_HIGH}",
                 "--RemoteProcessProxy.response-address", eg["response_address"],
                 "--RemoteProcessProxy.spark-context-initialization-mode", "none", *policy]
    with open(log, "w") as log_file:
        launcher = subprocess.Popen(
            [*argv, "--ip", "127.0.0.1"], env=launcher_env, stdout=log_file,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        info = json.loads(receiver.stdout.readline())
        assert "error" not in info, f"{info}; launcher log: {log.read_text()}"
        yield {"info": info, "launcher": launcher, "eg": eg, "log": log}
    finally:
        receiver.wait(timeout=30)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)


def connect_client(info: dict) -> BlockingKernelClient:
    """A client on the decrypted connection info, once the kernel answers kernel_info."""
    kc = BlockingKernelClient()
    kc.load_connection_info(info)
    # No heartbeat channel: its 1 s deadline misreads a loaded 2-core machine as a dead kernel.
    kc.start_channels(hb=False)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        kc.kernel_info()
        try:  # any reply will do: a late one answers an earlier request
            reply = kc.get_shell_msg(timeout=5)
        except queue.Empty:
            continue
        if reply["msg_type"] != "kernel_info_reply":
            continue
        # The reply can come before IOPub has joined (the kernel binds after the payload is
        # sent; the subscription follows the connection): then the next cell's whole output
        # is lost. An IOPub message (a kernel_info status) proves it; otherwise ask again.
        try:
            kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        kc.sandbox_info = reply["content"]["sandbox"]  # type: ignore[attr-defined]
        return kc
    raise AssertionError("the kernel did not answer kernel_info within 90 s")


@pytest.fixture(scope="module")
def launched(eg_python, tmp_path_factory):
    """A kernel started by eg-launch and reported to EG's ResponseManager."""
    with launch_with_eg(eg_python, tmp_path_factory.mktemp("eg") / "launcher.log") as launch:
        kc = connect_client(launch["info"])
        yield {**launch, "kc": kc}
        kc.stop_channels()


def test_payload_decrypts_in_eg(launched):
    info, launcher = launched["info"], launched["launcher"]
    assert info["kernel_id"] == launched["eg"]["kernel_id"]
    assert info["pid"] == launcher.pid  # the launcher became the kernel: EG's pid is right
    assert info["pgid"] == os.getpgid(launcher.pid)
    ports = [info[f"{name}_port"] for name in ("shell", "iopub", "stdin", "hb", "control")]
    ports.append(info["comm_port"])
    assert len(set(ports)) == 6
    assert all(PORT_LOW <= port <= PORT_HIGH for port in ports)
    assert info["transport"] == "tcp" and info["signature_scheme"] == "hmac-sha256"


def test_main_call_over_decrypted_connection(launched):
    out = execute(launched["kc"], "def main(x):\n    print('log line')\n    return {'y': 2 * x}",
                  metadata={"sandbox": {"entrypoint": "main", "inputs": {"x": 21}}})
    assert out["error"] is None, out
    assert out["result"] == {"y": 42}
    assert out["stdout"] == "log line\n"


def test_kernel_is_sandboxed_and_holds_nothing_of_eg(launched):
    kc = launched["kc"]
    out = execute(kc, "import os\ntry:\n    os.fork()\nexcept OSError as e:\n"
                      "    print(type(e).__name__, e.errno)")
    assert out["stdout"].startswith("PermissionError 1"), out
    out = execute(kc, "import os\n(sorted(os.environ), open('/proc/self/environ', 'rb').read())")
    assert out["error"] is None, out
    names, raw_environ = eval(out["text"])  # a repr of plain literals
    for leaked in ("EG_AUTH_TOKEN", "PUBLIC_KEY", "KERNEL_USERNAME", "LD_PRELOAD",
                   "PYTHONPATH"):
        assert leaked not in names
    assert SECRET.encode() not in raw_environ and b"PUBLIC_KEY" not in raw_environ
    # The comm port's socket stays with the listener, not the kernel.
    comm_inodes = _socket_inodes_on_port(launched["info"]["comm_port"])
    assert comm_inodes
    kernel_fds = {os.readlink(f"/proc/{launched['launcher'].pid}/fd/{fd}")
                  for fd in os.listdir(f"/proc/{launched['launcher'].pid}/fd")}
    assert not {f"socket:[{inode}]" for inode in comm_inodes} & kernel_fds


def _socket_inodes_on_port(port: int) -> set[str]:
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
            inodes.add(fields[9])
    return inodes


def test_user_code_cannot_reach_the_listener(launched):
    kernel_pid = launched["launcher"].pid
    listener = listener_of(kernel_pid)
    out = execute(launched["kc"], f"""
import os, signal
outcomes = []
for attempt in (lambda: os.kill({listener}, signal.SIGKILL),
                lambda: open('/proc/{listener}/environ', 'rb').read(),
                lambda: open('/proc/{listener}/mem', 'rb'),
                lambda: os.killpg({listener}, signal.SIGKILL)):
    try:
        attempt()
        outcomes.append('done')
    except OSError as e:
        outcomes.append(type(e).__name__)
outcomes""")
    assert out["error"] is None, out
    outcomes = eval(out["text"])
    assert outcomes[:2] == ["PermissionError", "PermissionError"], outcomes
    assert "done" not in outcomes, outcomes
    assert alive(listener)
    send_request(launched["info"]["comm_port"], {"signum": 0})  # EG's liveness poll
    assert execute(launched["kc"], "1 + 1")["text"] == "2"


def test_listener_ignores_malformed_requests(launched):
    port, kernel_pid = launched["info"]["comm_port"], launched["launcher"].pid
    listener = listener_of(kernel_pid)
    for junk in (b"not json", b'{"signum": "9"}', b'{"signum": 99999}', b'{"signum": true}',
                 b'["shutdown"]', b"{" * 10000):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(junk)
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # connects and sends nothing: the listener moves on after its deadline
    assert alive(listener) and alive(kernel_pid)
    assert execute(launched["kc"], "2 + 2")["text"] == "4"


def test_signum_2_interrupts_a_running_cell(launched):
    port = launched["info"]["comm_port"]
    out = execute(launched["kc"], "import time\nfor _ in range(600):\n    time.sleep(0.1)",
                  on_busy=lambda: (time.sleep(1), send_request(port, {"signum": 2})))
    assert out["error"] is not None and out["error"][0] == "KeyboardInterrupt", out
    assert execute(launched["kc"], "6 * 7")["text"] == "42"  # the kernel lives on


def send_from(source: str, port: int, request: dict) -> None:
    """A comm-port request from another address than the gateway's (another tenant's)."""
    with socket.socket() as sock:
        sock.settimeout(5)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        with contextlib.suppress(OSError):  # the listener may hang up before it reads
            sock.sendall(json.dumps(request).encode())
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # until the listener hangs up: it has judged the request


def test_only_the_gateway_and_only_egs_signals_are_obeyed(launched):
    """Another tenant's {"signum": 9} (or shutdown) kills nothing; EG's own SIGKILL request is
    no EG signal either (EG kills through its process proxy, never the comm port)."""
    port, kernel_pid = launched["info"]["comm_port"], launched["launcher"].pid
    listener = listener_of(kernel_pid)
    for request in ({"signum": 9}, {"signum": 15}, {"shutdown": 1}):
        send_from("127.0.0.2", port, request)  # loopback, but not the response address
    send_from("127.0.0.1", port, {"signum": 9})  # the gateway's address, not EG's signal
    send_request(port, {"signum": 0})  # the gateway's poll still works
    time.sleep(0.5)
    assert alive(listener) and alive(kernel_pid)
    assert execute(launched["kc"], "3 * 3")["text"] == "9"
    log = launched["log"].read_text()
    assert ("comm port: refused a request from 127.0.0.2, which is not the gateway (127.0.0.1);"
            " add --comm-peer 127.0.0.2 if it is") in log
    assert "comm port: refused signal 9: the comm port obeys only EG's signals [0, 2, 15]" in log


def test_shutdown_ends_kernel_and_removes_scratch(launched):
    kc, launcher, info = launched["kc"], launched["launcher"], launched["info"]
    out = execute(kc, "import os\nos.getcwd()")
    scratch = eval(out["text"])
    assert Path(scratch).is_dir()
    connection_dir = _connection_file_dir(launcher.pid)
    listener = listener_of(launcher.pid)
    send_request(info["comm_port"], {"shutdown": 1})
    assert launcher.wait(timeout=30) in (-signal.SIGTERM, 0)
    wait_until(lambda: not alive(listener), 15, "the listener to exit")
    wait_until(lambda: not Path(scratch).exists(), 15, f"scratch {scratch} to be removed")
    wait_until(lambda: not connection_dir.exists(), 15, "the connection file to be removed")
    with pytest.raises(ConnectionRefusedError):
        send_request(info["comm_port"], {"signum": 0})


def _connection_file_dir(pid: int) -> Path:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(argv[argv.index(b"-f") + 1].decode()).parent


def test_bad_arguments_are_refused_with_the_reason():
    run = subprocess.run([sys.executable, "-I", "-m", "sandbox_kernel", "eg-launch",
                          "--kernel-id", "k", "--response-address", "127.0.0.1:1",
                          "--public-key", "x", "--port-range", "5..3"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "port range '5..3'" in run.stderr
    run = subprocess.run([sys.executable, "-I", "-m", "sandbox_kernel", "eg-launch",
                          "--kernel-id", "k", "--response-address", "127.0.0.1:1",
                          "--public-key", "x", "--ip=127.0.0.1", "--KernelApp.foo=1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--KernelApp.foo=1" in run.stderr
    for kernel_id in ("../x", "a/b", "..", "\u00e9"):
        run = subprocess.run([sys.executable, "-I", "-m", "sandbox_kernel", "eg-launch",
                              "--kernel-id", kernel_id, "--response-address", "127.0.0.1:1",
                              "--public-key", "x"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, run
        assert run.stderr == (f"sandbox-kernel eg-launch: --kernel-id {kernel_id!r}: a kernel id "
                              "is letters, digits, '-', '_' and '.' (EG gives a UUID), and not "
                              "'.' or '..'\n")


KERNEL_ID_RULE = ("a kernel id is letters, digits, '-', '_' and '.' (EG gives a UUID), and not "
                  "'.' or '..'")
SPARK_RULE = ("a sandboxed kernel cannot start Spark (no processes, no network by default); "
              "use 'none'")


@pytest.mark.parametrize("variables, refusal", [
    # EG's container variables (launch_kubernetes.py copies its environment into the pod)
    ({"KERNEL_ID": "../../etc/cron.d/x"}, f"--kernel-id '../../etc/cron.d/x': {KERNEL_ID_RULE}"),
    ({"KERNEL_ID": "k\nspec: {hostNetwork: true}"},
     f"--kernel-id 'k\\nspec: {{hostNetwork: true}}': {KERNEL_ID_RULE}"),
    ({"KERNEL_ID": ".."}, f"--kernel-id '..': {KERNEL_ID_RULE}"),
    ({"KERNEL_ID": "k" * 300}, f"--kernel-id {'k' * 80!r}... (300 characters): {KERNEL_ID_RULE}"),
    ({"PORT_RANGE": "41000..40000"}, "port range '41000..40000' must hold more than 5 ports "
                                     "between 1 and 65535"),
    ({"PORT_RANGE": "-5..10"}, "port range '-5..10' is not LOW..HIGH, e.g. 40000..41000"),
    ({"PORT_RANGE": "40000..99999"}, "port range '40000..99999' must hold more than 5 ports "
                                     "between 1 and 65535"),
    ({"PORT_RANGE": "40000..40003"}, "port range '40000..40003' must hold more than 5 ports "
                                     "between 1 and 65535"),
    ({"PORT_RANGE": "9" * 5000 + "..1"},
     f"port range {'9' * 80!r}... (5003 characters) is not LOW..HIGH, e.g. 40000..41000"),
    ({"PORT_RANGE": "40000"}, "port range '40000' is not LOW..HIGH, e.g. 40000..41000"),
    ({"PORT_RANGE": "40_000..41_000"},
     "port range '40_000..41_000' is not LOW..HIGH, e.g. 40000..41000"),
    ({"PORT_RANGE": " 40000..41000\n"},
     "port range ' 40000..41000\\n' is not LOW..HIGH, e.g. 40000..41000"),
    ({"PORT_RANGE": "+40000..41000"},
     "port range '+40000..41000' is not LOW..HIGH, e.g. 40000..41000"),
    ({"PORT_RANGE": "\u0664\u0660\u0660\u0660\u0660..\u0664\u0661\u0660\u0660\u0660"},
     "port range '\u0664\u0660\u0660\u0660\u0660..\u0664\u0661\u0660\u0660\u0660' is not "
     "LOW..HIGH, e.g. 40000..41000"),
    ({"KERNEL_SPARK_CONTEXT_INIT_MODE": "eager"}, f"spark context mode 'eager': {SPARK_RULE}"),
    ({"KERNEL_SPARK_CONTEXT_INIT_MODE": "lazy"}, f"spark context mode 'lazy': {SPARK_RULE}"),
    ({"KERNEL_SPARK_CONTEXT_INIT_MODE": "None"}, f"spark context mode 'None': {SPARK_RULE}"),
    ({"KERNEL_SPARK_CONTEXT_INIT_MODE": "none\n--SandboxPolicy.network=on"},
     f"spark context mode 'none\\n--SandboxPolicy.network=on': {SPARK_RULE}"),
    ({"RESPONSE_ADDRESS": "127.0.0.1:99999"},
     "response address '127.0.0.1:99999' is not IP:PORT (a port from 1 to 65535)"),
    ({"RESPONSE_ADDRESS": "127.0.0.1:\u0661"},
     "response address '127.0.0.1:\u0661' is not IP:PORT (a port from 1 to 65535)"),
])
def test_hostile_container_variables_are_refused_on_one_line(monkeypatch, capsys, variables,
                                                              refusal):
    from sandbox_kernel.launch import eg

    base = {"KERNEL_ID": "0b4a1c52-7d1e-4c2f-9d7a-2f4f1e0c9a11", "PUBLIC_KEY": "x",
            "RESPONSE_ADDRESS": "127.0.0.1:1", "PORT_RANGE": "40000..41000"}
    for name in (*base, "KERNEL_SPARK_CONTEXT_INIT_MODE", eg.POLICY_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**base, **variables}.items():
        monkeypatch.setenv(name, value)
    assert eg.main([]) == eg.USAGE_ERROR
    assert capsys.readouterr().err == f"sandbox-kernel eg-launch: {refusal}\n"


@pytest.mark.parametrize("argv, variables, expected", [
    ([], {"PORT_RANGE": "0..0"}, (0, 0)),  # any port, as EG's default says
    ([], {"PORT_RANGE": "40000..40005"}, (40000, 40005)),  # exactly the six ports needed
    (["--spark-context-initialization-mode", "none"], {"KERNEL_SPARK_CONTEXT_INIT_MODE": "eager"},
     (40000, 41000)),  # EG's argument wins over its variable
])
def test_well_formed_container_variables_are_taken(argv, variables, expected):
    from sandbox_kernel.launch import eg

    environ = {"KERNEL_ID": "k-1.a_b", "PUBLIC_KEY": "x", "RESPONSE_ADDRESS": "127.0.0.1:8877",
               "PORT_RANGE": "40000..41000", **variables}
    request = eg.parse_arguments(argv, environ)
    assert (request.kernel_id, request.port_range, request.response_address) == (
        "k-1.a_b", expected, ("127.0.0.1", 8877))


# Loads a seccomp profile in OCI/Docker JSON form, as a container runtime would, then execs.
PROFILE_LOADER = """
import json, os, sys
import pyseccomp as sc
profile = json.load(open(sys.argv[1]))
flt = sc.SyscallFilter(sc.ERRNO(profile["defaultErrnoRet"]))
flt.set_attr(sc.Attr.CTL_NNP, 1)
for group in profile["syscalls"]:
    action = sc.ALLOW if group["action"] == "SCMP_ACT_ALLOW" else sc.ERRNO(group["errnoRet"])
    args = [sc.Arg(a["index"], sc.MASKED_EQ, a["value"], a["valueTwo"])
            for a in group.get("args", [])]
    for name in group["names"]:
        number = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if number >= 0:
            flt.add_rule(action, number, *args)
flt.load()
os.execv(sys.argv[2], sys.argv[2:])
"""


def _profile_wrapper(tmp_path: Path, profile: dict) -> tuple[str, ...]:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return (sys.executable, "-c", PROFILE_LOADER, str(path))


# Under the pod's Localhost profile no tmpfs can be mounted (no unshare/mount): the pod bounds
# scratch with its emptyDir instead. In the pod the kernel is not root and switches no identity;
# these tests run as root, where a uid of the kernel's own may need a private mount view
# (unshare) to reach an interpreter under /root, so the kernel stays uid 0 without capabilities,
# which RLIMIT_NPROC does not bound (the pod's non-root uid is bounded).
PROFILE_POLICY = ("--SandboxPolicy.scratch_size=0", "--SandboxPolicy.run_as=root",
                  "--SandboxPolicy.max_threads=0", "--SandboxPolicy.timeout=30")


def test_kernel_starts_and_confines_itself_under_the_pod_seccomp_profile(eg_python, tmp_path):
    from sandbox_kernel.launch.eg_kernelspec import pod_seccomp_profile

    wrapper = _profile_wrapper(tmp_path, pod_seccomp_profile())
    with launch_with_eg(eg_python, tmp_path / "launcher.log", wrapper, PROFILE_POLICY,
                        as_container=True) as launch:
        kc = connect_client(launch["info"])
        try:
            policy = kc.sandbox_info["policy"]  # from SANDBOX_KERNEL_EG_POLICY
            assert policy["timeout"] == 30 and policy["scratch_size"] == 0
            layers = kc.sandbox_info["layers"]
            assert layers["landlock"]["active"] and layers["seccomp"]["active"], layers
            out = execute(kc, "import os\ntry:\n    os.fork()\nexcept OSError as e:\n"
                              "    print(type(e).__name__)\nopen('/proc/self/status').read()")
            assert out["stdout"] == "PermissionError\n", out
            status = eval(out["text"])
            # Two filters stacked: the pod's and the kernel's own (loaded through the first).
            assert "Seccomp:\t2" in status and "NoNewPrivs:\t1" in status
            assert "Seccomp_filters:\t3" in status, status  # pod + denylist + allowlist
            send_request(launch["info"]["comm_port"], {"shutdown": 1})
            assert launch["launcher"].wait(timeout=30) in (-signal.SIGTERM, 0)
        finally:
            kc.stop_channels()


def test_runtime_profile_without_landlock_makes_the_kernel_refuse(eg_python, tmp_path):
    from sandbox_kernel.launch.eg_kernelspec import pod_seccomp_profile

    profile = pod_seccomp_profile()
    allowed = profile["syscalls"][0]
    allowed["names"] = [name for name in allowed["names"] if not name.startswith("landlock_")]
    log = tmp_path / "launcher.log"
    wrapper = _profile_wrapper(tmp_path, profile)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    with launch_with_eg(eg_python, log, wrapper, PROFILE_POLICY, {"TMPDIR": str(tmpdir)}) as launch:
        assert launch["launcher"].wait(timeout=60) != 0
        # The listener saw the kernel end: it exits and takes the connection file with it.
        wait_until(lambda: not list(tmpdir.iterdir()), 15, "the connection file's removal")
        with pytest.raises(ConnectionRefusedError):
            send_request(launch["info"]["comm_port"], {"signum": 0})
    assert "landlock" in log.read_text().lower()
    assert "--no-landlock" in log.read_text()


def test_unreachable_eg_fails_cleanly(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
    der = key.public_bytes(serialization.Encoding.DER,
                           serialization.PublicFormat.SubjectPublicKeyInfo)
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-I", "-m", "sandbox_kernel", "eg-launch", "--kernel-id", "k1",
         "--response-address", f"127.0.0.1:{port}", "--public-key",
         base64.b64encode(der).decode(), "--ip", "127.0.0.1"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == 3
    assert f"cannot reach EG's response address 127.0.0.1:{port}" in run.stderr
    assert list(tmp_path.iterdir()) == []  # no connection file left behind
