"""`sandbox-kernel eg-launch`: Jupyter Enterprise Gateway's remote-kernel launcher, sandboxed.

Enterprise Gateway (EG) starts a *launcher* wherever a kernel should run (a Kubernetes pod, a
Docker container, a remote host) and tells it `--kernel-id`, `--port-range`,
`--response-address` and `--public-key`. The launcher picks the kernel's five ports, writes a
connection file, sends the connection info back to EG encrypted with that public key, and leaves
a small TCP listener (the "comm port") through which EG later signals the kernel. EG's own
launcher then starts a plain ipykernel; this one ends in the ordinary sandboxed start-up
(`python -I -m sandbox_kernel -f <file> <policy>`), so the clean re-exec, the scratch directory,
Landlock and seccomp happen exactly as for every other kernel.

Everything here runs while the process is still unconfined and single-threaded: choose the
ports, write the connection file, bind the comm port, send the payload, fork the listener, then
exec the kernel. The kernel keeps this process's pid, which is the pid EG was told.

The payload's cryptography (RSA PKCS#1 v1.5 and AES-128-ECB) is what EG's receiving side,
`ResponseManager._decode_payload`, accepts; it is not a choice this module can improve on.
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import json
import os
import random
import selectors
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .. import secrets
from ..confine.environment import PASSED_THROUGH, SAFE_PATH
from ..confine.vault import VAULT_VAR
from ..policy import from_kernel_argv

LAUNCHER_VERSION = 1  # the payload format EG's ResponseManager decodes
PORT_COUNT = 5  # shell, iopub, stdin, heartbeat, control
POLICY_PREFIX = "--SandboxPolicy."
# The policy options when none are given on the command line (EG's docker launcher passes the
# kernelspec's env to the container, not its argv).
POLICY_VARIABLE = "SANDBOX_KERNEL_EG_POLICY"
MAX_REQUEST_BYTES = 4096  # EG's requests are a few bytes of JSON
REQUEST_TIMEOUT = 5.0  # seconds one comm-port client may take to send its request
SHUTDOWN_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when EG asks the kernel to end
SEND_TIMEOUT = 30.0  # seconds to reach EG's response address
USAGE_ERROR = 2
LAUNCH_FAILED = 3
# What EG sends to the comm port: 0 polls, SIGINT interrupts, SIGTERM ends the kernel (its
# distributed proxy's shutdown), besides {"shutdown": 1}. No other signal is obeyed: the listener
# runs unconfined, and must not be anyone's way to signal the kernel.
EG_SIGNALS = frozenset({0, int(signal.SIGINT), int(signal.SIGTERM)})

# EG's launch_kubernetes.py and launch_docker.py hand these to the container as variables.
_ENV_FALLBACKS = {"kernel_id": "KERNEL_ID", "port_range": "PORT_RANGE",
                  "response_address": "RESPONSE_ADDRESS", "public_key": "PUBLIC_KEY",
                  "spark_mode": "KERNEL_SPARK_CONTEXT_INIT_MODE"}


class LaunchError(Exception):
    """The kernel cannot be launched as asked; the message says why and what to change."""


@dataclass
class LaunchRequest:
    """What EG asked for, plus the sandbox policy to start the kernel with."""

    kernel_id: str
    public_key: str
    response_address: tuple[str, int]
    port_range: tuple[int, int] = (0, 0)
    ip: str = "0.0.0.0"  # EG connects from another host: listen on every interface
    policy_argv: list[str] = field(default_factory=list)
    comm_peers: list[str] = field(default_factory=list)  # besides the response address's host


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandbox-kernel eg-launch",
        description="Start a sandboxed kernel for Jupyter Enterprise Gateway: report its "
        "connection info to EG, listen for EG's signals, then run the sandboxed kernel. "
        "Options may also come from EG's container variables KERNEL_ID, PORT_RANGE, "
        "RESPONSE_ADDRESS and PUBLIC_KEY. --SandboxPolicy.* options are passed to the kernel.")
    # EG passes both spellings, depending on the kernelspec and the EG version.
    parser.add_argument("--kernel-id", "--RemoteProcessProxy.kernel-id", dest="kernel_id",
                        help="the kernel's id, as EG knows it")
    parser.add_argument("--port-range", "--RemoteProcessProxy.port-range", dest="port_range",
                        metavar="LOW..HIGH", help="ports the kernel may use (0..0: any)")
    parser.add_argument("--response-address", "--RemoteProcessProxy.response-address",
                        dest="response_address", metavar="IP:PORT",
                        help="where EG waits for the connection info")
    parser.add_argument("--public-key", "--RemoteProcessProxy.public-key", dest="public_key",
                        help="EG's RSA public key (base64 DER) to encrypt the connection info")
    parser.add_argument("--spark-context-initialization-mode",
                        "--RemoteProcessProxy.spark-context-initialization-mode",
                        dest="spark_mode", metavar="MODE",
                        help="only 'none': a sandboxed kernel cannot start Spark")
    parser.add_argument("--ip", default="0.0.0.0",
                        help="address the kernel's sockets listen on (default: all)")
    parser.add_argument("--comm-peer", dest="comm_peers", action="append", default=[],
                        metavar="ADDRESS",
                        help="another address EG's requests to the comm port may come from "
                        "(repeatable; by default only the response address's host is obeyed)")
    return parser


def parse_port_range(text: str | None) -> tuple[int, int]:
    """(low, high) from EG's 'LOW..HIGH'; (0, 0) means any free port.

    Only ASCII digits: int() would also take signs, spaces, '_' and other scripts' digits,
    which no EG sends.
    """
    if not text:
        return 0, 0
    low, sep, high = text.partition("..")
    if not (sep and _is_port_number(low) and _is_port_number(high)):
        raise LaunchError(f"port range {_shown(text)} is not LOW..HIGH, e.g. 40000..41000")
    bounds = int(low), int(high)
    if bounds == (0, 0):
        return bounds
    if not 0 < bounds[0] <= bounds[1] <= 65535 or bounds[1] - bounds[0] < PORT_COUNT:
        raise LaunchError(f"port range {_shown(text)} must hold more than {PORT_COUNT} ports "
                          "between 1 and 65535")
    return bounds


def _is_port_number(text: str) -> bool:
    return 0 < len(text) <= 5 and text.isascii() and text.isdigit()


def _shown(value: str) -> str:
    """A value from EG's request as an error shows it: quoted, on one line, not too long."""
    return repr(value) if len(value) <= 80 else f"{value[:80]!r}... ({len(value)} characters)"


