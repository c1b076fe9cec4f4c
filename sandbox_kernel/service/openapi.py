"""What /openapi.json says beyond what FastAPI infers from the routes' signatures.

The dify-sandbox routes read their body the way gin binds it (service/dify/gin.py), so FastAPI
sees no body model: their body, envelope and X-Api-Key scheme are written here. So are the
upload's raw body and the event names of the native API's server-sent events.
"""

from __future__ import annotations

from typing import Any

DIFY_KEY_SCHEME = "DifyApiKey"
DIFY_SECURITY: list[dict[str, list[str]]] = [{DIFY_KEY_SCHEME: []}]
SECURITY_SCHEMES = {DIFY_KEY_SCHEME: {
    "type": "apiKey", "in": "header", "name": "X-Api-Key",
    "description": "dify-sandbox's API_KEY (--api-key): the key Dify sends as "
                   "CODE_EXECUTION_API_KEY."}}

_ENVELOPE_DATA = {
    "type": ["object", "null"],
    "properties": {"stdout": {"type": "string"}, "stderr": {"type": "string"},
                   "error": {"type": "string", "description": "empty, or why the run failed "
                             "(\"process exited with code 255\" and the traceback)"},
                   "exit_code": {"type": "integer"}}}
ENVELOPE: dict[str, Any] = {
    "type": "object", "required": ["code", "message", "data"],
    "properties": {
        "code": {"type": "integer", "description": "0: success; -400: the request was refused "
                 "(e.g. nodejs without --nodejs-upstream, network disabled); -500: the run "
                 "could not be made; -503: too many requests."},
        "message": {"type": "string"},
        "data": _ENVELOPE_DATA}}
RUN_BODY = {
    "type": "object", "required": ["language", "code"],
    "properties": {
        "language": {"type": "string", "example": "python3", "description": "python3; "
                     "nodejs is forwarded to --nodejs-upstream (or refused with code -400); "
                     "anything else is a 400."},
        "code": {"type": "string", "description": "The program; Dify sends its runner around "
                 "the node's code."},
        "preload": {"type": "string", "description": "Accepted and ignored."},
        "enable_network": {"type": "boolean", "default": False}}}


def _answers(data: dict[str, Any] | None = None) -> dict[Any, Any]:
    envelope = ENVELOPE if data is None else {**ENVELOPE, "properties": {
        **ENVELOPE["properties"], "data": data}}
    return {
        200: {"description": "The envelope; `code` says whether it worked.",
              "content": {"application/json": {"schema": envelope}}},
        400: {"description": "A body gin would not bind, or a language neither service runs",
              "content": {"application/json": {"schema": ENVELOPE}}},
        401: {"description": "Missing or wrong X-Api-Key (empty body)"},
        503: {"description": "Too many requests in flight (code -503)",
              "content": {"application/json": {"schema": ENVELOPE}}}}


RUN_DOC: dict[str, Any] = {
    "openapi_extra": {"security": DIFY_SECURITY, "requestBody": {
        "required": True, "content": {
            "application/json": {"schema": RUN_BODY},
            "application/x-www-form-urlencoded": {"schema": RUN_BODY}}}},
    "responses": _answers()}

_DEPENDENCIES = {"type": "object", "properties": {"dependencies": {
    "type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "version": {"type": "string"}}}}}}
DEPENDENCIES_DOC: dict[str, Any] = {
    "openapi_extra": {"security": DIFY_SECURITY, "parameters": [{
        "name": "language", "in": "query", "required": True,
        "schema": {"type": "string", "example": "python3"}}]},
    "responses": _answers(_DEPENDENCIES)}

UPLOAD_BODY: dict[str, Any] = {"requestBody": {"required": True, "description": "The file's "
                                              "bytes, at most --max-file.", "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}

EVENTS = ("With `Accept: text/event-stream`, server-sent events as they happen: `stdout` and "
          "`stderr` (data: the text, a JSON string), `display` (data: the MIME bundle), then "
          "`result` (data: {text, result}) or `error` (data: {name, value, traceback}), and "
          "last `done` (data: the whole execution, as the JSON answer). Comments keep the "
          "connection alive every 15 s.")
EVENT_STREAM = {"description": EVENTS, "content": {"text/event-stream": {
    "schema": {"type": "string"},
    "example": 'event: stdout\ndata: "42\\n"\n\nevent: done\ndata: {"stdout": "42\\n"}\n\n'}}}


def complete(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's schema with the security schemes it cannot infer."""
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {}).update(SECURITY_SCHEMES)
    return schema
