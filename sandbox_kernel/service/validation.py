"""Input the kernel protocol can carry, and 422 answers that can always be written.

JSON lets a request hold a lone surrogate ("\\ud800") and Python's parser accepts NaN and
Infinity, but neither survives the trip to a kernel (jupyter_client packs UTF-8 JSON without
NaN) nor FastAPI's own 422 answer, which echoes the rejected input: both ended in a 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import Response


def sendable(value: Any) -> Any:
    """value, if a kernel message can carry it; ValueError naming the problem otherwise."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate (such as \\ud800), which is not valid "
                         "Unicode; send UTF-8 text") from None
    except ValueError:
        raise ValueError("holds NaN or Infinity, which JSON does not allow") from None
    return value


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


async def invalid_request(request: Request, exc: Exception) -> Response:
    """FastAPI's 422 `{"detail": [...]}`, as ASCII JSON with non-finite numbers as text."""
    assert isinstance(exc, RequestValidationError)
    detail = _finite(jsonable_encoder(exc.errors()))
    return Response(json.dumps({"detail": detail}, ensure_ascii=True), status_code=422,
                    media_type="application/json")
