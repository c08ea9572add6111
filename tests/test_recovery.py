"""Crash safety, one behaviour at a time: reconcile, the DLQ commands, stream trimming,
backpressure, graceful shutdown of workers and consumer, pickle refusal, bad servers."""

from __future__ import annotations

import base64
import json
import os
import pickle  # only to build the hostile message the worker must refuse
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from broker import errors
from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import AttemptRecord, StepRecord, unpack
from consumer.ingest import GROUP, Ingestor
from consumer.storage import open_store
from producer.enqueue import submit
from tests.conftest import ROOT, wait_for
from tests.storecheck import assert_trajectories_sound
from tests.test_integration import wait_job_stored, write_tasks
from tests.test_runner import make_job, stream_records
from workers.runner import WorkerRuntime

pytestmark = pytest.mark.integration


def cli(settings, *args, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())
    return subprocess.run([sys.executable, "-m", "interactor.cli", *args], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=timeout)


def test_reconcile_resends_episodes_the_broker_lost(settings, redis_client, tmp_path):
    sub = submit(redis_client, settings, [write_tasks(tmp_path, "http://127.0.0.1:9", guess=2, rows=2)])
    assert redis_client.llen(settings.queue) == 6
    redis_client.delete(settings.queue)  # the broker lost every message
    dry = cli(settings, "reconcile", sub.job.job_id, "--dry-run")
    assert dry.returncode == 0 and "would re-enqueue 6 episodes" in dry.stdout
    assert redis_client.llen(settings.queue) == 0
    out = cli(settings, "reconcile", sub.job.job_id)
    assert out.returncode == 0 and "re-enqueued 6 episodes" in out.stdout, out.stderr
    assert redis_client.llen(settings.queue) == 6
    # Nothing is lost any more, so a second pass sends nothing (no duplicates).
    again = cli(settings, "reconcile", sub.job.job_id)
    assert "re-enqueued 0 episodes" in again.stdout
    assert redis_client.llen(settings.queue) == 6


def test_dlq_commands(settings, redis_client, env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    job, eps = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1",
                        env_name="no_such_env", n=2)
    rt = WorkerRuntime(settings, name="dlq-worker")
    try:
        for e in eps:
            assert rt.run(job.job_id, e.episode_id) == "failed"
    finally:
        rt.stop()
    listed = cli(settings, "dlq", "list", "--job", job.job_id)
    assert listed.returncode == 0 and "2 dead-lettered episodes" in listed.stdout
    assert errors.ENV_BAD_REQUEST in listed.stdout
    shown = cli(settings, "dlq", "show", eps[0].episode_id)
    letter = json.loads(shown.stdout)
    assert letter["reason"] == errors.ENV_BAD_REQUEST and letter["spec"]["group_id"] == eps[0].group_id
    assert letter["attempts"] == 1 and letter["error_class"] and letter["dead_at"] > 0
    missing = cli(settings, "dlq", "show", "nope")
    assert missing.returncode == 2 and "nope" in missing.stderr
    unsure = cli(settings, "dlq", "redrive")
    assert unsure.returncode == 2 and "--all" in unsure.stderr
    assert cli(settings, "dlq", "list", "--reason", "model_malformed").stdout.strip().endswith("0 dead-lettered episodes")
    redrove = cli(settings, "dlq", "redrive", eps[0].episode_id)
    assert "re-drove 1 episodes" in redrove.stdout
    assert Ledger(redis_client, Keys(settings.key_prefix)).state(job.job_id, eps[0].episode_id) == "queued"
    assert redis_client.llen(settings.queue) == 1
    purged = cli(settings, "dlq", "purge", "--all")
    assert "purged 1 dead letters" in purged.stdout
    assert len(DeadLetterQueue(redis_client, settings)) == 0


def test_trim_keeps_everything_not_acknowledged(settings, redis_client, tmp_path):
    keys = Keys(settings.key_prefix)
    store = open_store(str(tmp_path / "trim.sqlite"))
    ing = Ingestor(redis_client, settings.replace(consumer_batch=10), store, name="c1")
    rec = StepRecord("j", "e", 1, 1, "env", "m", "g", b"[]", "x", 0.0, 0.0, False, False, False, True)
    for i in range(30):
        rec.step_id = i + 1
        redis_client.xadd(keys.results, {"r": rec.pack()})
    assert ing.poll_once(block_ms=10) == 10  # 10 acknowledged
    # 10 delivered to another consumer and never acknowledged; 10 never read at all.
    redis_client.xreadgroup(GROUP, "c2", {keys.results: ">"}, count=10)
    ing.trim()
    left = [int(unpack(f[b"r"]).step_id) for _, f in redis_client.xrange(keys.results)]
    assert left[0] <= 11 and left[-1] == 30 and set(range(11, 31)) <= set(left)
    store.close()


