"""API keys: dify-sandbox's one X-Api-Key, and the native API's bearer keys from a file."""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path


class KeyFileError(ValueError):
    """The keys file cannot be used; the message says which entry and why."""


@dataclass(frozen=True)
class ApiKey:
    """One bearer key: its id (logged, never the secret) and its session limit (None: none)."""

    id: str
    secret: str
    max_sessions: int | None = None


def same(given: str | None, expected: str) -> bool:
    """Compare secrets in constant time."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def load_keys(path: str) -> list[ApiKey]:
    """The keys of a JSON file {"keys": [{"id", "key", "max_sessions"?}]}."""
    try:
        document = json.loads(Path(path).read_text())
    except OSError as exc:
        raise KeyFileError(f"cannot read the API keys file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise KeyFileError(f"the API keys file {path} is not JSON: {exc}") from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise KeyFileError(f'{path}: expected {{"keys": [{{"id": ..., "key": ...}}, ...]}}')
    keys = [_entry(path, number, entry) for number, entry in enumerate(entries)]
    ids = [key.id for key in keys]
    if len(set(ids)) != len(ids):
        raise KeyFileError(f"{path}: key ids must be unique")
    if len({key.secret for key in keys}) != len(keys):
        raise KeyFileError(f"{path}: two entries share one key")
    return keys


def _entry(path: str, number: int, entry: object) -> ApiKey:
    where = f"{path}: keys[{number}]"
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where} must be an object")
    key_id, secret, limit = entry.get("id"), entry.get("key"), entry.get("max_sessions")
    if not isinstance(key_id, str) or not key_id:
        raise KeyFileError(f"{where}: id must be a non-empty string")
    if not isinstance(secret, str) or len(secret) < 16:
        raise KeyFileError(f"{where}: key must be a string of at least 16 characters")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise KeyFileError(f"{where}: max_sessions must be a non-negative integer")
    return ApiKey(key_id, secret, limit)


class BearerKeys:
    """Finds the key an Authorization: Bearer header names."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    def find(self, authorization: str | None) -> ApiKey | None:
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        token = token.strip()
        found = None
        for key in self.keys:  # look at every key, so the time does not tell which one matched
            if same(token, key.secret):
                found = key
        return found