def _parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not _is_port_number(port) or not 0 < int(port) <= 65535:
        raise LaunchError(f"response address {_shown(text)} is not IP:PORT (a port from 1 to "
                          "65535)")
    return host, int(port)


def parse_arguments(argv: list[str], environ: dict[str, str] | os._Environ[str]) -> LaunchRequest:
    """The launch request from EG's arguments (either spelling) and container variables."""
    args, rest = _parser().parse_known_args(argv)
    if not rest and environ.get(POLICY_VARIABLE):
        rest = shlex.split(environ[POLICY_VARIABLE])
    for name, variable in _ENV_FALLBACKS.items():
        if getattr(args, name) is None and environ.get(variable):
            setattr(args, name, environ[variable])
    foreign = [arg for arg in rest if not arg.startswith(POLICY_PREFIX)]
    if foreign:
        raise LaunchError(f"unknown options {foreign}: only EG's launcher options and "
                          f"{POLICY_PREFIX}* options are accepted")
    missing = [option for option, value in (("--kernel-id", args.kernel_id),
                                            ("--response-address", args.response_address),
                                            ("--public-key", args.public_key)) if not value]
    if missing:
        raise LaunchError(f"missing {', '.join(missing)}: EG passes them in the kernelspec's "
                          "argv or as KERNEL_ID, RESPONSE_ADDRESS, PUBLIC_KEY")
    if not _safe_kernel_id(args.kernel_id):
        raise LaunchError(f"--kernel-id {_shown(args.kernel_id)}: a kernel id is letters, "
                          "digits, '-', '_' and '.' (EG gives a UUID), and not '.' or '..'")
    if args.spark_mode not in (None, "none"):
        raise LaunchError(f"spark context mode {_shown(args.spark_mode)}: a sandboxed kernel "
                          "cannot start Spark (no processes, no network by default); use 'none'")
    return LaunchRequest(kernel_id=args.kernel_id, public_key=args.public_key,
                         response_address=_parse_address(args.response_address),
                         port_range=parse_port_range(args.port_range), ip=args.ip,
                         policy_argv=rest, comm_peers=args.comm_peers)


