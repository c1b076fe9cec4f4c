"""Exact, fast JSON for messages and main() results: orjson where it is exact, json elsewhere.

orjson is 5-15x faster than the standard library, but not exact everywhere: it parses integers
beyond 64 bits as floats (``2**70`` arrives as ``1.1805916207174113e+21``) and writes NaN and
Infinity as ``null``. jupyter_client switches to it whenever it is importable, so results were
exact or not depending on what happened to be installed. Here every inexact case is detected
and sent through the standard library instead, so the value is the same either way:

- ``loads``: orjson unless the text has a run of 19 or more digits (the only way to write an
  integer outside orjson's range, or a float orjson and Python might round differently), or
  orjson refuses it; then ``json.loads`` (jupyter_client's semantics). The garbage collector is
  paused while a large message is parsed: building millions of small objects otherwise
  triggers collections that walk all of them, 3-4x the parse itself.
- ``encode_result``: validates and encodes a main() result in one pass (orjson), falling back to
  the standard library's encoder, and a walk that names the offending place, only when orjson
  refused the value or wrote a ``null`` that might stand for NaN or Infinity.
- ``pack_message``: a Jupyter message's parts, byte for byte as jupyter_client packs them.

It imports nothing of Jupyter: a kernel's Session is made to parse exactly in
kernel/peeking.py, and a one-shot builds its messages without one (kernel/messages.py).
"""

from __future__ import annotations

import binascii
import contextlib
import gc
import json
import math
import numbers
import os
import re
import threading
import uuid
from collections.abc import Iterable
from datetime import date, datetime
from enum import Enum
from typing import Any

try:
    import orjson
except ImportError:  # an optional speed-up: without it, the standard library does everything
    orjson = None  # type: ignore[assignment]

_LONG_DIGITS = 19  # orjson's integers stop at 2**64 - 1 (20 digits) and -2**63 (19 digits)
_ONLY_DIGITS = bytes(1 if chr(byte).isdigit() and byte < 128 else 0 for byte in range(256))
_DIGIT_RUN = b"\x01" * _LONG_DIGITS
_SCAN_PIECE = 64 * 1024
# A literal search: the regular-expression engine finds it several times faster than `in`
# (which stumbles over every "l" of the text).
_NULL = re.compile(rb"null")
_GC_PAUSE_FROM = 64 * 1024  # below this a collection during the parse is unlikely and cheap
_ORJSON_REFUSED = (TypeError, ValueError) if orjson is None else (
    TypeError, ValueError, orjson.JSONEncodeError)
# Types orjson would serialise natively that are not JSON: refused like the standard library.
_PASSTHROUGH = 0 if orjson is None else (
    orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS)


class NotJSON(ValueError):
    """A value that is not JSON; the message names the place, e.g. 'result["when"]: datetime'."""


