"""The continuous producer (producer/continuous.py) on its own thread against the session's
Redis, when what it produces from is broken: a group to run again whose episode specs are gone
is dropped and counted, a round that fails for any reason is logged and tried again, and what
the producer is doing shows in ``/stats`` (FeedService.stats) and ``interactor status``. No
worker runs: producing is writing to the ledger and the queues, which is what is under test."""

from __future__ import annotations

import logging
import threading

import msgpack
import pytest

from broker import feed
from broker.keys import Keys
from broker.states import ProducerState
from consumer.storage import open_store
from interactor.feed_service import FeedService
from producer.continuous import ContinuousProducer, create_continuous_job
from tests.conftest import wait_for
from tests.taskfiles import write_arith_tasks

pytestmark = pytest.mark.integration

MAX_AHEAD = 3


class Producing:
    """A continuous job over four task rows and its producer thread."""

    def __init__(self, settings, redis_client, tmp_path):
        self.settings = settings.replace(feed_max_ahead=MAX_AHEAD)
        self.r = redis_client
        self.keys = Keys(self.settings.key_prefix)
        tasks = write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=4, env_num=2)
        self.job_id = create_continuous_job(redis_client, self.settings, [tasks]).job_id
        self.producer = ContinuousProducer(redis_client, self.settings, self.job_id)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.producer.run, args=(self.stop,), daemon=True)
        self.store = open_store(str(tmp_path / "results.sqlite"))
        self.service = FeedService(redis_client, self.settings, self.job_id, self.store)

    def counters(self) -> dict:
        return feed.counters(self.r, self.keys, self.job_id)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.store.close()


@pytest.fixture
def producing(settings, redis_client, tmp_path):
    p = Producing(settings, redis_client, tmp_path)
    yield p
    p.close()


def status_text(p: Producing) -> str:
    from interactor.fleet_reader import FleetReader
    from interactor.status_text import render_status

    return render_status(FleetReader(p.r, p.settings).snapshot(p.job_id))


def test_a_redo_whose_specs_are_gone_is_dropped_counted_and_production_goes_on(producing, caplog):
    """A group to run again (stale, or refilled) whose episodes' specs are no longer in the
    ledger: the producer logs it, drops it with a count, and produces the job's groups."""
    p = producing
    p.r.rpush(p.keys.feed_redo(p.job_id),
              msgpack.packb(["old-group", [f"{p.job_id}.gone.1", f"{p.job_id}.gone.2"], "stale", 0]),
              msgpack.packb(b"\x01not a redo entry"))
    with caplog.at_level(logging.ERROR, logger="interactor.producer"):
        p.thread.start()
        wait_for(lambda: p.counters().get(feed.C_PRODUCED, 0) == MAX_AHEAD, 60, what="max_ahead groups produced")
    assert p.thread.is_alive()
    assert p.r.llen(p.keys.feed_redo(p.job_id)) == 0
    assert p.counters()[feed.C_REDO_DROPPED] == 2
    assert "the specs of 2 of its 2 episodes are gone" in caplog.text and "unreadable entry" in caplog.text
    # the groups produced are the job's own tasks, not re-runs
    states = p.r.hgetall(p.keys.job_state(p.job_id))
    assert len(states) == MAX_AHEAD * 2
    producer = p.service.stats()["producer"]
    assert producer["state"] == ProducerState.RUNNING and producer["redo_dropped"] == 2
    assert "2 groups to re-run dropped" in status_text(p)


def test_a_failing_round_is_retried_with_backoff_and_shown(producing, caplog):
    """A job whose templates are gone fails every round: the thread lives on, the failures are
    logged with their traceback and counted, /stats and `interactor status` say so; once the
    templates are back it produces again."""
    p = producing
    templates = p.r.hgetall(p.keys.feed_templates(p.job_id))
    p.r.delete(p.keys.feed_templates(p.job_id))
    with caplog.at_level(logging.ERROR, logger="interactor.producer"):
        p.thread.start()
        wait_for(lambda: (p.service.stats()["producer"] or {}).get("errors", 0) >= 1, 60,
                 what="a failed round reported")
    assert p.thread.is_alive()
    producer = p.service.stats()["producer"]
    assert producer["state"] == ProducerState.BACKING_OFF and "no task templates" in producer["last_error"]
    assert "Traceback" in caplog.text and "no task templates" in caplog.text
    shown = status_text(p)
    assert "producer backing_off" in shown and "no task templates" in shown
    p.r.hset(p.keys.feed_templates(p.job_id), mapping=templates)
    wait_for(lambda: p.counters().get(feed.C_PRODUCED, 0) == MAX_AHEAD, 120, what="production resumed")
    wait_for(lambda: p.service.stats()["producer"]["state"] == ProducerState.RUNNING, 30, what="reported running")
    assert p.thread.is_alive()
    p.stop.set()
    p.thread.join(30)
    assert p.service.stats()["producer"]["state"] == ProducerState.STOPPED