def _safe_kernel_id(kernel_id: str) -> bool:
    """Whether the id can name a file in the launcher's directory (it becomes part of one)."""
    return (0 < len(kernel_id) <= 255 and kernel_id not in (".", "..")
            and all(char.isascii() and (char.isalnum() or char in "-_.") for char in kernel_id))


def bind_in_range(ip: str, low: int, high: int, attempts: int = 200) -> socket.socket:
    """A TCP socket bound to a free port in [low, high] (any free port for 0..0)."""
    for _ in range(attempts):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((ip, random.randint(low, high) if high else 0))
        except OSError:
            sock.close()
            continue
        return sock
    raise LaunchError(f"no free port in {low}..{high} after {attempts} tries; widen EG's "
                      "port range (EG_PORT_RANGE)")


def write_connection_file(directory: str, request: LaunchRequest, ports: list[int]) -> str:
    """The kernel's connection file (mode 0600) in directory; returns its path."""
    from jupyter_client.connect import write_connection_file as write

    path = os.path.join(directory, f"kernel-{request.kernel_id}.json")
    write(fname=path, ip=request.ip, key=str(uuid.uuid4()).encode(), transport="tcp",
          shell_port=ports[0], iopub_port=ports[1], stdin_port=ports[2], hb_port=ports[3],
          control_port=ports[4], kernel_name="sandbox")
    return path


def encrypt_payload(connection_info: dict, public_key: str) -> bytes:
    """EG's version-1 payload: the connection info under a fresh AES key sealed with RSA."""
    try:
        from cryptography.hazmat.primitives import padding, serialization
        from cryptography.hazmat.primitives.asymmetric import padding as rsa_padding
        from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError:
        from ..extras import install_hint

        raise LaunchError("eg-launch needs the 'cryptography' package: install the [eg] extra: "
                          f"{install_hint('eg')}") from None
    try:
        key = serialization.load_der_public_key(base64.b64decode(public_key, validate=True))
    except ValueError as exc:
        raise LaunchError(f"--public-key is not a base64 DER public key: {exc}") from None
    if not isinstance(key, RSAPublicKey):
        raise LaunchError("--public-key is not an RSA key")
    aes_key = os.urandom(16)
    padder = padding.PKCS7(128).padder()
    plain = padder.update(json.dumps(connection_info).encode()) + padder.finalize()
    encryptor = Cipher(algorithms.AES(aes_key), modes.ECB()).encryptor()  # EG's format
    sealed = encryptor.update(plain) + encryptor.finalize()
    payload = {"version": LAUNCHER_VERSION,
               "key": base64.b64encode(key.encrypt(aes_key, rsa_padding.PKCS1v15())).decode(),
               "conn_info": base64.b64encode(sealed).decode()}
    return base64.b64encode(json.dumps(payload).encode())


def send_payload(address: tuple[str, int], payload: bytes) -> None:
    """Deliver the payload to EG's response address (EG reads until we close)."""
    try:
        with socket.create_connection(address, timeout=SEND_TIMEOUT) as sock:
            sock.sendall(payload)
    except OSError as exc:
        raise LaunchError(f"cannot reach EG's response address {address[0]}:{address[1]}: "
                          f"{exc}; check EG_RESPONSE_IP and that the kernel may connect "
                          "to it") from None


