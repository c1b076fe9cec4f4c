"""The service's network (#21): a network run reaches neither another team's kernel nor the
service itself; a session can ask for an allowlist of its own; dify's enable_network is `on`
through the egress proxy."""

from __future__ import annotations

import psutil

from .helpers import DIFY_KEY, KEY_A, KEY_B, RUN, auth, http

PROBE = """
import errno, socket, requests
ports = {ports!r}
listening = [line.split()[1] for line in open('/proc/net/tcp').read().splitlines()[1:]
             if line.split()[3] == '0A']
direct = sorted({{errno.errorcode.get(socket.socket().connect_ex(('127.0.0.1', port)), 'open')
                  for port in ports}})
answer = requests.get('http://127.0.0.1:{service}/ready', timeout=10)
print(listening, direct, answer.status_code, answer.reason)
"""


def _host_listeners() -> list[int]:
    """Every TCP port listening on the host's loopback: the service's, every kernel's."""
    return sorted({c.laddr.port for c in psutil.net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1"})


def _said(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


def test_team_as_network_run_cannot_reach_team_bs_session_or_the_service(server, session):
    ports = _host_listeners()
    assert server.port in ports and len(ports) >= 6  # the service and at least B's kernel
    code = PROBE.format(ports=ports, service=server.port)
    expected = (f"['0100007F:0C38'] ['ECONNREFUSED'] 403 127.0.0.1, a loopback address the "
                f"sandbox never reaches; grant it with --allow-address 127.0.0.1:{server.port} "
                "(only for a service meant for user code)")
    native = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), timeout=60,
                       json={"code": code, "network": True}).json()
    assert native["error"] is None, native
    assert _said(native["stdout"]) == expected
    dify = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, timeout=60,
                     json={"language": "python3", "code": code, "enable_network": True}).json()
    assert dify["code"] == 0 and dify["data"]["error"] == "", dify
    assert _said(dify["data"]["stdout"]) == expected
    still = http.post(session + "/execute", headers=auth(KEY_B), json={"code": "1 + 1"},
                      timeout=60).json()
    assert still["text"] == "2"


def test_a_session_with_an_allowlist_of_its_own(server):
    url = server.url + "/api/v1/sessions"
    created = http.post(url, headers=auth(KEY_A), timeout=60, json={
        "network": {"mode": "hosts", "allow_hosts": ["localhost", "*.example.org:443"]}})
    assert created.status_code == 201, created.text
    shape = created.json()
    try:
        assert (shape["network"], shape["policy"], shape["allow_hosts"]) == (
            True, "hosts", ["localhost", "*.example.org:443"])
        code = ("import requests\n"
                f"for url in ('http://example.com/', 'http://localhost:{server.port}/ready'):\n"
                "    print(requests.get(url, timeout=10).reason)\n")
        answer = http.post(f"{url}/{shape['id']}/execute", headers=auth(KEY_A), timeout=60,
                           json={"code": code}).json()
        assert answer["stdout"].splitlines() == [
            "example.com:80 is not on the allowlist; allow it with --allow-host example.com "
            "(or example.com:80)",
            f"localhost resolves to 127.0.0.1, a loopback address the sandbox never reaches; "
            f"grant it with --allow-address 127.0.0.1:{server.port} (only for a service meant "
            "for user code)"]
    finally:
        http.delete(f"{url}/{shape['id']}", headers=auth(KEY_A))
    bad = http.post(url, headers=auth(KEY_A), timeout=60,
                    json={"network": {"mode": "hosts", "allow_hosts": ["not a name"]}})
    assert bad.status_code == 422 and "not a host name" in bad.text
