"""`interactor_queue_inflight` (and `status`, and the autoscaler) count the episodes delivered to
a worker and not finished: a live lease or reservation, each episode once, per queue (the
transport keeps no copy of a delivered message, broker/kombu_redis.py)."""

from __future__ import annotations

import time

from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import EpisodeSpec, JobSpec
from interactor.fleet_reader import FleetReader


def test_inflight_counts_live_leases_and_reservations_per_queue(redis_client, settings):
    r, k = redis_client, Keys(settings.key_prefix)
    fast = f"fast-{settings.queue}"
    job = JobSpec(job_id="J", llm_base_url="http://llm/v1", model="m", episodes=5, groups=1)
    eps = [EpisodeSpec(job_id="J", episode_id=f"e{i}", group_id="g", group_size=5, env_name="x",
                       base_url="http://env:1", env_params={}, queue=fast if i == 3 else settings.queue)
           for i in range(1, 6)]
    Ledger.for_settings(r, settings).create_job(job, eps)
    now_ms = int(time.time() * 1000)
    # e1, e2 run (live leases), e3 is reserved by a live worker, e5's lease expired (its worker
    # died: the sweeper's business, not work in flight), e4 waits in its queue.
    r.zadd(k.running, {"J e1": now_ms + 30_000, "J e2": now_ms + 30_000, "J e5": now_ms - 1})
    r.zadd(k.reserved, {"J e3": now_ms + 30_000})
    reader = FleetReader(r, settings)
    assert reader.inflight() == {settings.queue: 2, fast: 1}
    r.zrem(k.running, "J e1", "J e2")
    r.zrem(k.reserved, "J e3")
    assert reader.inflight() == {}  # the job is done: nothing in flight
