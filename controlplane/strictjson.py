"""JSON as requests may send it: UTF-8, finite numbers, bounded integers and nesting, no lone
surrogates or NUL characters. Python's json accepts all of those, and each became a 500
somewhere downstream (protobuf, PostgreSQL, Prometheus labels, int() beyond 4,300 digits)."""

from __future__ import annotations

import json
import math

MAX_DEPTH = 32
MAX_INT_DIGITS = 24  # a signed 64-bit integer has 20


class JSONError(ValueError):
    """The text is not JSON this API accepts; the message says why."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JSONError(f"an integer of {len(text)} digits is out of range")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONError(f"the number {text[:40]} is out of range")
    return value


def _constant(name: str):
    raise JSONError(f"{name} is not a JSON number")


def check(value, depth: int = 0) -> None:
    """Raise JSONError for nesting deeper than MAX_DEPTH, a string no UTF-8 can carry, or NUL."""
    if depth > MAX_DEPTH:
        raise JSONError(f"nesting deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise JSONError("a string holds a lone UTF-16 surrogate") from None
        if "\x00" in value:  # PostgreSQL text cannot hold it
            raise JSONError("a string holds a NUL character")
    elif isinstance(value, dict):
        for k, v in value.items():
            check(k, depth + 1)
            check(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            check(v, depth + 1)


def loads(data: bytes | str):
    """Parse and check; JSONError with a reason otherwise."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except JSONError:
        raise
    except RecursionError:
        raise JSONError(f"nesting deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise JSONError(f"not valid JSON: {exc}") from None
    check(value)
    return value
