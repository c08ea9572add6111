"""A message a worker took and never ran comes back through the ledger, not the broker: the
transport keeps no copy of a delivered message (broker/kombu_redis.py, no ack emulation). Real
Redis, a real consumer (its sweeper) and worker process, stand-in servers: messages taken by a
worker that died, one after its reservation was written and one before, are sent again within
their bounds, and every episode runs once."""

from __future__ import annotations

import time

import pytest

from broker.keys import member
from broker.ledger import Ledger
from broker.queueing import decode_task_args
from broker.states import LedgerState
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.taskfiles import write_arith_tasks

pytestmark = [pytest.mark.integration, pytest.mark.fault]


def test_messages_a_dead_worker_took_come_back_within_their_bounds(settings, procs, redis_client, tmp_path,
                                                                   env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    s = settings.replace(llm_base_url=model_url + "/v1")
    procs.settings = s
    job = submit(redis_client, s, [write_arith_tasks(tmp_path, env_url, rows=3, env_num=2)]).job
    ledger = Ledger.for_settings(redis_client, s)
    # A worker takes two messages and dies: one after the renewer wrote its episode's
    # reservation, one before. Neither message is anywhere in Redis now.
    taken = [decode_task_args(redis_client.rpop(s.queue)) for _ in range(2)]
    reserved, unreserved = taken
    ledger.reserve([member(*reserved)])
    assert not redis_client.exists("unacked")
    t0 = time.monotonic()
    procs.consumer()  # its sweeper: reservations that lapse, and reconcile
    procs.worker("w1")
    back = {}

    def started(args) -> bool:
        if ledger.attempts(*args) >= 1 and args not in back:
            back[args] = time.monotonic() - t0
        return args in back

    wait_for(lambda: started(reserved) and started(unreserved), 120, what="both taken episodes run")
    wait_for(lambda: ledger.counts(job.job_id)[LedgerState.DONE] == 6, 120, what="the job done")
    for e in ledger.states(job.job_id):
        assert ledger.attempts(job.job_id, e) == 1  # each ran once: nothing sent twice ran twice
    # A reservation lapses a lease TTL after it was written, and the next sweep sends it again;
    # an episode with neither message nor reservation is confirmed lost over two reconcile rounds.
    # The slack is for a busy machine: what is bounded is minutes against the hour a visibility
    # timeout would take.
    slack = 20.0
    assert back[reserved] <= s.lease_ttl_s + s.sweep_interval_s + slack, back
    assert back[unreserved] <= 2 * s.reconcile_interval_s + 2 * s.renewal_interval_s + s.sweep_interval_s + slack, back
    print(f"\n[delivery] taken and reserved: back after {back[reserved]:.1f}s (lease TTL {s.lease_ttl_s:g}s); "
          f"taken, not reserved: back after {back[unreserved]:.1f}s (reconcile every {s.reconcile_interval_s:g}s)")
