"""gin's side of dify-sandbox, reproduced as bytes: its JSON and its request binding.

Go's JSON encoding (compact, HTML characters escaped, `application/json; charset=utf-8`) and
gin's binding rules (an exact `Content-Type: application/json` makes a bad body a 400, any other
type a 200 with the same -400 envelope), with its validation messages. Written by hand: no
library binds a request as gin does, and the platform reads these answers byte for byte.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import Response


class GoJSON(Response):
    """JSON as gin's c.JSON writes it."""

    media_type = "application/json; charset=utf-8"

    def render(self, content: Any) -> bytes:
        """Encode as gin does: compact, UTF-8, with <, >, & and U+2028/9 escaped."""
        text = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
        for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                             ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
            text = text.replace(char, escape)
        return text.encode("utf-8", "replace")


def envelope(code: int, message: str, data: Any = None) -> dict[str, Any]:
    """dify-sandbox's answer envelope: {code, message, data}."""
    return {"code": code, "message": message, "data": data}


def error_answer(status: int, code: int, message: str) -> GoJSON:
    """An error in dify-sandbox's envelope, with the HTTP status it uses."""
    return GoJSON(envelope(code, message), status_code=status)


def success(data: Any) -> GoJSON:
    """A success in dify-sandbox's envelope (code 0)."""
    return GoJSON(envelope(0, "success", data))


class BindError(Exception):
    """The request could not be bound; str() is gin's message."""


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads has joined every valid pair
_FIELD_TYPES = {"language": str, "code": str, "preload": str, "enable_network": bool}
_GO_TYPES = {str: "string", bool: "bool"}
_JSON_KINDS = {str: "string", bool: "bool", int: "number", float: "number", list: "array",
               dict: "object"}


def _go_syntax_error(exc: json.JSONDecodeError) -> str:
    if exc.pos >= len(exc.doc.rstrip()):
        return "unexpected EOF"
    char = exc.doc[exc.pos]
    context = {"Expecting ':' delimiter": "after object key",
               "Expecting ',' delimiter": "after object key:value pair",
               "Expecting property name enclosed in double quotes": "looking for beginning of "
               "object key string"}.get(exc.msg, "looking for beginning of value")
    if exc.msg == "Extra data":
        context = "after top-level value"
    return f"invalid character {char!r} {context}"


def _from_json(body: bytes, fields: tuple[str, ...]) -> dict[str, Any]:
    text = body.decode("utf-8", "replace")  # Go puts U+FFFD for invalid UTF-8, too
    if not text.strip():
        raise BindError("EOF")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BindError(_go_syntax_error(exc)) from None
    except RecursionError:  # Go's decoder stops at 10000 levels; Python's stack sooner
        raise BindError("exceeded max depth") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise BindError(f"invalid JSON: {exc}") from None
    if not isinstance(document, dict):
        kind = "null" if document is None else _JSON_KINDS.get(type(document), "value")
        if document is None:
            return {}
        raise BindError(f"json: cannot unmarshal {kind} into Go value of type struct")
    values: dict[str, Any] = {}
    for name in fields:
        # encoding/json matches keys case-insensitively, preferring an exact match.
        keys = [key for key in document if key.lower() == name]
        if not keys:
            continue
        value = document[name] if name in document else document[keys[-1]]
        if value is None:
            continue
        expected = _FIELD_TYPES[name]
        if type(value) is not expected:
            kind = _JSON_KINDS.get(type(value), "value")
            raise BindError(f"json: cannot unmarshal {kind} into Go struct field .{name} of "
                            f"type {_GO_TYPES[expected]}")
        if isinstance(value, str):  # Go decodes a lone "\ud800" escape as U+FFFD
            value = _LONE_SURROGATE.sub("\ufffd", value)
        values[name] = value
    return values


def _from_form(pairs: dict[str, list[str]], fields: tuple[str, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in fields:
        if name not in pairs:
            continue
        text = pairs[name][0]
        if _FIELD_TYPES[name] is bool:
            lowered = text.lower()
            if lowered in ("1", "t", "true"):
                values[name] = True
            elif lowered in ("0", "f", "false", ""):
                values[name] = False
            else:
                raise BindError(f'strconv.ParseBool: parsing "{text}": invalid syntax')
        else:
            values[name] = text
    return values


def _validate(values: dict[str, Any], required: tuple[str, ...]) -> None:
    problems = [f"Key: '{name.capitalize()}' Error:Field validation for '{name.capitalize()}' "
                "failed on the 'required' tag" for name in required if not values.get(name)]
    if problems:
        raise BindError("\n".join(problems))


async def bind(request: Request, fields: tuple[str, ...], required: tuple[str, ...]
               ) -> tuple[dict[str, Any] | None, GoJSON | None]:
    """The request's fields as gin binds them, or the answer gin gives when it cannot."""
    content_type = request.headers.get("content-type", "")
    mime = content_type.split(";")[0].strip().lower()
    status = 400 if content_type == "application/json" else 200  # BindJSON vs ShouldBind
    try:
        if request.method == "GET":
            values = _from_form(parse_qs(request.url.query, keep_blank_values=True), fields)
        elif mime == "application/json":
            values = _from_json(await request.body(), fields)
        elif mime == "application/x-www-form-urlencoded":
            query = parse_qs(request.url.query, keep_blank_values=True)
            body = parse_qs((await request.body()).decode("utf-8", "replace"),
                            keep_blank_values=True)
            values = _from_form({**query, **body}, fields)
        else:
            values = _from_form(parse_qs(request.url.query, keep_blank_values=True), fields)
        _validate(values, required)
    except BindError as exc:
        answer = error_answer(status, -400, str(exc))
        if status == 400:
            # gin's BindJSON writes the 400 status line before c.JSON sets its header, so Go's
            # net/http sniffs the body instead: the envelope goes out as text/plain.
            answer.headers["content-type"] = "text/plain; charset=utf-8"
        return None, answer
    return values, None