def test_trim_honours_a_live_tap_but_not_a_forgotten_one(settings, redis_client, tmp_path, monkeypatch):
    """Another consumer group (a trainer tapping the stream) holds the trim floor while its
    consumers read; once they have been idle for STALE_GROUP_S, or it has none, it no longer
    does (a forgotten tap must not grow the stream until workers stop)."""
    import consumer.ingest as ingest

    keys = Keys(settings.key_prefix)
    store = open_store(str(tmp_path / "tap.sqlite"))
    ing = Ingestor(redis_client, settings.replace(consumer_batch=100), store, name="c1")
    rec = StepRecord("j", "e", 1, 1, "env", "m", "g", b"[]", "x", 0.0, 0.0, False, False, False, True)
    for i in range(20):
        rec.step_id = i + 1
        redis_client.xadd(keys.results, {"r": rec.pack()})
    redis_client.xgroup_create(keys.results, "trainer-tap", id="0")
    redis_client.xreadgroup("trainer-tap", "t1", {keys.results: ">"}, count=5)  # read 5, acked none
    redis_client.xgroup_create(keys.results, "forgotten", id="0")  # never had a consumer
    assert ing.poll_once(block_ms=10) == 20
    ing.trim()
    left = [int(unpack(f[b"r"]).step_id) for _, f in redis_client.xrange(keys.results)]
    assert left == list(range(1, 21))  # the live tap's pending entries hold the floor
    monkeypatch.setattr(ingest, "STALE_GROUP_S", 0.2)
    time.sleep(0.3)
    ing.trim()
    # Trimmed up to the last entry our own group was given (XTRIM MINID keeps that one).
    left = [int(unpack(f[b"r"]).step_id) for _, f in redis_client.xrange(keys.results)]
    assert left == [20]
    store.close()


def test_backpressure_holds_workers_until_the_consumer_catches_up(settings, redis_client, env_server, model_server,
                                                                  tmp_path):
    _, env_url = env_server
    model, model_url = model_server
    # Steps slower than the publisher's linger: each step's record is sent before the next
    # is made, so the bound is seen as precisely as with one round trip per record.
    model.latency_ms = 50
    bound = 4
    tight = settings.replace(stream_backlog_max=bound)
    job, (ep,) = make_job(redis_client, tight, env_url=env_url, llm_url=model_url + "/v1",
                          env_params={"low": 1, "high": 1000, "max_turns": 12})
    rt = WorkerRuntime(tight, name="bp-worker")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", rt.run(job.job_id, ep.episode_id)), daemon=True)
    t.start()
    try:
        keys = Keys(settings.key_prefix)
        wait_for(lambda: redis_client.xlen(keys.results) > bound, 20, what="backlog over the bound")
        time.sleep(0.5)
        held = redis_client.xlen(keys.results)
        time.sleep(1.5)
        # Held at the bound: the stream stops growing (records are sent in batches, so the one
        # that crossed the bound may have had a companion).
        assert t.is_alive(), result
        assert redis_client.xlen(keys.results) == held <= bound + 2
        store = open_store(str(tmp_path / "bp.sqlite"))
        ing = Ingestor(redis_client, tight, store, name="bp-consumer")
        deadline = time.monotonic() + 30
        while t.is_alive() and time.monotonic() < deadline:
            ing.poll_once(block_ms=50)
        t.join(1)
        assert result["r"] == "completed"
        store.close()
    finally:
        rt.stop()


