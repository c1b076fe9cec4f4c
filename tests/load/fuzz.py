"""Scenario 4, bad input: schemathesis (property-based, from the service's own OpenAPI schema)
over every route, plus the dify-sandbox routes from their contract (the service leaves them out
of its schema), plus a battery of inputs a generator rarely makes: oversized bodies, deep JSON,
invalid UTF-8, lying content types, hostile paths and headers.

Goals: no 5xx, no hang, every rejection a 4xx whose body says why."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.load.results import ScenarioResult
from tests.load.service import Service, Settings


@dataclass
class Plan:
    max_examples: int = 150  # per operation and phase
    request_timeout: float = 30.0  # an answer later than this is a hang
    workers: int = 2
    max_body: int = 2**20


FULL = Plan()
QUICK = Plan(max_examples=8)

_ENVELOPE = {"type": "object", "properties": {"code": {"type": "integer"},
                                              "message": {"type": "string"}, "data": {}}}
_JSON = "application/json"


def _answers(*codes: str) -> dict[str, Any]:
    return {code: {"description": code, "content": {_JSON: {"schema": _ENVELOPE}}}
            for code in codes}


# The dify-sandbox routes as its contract (shared/contracts/dify-sandbox.md) states them.
DIFY_SCHEMA: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "dify-sandbox contract", "version": "0.2.15"},
    "components": {"securitySchemes": {"key": {"type": "apiKey", "in": "header",
                                               "name": "X-Api-Key"}}},
    "security": [{"key": []}],
    "paths": {
        "/health": {"get": {"security": [], "responses": {"200": {
            "description": "ok", "content": {_JSON: {"schema": {"type": "string"}}}}}}},
        "/v1/sandbox/run": {"post": {
            "requestBody": {"required": True, "content": {_JSON: {"schema": {
                "type": "object", "required": ["language", "code"], "properties": {
                    "language": {"type": "string", "enum": ["python3", "nodejs"]},
                    "code": {"type": "string", "minLength": 1},
                    "preload": {"type": "string"},
                    "enable_network": {"type": "boolean"}}}}}},
            "responses": _answers("200", "400", "503")}},
        "/v1/sandbox/dependencies": {"get": {
            "parameters": [{"name": "language", "in": "query", "required": True,
                            "schema": {"type": "string"}}],
            "responses": _answers("200", "400")}},
        "/v1/sandbox/dependencies/update": {"post": {
            "requestBody": {"required": True, "content": {_JSON: {"schema": {
                "type": "object", "required": ["language"],
                "properties": {"language": {"type": "string"}}}}}},
            "responses": _answers("200", "400")}},
        "/v1/sandbox/dependencies/refresh": {"get": {
            "parameters": [{"name": "language", "in": "query", "required": True,
                            "schema": {"type": "string"}}],
            "responses": _answers("200", "400")}},
    },
}


@dataclass
class Exchange:
    """One request the fuzz sent and what came back."""

    source: str
    method: str
    url: str
    status: int  # 0: no answer
    seconds: float
    body: str
    request: str = ""

    def clear(self) -> bool:
        """A rejection that says why: a JSON message; on the dify routes its envelope's
        message (gin's own words, e.g. "EOF") or the empty 401 its contract prescribes."""
        dify = "/v1/sandbox/" in self.url
        if self.status == 401 and dify and not self.body:
            return True
        try:
            parsed = json.loads(self.body)
        except ValueError:
            return False
        if not isinstance(parsed, dict):
            return False
        if dify and parsed.get("code", 0) < 0:
            return bool(str(parsed.get("message") or "").strip())
        detail = parsed.get("detail", parsed.get("message"))
        if isinstance(detail, list):
            return all(isinstance(d, dict) and d.get("msg") for d in detail) and bool(detail)
        return isinstance(detail, str) and len(detail.strip()) > 3


def schemathesis(location: str, base_url: str, headers: list[str], plan: Plan,
                 report_dir: Path, seed: int) -> tuple[list[Exchange], str, int]:
    """Run the schemathesis CLI; every exchange from its HAR, its summary, its exit code."""
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", location,
               "--url", base_url, "--checks", "all", "--max-examples", str(plan.max_examples),
               "--request-timeout", str(plan.request_timeout), "--workers", str(plan.workers),
               "--seed", str(seed), "--report", "har,junit", "--report-dir", str(report_dir),
               "--no-color", "--suppress-health-check", "all", "--continue-on-failure"]
    for header in headers:
        command += ["-H", header]
    # In the report dir: schemathesis keeps a .schemathesis cache in its working directory.
    finished = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                              cwd=report_dir)
    har = next(report_dir.glob("har-*.json"), None)
    exchanges = []
    if har is not None:
        for entry in json.loads(har.read_text())["log"]["entries"]:
            request, response = entry["request"], entry["response"]
            exchanges.append(Exchange(
                "schemathesis", request["method"], request["url"], int(response["status"]),
                float(entry["time"]) / 1000, response.get("content", {}).get("text", "") or "",
                (request.get("postData") or {}).get("text", "")[:300]))
    summary = finished.stdout.split("SUMMARY", 1)[-1]
    return exchanges, summary, finished.returncode


