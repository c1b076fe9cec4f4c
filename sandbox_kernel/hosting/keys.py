"""API keys: dify-sandbox's one X-Api-Key, and the native API's bearer keys from a file.

No route runs code for an empty key, a key shorter than MIN_KEY_LENGTH, or dify-sandbox's public
default key unless the operator was warned at start-up (`insecure_key_warning`).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from ..secrets import readable_by_others

DIFY_DEFAULT_KEY = "dify-sandbox"  # dify-sandbox's and Dify's default, known to everyone
MIN_KEY_LENGTH = 16
# The placeholder secrets of the keys files this project publishes (examples/mcp/keys.json):
# known to everyone who read them, so a keys file that still holds one is refused, not served.
PUBLISHED_KEYS = frozenset({"replace-with-a-long-random-secret-1",
                            "replace-with-a-long-random-secret-2"})


class KeyFileError(ValueError):
    """The keys file cannot be used; the message says which entry and why."""


@dataclass(frozen=True)
class ApiKey:
    """One bearer key: its id (logged, never the secret) and its session limit (None: none)."""

    id: str
    secret: str
    max_sessions: int | None = None


def same(given: str | None, expected: str | None) -> bool:
    """Compare secrets in constant time; nothing matches an empty or missing key."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def check_dify_key(key: str | None) -> None:
    """Refuse an empty or short --api-key (None, unset, is decided by `dify_key`)."""
    if key is None or key == DIFY_DEFAULT_KEY:
        return
    if not key:
        raise ValueError("API_KEY (--api-key) is empty: an empty X-Api-Key would run code. Set a "
                         f"key of at least {MIN_KEY_LENGTH} characters (e.g. `openssl rand -hex "
                         "16`), or unset it for dify-sandbox's public default (warned).")
    if len(key) < MIN_KEY_LENGTH:
        raise ValueError(f"API_KEY (--api-key) has {len(key)} characters; use at least "
                         f"{MIN_KEY_LENGTH} (e.g. `openssl rand -hex 16`).")


def dify_key(key: str | None, keys_file: str) -> str | None:
    """The X-Api-Key the dify routes accept: the set key; unset, the public default, unless a
    keys file says the operator runs real keys (then the dify routes accept none)."""
    if key is not None:
        return key
    return None if keys_file else DIFY_DEFAULT_KEY


def insecure_key_warning(dify: str | None, keys_file: str, host: str) -> str | None:
    """What start-up must say loudly about the keys, or None when nothing is amiss."""
    if dify is None:
        return ("the dify-sandbox routes (/v1/sandbox/*) are OFF: --api-keys-file is set and "
                "API_KEY is not. Set API_KEY (--api-key) to a key of at least "
                f"{MIN_KEY_LENGTH} characters to turn them on.")
    if dify != DIFY_DEFAULT_KEY:
        return None
    who = ("anyone who can reach this port" if host in ("0.0.0.0", "::", "")
           else f"any local process that can reach {host}")
    native = "" if keys_file else " and the native API's bearer key"
    return (f"the X-Api-Key of /v1/sandbox/*{native} is dify-sandbox's public default "
            f"'{DIFY_DEFAULT_KEY}': {who} can run code. Set API_KEY (--api-key) to a secret of "
            f"at least {MIN_KEY_LENGTH} characters, and the same as Dify's "
            "CODE_EXECUTION_API_KEY.")


def load_keys(path: str) -> list[ApiKey]:
    """The keys of a JSON file {"keys": [{"id", "key", "max_sessions"?}]}, readable by its
    owner only (as --secrets-file: the keys in it run code)."""
    try:
        with open(path, "rb") as file:
            refused = readable_by_others(file.fileno(), f"the API keys file {path}", path)
            text = b"" if refused else file.read()
    except OSError as exc:
        raise KeyFileError(f"cannot read the API keys file {path}: {exc.strerror}") from None
    if refused:
        raise KeyFileError(refused)
    try:
        document = json.loads(text)
    except ValueError as exc:  # not JSON, or not UTF-8
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
    if not isinstance(secret, str) or len(secret) < MIN_KEY_LENGTH:
        raise KeyFileError(f"{where}: key must be a string of at least {MIN_KEY_LENGTH} "
                           "characters")
    if secret in PUBLISHED_KEYS:
        raise KeyFileError(f"{where} ({key_id!r}): the key is the published example's "
                           "placeholder, which anyone can send; replace it with a secret of your "
                           "own (e.g. `openssl rand -hex 32`)")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise KeyFileError(f"{where}: max_sessions must be a non-negative integer")
    return ApiKey(key_id, secret, limit)


class BearerKeys:
    """Finds the key an Authorization: Bearer header names."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    def find(self, authorization: str | None) -> ApiKey | None:
        """The key an Authorization: Bearer header names, or None."""
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
