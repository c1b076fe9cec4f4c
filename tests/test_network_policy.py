"""The network settings everywhere they are set (#21): flags, the --allow-network alias,
`check`, and CurveZMQ keys for the kernel's channels when the launcher provisions them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import zmq
from jupyter_client.manager import KernelManager
from traitlets import TraitError

from sandbox_kernel.install import install
from sandbox_kernel.policy import SandboxPolicy


def test_allow_network_is_network_on_and_network_decides():
    assert SandboxPolicy(allow_network=True).network == "on"
    assert SandboxPolicy(network="hosts").allow_network is True
    assert SandboxPolicy(network="off").allow_network is False
    assert SandboxPolicy(allow_network=True, network="hosts").network == "hosts"
    argv = SandboxPolicy(network="hosts", allow_hosts=["idx.example.org", "*.dl.example.org:443"],
                         allow_addresses=["10.0.0.5:5432"],
                         upstream_proxy="http://proxy:3128").to_argv()
    assert "--SandboxPolicy.network=hosts" in argv
    assert "--SandboxPolicy.allow_hosts=*.dl.example.org:443" in argv


@pytest.mark.parametrize(("values", "message"), [
    ({"allow_hosts": ["exa mple.com"]}, "--allow-host: 'exa mple.com' is not a host name"),
    ({"allow_hosts": ["example.com:99999"]}, "the port must be a number from 1 to 65535"),
    ({"allow_addresses": ["localhost"]}, "--allow-address: 'localhost' is not an address"),
    ({"upstream_proxy": "socks5://h:1"}, "--upstream-proxy: upstream proxy 'socks5://h:1': "
                                         "expected http://HOST:PORT"),
    ({"network": "some"}, "The 'network' trait of a SandboxPolicy instance expected any of"),
])
def test_bad_settings_are_refused_naming_the_flag(values, message):
    with pytest.raises(TraitError, match=message.replace("*", r"\*").replace("(", r"\(")):
        SandboxPolicy(**values)


def _check(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", "check", *flags],
                          capture_output=True, text=True, timeout=60)


def test_check_reports_the_namespace_and_what_the_network_lets_through():
    done = _check("--network", "hosts", "--allow-host", "idx.example.org", "--allow-address",
                  "10.1.2.3")
    assert "  network namespace per kernel: available (root)" in done.stdout
    assert ("  network: hosts: only idx.example.org through the egress proxy; private addresses "
            "granted: 10.1.2.3") in done.stdout
    report = json.loads(_check("--json", "--allow-network").stdout)
    assert report["network"] == {"mode": "on", "namespace": {"available": True,
                                                             "owner": "root"},
                                 "allow_addresses": [], "upstream_proxy": False}


def test_curve_keys_from_the_launcher_encrypt_the_channels(tmp_path):
    """jupyter_client 8.10 provisions CurveZMQ keys for a kernelspec that says it supports them;
    a fork-served kernel gets keys of its own; a peer without them hears nothing."""
    install(SandboxPolicy(), name="sandbox-curve", user=True)
    managers = [KernelManager(kernel_name="sandbox-curve", transport_encryption="required")
                for _ in range(2)]
    clients = []
    try:
        for km in managers:
            km.start_kernel()
            kc = km.client()
            kc.start_channels()
            kc.wait_for_ready(timeout=60)
            clients.append(kc)
        keys = [km.curve_publickey for km in managers]
        assert all(keys) and keys[0] != keys[1]
        reply = clients[0].execute_interactive("x = 6 * 7", timeout=30)
        assert reply["content"]["status"] == "ok"
        info = managers[0].get_connection_info()
        context = zmq.Context()
        eavesdropper = context.socket(zmq.SUB)
        eavesdropper.setsockopt(zmq.SUBSCRIBE, b"")
        eavesdropper.connect(f"tcp://127.0.0.1:{info['iopub_port']}")
        clients[0].execute_interactive("print('secret output')", timeout=30)
        assert eavesdropper.poll(2000) == 0  # no handshake without the server's key
        eavesdropper.close(0)
        context.term()
    finally:
        for kc in clients:
            kc.stop_channels()
        for km in managers:
            km.shutdown_kernel(now=True)


def test_without_root_the_namespace_is_owned_by_a_user_namespace():
    """The unprivileged path of netns.py, in a child that drops root first: its own uid kept,
    loopback up, the egress listener made, every capability dropped afterwards."""
    import ctypes
    import os

    from sandbox_kernel.confine import netns

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - reports through the pipe
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            # As a process started by that user is: dumpable (a uid change made it not, and
            # /proc/self/uid_map would then belong to root).
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
            layer = netns.enter()
            netns.loopback_up()
            listener = netns.egress_listener(3128)
            netns.drop_capabilities()
            status = dict(line.split(":\t", 1) for line in
                          open("/proc/self/status").read().splitlines() if ":\t" in line)
            report = {"owner": layer["owner"], "uid": os.getuid(),
                      "uid_map": open("/proc/self/uid_map").read().split(),
                      "listening": listener.getsockname(),
                      "cap_eff": status["CapEff"].strip(), "cap_prm": status["CapPrm"].strip(),
                      "moved": layer["namespace"] != layer["launcher"]}
        except OSError as exc:
            report = {"error": str(exc)}
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        report = json.loads(pipe.read())
    os.waitpid(pid, 0)
    if "error" in report:
        pytest.skip(f"this host has no unprivileged user namespaces: {report['error']}")
    assert report == {"owner": "user namespace", "uid": 65534,
                      "uid_map": ["65534", "65534", "1"], "listening": ["127.0.0.1", 3128],
                      "cap_eff": "0000000000000000", "cap_prm": "0000000000000000",
                      "moved": True}
