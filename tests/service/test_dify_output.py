"""A Dify node that prints more than the kernel's --max-output still gets its result: the
runner's framed result never shares the logs' cap; the logs before it are cut, marked."""

from __future__ import annotations

import pytest

from .helpers import DIFY_KEY, RUN, Server, http
from .platform_client import JINJA2_RUNNER, RUNNER, PlatformClient, _encoded

LOUD = ("def main(n: int) -> dict:\n"
        "    for _ in range(n):\n"
        "        print('x' * 999)\n"
        "    return {'printed': n * 1000, 'text': 'é' * 3}\n")


@pytest.fixture(scope="module")
def platform(server):
    return PlatformClient(server.url)


def test_a_node_printing_3_mb_gets_its_result(platform):
    assert platform.execute(LOUD, {"n": 3000}) == {"printed": 3_000_000, "text": "ééé"}


def test_the_logs_are_cut_before_the_result_and_say_so(server):
    runner = RUNNER.format(code=LOUD, inputs=_encoded({"n": 3000}))
    data = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json={
        "language": "python3", "code": runner, "enable_network": True}).json()["data"]
    logs, framed = data["stdout"].split("<<RESULT>>", 1)
    assert logs.startswith("x" * 999 + "\n")
    assert len(logs.encode()) < 1_100_000  # the kernel's 1 MiB, and its marker
    assert logs.endswith("more bytes were dropped (--max-output raises the limit)]\n")
    assert logs.rsplit("\n[", 1)[1].startswith("sandbox-kernel: output limit of 1,048,576 bytes")
    assert "more bytes were dropped" in data["stderr"]  # where the kernel says it, too
    assert framed.endswith("<<RESULT>>\n") and '"printed": 3000000' in framed
    assert data["error"] == "" and data["exit_code"] == 0


def test_a_template_rendering_2_mb_comes_back_whole(platform):
    rendered = platform.render("{{ word * n }}", {"word": "ab", "n": 1_000_000})
    assert rendered == "ab" * 1_000_000


def test_an_error_in_a_runner_still_points_at_the_users_line(platform):
    with pytest.raises(Exception) as raised:
        platform.execute("def main() -> dict:\n    return {'x': 1 / 0}\n", {})
    assert "ZeroDivisionError: division by zero" in str(raised.value)
    assert "line 2, in main" in str(raised.value)


def test_code_that_is_not_a_runner_runs_as_sent(server):
    data = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json={
        "language": "python3", "code": "result = 1\nprint(result)\n"}).json()["data"]
    assert data["stdout"] == "1\n"


def test_jinja_runner_shape_is_recognised():
    assert "print(result)" in JINJA2_RUNNER and "print(result)" in RUNNER


@pytest.fixture(scope="module")
def small_results(tmp_path_factory):
    """A service whose results may hold 2 KiB."""
    srv = Server(tmp_path_factory.mktemp("small-results"), "--max-result", "2K",
                 "--pool-size", "0", env={"ENABLE_NETWORK": "false"})
    yield srv
    srv.stop()


def test_a_result_past_the_limit_says_so_in_the_nodes_terms(small_results):
    code = "def main() -> dict:\n    return {'x': 'a' * 5000}\n"
    runner = RUNNER.format(code=code, inputs=_encoded({}))
    data = http.post(small_results.url + RUN, headers={"X-Api-Key": DIFY_KEY}, json={
        "language": "python3", "code": runner}).json()["data"]
    said = ("InvalidResult: the node's result is 5,054 bytes (as the runner frames it, JSON in "
            "<<RESULT>>), more than this sandbox's limit of 2,048 bytes for a result: return "
            "less from main() (large data belongs in a file or a store, not in the node's "
            "output), or have the sandbox's operator raise the limit (sandbox-kernel serve "
            "--max-result)\n")
    assert data == {"stdout": "", "stderr": said, "error": f"process exited with code 255\n{said}",
                    "exit_code": 255}