class _CollectorPause:
    """Pause the garbage collector while any thread parses a large message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                gc.enable()


_PAUSE = _CollectorPause()


def _has_long_number(data: bytes | bytearray | memoryview) -> bool:
    """Whether the text holds 19 or more digits in a row (inside strings too: harmless).

    Scanned in 64 KiB pieces (overlapping by a run's length less one): a piece's two copies
    stay in the processor's cache and the allocator's free lists, where one copy of a whole
    megabyte costs fresh pages every time, twice the time.
    """
    view = memoryview(data).cast("B")
    overlap = _LONG_DIGITS - 1
    for start in range(0, max(len(view) - overlap, 1), _SCAN_PIECE):
        if _DIGIT_RUN in view[start:start + _SCAN_PIECE + overlap].tobytes().translate(
                _ONLY_DIGITS):
            return True
    return False


def _std_loads(data: bytes | bytearray | memoryview | str) -> Any:
    if not isinstance(data, str):
        data = bytes(data).decode("utf8", "replace")  # as jupyter_client's json_unpacker
    return json.loads(data)


def loads(data: bytes | bytearray | memoryview | str, keep: bool = False) -> Any:
    """Parse JSON exactly (big integers stay integers), with orjson's speed where it is exact.

    keep: the value will live on (a request being served, a result handed to the caller):
    a large one is parked outside the collector's young generations until thaw(), so it is
    not walked again by the collections the next allocations trigger.
    """
    size = len(data)
    if size < _GC_PAUSE_FROM:
        return _loads(data)
    with _PAUSE:
        value = _loads(data)
        if keep:
            _park()
    return value


_PARKED = threading.Event()
_FOREIGN_FREEZE: set[int] = set()  # processes (pids) where someone else uses gc.freeze


def _park() -> None:
    # gc.freeze moves every tracked object to the permanent generation; thaw() moves them all
    # back into the oldest one, so the parsed value skips the young collections entirely.
    # Only while nobody else uses the permanent generation (a fork server freezes what its
    # children share): unfreezing theirs would undo that. Counting the frozen objects walks
    # all of them (tens of thousands in a fork-served kernel), so once another user is seen
    # this process never parks again and never counts again. (A pid, not a flag: a fork
    # server's children must look for themselves.)
    if _PARKED.is_set():
        gc.freeze()
        return
    pid = os.getpid()
    if pid in _FOREIGN_FREEZE:
        return
    if gc.get_freeze_count() == 0:
        gc.freeze()
        _PARKED.set()
    else:
        _FOREIGN_FREEZE.add(pid)


def thaw() -> None:
    """Return what loads(keep=True) parked to the collector (its oldest generation)."""
    if _PARKED.is_set():
        _PARKED.clear()
        gc.unfreeze()


def _loads(data: bytes | bytearray | memoryview | str) -> Any:
    if orjson is None:
        return _std_loads(data)
    raw = data.encode("utf8", "surrogatepass") if isinstance(data, str) else data
    if _has_long_number(raw):
        return _std_loads(data)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:  # NaN, 1e400, lone surrogates...: the standard library's say
        return _std_loads(data)


def natives(value: Any) -> Any:
    """What both encoders write for the two non-JSON types orjson always accepts."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON of plain JSON values (no validation beyond the encoder's own)."""
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except _ORJSON_REFUSED:
            pass
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                      default=natives).encode("utf-8")


_MESSAGE_OPTIONS = 0 if orjson is None else orjson.OPT_NAIVE_UTC | orjson.OPT_UTC_Z