def test_worker_sigterm_hands_back_running_episodes(settings, procs, env_server, redis_client, tmp_path):
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=700)
    try:
        s = settings.replace(llm_base_url=slow_url + "/v1", shutdown_grace_s=1.0)
        procs.settings = s
        tasks = tmp_path / "long.yaml"
        tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                         f"    env_params: {{low: 1, high: 100000, max_turns: 20}}\n    env_num: 3\n")
        sub = submit(redis_client, s, [str(tasks)])
        ledger = Ledger(redis_client, Keys(s.key_prefix))
        w = procs.worker("w1")
        wait_for(lambda: ledger.counts(sub.job.job_id)["running"] == 3, 30, what="3 running")
        t0 = time.monotonic()
        os.kill(w.pid, signal.SIGTERM)
        w.wait(30)
        assert time.monotonic() - t0 < 15  # grace 1 s + one in-flight call + shutdown
        counts = ledger.counts(sub.job.job_id)
        assert counts["queued"] == 3 and counts["running"] == 0, counts
        assert "handed back" in procs.log("w1")
        procs.worker("w2")
        procs.consumer()
        res = wait_job_stored(s, sub.job.job_id, 3, timeout=120)
        assert res["completed"] == 3
        assert_trajectories_sound(s.results_db, sub.job.job_id)
    finally:
        slow.shutdown()


def test_consumer_sigterm_commits_and_acks(settings, procs, redis_client):
    keys = Keys(settings.key_prefix)
    rec = AttemptRecord("jt", "jt.1.1.1.1", 1, "completed", "jt.1.1.1", 1, "env", "m")
    for i in range(200):
        rec.episode_id = f"jt.1.1.{i}.1"
        rec.group_id = f"jt.1.1.{i}"
        redis_client.xadd(keys.results, {"r": rec.pack()})
    last = redis_client.xrevrange(keys.results, count=1)[0][0]
    c = procs.consumer()

    def all_read():
        groups = [g for g in redis_client.xinfo_groups(keys.results) if g["name"] in (GROUP, GROUP.encode())]
        return groups and groups[0]["last-delivered-id"] == last

    wait_for(all_read, 30, what="records read")
    os.kill(c.pid, signal.SIGTERM)
    assert c.wait(30) == 0
    assert redis_client.xpending(keys.results, GROUP)["pending"] == 0
    store = open_store(settings.results_store)
    try:
        assert store.results("jt")["job"]["completed"] == 200
    finally:
        store.close()


