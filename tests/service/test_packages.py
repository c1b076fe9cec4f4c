"""Packages through the service. `serve --runtime NAME`: kernels on an operator's runtime built
with dify-sandbox's default packages; the dify routes' /dependencies list it as dify-sandbox
lists its requirements file, and Dify's Template (Jinja2) and Python nodes work through Dify's
own runner scripts. A native API session installs wheels from the operator's index."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..packages import LocalIndex, make_wheel, write_simple_index
from .helpers import DIFY_KEY, Server, auth, http
from .platform_client import PlatformClient

requests = pytest.importorskip("requests")  # the [dify] extra; the runtime pins its version
REQUIREMENTS = f"# dify-sandbox's default packages\njinja2>=3.1\nrequests=={requests.__version__}\n"


@pytest.fixture(scope="module")
def dify_runtime(tmp_path_factory):
    """Runtime `dify` from a requirements file, and a server whose kernels run on it."""
    base = tmp_path_factory.mktemp("dify-runtime")
    requirements = base / "python-requirements.txt"
    requirements.write_text(REQUIREMENTS)
    environ = {**os.environ, "SANDBOX_KERNEL_RUNTIMES": str(base / "store")}
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "runtime", "create", "dify",
                           "-r", str(requirements), "--preload", "jinja2", "--user"],
                          env=environ, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = os.environ.get("SANDBOX_KERNEL_RUNTIMES")
    os.environ["SANDBOX_KERNEL_RUNTIMES"] = environ["SANDBOX_KERNEL_RUNTIMES"]
    server = Server(base, "--pool-size", "1", env={"SANDBOX_RUNTIME": "dify"})
    server.requirements = requirements
    yield server
    server.stop()
    subprocess.run([sys.executable, "-m", "sandbox_kernel", "runtime", "remove", "dify",
                    "--force"], env=environ, capture_output=True, check=False)
    if saved is None:
        os.environ.pop("SANDBOX_KERNEL_RUNTIMES")
    else:
        os.environ["SANDBOX_KERNEL_RUNTIMES"] = saved


def test_dependencies_lists_the_runtimes_requirements_as_dify_sandbox_does(dify_runtime):
    listed = http.get(dify_runtime.url + "/v1/sandbox/dependencies?language=python3",
                      headers={"X-Api-Key": DIFY_KEY})
    assert listed.status_code == 200
    assert listed.json() == {"code": 0, "message": "success", "data": {"dependencies": [
        {"name": "jinja2", "version": "3.1"},
        {"name": "requests", "version": requests.__version__}]}}
    updated = http.post(dify_runtime.url + "/v1/sandbox/dependencies/update",
                        headers={"X-Api-Key": DIFY_KEY}, json={"language": "python3"})
    assert updated.content == b'{"code":0,"message":"success","data":{}}'


def test_a_template_node_renders_through_difys_jinja2_runner(dify_runtime):
    client = PlatformClient(dify_runtime.url)  # Dify's Jinja2 runner, run as python3
    rendered = client.render("Hello {{ name }}{% for i in items %} {{ i }}{% endfor %}",
                             {"name": "Wörld", "items": [1, 2]})
    assert rendered == "Hello Wörld 1 2"


def test_a_python_node_imports_requests_from_the_runtime(dify_runtime):
    client = PlatformClient(dify_runtime.url)
    code = ("def main() -> dict:\n    import requests, sys\n"
            "    return {'version': requests.__version__, 'prefix': sys.prefix}\n")
    result = client.execute(code, {})
    assert result["version"] == requests.__version__
    assert result["prefix"].endswith("/store/dify/builds/1")


def test_refresh_rebuilds_the_runtime_from_the_operators_file(dify_runtime, tmp_path):
    """As dify-sandbox installs its python-requirements.txt again on refresh."""
    make_wheel(tmp_path, "refreshpkg", "1.0", {"refreshpkg.py": "VALUE = 'new'\n"})
    with dify_runtime.requirements.open("a") as requirements:
        requirements.write(f"--find-links {tmp_path}\nrefreshpkg==1.0\n")
    refreshed = http.get(dify_runtime.url + "/v1/sandbox/dependencies/refresh?language=python3",
                         headers={"X-Api-Key": DIFY_KEY}, timeout=600)
    assert refreshed.status_code == 200
    listed = refreshed.json()["data"]["dependencies"]
    assert listed[-1] == {"name": "refreshpkg", "version": "1.0"}
    assert [entry["name"] for entry in listed] == ["jinja2", "requests", "refreshpkg"]
    code = ("def main() -> dict:\n    import refreshpkg, sys\n"
            "    return {'value': refreshpkg.VALUE, 'prefix': sys.prefix}\n")
    result = PlatformClient(dify_runtime.url).execute(code, {})
    assert result["value"] == "new" and result["prefix"].endswith("/store/dify/builds/2")


@pytest.fixture(scope="module")
def index_server(tmp_path_factory):
    """A service whose network sessions reach a local package index serving testpkg."""
    root = tmp_path_factory.mktemp("index")
    (root / "dist").mkdir()
    make_wheel(root / "dist", "testpkg", "1.0", {"testpkg/__init__.py": "VALUE = 42\n"})
    write_simple_index(root / "dist", root)
    with LocalIndex(root) as index:
        # The index on the host's loopback: granted, as the proxy never reaches it otherwise.
        where = f"127.0.0.1:{index.server.server_address[1]}"
        server = Server(root, "--enable-network", "--package-index", index.url,
                        "--allow-address", where, "--pool-size", "0",
                        env={"API_KEY": DIFY_KEY})
        yield server
        server.stop()


def test_a_session_installs_a_wheel_for_its_next_execution(index_server):
    sessions = index_server.url + "/api/v1/sessions"
    created = http.post(sessions, headers=auth(DIFY_KEY), json={"network": True})
    assert created.status_code == 201, created.text
    session = f"{sessions}/{created.json()['id']}"
    try:
        installed = http.post(session + "/packages", headers=auth(DIFY_KEY),
                              json={"packages": ["testpkg==1.0"], "timeout": 60})
        assert installed.status_code == 200, installed.text
        assert installed.json()["error"] is None
        assert "Installed into this session: testpkg==1.0" in installed.json()["stdout"]
        used = http.post(session + "/execute", headers=auth(DIFY_KEY),
                         json={"code": "import testpkg\nprint(testpkg.VALUE)"})
        assert used.json()["stdout"] == "42\n"
        refused = http.post(session + "/packages", headers=auth(DIFY_KEY),
                            json={"packages": ["--index-url=http://elsewhere/"]})
        assert refused.status_code == 422
    finally:
        http.delete(session, headers=auth(DIFY_KEY))


def test_a_session_without_network_is_told_which_setting_allows_installs(index_server):
    sessions = index_server.url + "/api/v1/sessions"
    created = http.post(sessions, headers=auth(DIFY_KEY), json={})
    session = f"{sessions}/{created.json()['id']}"
    try:
        installed = http.post(session + "/packages", headers=auth(DIFY_KEY),
                              json={"packages": ["testpkg"]})
        error = installed.json()["error"]
        assert error["name"] == "PackageInstallError"
        assert "the network is off in this sandbox (--network off)" in error["value"]
    finally:
        http.delete(session, headers=auth(DIFY_KEY))
