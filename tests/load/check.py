"""Judge each answer: a normal run must return exactly its expected result, a hostile one an error.

The rules are the Dify code executor's: a non-200 status, a body that is not JSON, `code != 0` or a
non-empty `data.error` fail the node; otherwise the result is the JSON between the `<<RESULT>>`
markers in `data.stdout`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tests.load.workload import RESULT_MARKER, Item

# Verdicts. A normal run is "correct" or one of the failures; a hostile run is "error" or one.
CORRECT, WRONG, MISSING, REJECTED = "correct", "wrong", "missing", "rejected"
ERROR_ENVELOPE, NO_ERROR, ESCAPED, HUNG = "error", "no-error", "escaped", "hung"
LATE = "late"  # an error envelope, but past the deadline


@dataclass
class Answer:
    """What came back for one request (or why nothing did)."""

    status: int | None  # None: no HTTP answer (timeout, connection error)
    body: bytes = b""
    failure: str = ""  # the transport failure, e.g. "ReadTimeout"
    started: float = 0.0  # monotonic
    latency: float = 0.0

    def json(self) -> Any:
        """The body as JSON, or None when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def parse_result(stdout: str) -> tuple[dict | None, str]:
    """The dict between the markers and what was printed before it, as Dify reads them."""
    parts = stdout.split(RESULT_MARKER)
    if len(parts) < 3:
        return None, stdout
    try:
        result = json.loads(parts[1])
    except ValueError:
        return None, parts[0]
    return (result if isinstance(result, dict) else None), parts[0]


@dataclass
class Verdict:
    """The judgement of one answer, with the reason when it is not the good one."""

    verdict: str
    reason: str = ""

    @property
    def good(self) -> bool:
        return self.verdict in (CORRECT, ERROR_ENVELOPE)


def _envelope(answer: Answer) -> tuple[dict | None, str]:
    """The `data` of a 200 `code: 0` envelope, or None with what was wrong."""
    if answer.status is None:
        return None, f"no answer: {answer.failure}"
    if answer.status == 503:
        return None, "503 Too many requests"
    if answer.status != 200:
        return None, f"HTTP {answer.status}: {answer.body[:200]!r}"
    envelope = answer.json()
    if not isinstance(envelope, dict) or not isinstance(envelope.get("data"), (dict, type(None))):
        return None, f"not a JSON envelope: {answer.body[:200]!r}"
    if envelope.get("code") != 0:
        return None, f"code {envelope.get('code')}: {envelope.get('message')!r}"
    return envelope.get("data") or {}, ""


def judge_normal(item: Item, answer: Answer) -> Verdict:
    """correct only for the expected result, the expected prints and no error."""
    data, why = _envelope(answer)
    if data is None:
        kind = MISSING if answer.status is None else REJECTED if answer.status == 503 else WRONG
        return Verdict(kind, why)
    if data.get("error"):
        return Verdict(WRONG, f"error: {str(data['error'])[-300:]}")
    result, printed = parse_result(str(data.get("stdout") or ""))
    if result is None:
        return Verdict(WRONG, f"no result in stdout: {str(data.get('stdout'))[:200]!r}")
    if result != item.expected:
        return Verdict(WRONG, f"result {result!r} != expected {item.expected!r}")
    if printed != item.expected_stdout:
        return Verdict(WRONG, f"stdout {printed!r} != expected {item.expected_stdout!r}")
    return Verdict(CORRECT)


def judge_hostile(item: Item, answer: Answer, deadline: float) -> Verdict:
    """error when the service answered with an error envelope (no result) within deadline."""
    if answer.status is None:
        return Verdict(HUNG if "Timeout" in answer.failure else MISSING, answer.failure)
    envelope = answer.json()
    if answer.status != 200 or not isinstance(envelope, dict):
        return Verdict(REJECTED, f"HTTP {answer.status}: {answer.body[:200]!r}")
    data = envelope.get("data") or {}
    result, _ = parse_result(str(data.get("stdout") or ""))
    if result is not None:
        return Verdict(ESCAPED, f"hostile code returned a result: {result!r}"[:300])
    if envelope.get("code") == 0 and not data.get("error"):
        return Verdict(NO_ERROR, f"code 0, empty error, exit_code {data.get('exit_code')!r}")
    if answer.latency > deadline:
        return Verdict(LATE, f"an error envelope, but after {answer.latency:.1f} s > "
                       f"{deadline:.1f} s: {error_text(answer)[:80]!r}")
    return Verdict(ERROR_ENVELOPE)


def error_text(answer: Answer) -> str:
    """The `data.error` (or message) of an answer, for the report."""
    envelope = answer.json()
    if not isinstance(envelope, dict):
        return answer.failure or f"HTTP {answer.status}"
    data = envelope.get("data") or {}
    text = str(data.get("error") or envelope.get("message") or "")
    return text.strip().splitlines()[-1] if text.strip() else ""