def test_pickled_message_is_refused(settings, procs, redis_client, env_server, model_server, tmp_path):
    _, env_url = env_server
    _, model_url = model_server
    s = settings.replace(llm_base_url=model_url + "/v1")
    procs.settings = s
    marker = tmp_path / "pwned"
    body = base64.b64encode(pickle.dumps(((["x", "y"]), {}, {}))).decode()
    hostile = {"body": body, "content-encoding": "binary", "content-type": "application/x-python-serialize",
               "headers": {"lang": "py", "task": "interactor.run_episode", "id": str(uuid.uuid4()),
                           "argsrepr": str(marker)},
               "properties": {"delivery_mode": 2, "delivery_info": {"exchange": "", "routing_key": s.queue},
                              "priority": 0, "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())}}
    redis_client.lpush(s.queue, json.dumps(hostile))
    sub = submit(redis_client, s, [write_tasks(tmp_path, env_url, guess=1, rows=1, arith_num=1)])
    procs.worker("w1")
    procs.consumer()
    res = wait_job_stored(s, sub.job.job_id, 2)
    assert res["completed"] == 2  # the worker refused the pickle and went on
    log = procs.log("w1")
    assert "ContentDisallowed" in log or "disallowed" in log.lower() or "Refusing" in log, log[-2000:]
    assert not marker.exists()


@pytest.mark.parametrize("knob,reason", [("garbage_rate", errors.ENV_MALFORMED)])
def test_malformed_env_answers_end_in_the_dlq(settings, redis_client, model_server, knob, reason):
    from examples.envserver import start_in_thread

    _, model_url = model_server
    env, env_url = start_in_thread(**{knob: 1.0})
    rt = WorkerRuntime(settings, name="bad-env")
    try:
        job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1")
        assert rt.run(job.job_id, ep.episode_id) == "failed"
        (letter,) = DeadLetterQueue(redis_client, settings).list()
        assert letter.reason == reason and letter.error
    finally:
        rt.stop()
        env.shutdown()


def test_malformed_model_answers_end_in_the_dlq(settings, redis_client, env_server):
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    model, model_url = start_in_thread(malformed_rate=1.0)
    rt = WorkerRuntime(settings, name="bad-model")
    try:
        job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1")
        assert rt.run(job.job_id, ep.episode_id) == "failed"
        (letter,) = DeadLetterQueue(redis_client, settings).list()
        assert letter.reason == errors.MODEL_MALFORMED
        closing = [r for r in stream_records(redis_client, settings) if isinstance(r, AttemptRecord)]
        assert closing[-1].status == "failed" and closing[-1].reason == errors.MODEL_MALFORMED
    finally:
        rt.stop()
        model.shutdown()


def test_hanging_env_server_is_a_clear_reason_not_a_stuck_episode(settings, redis_client, model_server):
    from examples.envserver import start_in_thread

    _, model_url = model_server
    env, env_url = start_in_thread(latency_ms=2000)
    s = settings.replace(env_read_timeout_s=0.3, env_retries=0)
    rt = WorkerRuntime(s, name="hang")
    try:
        job, (ep,) = make_job(redis_client, s, env_url=env_url, llm_url=model_url + "/v1", max_attempts=1)
        t0 = time.monotonic()
        assert rt.run(job.job_id, ep.episode_id) == "failed"
        assert time.monotonic() - t0 < 10
        (letter,) = DeadLetterQueue(redis_client, s).list()
        assert letter.reason == errors.ENV_UNREACHABLE and "after 1 attempts" in letter.error
    finally:
        rt.stop()
        env.shutdown()


def test_dead_workers_episodes_rerun_within_the_lease_bound(settings, procs, env_server, redis_client, tmp_path):
    """SIGKILL a worker mid-episode: its episodes start again (attempt 2) from a fresh reset within
    about lease TTL + sweep interval. (Resuming
    is off here, so that every re-run shows as a reset; tests/test_resume.py has the resumed ones.)"""
    from examples.model_standin import start_in_thread

    env, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=500)
    try:
        s = settings.replace(llm_base_url=slow_url + "/v1", no_resume=True)
        procs.settings = s
        tasks = tmp_path / "long.yaml"
        tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                         f"    env_params: {{low: 1, high: 100000, max_turns: 20}}\n    env_num: 3\n")
        sub = submit(redis_client, s, [str(tasks)])
        ledger = Ledger(redis_client, Keys(s.key_prefix))
        procs.worker("w1")
        wait_for(lambda: ledger.counts(sub.job.job_id)["running"] == 3, 60, what="3 running")
        # The survivor is up before the kill: what is measured is the reclaim, not how long a
        # Celery worker takes to start on a busy machine.
        procs.worker("w2")
        wait_for(lambda: " ready." in procs.log("w2"), 120, what="w2 ready")
        resets_before = env.stats()["resets"]
        procs.kill("w1")
        killed_at = time.monotonic()
        eps = list(ledger.states(sub.job.job_id))
        wait_for(lambda: all(ledger.attempts(sub.job.job_id, e) >= 2 for e in eps), 120, what="attempt 2 started")
        took = time.monotonic() - killed_at
        bound = s.lease_ttl_s + s.sweep_interval_s + 20  # + scheduling on a loaded machine
        assert took < bound, f"re-run after {took:.1f}s, bound {bound:.1f}s"
        # From a fresh reset: START counts the attempt a moment before the worker's reset
        # reaches the env server, so the resets are awaited, not read at once.
        wait_for(lambda: env.stats()["resets"] >= resets_before + 3, 60, what="attempt 2's fresh resets")
        # Not the broker's redelivery: the transport keeps no copy of a delivered message.
        assert not redis_client.exists("unacked") and not redis_client.exists("unacked_index")
    finally:
        slow.shutdown()


