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


LOST_READS: list = []  # (client, stream), armed by a test: see lose_the_read


def lose_the_read(group: dict) -> bool:
    """Keeps every group. Armed (``LOST_READS``), its next call undoes the read of the groups the
    take holds, as a Redis failover to a replica that never got the read does: they are unread
    again, and pending to nobody."""
    while LOST_READS:
        client, stream = LOST_READS.pop()
        pending = client.xpending_range(stream, "trainers", min="-", max="+", count=100)
        if pending:
            client.xack(stream, "trainers", *[p["message_id"] for p in pending])
        client.xgroup_setid(stream, "trainers", "0")
    return True
