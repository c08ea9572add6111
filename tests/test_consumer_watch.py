"""A worker whose Celery consumer stopped taking work is replaced (workers/consumer_watch.py).

Celery's gevent consumer can come back from a Redis restart connected but fetching nothing
(celery/celery#9191); the fault suite saw a job sit for minutes with every worker idle. The
end-to-end test makes a real worker's consumer stop the way Celery itself can: a remote-control
``cancel_consumer``, after which the process is up, connected and takes nothing."""

from __future__ import annotations

import pytest
import redis

from broker.celery_app import make_app
from broker.keys import Keys
from broker.ledger import Ledger
from broker.queueing import push_episodes
from producer.enqueue import submit
from tests.conftest import wait_for
from workers.consumer_watch import ConsumerWatch


def _watch(redis_client, settings, *, in_hand, last, stalls, stopping=lambda: False):
    return ConsumerWatch(redis_client, [settings.queue], 4, in_hand=lambda: in_hand[0], last_received=lambda: last[0],
                         on_stall=stalls.append, stall_s=10, stopping=stopping)


def test_stall_needs_waiting_episodes_free_slots_and_no_receipt_for_the_whole_time(settings, redis_client):
    stalls: list[str] = []
    in_hand, last = [1], [0.0]
    w = _watch(redis_client, settings, in_hand=in_hand, last=last, stalls=stalls)
    w.tick(now=100.0)
    w.tick(now=200.0)
    assert stalls == []  # nothing waits: an idle worker is not a stalled one
    push_episodes(redis_client, [("j", f"j.e{i}", settings.queue) for i in range(3)])
    w.tick(now=300.0)
    w.tick(now=305.0)
    assert stalls == []
    last[0] = 306.0  # a task arrived: the clock starts again
    w.tick(now=307.0)
    w.tick(now=316.0)
    assert stalls == []
    w.tick(now=317.5)
    (reason,) = stalls
    assert "took no task for 10s" in reason and "3 episodes waited" in reason and "3 of its 4 slots" in reason
    in_hand[0] = 4  # every slot busy: nothing to take
    for t in (400.0, 420.0, 440.0):
        w.tick(now=t)
    assert len(stalls) == 1


def test_a_stopping_worker_or_an_unreachable_redis_is_not_judged(settings, redis_client):
    stalls: list[str] = []
    push_episodes(redis_client, [("j", "j.e0", settings.queue)])
    stopping = [True]
    w = _watch(redis_client, settings, in_hand=[0], last=[0.0], stalls=stalls, stopping=lambda: stopping[0])
    for t in (100.0, 200.0, 300.0):
        w.tick(now=t)
    assert stalls == []
    dead = ConsumerWatch(redis.Redis(port=9, socket_connect_timeout=1), [settings.queue], 4, in_hand=lambda: 0, last_received=lambda: 0.0, on_stall=stalls.append,
                         stall_s=10)
    for t in (100.0, 200.0, 300.0):
        dead.tick(now=t)
    assert stalls == []


@pytest.mark.fault
def test_a_worker_whose_consumer_stopped_taking_tasks_is_replaced(settings, procs, env_server, model_server,
                                                                  redis_client, tmp_path):
    _, env_url = env_server
    _, model_url = model_server
    s = settings.replace(llm_base_url=model_url + "/v1", worker_stall_s=4.0, concurrency=2, worker_remote_control=True)
    procs.settings = s
    procs.worker("w1")
    wait_for(lambda: " ready." in procs.log("w1"), 120, what="the worker ready")
    # The consumer stops consuming (as a wedged reconnect leaves it): the process is up and
    # connected, and takes nothing.
    replies = make_app(s).control.cancel_consumer(s.queue, reply=True, timeout=10)
    assert replies, "the worker answered the cancel_consumer command"
    tasks = tmp_path / "t.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                     f"    env_params: {{low: 1, high: 8, max_turns: 4}}\n    env_num: 4\n")
    sub = submit(redis_client, s, [str(tasks)])
    ledger = Ledger(redis_client, Keys(s.key_prefix))
    wait_for(lambda: "took no task" in procs.log("w1"), 90, what="the consumer watch to notice")
    wait_for(lambda: ledger.counts(sub.job.job_id)["done"] == 4, 180, what="the job done by the fresh process")
    log = procs.log("w1")
    assert "without being asked to; restarting" in log
    assert sum(ledger.attempts(sub.job.job_id, e) for e in ledger.states(sub.job.job_id)) == 4  # nothing counted