def test_a_reclaimed_attempt_names_the_worker_that_held_its_lease(settings, redis_client, tmp_path):
    """A lease's token is the one place that names its worker, and it is gone once the lease
    expired: the sweeps note the token of a lease running out, and the reclaim's attempt record,
    abandoned or failed, names the worker (the attempts table's ``worker``)."""
    from broker.recovery import Sweeper
    from broker.states import AttemptStatus, LedgerState

    s = settings.replace(lease_ttl_s=2.0, sweep_interval_s=0.25)
    keys = Keys(s.key_prefix)
    job, eps = _episodes("jobw", 2)
    job.max_attempts = 2
    ledger = Ledger.for_settings(redis_client, s)
    ledger.create_job(job, eps)
    sweeper = Sweeper(redis_client, s)

    def swept_until(state: str, n: int) -> bool:
        sweeper.tick()
        return ledger.counts("jobw")[state] == n

    e1, e2 = (e.episode_id for e in eps)
    ledger.start("jobw", e1, "gpu-box-7-41213")
    ledger.start("jobw", e2, "gpu-box-7:41214")  # a colon in a name too
    wait_for(lambda: swept_until(LedgerState.QUEUED, 2), 20, interval=0.2, what="both lost attempts re-queued")
    ledger.start("jobw", e1, "gpu-box-8-5150")
    wait_for(lambda: swept_until(LedgerState.FAILED, 1), 20, interval=0.2, what="the last attempt dead-lettered")
    records = [unpack(f[b"r"]) for _, f in redis_client.xrange(keys.results)]
    expected = [(e1, 1, AttemptStatus.ABANDONED, "gpu-box-7-41213"), (e1, 2, AttemptStatus.FAILED, "gpu-box-8-5150"),
                (e2, 1, AttemptStatus.ABANDONED, "gpu-box-7:41214")]
    closes = sorted((r.episode_id, r.attempt, r.status, r.worker) for r in records if isinstance(r, AttemptRecord))
    assert closes == expected and {r.reason for r in records if isinstance(r, AttemptRecord)} == {errors.WORKER_LOST}
    store = open_store(str(tmp_path / "results.sqlite"))
    try:
        store.write_batch(records)
        rows = store.sql("SELECT episode_id, attempt, status, worker FROM attempts ORDER BY episode_id, attempt")
    finally:
        store.close()
    assert [tuple(r) for r in rows] == expected


def test_a_killed_workers_attempts_name_it_in_the_store(settings, procs, env_server, redis_client, tmp_path):
    """A worker process SIGKILLed mid-episode: the other processes' sweeps reclaim its attempts,
    and their rows in the attempts table name it (as its lease token did)."""
    from examples.model_standin import start_in_thread

    env, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=500)
    try:
        s = settings.replace(llm_base_url=slow_url + "/v1", no_resume=True)
        procs.settings = s
        tasks = tmp_path / "long.yaml"
        tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                         f"    env_params: {{low: 1, high: 100000, max_turns: 20}}\n    env_num: 2\n")
        sub = submit(redis_client, s, [str(tasks)])
        job = sub.job.job_id
        keys = Keys(s.key_prefix)
        ledger = Ledger(redis_client, keys)
        procs.worker("w1")
        wait_for(lambda: ledger.counts(job)["running"] == 2, 60, what="2 running")
        held = {e: redis_client.get(keys.lease(e)).decode().rsplit(":", 2)[0] for e in ledger.states(job)}
        procs.worker("w2")
        procs.consumer()
        wait_for(lambda: " ready." in procs.log("w2"), 120, what="w2 ready")
        procs.kill("w1")
        store = open_store(s.results_store)
        try:
            def lost_rows():
                rows = store.sql("SELECT episode_id, worker FROM attempts WHERE job_id = ? AND reason = ?",
                                 (job, errors.WORKER_LOST))
                return rows if len(rows) == 2 else None

            rows = wait_for(lost_rows, 120, what="both lost attempts stored")
        finally:
            store.close()
        assert {r[0]: r[1] for r in rows} == held and all(w.rsplit("-", 1)[1].isdigit() for w in held.values())
    finally:
        slow.shutdown()


def test_instances_of_dead_lettered_lost_attempts_are_closed(settings, redis_client, env_server):
    """A worker died mid-episode on its last attempt: the sweeper dead-letters the episode and
    names its env instance as an orphan, which a worker's OrphanCloser closes (no later
    attempt would ever touch that instance again)."""
    from broker.keys import env_instance_id
    from broker.recovery import Sweeper
    from workers.envclient import EnvClient
    from workers.orphans import OrphanCloser

    env, env_url = env_server
    s = settings.replace(lease_ttl_s=2)
    job, (ep,) = make_job(redis_client, s, env_url=env_url, llm_url="http://127.0.0.1:9/v1", max_attempts=1)
    ledger = Ledger.for_settings(redis_client, s)
    started = ledger.start(job.job_id, ep.episode_id, "doomed-worker")
    assert started.status == "ok"
    lease = started.lease
    instance = env_instance_id(ep.episode_id, lease.attempt, lease.attempt_id)
    client = EnvClient(s)
    client.reset(env_url, ep.env_name, instance, ep.env_params, ep.seed, deadline=time.monotonic() + 10)
    live_before = env.stats()["live"]
    # The worker is gone: no renewal. After the TTL and its grace the sweeper gives up on it.
    report = wait_for(lambda: (r := Sweeper(redis_client, s).tick()) and r.dead and r, 15, what="dead-lettered")
    assert report.dead == [f"{job.job_id} {ep.episode_id}"]
    closer = OrphanCloser(redis_client, Keys(s.key_prefix), client)
    closer.tick()
    assert env.stats()["live"] == live_before - 1
    assert redis_client.llen(Keys(s.key_prefix).orphans) == 0
    client.shutdown()