def _deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def battery(service: Service, max_body: int, session: str) -> list[tuple[str, str, dict[str,
                                                                                       Any]]]:
    """(label, method path, httpx request arguments) for inputs generators rarely make."""
    key = {"X-Api-Key": service.api_key}
    bearer = {"Authorization": f"Bearer {service.api_key}"}
    js = {"Content-Type": _JSON}
    run_body = {"language": "python3", "code": "print(1)", "preload": "", "enable_network": False}
    cases: list[tuple[str, str, dict[str, Any]]] = []
    posts = [("/v1/sandbox/run", key), ("/v1/sandbox/dependencies/update", key),
             ("/api/v1/execute", bearer), ("/api/v1/sessions", bearer),
             (f"/api/v1/sessions/{session}/execute", bearer)]
    for path, auth in posts:
        cases += [
            ("oversized body (max-body + 1 bytes)", f"POST {path}",
             {"headers": {**auth, **js}, "content": b'{"code": "' + b"x" * max_body + b'"}'}),
            ("deep JSON (100,000 nested arrays)", f"POST {path}",
             {"headers": {**auth, **js}, "content": _deep(100_000)}),
            ("deep JSON object (5,000 nested objects)", f"POST {path}",
             {"headers": {**auth, **js}, "content": b'{"a":' * 5000 + b"1" + b"}" * 5000}),
            ("invalid UTF-8", f"POST {path}",
             {"headers": {**auth, **js}, "content": b'{"language": "python3", "code": "\xff\xfe'
                                                    b'\xc3\x28"}'}),
            ("lone surrogate escape", f"POST {path}",
             {"headers": {**auth, **js}, "content": b'{"language": "python3", "code": "\\ud800"}'}),
            ("NaN and Infinity", f"POST {path}",
             {"headers": {**auth, **js}, "content": b'{"language": "python3", "code": "1", '
                                                    b'"timeout": NaN, "idle_timeout": Infinity}'}),
            ("huge number", f"POST {path}",
             {"headers": {**auth, **js}, "content": b'{"code": "1", "timeout": 1' + b"0" * 5000 +
                                                    b', "idle_timeout": -1e999}'}),
            ("wrong types", f"POST {path}",
             {"headers": {**auth, **js}, "json": {"language": ["python3"], "code": 12,
                                                  "preload": {}, "enable_network": "yes",
                                                  "inputs": [1], "timeout": "5",
                                                  "network": "no", "idle_timeout": []}}),
            ("JSON that is not an object", f"POST {path}",
             {"headers": {**auth, **js}, "content": b'"just a string"'}),
            ("empty body", f"POST {path}", {"headers": {**auth, **js}, "content": b""}),
            ("truncated JSON", f"POST {path}",
             {"headers": {**auth, **js}, "content": b'{"language": "python3", "code": "pri'}),
            ("form content type", f"POST {path}",
             {"headers": auth, "data": {"language": "python3", "code": "print(1)"}}),
            ("text/plain with a JSON body", f"POST {path}",
             {"headers": {**auth, "Content-Type": "text/plain"}, "json": run_body}),
            ("NUL in code", f"POST {path}",
             {"headers": {**auth, **js}, "json": {**run_body, "code": "print(1)\x00"}}),
            ("non-ASCII key header", f"POST {path}",
             {"headers": {"X-Api-Key": "clé".encode(), "Authorization": "Bearer é".encode(),
                          **js}, "json": run_body}),
            ("64 KiB header", f"POST {path}",
             {"headers": {**auth, **js, "X-Padding": "a" * 65536}, "json": run_body}),
        ]
    for path in ("/api/v1/execute", f"/api/v1/sessions/{session}/execute"):
        cases += [
            ("NaN inside inputs", f"POST {path}",
             {"headers": {**bearer, **js}, "content": b'{"code": "def main(x):\\n    return '
                                                       b'{\\"x\\": x}", "inputs": {"x": NaN}}'}),
            ("main() returns NaN", f"POST {path}",
             {"headers": bearer, "json": {"code": "def main():\n    return {'x': float('nan')}",
                                          "inputs": {}}}),
            ("lone surrogate inside inputs", f"POST {path}",
             {"headers": {**bearer, **js}, "content": b'{"code": "def main(x):\\n    return '
                                                       b'{}", "inputs": {"x": "\\udfff"}}'}),
        ]
    # Valid requests whose code makes output JSON cannot carry as UTF-8 (or at all).
    printing = "print(chr(0xd800), float('nan'))"
    cases += [("code prints a lone surrogate", "POST /v1/sandbox/run",
               {"headers": key, "json": {**run_body, "code": printing}}),
              ("code prints a lone surrogate", "POST /api/v1/execute",
               {"headers": bearer, "json": {"code": printing}}),
              ("main() returns a lone surrogate", "POST /api/v1/execute",
               {"headers": bearer, "json": {"code": "def main():\n    return {'s': chr(0xdfff)}",
                                            "inputs": {}}})]
    gets = [("/v1/sandbox/dependencies?language=" + "%ff%fe", key),
            ("/v1/sandbox/dependencies?language=python3&language=nodejs", key),
            ("/v1/sandbox/dependencies/refresh?language=" + "x" * 8000, key),
            (f"/api/v1/sessions/{session}/files/..%2f..%2fetc%2fpasswd", bearer),
            (f"/api/v1/sessions/{session}/files/a%00b", bearer),
            (f"/api/v1/sessions/{session}/files/{'d/' * 600}f", bearer),
            (f"/api/v1/sessions/{session}/files/%ff%fe", bearer),
            (f"/api/v1/sessions/{session}/files/%ed%a0%80", bearer),
            ("/api/v1/sessions/" + "%ff" * 10, bearer),
            ("/api/v1/sessions/" + "s" * 10000, bearer)]
    cases += [("hostile URL", f"GET {path}", {"headers": auth}) for path, auth in gets]
    puts = [f"/api/v1/sessions/{session}/files/fuzz.bin",
            f"/api/v1/sessions/{session}/files/fuzz.bin/inside",  # under a file
            f"/api/v1/sessions/{session}/files/%ed%a0%80"]
    cases += [("file upload over --max-file", f"PUT {puts[0]}",
               {"headers": bearer, "content": b"z" * (max_body + 1)}),
              ("small upload", f"PUT {puts[0]}", {"headers": bearer, "content": b"z" * 10}),
              ("upload below a file", f"PUT {puts[1]}", {"headers": bearer, "content": b"z"}),
              ("upload to an undecodable path", f"PUT {puts[2]}",
               {"headers": bearer, "content": b"z"})]
    for path in ("/v1/sandbox/run", "/api/v1/execute", "/health"):
        cases += [("unsupported method", f"PATCH {path}", {"headers": {**key, **bearer}}),
                  ("unsupported method", f"DELETE {path}", {"headers": {**key, **bearer}})]
    return cases


