"""The operational face: the OpenAPI schema, metrics, readiness, the access log."""

from __future__ import annotations

import json
import re
import time

from .helpers import DIFY_KEY, KEY_A, RUN, auth, http


def test_openapi_schema_documents_the_native_api(server):
    schema = http.get(server.url + "/openapi.json").json()
    for path in ("/api/v1/execute", "/api/v1/sessions", "/api/v1/sessions/{session_id}/execute",
                 "/api/v1/sessions/{session_id}/files/{path}", "/v1/sandbox/run",
                 "/api/v1/sessions/{session_id}/snapshots", "/api/v1/snapshots",
                 "/api/v1/snapshots/{snapshot_id}", "/api/v1/sessions/{session_id}/pause"):
        assert path in schema["paths"], path
    assert {"ExecutionShape", "SnapshotShape"} <= set(schema["components"]["schemas"])
    assert "snapshot" in schema["components"]["schemas"]["SessionRequest"]["properties"]


def test_the_openapi_schema_is_valid_and_complete(server):
    from openapi_spec_validator import validate

    schema = http.get(server.url + "/openapi.json").json()
    validate(schema)  # raises on any violation of the OpenAPI specification
    run = schema["paths"]["/v1/sandbox/run"]["post"]
    body = run["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["language", "code"]
    assert set(body["properties"]) == {"language", "code", "preload", "enable_network"}
    assert run["security"] == [{"DifyApiKey": []}]
    assert schema["components"]["securitySchemes"]["DifyApiKey"] == {
        "type": "apiKey", "in": "header", "name": "X-Api-Key",
        "description": schema["components"]["securitySchemes"]["DifyApiKey"]["description"]}
    assert set(run["responses"]) >= {"200", "400", "401", "503"}
    upload = schema["paths"]["/api/v1/sessions/{session_id}/files/{path}"]["put"]
    assert upload["requestBody"]["content"]["application/octet-stream"]["schema"] == {
        "type": "string", "format": "binary"}
    for path in ("/api/v1/execute", "/api/v1/sessions/{session_id}/execute"):
        streamed = schema["paths"][path]["post"]["responses"]["200"]
        assert "text/event-stream" in streamed["content"]
        for event in ("`stdout`", "`stderr`", "`display`", "`result`", "`error`", "`done`"):
            assert event in streamed["description"], (path, event)


def test_docs_work_offline(server):
    """/docs loads Swagger UI from the service itself, never from a CDN."""
    page = http.get(server.url + "/docs")
    assert page.status_code == 200
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(asset.startswith("/") for asset in assets), assets
    for asset in assets:
        answer = http.get(server.url + asset)
        assert answer.status_code == 200 and len(answer.content) > 1000, asset
    assert "url: '/openapi.json'" in page.text


def test_metrics_and_readiness(server):
    # What the metrics below count, so this test does not rely on the tests that ran before it.
    http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY},
              json={"language": "python3", "code": "print(1)"})
    http.post(server.url + RUN, headers={"X-Api-Key": "wrong"}, json={})
    text = http.get(server.url + "/metrics").text
    assert 'sandbox_requests_total{route="/v1/sandbox/run",status="200"}' in text
    assert "sandbox_kernels_live" in text and "sandbox_kernels_pooled" in text
    assert 'sandbox_denials_total{reason="bad_key"}' in text
    ready = server.ready()
    assert ready["ready"] is True and set(ready["pool"]) == {"offline", "network"}


def test_log_lines_never_carry_code(server):
    secret = "print('do-not-log-this-123')"
    http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY},
              json={"language": "python3", "code": secret})
    time.sleep(0.2)
    lines = server.log.read_text().splitlines()
    assert "do-not-log-this" not in "\n".join(lines)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    runs = [r for r in records if r.get("route") == RUN and r.get("status") == 200]
    assert runs[-1]["kernel"] and runs[-1]["duration"] > 0 and runs[-1]["key"] is None
    native = [r for r in records if r.get("route", "").startswith("/api/v1")]
    assert {r["key"] for r in native} <= {"team-a", "team-b", None}


def test_a_native_line_names_its_route_with_the_prefix(server):
    """FastAPI 0.165 showed an included router's route without its prefix (`/execute`)."""
    http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), json={"code": "1"})
    time.sleep(0.2)
    records = [json.loads(line) for line in server.log.read_text().splitlines()
               if line.startswith("{")]
    assert [r["route"] for r in records if r.get("method") == "POST"
            and r.get("route", "").endswith("/execute")][-1] == "/api/v1/execute"
    metrics = http.get(server.url + "/metrics").text
    assert 'route="/api/v1/execute"' in metrics and 'route="/execute"' not in metrics


def _sample(text: str, series: str) -> float:
    """A series' value in the exposition text, 0 when it has none yet."""
    return next((float(line[len(series) + 1:]) for line in text.splitlines()
                 if line.startswith(series + " ")), 0.0)


def test_each_executions_usage_is_in_the_metrics(server):
    def count(text: str, name: str) -> float:
        return _sample(text, f'{name}_count{{api="native"}}')

    before = http.get(server.url + "/metrics").text
    answer = http.post(server.url + "/api/v1/execute", headers=auth(KEY_A), json={
        "code": "import time\nend = time.process_time() + 0.3\n"
                "while time.process_time() < end: pass\nprint('x' * 1000)"})
    usage = answer.json()["usage"]
    after = http.get(server.url + "/metrics").text
    for name in ("wall_seconds", "cpu_seconds", "peak_memory_bytes", "output_bytes"):
        metric = f"sandbox_execution_{name}"
        assert count(after, metric) == count(before, metric) + 1, metric
    assert usage["cpu_user_seconds"] + usage["cpu_system_seconds"] >= 0.25
    # the busy loop's CPU landed above 0.1 s, in the buckets from 0.25 s up
    low, high = (f'sandbox_execution_cpu_seconds_bucket{{api="native",le="{le}"}}'
                 for le in ("0.1", "0.5"))
    assert _sample(after, low) == _sample(before, low)
    assert _sample(after, high) == _sample(before, high) + 1