def _episodes(job_id: str, n: int):
    from broker.records import EpisodeSpec, JobSpec

    job = JobSpec(job_id=job_id, llm_base_url="http://127.0.0.1:9/v1", model="stand-in", episodes=n, groups=1)
    eps = [EpisodeSpec(job_id=job_id, episode_id=f"{job_id}.1.1.1.{k}", group_id=f"{job_id}.1.1.1", group_size=n,
                       env_name="arith", base_url="http://127.0.0.1:9", env_params={}, seed=k, queue="q")
           for k in range(1, n + 1)]
    return job, eps


def _interleave(monkeypatch, client, at_call: int, action) -> None:
    """Run ``action`` right before the ``at_call``-th pipeline the submit opens (between its chunks)."""
    real, calls = client.pipeline, [0]

    def pipeline(*a, **kw):
        calls[0] += 1
        if calls[0] == at_call:
            action()
        return real(*a, **kw)

    monkeypatch.setattr(client, "pipeline", pipeline)


def test_housekeeping_during_a_submit_keeps_the_job(settings, redis_client, monkeypatch):
    """Housekeeping that runs while a job is written (claimed and indexed, its spec not yet
    there) leaves it alone: the job stays indexed, reconciled and visible."""
    import redis as redis_lib

    from broker.recovery import Sweeper

    keys = Keys(settings.key_prefix)
    other = redis_lib.Redis.from_url(settings.redis_url)  # housekeeping's own connection
    sweeper = Sweeper(other, settings)
    seen = {}

    def housekeeping():
        seen["spec"] = redis_client.exists(keys.job_spec("jobh"))
        sweeper._last_housekeeping = 0.0
        sweeper._housekeeping()

    _interleave(monkeypatch, redis_client, 2, housekeeping)  # after the first of three chunks
    job, eps = _episodes("jobh", 6)
    Ledger(redis_client, keys).create_job(job, eps, chunk=2)
    monkeypatch.undo()
    assert seen == {"spec": 0}  # it did run in between
    ledger = Ledger(redis_client, keys)
    assert "jobh" in ledger.job_ids()
    assert ledger.counts("jobh")["queued"] == 6 and len(ledger.states("jobh")) == 6
    assert redis_client.ttl(keys.job_state("jobh")) == -1  # no retention started on it
    assert not redis_client.exists(keys.job_submitting("jobh"))
    sweeper._last_housekeeping = 0.0
    sweeper._housekeeping()
    assert "jobh" in ledger.job_ids()
    other.close()


def test_a_submit_that_died_after_its_claim_is_forgotten_with_its_keys(settings, redis_client, monkeypatch):
    """The producer died between claiming the id and writing the spec: once its marker
    expired, housekeeping forgets the job and deletes what the submit had written."""
    from broker.recovery import Sweeper

    keys = Keys(settings.key_prefix)

    def crash():
        raise KeyboardInterrupt("the producer dies")

    _interleave(monkeypatch, redis_client, 2, crash)
    job, eps = _episodes("jobd", 6)
    with pytest.raises(KeyboardInterrupt):
        Ledger(redis_client, keys).create_job(job, eps, chunk=2, marker_ttl_s=0.5)
    monkeypatch.undo()
    assert redis_client.exists(keys.job_state("jobd"))  # one chunk written
    sweeper = Sweeper(redis_client, settings)
    sweeper._housekeeping()
    assert "jobd" in Ledger(redis_client, keys).job_ids()  # marker still alive: being written
    wait_for(lambda: not redis_client.exists(keys.job_submitting("jobd")), 10, what="marker expiry")
    sweeper._last_housekeeping = 0.0
    sweeper._housekeeping()
    assert "jobd" not in Ledger(redis_client, keys).job_ids()
    assert not redis_client.exists(*keys.job_keys("jobd"))