async def run_battery(service: Service, plan: Plan) -> list[Exchange]:
    """Each input on a connection of its own, so a connection the service closed after one
    answer cannot make the next input look dropped."""
    exchanges = []
    bearer = {"Authorization": f"Bearer {service.api_key}"}

    def fresh() -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=service.url, timeout=plan.request_timeout,
                                 trust_env=False)

    async with fresh() as http:
        made = await http.post("/api/v1/sessions", json={}, headers=bearer)
    session = made.json().get("id", "none") if made.status_code == 201 else "none"
    try:
        for label, target, kwargs in battery(service, plan.max_body, session):
            method, path = target.split(" ", 1)
            started = time.monotonic()
            try:
                async with fresh() as http:
                    response = await http.request(method, path, **kwargs)
                status, body = response.status_code, response.text
            except httpx.TimeoutException:
                status, body = 0, "no answer within the request timeout"
            except httpx.HTTPError as exc:
                status, body = -1, f"connection failed: {type(exc).__name__}: {exc}"
            exchanges.append(Exchange(f"battery: {label}", method, service.url + path,
                                      status, time.monotonic() - started, body[:20000]))
    finally:
        async with fresh() as http:
            await http.delete(f"/api/v1/sessions/{session}", headers=bearer)
    return exchanges


