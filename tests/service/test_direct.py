"""The direct ways of the stateless routes (service/direct.py) answer as FastAPI does.

Each request goes to the app twice, in this process, with the run itself canned (what is
compared is the front's answer, not a kernel's): once as served, once with the route's direct
way removed, so FastAPI answers it. Status, headers (but the date) and body must be the same,
for the usual request, which the direct way must answer itself, and for the requests it must
give back, whose answers FastAPI words.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sandbox_kernel.client import Execution
from sandbox_kernel.service import access, direct
from sandbox_kernel.service.app import create_app
from sandbox_kernel.service.config import ServiceConfig
from sandbox_kernel.service.dify import routes as dify_routes
from sandbox_kernel.service.native import execute as native_execute

KEY = "direct-test-key-0123456789"
RUN = "/v1/sandbox/run"
EXECUTE = "/api/v1/execute"
JSON = "application/json"
DIFY_RUNNER = ("def main() -> dict:\n    return {'a': 1}\nimport json\n"  # as Dify's runner
               "output = json.dumps(main())\n"
               "result = f'''<<RESULT>>{output}<<RESULT>>'''\nprint(result)\n")


@pytest.fixture(scope="module")
def app():
    app = create_app(ServiceConfig(api_key=KEY, one_shot_pool_size=0, enable_network=False,
                                   max_timeout=30))

    async def canned(code: str, **kwargs: Any) -> tuple[Execution, bool]:
        framed = kwargs.get("entrypoint") == "_dify_framed_result"
        result = b'{"framed": "<<RESULT>>{\\"a\\": 1}<<RESULT>>"}' if framed else b'{"a": 1}'
        return Execution(logs=[{"name": "stdout", "text": "hi\n"}], result_json=result), False

    app.state.service.runner.run = canned
    return app


def _ask(app, path: str, headers: dict[str, str], body: bytes
         ) -> tuple[int, list, bytes, dict[str, Any]]:
    """(status, headers, body, access log line but its time and duration) of one request sent
    to the ASGI app."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8194),
             "client": ("127.0.0.1", 50000), "state": {},
             "headers": [(b"host", b"127.0.0.1"), (b"content-length", str(len(body)).encode()),
                         *((name.lower().encode(), value.encode())
                           for name, value in headers.items())]}
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)  # the client stays: no disconnect
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    lines: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(access.log, "info", lines.append)
        asyncio.run(app(scope, receive, send))
    start = sent[0]
    line = {name: value for name, value in json.loads(lines[-1]).items()
            if name not in ("time", "duration")}
    return (start["status"], sorted(start["headers"]),
            b"".join(message.get("body", b"") for message in sent[1:]), line)


def _both_ways(app, endpoint, path: str, headers: dict[str, str], body: bytes,
               monkeypatch) -> tuple[tuple[int, list, bytes, dict[str, Any]], str]:
    """The answer served and its log line, what the direct way did ("answered", "gave back",
    "raised"), and that FastAPI's answer and log line are the same."""
    answered = []
    way = direct._DIRECT[endpoint]

    async def watched(request):
        try:
            response = await way(request)
        except Exception:
            answered.append("raised")
            raise
        answered.append("gave back" if response is None else "answered")
        return response

    monkeypatch.setitem(direct._DIRECT, endpoint, watched)
    served = _ask(app, path, headers, body)
    monkeypatch.delitem(direct._DIRECT, endpoint)
    assert _ask(app, path, headers, body) == served
    assert len(answered) == 1
    return served, answered[0]


def test_the_usual_native_run_is_answered_directly_as_fastapi_answers_it(app, monkeypatch):
    (status, _, body, line), directly = _both_ways(
        app, native_execute.execute, EXECUTE, {"Authorization": f"Bearer {KEY}",
                                               "Content-Type": JSON},
        json.dumps({"code": "def main():\n    return {'a': 1}", "inputs": {}}).encode(),
        monkeypatch)
    assert directly == "answered" and status == 200 and json.loads(body)["result"] == {"a": 1}
    assert line["key"] == "default" and line["status"] == 200


def test_the_usual_dify_run_is_answered_directly_as_fastapi_answers_it(app, monkeypatch):
    (status, _, body, _), directly = _both_ways(
        app, dify_routes.run, RUN, {"X-Api-Key": KEY, "Content-Type": JSON},
        json.dumps({"language": "python3", "code": DIFY_RUNNER}).encode(), monkeypatch)
    assert directly == "answered" and status == 200
    assert json.loads(body)["data"]["stdout"] == 'hi\n<<RESULT>>{"a": 1}<<RESULT>>\n'


@pytest.mark.parametrize(("headers", "body", "status"), [
    ({"Authorization": "Bearer wrong-key-0123456789"}, {"code": "1"}, 401),
    ({}, {"code": "1"}, 401),
    ({"Authorization": "Basic " + KEY}, {"code": "1"}, 401),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"}, {"code": "1"}, 422),
    # No type, or another spelling of JSON's: whatever FastAPI's version makes of them.
    ({"Authorization": f"Bearer {KEY}"}, {"code": "1"}, None),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": "application/json; charset=utf-8"},
     {"code": "1"}, None),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": JSON}, b'{"code": ', 422),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": JSON}, b"", 422),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": JSON}, b"[" * 100_000, 400),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": JSON}, {"cod": "1"}, 422),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": JSON}, {"code": "\ud800"}, 422),
    ({"Authorization": f"Bearer {KEY}", "Content-Type": JSON}, b'{"code": "1", "inputs": '
     b'{"x": NaN}}', 422),
    ({"Authorization": "Bearer wrong", "Content-Type": JSON}, b'{"code": ', 422),
])
def test_other_native_requests_are_given_back_to_fastapi(app, monkeypatch, headers, body,
                                                         status):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    (answered, _, _, line), directly = _both_ways(app, native_execute.execute, EXECUTE,
                                                  headers, raw, monkeypatch)
    assert answered == (status or answered) == line["status"] and directly == "gave back"


@pytest.mark.parametrize(("body", "status"), [
    ({"code": "1", "timeout": 1000}, 400),  # past --max-timeout: the endpoint's HTTPException
    ({"code": "1", "network": True}, 403),  # the network is off on this service
])
def test_the_endpoints_errors_are_the_apps_either_way(app, monkeypatch, body, status):
    (answered, _, _, _), directly = _both_ways(
        app, native_execute.execute, EXECUTE, {"Authorization": f"Bearer {KEY}",
                                               "Content-Type": JSON},
        json.dumps(body).encode(), monkeypatch)
    assert answered == status and directly == "raised"  # to the app's handlers