def gateway_addresses(request: LaunchRequest) -> frozenset[str]:
    """The addresses EG's comm-port requests may come from: its response address's host (each
    address it resolves to) and any --comm-peer."""
    found: set[str] = set()
    for host in (request.response_address[0], *request.comm_peers):
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError as exc:
            raise LaunchError(f"cannot resolve {host!r}, where EG's requests come from: "
                              f"{exc}") from None
        found.update(_plain_address(str(info[4][0])) for info in infos)
    return frozenset(found)


def _plain_address(text: str) -> str:
    """An address as one spelling: IPv4-mapped IPv6 addresses as IPv4."""
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _read_request(server: socket.socket, gateway: frozenset[str]) -> dict | None:
    """One JSON request from the next comm-port client; None when it is not usable or does not
    come from the gateway."""
    try:
        conn, peer = server.accept()
    except OSError:
        return None
    if _plain_address(peer[0]) not in gateway:
        _refused(f"a request from {peer[0]}, which is not the gateway "
                 f"({', '.join(sorted(gateway))}); add --comm-peer {peer[0]} if it is")
        conn.close()
        return None
    data = b""
    deadline = time.monotonic() + REQUEST_TIMEOUT  # for the whole request, not per recv
    with conn:
        try:
            while len(data) <= MAX_REQUEST_BYTES:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                conn.settimeout(remaining)
                chunk = conn.recv(1024)
                if not chunk:
                    break
                data += chunk
                try:  # EG closes after a signal request but may keep a shutdown open
                    return _as_request(json.loads(data))
                except ValueError:
                    continue
        except OSError:
            return None
    try:
        return _as_request(json.loads(data))
    except ValueError:
        return None


def _as_request(value: object) -> dict | None:
    return value if isinstance(value, dict) else None


def _wait_for_exit(pidfd: int, seconds: float) -> bool:
    with selectors.DefaultSelector() as waiter:
        waiter.register(pidfd, selectors.EVENT_READ)
        return bool(waiter.select(seconds))


def end_kernel(pidfd: int) -> None:
    """SIGTERM the kernel, then SIGKILL it if it has not ended within the grace period."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            signal.pidfd_send_signal(pidfd, signum)
        except ProcessLookupError:
            return
        if _wait_for_exit(pidfd, SHUTDOWN_GRACE):
            return


def _refused(what: str) -> None:
    print(f"sandbox-kernel eg-launch: comm port: refused {what}", file=sys.stderr, flush=True)


def serve_comm_port(server: socket.socket, pidfd: int, gateway: frozenset[str]) -> None:
    """Answer the gateway's requests until the kernel ends or EG asks for shutdown.

    {"signum": n} signals the kernel, for the signals EG sends (0 only checks that it lives);
    {"shutdown": 1} ends it. Requests from other addresses, and other signals, are refused.
    """
    server.setblocking(False)
    with selectors.DefaultSelector() as events:
        events.register(server, selectors.EVENT_READ)
        events.register(pidfd, selectors.EVENT_READ)
        while True:
            for key, _ in events.select():
                if key.fd == pidfd:
                    return  # the kernel ended: nothing left to signal
                request = _read_request(server, gateway)
                if request is None:
                    continue
                signum = request.get("signum")
                if type(signum) is int and signum not in EG_SIGNALS:  # not bool, not str
                    _refused(f"signal {signum}: the comm port obeys only EG's signals "
                             f"{sorted(EG_SIGNALS)} and shutdown")
                elif type(signum) is int and signum > 0:
                    try:
                        signal.pidfd_send_signal(pidfd, signum)
                    except ProcessLookupError:
                        return
                if request.get("shutdown"):
                    end_kernel(pidfd)
                    return


def _listener_main(server: socket.socket, kernel_pid: int, workdir: str,
                   gateway: frozenset[str]) -> None:
    """Body of the forked listener: out of the kernel's process group, holding only its socket."""
    os.setsid()  # EG may signal the kernel's process group; that must not end the listener
    try:
        pidfd = os.pidfd_open(kernel_pid)
        if os.getppid() != kernel_pid:  # the kernel ended before we could watch it
            return
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        keep = sorted((0, 1, 2, server.fileno(), pidfd))
        for low, high in zip(keep, [*keep[1:], 65536], strict=True):
            os.closerange(low + 1, high)
        serve_comm_port(server, pidfd, gateway)
    except OSError as exc:
        print(f"sandbox-kernel eg-launch: comm-port listener: {exc}", file=sys.stderr)
    finally:
        server.close()  # refuse EG's polls first: the kernel is gone
        shutil.rmtree(workdir, ignore_errors=True)


