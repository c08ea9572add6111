"""The fleet's breakers hash (``<prefix>:breakers``) has one writer, the workers: each publishes
its own open breakers and removes the entries nobody refreshes (a dead worker's); readers
(``interactor status``, the metrics) only read, and skip stale entries."""

from __future__ import annotations

import time

from broker.keys import Keys
from broker.records import BREAKER_STALE_S, BreakerState
from interactor.fleet_reader import FleetReader
from workers.breakers import BreakerBoard


def entry(worker: str, seen: float) -> tuple[str, bytes]:
    state = BreakerState(kind="env", server="http://env:1", worker=worker, since=seen - 5, error="down", seen=seen)
    return state.hash_field(), state.pack()


def test_readers_skip_stale_entries_and_workers_remove_them(redis_client, settings):
    keys = Keys(settings.key_prefix)
    now = time.time()
    fresh, dead, garbage = entry("w-alive", now), entry("w-dead", now - BREAKER_STALE_S - 5), ("x y z", b"\xc1")
    redis_client.hset(keys.breakers, mapping=dict([fresh, dead, garbage]))

    shown = FleetReader(redis_client, settings).breakers()
    assert [(b["server"], b["workers"]) for b in shown] == [("http://env:1", 1)]
    assert redis_client.hlen(keys.breakers) == 3  # a reader writes nothing

    board = BreakerBoard(redis_client, keys, "w-other")
    assert board.prune_stale() == 2
    assert set(redis_client.hkeys(keys.breakers)) == {fresh[0].encode()}
    board.heartbeat()  # pruned a moment ago: the next prune waits its period
    assert redis_client.hlen(keys.breakers) == 1
