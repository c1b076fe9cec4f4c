"""How the hosting layer writes its log: one JSON object a line, on `sandbox_kernel.hosting`.

The service sends these lines to stderr as they are (serve.py); the MCP server's log takes
them beside its own. Every line starts with its time, ISO 8601 in UTC to the millisecond.
"""

from __future__ import annotations

import datetime
import json
import logging

log = logging.getLogger("sandbox_kernel.hosting")
# What json.dumps(default=str, separators=...) builds anew on every call (a line per request).
_ENCODER = json.JSONEncoder(default=str, separators=(",", ":"))


def json_line(**fields: object) -> str:
    """A compact JSON log line: {"time": "2025-01-31T12:00:00.000Z", **fields}."""
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = now.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return _ENCODER.encode({"time": stamp, **fields})


def http_url(host: str, port: int) -> str:
    """The URL a server listening on host:port answers at (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