def _message_default(value: Any) -> Any:
    """What jupyter_client's packer writes for values that are not JSON (its json_default)."""
    if isinstance(value, datetime):
        if value.tzinfo is None:  # as jupyter_client: a naive time is local time
            value = value.astimezone()
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, bytes):
        return binascii.b2a_base64(value, newline=False).decode("ascii")
    if isinstance(value, Iterable):
        return list(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{value!r} is not JSON serializable")


def _std_pack_message(value: Any) -> bytes:
    return json.dumps(value, default=_message_default, ensure_ascii=False,
                      allow_nan=False).encode("utf8", errors="surrogateescape")


def pack_message(value: Any) -> bytes:
    """A message part (header, parent header, metadata, content) as JSON, byte for byte what
    jupyter_client's Session packs (orjson when installed, else the standard library), so a
    message built without jupyter_client (kernel/messages.py) reads as one built with it.
    What neither encoder takes (NaN beside a 20-digit integer, say) is cleaned as
    jupyter_client cleans it: NaN and Infinity as their repr, keys as strings."""
    if orjson is not None:
        with contextlib.suppress(Exception):  # as jupyter_client: the standard library decides
            return orjson.dumps(value, default=_message_default, option=_MESSAGE_OPTIONS)
    try:
        return _std_pack_message(value)
    except (TypeError, ValueError):
        return _std_pack_message(_cleaned(value))


def _cleaned(value: Any) -> Any:
    """The value as jupyter_client's deprecated last resort (json_clean) makes it JSON."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else repr(value)
    if isinstance(value, bytes):
        return binascii.b2a_base64(value, newline=False).decode("ascii")
    if isinstance(value, dict):
        if len({str(key) for key in value}) != len(value):
            raise ValueError("dict cannot be safely converted to JSON: "
                             "key collision would lead to dropped values")
        return {str(key): _cleaned(item) for key, item in value.items()}
    if isinstance(value, (datetime, date)):
        return value.strftime("%Y-%m-%dT%H:%M:%S.%f")
    if isinstance(value, (list, tuple, set, frozenset)) or hasattr(value, "__next__"):
        return [_cleaned(item) for item in value]
    raise ValueError(f"Can't clean for JSON: {value!r}")


def encode_result(value: dict[str, Any]) -> bytes:
    """A main() result as compact UTF-8 JSON, checked to be exactly JSON; NotJSON if not."""
    if orjson is not None:
        try:
            encoded = orjson.dumps(value, option=_PASSTHROUGH)
        except _ORJSON_REFUSED:
            pass  # a type, key, integer or string orjson will not take: the exact path decides
        else:
            # orjson writes NaN and Infinity as null: only then is a second look needed.
            if _NULL.search(encoded) is None or not _has_non_finite(value):
                return encoded
    return _std_encode_result(value)


def _has_non_finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False, default=natives)
    except ValueError:
        return True
    return False


def _std_encode_result(value: dict[str, Any]) -> bytes:
    """The standard library's encoding, then a walk wherever it bent or refused the value."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                          default=natives)
        encoded = text.encode("utf-8")
    except (TypeError, ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        encoded = None
    # The encoder turns int keys into strings silently: compare with the value to catch that.
    if encoded is not None and loads(encoded) == _comparable(value):
        return encoded
    problem = json_problem(value)
    if problem:
        raise NotJSON(problem)
    assert encoded is not None, "the walk and the encoder disagree"
    return encoded


def _comparable(value: Any) -> Any:
    """The value as its JSON text reads back: tuples as lists, Enum and UUID as written."""
    if isinstance(value, dict):
        return {key: _comparable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_comparable(item) for item in value]
    if isinstance(value, (Enum, uuid.UUID)):
        return _comparable(natives(value))
    return value


def _key_text(key: str) -> str:
    """A key as it appears in a path, readable even when it holds a lone surrogate."""
    text = json.dumps(key, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(key)
    return text


def _string_problem(value: str, path: str) -> str | None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = value[exc.start]
        return f"{path}: str with a lone surrogate {char!r} at index {exc.start} (not UTF-8)"
    return None


def json_problem(value: Any, path: str = "result", parents: frozenset[int] = frozenset()
                 ) -> str | None:
    """The first place where `value` is not JSON, as 'path: what', or None if it all is."""
    if isinstance(value, str):
        return _string_problem(value, path)
    if value is None or isinstance(value, (bool, int, Enum, uuid.UUID)):
        return None if not isinstance(value, Enum) else json_problem(value.value, path, parents)
    if isinstance(value, float):
        ok = math.isfinite(value)
        return None if ok else f"{path}: float {value!r} (NaN and Infinity are not JSON)"
    if not isinstance(value, (dict, list, tuple)):
        return f"{path}: {type(value).__name__}"
    if id(value) in parents:
        return f"{path}: circular reference"
    parents = parents | {id(value)}
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path}[{key!r}]: {type(key).__name__} key (JSON keys are strings)"
            inner = f"{path}[{_key_text(key)}]"
            found = _string_problem(key, f"{inner} (the key)") or json_problem(
                item, inner, parents)
            if found:
                return found
        return None
    for index, item in enumerate(value):
        found = json_problem(item, f"{path}[{index}]", parents)
        if found:
            return found
    return None


def use_exact_json(session: Any) -> None:
    """Make a jupyter_client Session parse exactly (it picks orjson's inexact loads if present)."""
    session.unpack = loads
