"""`interactor_queue_inflight` (and `status`, and the autoscaler) count a delivery only while its
episode holds a live lease or reservation: a SIGKILLed worker's deliveries stay in kombu's
``unacked`` hash until the visibility timeout, though the sweeper re-ran their episodes."""

from __future__ import annotations

import base64
import json
import time

from broker.keys import Keys
from broker.queueing import EPISODE_TASK, UNACKED_KEY, inflight_per_queue


def _delivery(job: str, episode: str, queue: str) -> str:
    body = base64.b64encode(json.dumps([[job, episode], {}, {}]).encode()).decode()
    envelope = {"body": body, "content-type": "application/json", "headers": {"task": EPISODE_TASK}}
    return json.dumps([envelope, "", queue])


def test_inflight_counts_only_live_episodes_once(redis_client, settings):
    r, k, q = redis_client, Keys(settings.key_prefix), settings.queue
    now_ms = int(time.time() * 1000)
    # A dead worker's four deliveries (tags a1..a4); the sweeper re-ran e1 and e2 elsewhere
    # (tags b1, b2: live leases), e3 is reserved by a live worker, e4 is done.
    for tag, ep in (("a1", "e1"), ("a2", "e2"), ("a3", "e3"), ("a4", "e4"), ("b1", "e1"), ("b2", "e2")):
        r.hset(UNACKED_KEY, f"{settings.key_prefix}-{tag}", _delivery("J", ep, q))
    r.zadd(k.running, {"J e1": now_ms + 30_000, "J e2": now_ms + 30_000, "J e5": now_ms - 1})
    r.zadd(k.reserved, {"J e3": now_ms + 30_000})
    try:
        assert inflight_per_queue(r)[q] == 6  # every delivery, as kombu holds them
        assert inflight_per_queue(r, k)[q] == 3  # e1, e2 (once each) and e3
        r.zrem(k.running, "J e1", "J e2")
        r.zrem(k.reserved, "J e3")
        assert inflight_per_queue(r, k).get(q, 0) == 0  # the job is done: nothing in flight
    finally:
        for tag in ("a1", "a2", "a3", "a4", "b1", "b2"):
            r.hdel(UNACKED_KEY, f"{settings.key_prefix}-{tag}")
