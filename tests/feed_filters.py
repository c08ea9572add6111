"""User filters for the feed's tests (``feed_filter = module:function``, allow-listed by
``feed_filters``). ``reexported`` is named in a test to show that only what this module
defines itself may be named, as for episode hooks."""

from __future__ import annotations

from json import loads as reexported  # noqa: F401 - defined in json, not here: refused

CALLS: list[str] = []


def even_groups(group: dict) -> bool:
    """Keep the continuous producer's even-numbered groups (``<job>.s2``, ``.s4``...): a
    filter whose verdict a test can predict."""
    return int(group["group_id"].rsplit(".s", 1)[1]) % 2 == 0
