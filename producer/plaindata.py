"""Plain JSON data in a task file: the check that a value can travel to an env, and fast copies.

Specs travel to the workers as msgpack and reach the env as JSON, so whatever a task file or a
dataset holds must be str-keyed mappings, lists and scalars, with integers that fit in 64 bits.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_int", "check_plain", "copy_tree", "is_flat"]

_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1  # what msgpack can carry


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_plain(v: Any, where: str) -> str | None:
    """Return None if ``v`` is plain JSON data (str-keyed maps, lists, scalars), else a
    description of the first offending place. Specs travel as msgpack and reach the env as
    JSON, so dates, bytes, sets, Decimals or non-string keys must be caught here."""
    if v is None or isinstance(v, (str, bool)):
        return None
    if isinstance(v, int):
        # Specs travel as msgpack, whose integers are 64 bits: a larger one cannot be sent.
        if _INT_MIN <= v <= _UINT_MAX:
            return None
        return f"{where}: the integer {v} does not fit in 64 bits (write it as a string)"
    if isinstance(v, float):
        return None  # NaN/inf included: msgpack and Python's json both carry them
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                return f"{where}: key {k!r} is a {type(k).__name__}; keys must be strings"
            bad = check_plain(x, f"{where}.{k}")
            if bad:
                return bad
        return None
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            bad = check_plain(x, f"{where}[{i}]")
            if bad:
                return bad
        return None
    return f"{where}: a {type(v).__name__} value ({v!r:.60}) cannot be sent to an env as JSON"


def copy_tree(v: Any) -> Any:
    """Deep copy of plain JSON data (much faster than copy.deepcopy)."""
    if isinstance(v, dict):
        return {k: copy_tree(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [copy_tree(x) for x in v]
    return v


def is_flat(d: dict) -> bool:
    return not any(isinstance(x, (dict, list, tuple)) for x in d.values())