def start_listener(server: socket.socket, workdir: str, gateway: frozenset[str]) -> int:
    """Fork the comm-port listener; it watches this process, the future kernel."""
    kernel_pid = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        try:
            _listener_main(server, kernel_pid, workdir, gateway)
        finally:
            os._exit(0)
    server.close()
    return child


def kernel_environment(policy_argv: list[str], environ: dict[str, str] | os._Environ[str]
                       ) -> dict[str, str]:
    """The environment the kernel is exec'd with: none of EG's variables, keys or tokens.

    The kernel's own start-up re-executes itself with its allowlisted environment anyway; this
    keeps EG's variables (LD_PRELOAD, credentials) out of even that first exec.
    """
    passed = list(PASSED_THROUGH)
    for index, arg in enumerate(policy_argv):
        name, sep, value = arg.partition("=")
        if name == f"{POLICY_PREFIX}pass_env" and (sep or index + 1 < len(policy_argv)):
            passed.append(value if sep else policy_argv[index + 1])
    return {"PATH": SAFE_PATH, **{name: environ[name] for name in passed if name in environ}}


def launch(request: LaunchRequest) -> None:
    """Report the kernel to EG, fork the listener, and become the sandboxed kernel."""
    # The kernel's secrets come from this launcher's environment (the pod's): sealed for its
    # reaper, which the kernel forks before its re-exec (confine/vault.py).
    env = dict(os.environ)
    try:
        placeholders, sealed = secrets.seal_for(from_kernel_argv(list(request.policy_argv)),
                                                env, request.kernel_id)
    except secrets.SecretError as exc:
        raise LaunchError(str(exc)) from None
    low, high = request.port_range
    workdir = tempfile.mkdtemp(prefix="sandbox-kernel-eg-")
    try:
        gateway = gateway_addresses(request)
        chosen = [bind_in_range(request.ip, low, high) for _ in range(PORT_COUNT)]
        comm = bind_in_range(request.ip, low, high)
        comm.listen(8)
        ports = [sock.getsockname()[1] for sock in chosen]
        for sock in chosen:  # held until now so that the five ports differ
            sock.close()
        connection_file = write_connection_file(workdir, request, ports)
        info = json.loads(Path(connection_file).read_text())
        info.update(pid=os.getpid(), pgid=os.getpgid(0), kernel_id=request.kernel_id,
                    comm_port=comm.getsockname()[1])
        send_payload(request.response_address, encrypt_payload(info, request.public_key))
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    start_listener(comm, workdir, gateway)
    argv = [sys.executable, "-I", "-m", "sandbox_kernel", "-f", connection_file,
            *request.policy_argv, *placeholders]
    kernel_env = kernel_environment(request.policy_argv, env)
    if sealed is not None:
        os.set_inheritable(sealed, True)
        kernel_env[VAULT_VAR] = str(sealed)
    os.execve(sys.executable, argv, kernel_env)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `sandbox-kernel eg-launch`."""
    try:
        request = parse_arguments(sys.argv[1:] if argv is None else argv, os.environ)
    except LaunchError as exc:
        print(f"sandbox-kernel eg-launch: {exc}", file=sys.stderr)
        return USAGE_ERROR
    try:
        launch(request)
    except LaunchError as exc:
        print(f"sandbox-kernel eg-launch: {exc}", file=sys.stderr)
        return LAUNCH_FAILED
    raise AssertionError("unreachable: execve returned")
