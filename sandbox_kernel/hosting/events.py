"""How the hosting layer writes its log: one JSON object a line, on `sandbox_kernel.hosting`.

The service sends these lines to stderr as they are (serve.py); the MCP server's log takes
them beside its own.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("sandbox_kernel.hosting")


def json_line(**fields: object) -> str:
    """A compact JSON log line."""
    return json.dumps(fields, default=str, separators=(",", ":"))