def test_a_sweeper_that_slept_through_an_outage_does_not_reclaim_lapsed_leases(settings, redis_client):
    """No sweep reached Redis for longer than half a lease TTL (Redis was away; this sweeper
    saw no error of its own), and the leases of live attempts lapsed meanwhile. The first sweep
    afterwards holds reclaims for two TTLs, so the attempts' renewals take their leases back
    first; a lease nobody takes back is reclaimed once the hold is over."""
    from broker.recovery import Sweeper

    s = settings.replace(lease_ttl_s=2.0, sweep_interval_s=0.25)
    keys = Keys(s.key_prefix)
    job, eps = _episodes("jobo", 2)
    ledger = Ledger.for_settings(redis_client, s)
    ledger.create_job(job, eps)
    alive = ledger.start("jobo", eps[0].episode_id, "w-alive").lease
    dead = ledger.start("jobo", eps[1].episode_id, "w-dead").lease
    sweeper = Sweeper(redis_client, s)
    assert not sweeper.tick().reclaimed
    time.sleep(s.lease_ttl_s * 1.5)  # the outage: no sweep, no renewal; both leases lapse
    assert not redis_client.exists(keys.lease(alive.episode_id), keys.lease(dead.episode_id))
    report = sweeper.tick()
    assert not report.reclaimed and not report.dead
    ledger.renew([alive])  # the live attempt's renewer comes back
    assert not alive.lost.is_set()

    def renew_then_sweep():
        ledger.renew([alive])  # the live attempt goes on renewing
        return sweeper.tick().reclaimed

    reclaimed = wait_for(renew_then_sweep, 20, interval=0.25, what="the dead attempt reclaimed")
    assert reclaimed == [dead.member]
    assert ledger.state("jobo", alive.episode_id) == "running" and not alive.lost.is_set()
    assert ledger.attempts("jobo", alive.episode_id) == 1


def test_a_lease_that_lapsed_in_an_outage_and_was_never_taken_back_costs_no_attempt(settings, redis_client):
    """The holder of a lease died while no sweeper reached Redis (a worker stopped during an
    outage, killed at its shutdown deadline while it waited to hand its episode back). After
    the hold the lease is reclaimed, its attempt not counted: on its last attempt the episode is
    queued again, with one more attempt allowed, not dead-lettered. A lease that expires with
    Redis there all along is still counted (the same last attempt: a dead letter)."""
    from broker.recovery import Sweeper

    s = settings.replace(lease_ttl_s=2.0, sweep_interval_s=0.25)
    keys = Keys(s.key_prefix)
    job, eps = _episodes("jobu", 2)
    job.max_attempts = 1
    ledger = Ledger.for_settings(redis_client, s)
    ledger.create_job(job, eps)
    gone = ledger.start("jobu", eps[0].episode_id, "w-stopped-in-the-outage").lease
    sweeper = Sweeper(redis_client, s)
    assert not sweeper.tick().reclaimed
    time.sleep(s.lease_ttl_s * 1.5)  # the outage: no sweep, no renewal; the holder dies meanwhile
    report = sweeper.tick()
    assert not report.reclaimed and not report.dead  # held first: a live holder would take it back
    reclaimed = wait_for(lambda: sweeper.tick().reclaimed, 20, interval=0.2, what="the lapsed lease reclaimed")
    assert reclaimed == [gone.member]
    assert ledger.state("jobu", gone.episode_id) == "queued"
    assert ledger.attempt_limit("jobu", gone.episode_id, job.max_attempts) == 2
    assert DeadLetterQueue(redis_client, s).list(job_id="jobu") == []
    (closed,) = [r for _, f in redis_client.xrange(keys.results) if isinstance(r := unpack(f[b"r"]), AttemptRecord)]
    assert closed.reason == errors.WORKER_LOST and closed.status == "abandoned"
    assert "while Redis was unreachable" in closed.error and "not counted" in closed.error

    # No outage: sweeps every quarter second while the next lease expires. Counted.
    lost = ledger.start("jobu", eps[1].episode_id, "w-crashed").lease
    dead = wait_for(lambda: sweeper.tick().dead, 20, interval=0.2, what="the expired lease dead-lettered")
    assert dead == [lost.member]
    (letter,) = DeadLetterQueue(redis_client, s).list(job_id="jobu")
    assert letter.reason == errors.WORKER_LOST and "not counted" not in letter.error