async def run(plan: Plan, quick: bool) -> ScenarioResult:
    result = ScenarioResult("fuzz", quick=quick)
    settings = Settings(max_workers=4, max_requests=32, pool_size=1, worker_timeout=3,
                        extra=["--max-timeout", "10", "--max-sessions", "4",
                               "--session-idle-timeout", "30", "--max-body", str(plan.max_body),
                               "--max-file", str(plan.max_body)])
    result.settings = {"plan": plan.__dict__, "service_flags": settings.flags()}
    with Service(settings) as service, tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        served, dify_schema = root / "served", root / "dify"
        served.mkdir()
        dify_schema.mkdir()
        (root / "dify.json").write_text(json.dumps(DIFY_SCHEMA))
        runs = [
            ("served schema (/openapi.json)", f"{service.url}/openapi.json", served,
             [f"Authorization: Bearer {service.api_key}"]),
            ("dify-sandbox contract", str(root / "dify.json"), dify_schema,
             [f"X-Api-Key: {service.api_key}"]),
        ]
        exchanges: list[Exchange] = []
        for label, location, report_dir, headers in runs:
            found, summary, code = await asyncio.to_thread(
                schemathesis, location, service.url, headers, plan, report_dir, 14)
            exchanges += found
            result.figure(f"schemathesis, {label}", f"{len(found)} requests, exit {code}")
            result.notes.append(f"schemathesis summary, {label}:\n{_short(summary)}")
        exchanges += await run_battery(service, plan)
        alive = httpx.get(f"{service.url}/health", timeout=5, trust_env=False).status_code
        log = service.log_tail(6)
        errors = service.log_errors()
    summarize(result, exchanges, plan, alive)
    result.notes.append(f"service log tail:\n{log}")
    if errors:
        result.notes.append(f"tracebacks in the service log:\n{errors}")
    return result


def _short(summary: str) -> str:
    keep = [line for line in summary.splitlines()
            if re.search(r"ST\d|generated|Operations|Selected|Tested|Errors?|❌|✅|⏭", line)]
    return "\n".join(keep[:30])


def summarize(result: ScenarioResult, exchanges: list[Exchange], plan: Plan, alive: int) -> None:
    statuses = collections.Counter(e.status for e in exchanges)
    result.figure("requests sent", f"{len(exchanges)} "
                  f"({sum(1 for e in exchanges if e.source.startswith('battery'))} from the "
                  "battery)")
    result.figure("status codes", ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    slowest = max(exchanges, key=lambda e: e.seconds, default=None)
    if slowest:
        result.figure("slowest answer", f"{slowest.seconds:.2f} s ({slowest.method} "
                      f"{slowest.url.split('/', 3)[-1][:60]})")
    # A 503 that says why is the contract of /ready (not ready) and of the run routes (too many
    # runs); any other 5xx is a server error.
    said_busy = [e for e in exchanges if e.status == 503
                 and (e.clear() or e.url.split("?")[0].endswith("/ready"))]
    server_errors = [e for e in exchanges if e.status >= 500 and e not in said_busy]
    result.figure("503 answers saying why (/ready not ready, too many runs)",
                  ", ".join(f"{n} x {route}" for route, n in collections.Counter(
                      f"{e.method} /{e.url.split('/', 3)[-1].split('?')[0][:40]}"
                      for e in said_busy).items()) or "none")
    result.goal("zero 5xx", "0 (a 503 saying why is /ready's and the run routes' contract)",
                str(len(server_errors)), not server_errors,
                "\n".join(f"{e.source}: {e.method} {e.url.split('/', 3)[-1][:90]} → "
                          f"{e.status} {e.body[:160]!r} (request {e.request[:120]!r})"
                          for e in server_errors[:12]))
    hangs = [e for e in exchanges if e.status == 0 or e.seconds >= plan.request_timeout]
    result.goal("zero hangs", f"every answer within {plan.request_timeout:g} s, the service "
                "alive after", f"{len(hangs)} hung or dropped; /health {alive} after",
                not hangs and alive == 200,
                "\n".join(f"{e.source}: {e.method} {e.url.split('/', 3)[-1][:90]} → "
                          f"{e.body[:160]}" for e in hangs[:12]))
    rejections = [e for e in exchanges if 400 <= e.status < 500]
    unclear = [e for e in rejections if not e.clear()]
    result.goal("each rejection a clear 4xx", "a 4xx with a JSON message saying why (dify's "
                "401: empty, by contract)",
                f"{len(rejections) - len(unclear)}/{len(rejections)} clear", not unclear,
                "\n".join(f"{e.source}: {e.method} {e.url.split('/', 3)[-1][:80]} → "
                          f"{e.status} {e.body[:120]!r}" for e in unclear[:12]))
    # A connection dropped before any answer (-1) is a rejection the client never saw.
    dropped = [e for e in exchanges if e.status < 0]
    result.goal("no rejection dropped", "the client reads the 4xx (no connection reset "
                "instead)", f"{len(dropped)} dropped without an answer", not dropped,
                "\n".join(f"{e.source}: {e.method} {e.url.split('/', 3)[-1][:80]} → "
                          f"{e.body[:120]}" for e in dropped[:12]))
    battery_rows = [f"{e.source[9:]}: {e.method} {e.url.split('/', 3)[-1][:50]} → {e.status}"
                    for e in exchanges if e.source.startswith("battery")]
    result.series["battery"] = battery_rows
