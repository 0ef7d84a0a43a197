"""JSON text for Postgres: lossless for what ``jsonb`` cannot hold.

Postgres' ``jsonb`` refuses ``\\u0000``, and UTF-8 (hence orjson and asyncpg) refuses lone
surrogates; both arrive in model output, tool results and human messages, which are untrusted. A
string holding either is stored *tagged*: a private-use mark, a tag letter, and the string with
``\\``, NUL and surrogates escaped. Integers beyond 64 bits are tagged the same way, and so are
floats from 1e16 to 2**64 in size (jsonb keeps them as whole numbers and prints them without a
fraction, which would read back as integers). Every string that itself starts with the mark is
tagged too, so decoding is exact for every value::

    "a\\x00b"   ->  "\\ue000sa\\\\x00b"  ->  "a\\x00b"
    2**70       ->  "\\ue000i1180591620717411303424"
    4.2e16      ->  "\\ue000f4.2e+16"

Only values that need it pay: encoding walks a value only when orjson refuses it or its output
holds a NUL escape or the mark; decoding walks only text that holds the mark. Special floats
(NaN, infinities) have no JSON form and are written as ``null``, as orjson does; that is why an
actor's state is folded from what was written, never from the object emitted
(:meth:`toren.Context.emit`).

Text columns (error messages) cannot be tagged; :func:`safe_text` escapes them readably.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

import orjson

MARK = "\ue000"
_MARK_UTF8 = MARK.encode()
_STR = MARK + "s"
_INT = MARK + "i"
_FLOAT = MARK + "f"
_INT64 = range(-(2**63), 2**64)  # what orjson writes as a number
_WHOLE = re.compile(rb"\de\+")  # how orjson writes a float of 1e16 or more
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*+\\u0000")  # not the text "\u0000" escaped

_NEEDS_TAG = re.compile("[\x00\ud800-\udfff]")
SURROGATE = re.compile("[\ud800-\udfff]")  # a lone surrogate (UTF-8 cannot carry one)
_SURROGATE_ESCAPES = {c: f"\\u{c:04x}" for c in range(0xD800, 0xE000)}


def _escape(s: str) -> str:
    """Backslashes, NUL and lone surrogates written as the escapes Python's ``unicode_escape``
    codec reads back (all at C speed: a megabyte of NULs takes milliseconds, not seconds)."""
    escaped = s.replace("\\", "\\\\").replace("\x00", "\\x00")
    if SURROGATE.search(escaped):
        escaped = escaped.translate(_SURROGATE_ESCAPES)
    return escaped


def _unescape(s: str) -> str:
    try:
        return s.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:  # not written by _escape (edited by hand): kept as it is
        return s


def _tag_str(s: str) -> str:
    if s.startswith(MARK) or _NEEDS_TAG.search(s):
        return _STR + _escape(s)
    return s


def _tag(value: Any) -> Any:
    if isinstance(value, str):
        return _tag_str(value)
    if isinstance(value, dict):
        return {_tag_str(k) if isinstance(k, str) else k: _tag(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_tag(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        return f"{_INT}{value}"
    if isinstance(value, float) and 1e16 <= abs(value) < 2.0**64:
        return f"{_FLOAT}{value!r}"
    if isinstance(value, enum.Enum):  # orjson writes these itself, past the tags
        return _tag(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _tag(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _untag_str(s: str) -> Any:
    if s.startswith(_STR):
        return _unescape(s[2:])
    if s.startswith(_INT):
        try:
            return int(s[2:])
        except ValueError:
            return s
    if s.startswith(_FLOAT):
        try:
            return float(s[2:])
        except ValueError:
            return s
    return s


def _untag(value: Any) -> Any:
    if isinstance(value, str):
        return _untag_str(value) if value.startswith(MARK) else value
    if isinstance(value, dict):
        return {_untag_str(k): _untag(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untag(v) for v in value]
    return value


def dumps(value: Any, *, sort_keys: bool = False) -> str:
    """``value`` as JSON text that ``jsonb`` accepts and :func:`loads` turns back into it.

    Raises:
        TypeError: the value holds something JSON cannot (a non-string key, an unknown type,
            nesting deeper than 254 levels).
    """
    option = orjson.OPT_SORT_KEYS if sort_keys else 0
    try:
        out = orjson.dumps(value, option=option)
    except orjson.JSONEncodeError:
        out = None
    if out is None or b"\\u0000" in out or _MARK_UTF8 in out or _WHOLE.search(out):
        try:
            out = orjson.dumps(_tag(value), option=option)
        except RecursionError as exc:
            raise TypeError("value is nested too deeply for JSON") from exc
        # A NUL inside a type orjson writes itself that _tag does not know (the cheap test first).
        if b"\\u0000" in out and _NUL_ESCAPE.search(out):
            raise TypeError("value holds a NUL inside a type that cannot be tagged")
    return out.decode()


def loads(text: str | bytes) -> Any:
    """The value :func:`dumps` wrote (any JSON text is accepted)."""
    value = orjson.loads(text)
    marked = MARK in text if isinstance(text, str) else _MARK_UTF8 in text
    return _untag(value) if marked else value


def safe_text(text: str) -> str:
    """``text`` for a Postgres ``text`` column: NUL and lone surrogates written as escapes."""
    if _NEEDS_TAG.search(text):
        return _NEEDS_TAG.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a lone surrogate counted as the three bytes it takes)."""
    return len(text.encode("utf-8", "surrogatepass"))
