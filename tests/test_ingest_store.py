"""The consumer against a real Redis and real stores (a SQLite file, a real PostgreSQL): what it
does with records the store refuses, with a store it cannot write, and with a completion whose
steps never all arrive."""

from __future__ import annotations

import orjson
import pytest

from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import AttemptRecord, EpisodeSpec, JobSpec, StepRecord
from broker.states import LedgerState
from consumer.ingest import GROUP, Ingestor
from consumer.storage import open_store

JOB = "jobi"


def step(n, *, ep="jobi.e1", last=False, tokens=None, response="ok", aid="A1"):
    return StepRecord(job_id=JOB, env_id=ep, attempt=1, step_id=n, env_name="arith", llm_model="m", group_id="g1",
                      messages_json=orjson.dumps([{"role": "user", "content": f"turn {n}"}]), response=response,
                      step_reward=1.0, cumulative_reward=float(n), terminated=last, truncated=False,
                      episode_finished=last, is_trainable=True, attempt_id=aid, created_at=1000.0 + n,
                      prompt_tokens=tokens, completion_tokens=tokens)


def completed(steps, *, ep="jobi.e1", aid="A1"):
    return AttemptRecord(job_id=JOB, episode_id=ep, attempt=1, status="completed", group_id="g1", group_size=1,
                         env_name="arith", llm_model="m", total_reward=float(steps), steps=steps, attempt_id=aid,
                         started_at=1000.0, finished_at=1100.0, ended_by="terminated")


@pytest.fixture
def ledger_job(settings, redis_client):
    """A one-episode job in the ledger, its episode done (the records below are its attempt)."""
    ledger = Ledger.for_settings(redis_client, settings)
    ledger.create_job(JobSpec(job_id=JOB, llm_base_url="http://llm", model="m", episodes=1, groups=1),
                      [EpisodeSpec(job_id=JOB, episode_id="jobi.e1", group_id="g1", group_size=1, env_name="arith",
                                   base_url="http://env", env_params={})])
    assert ledger.move(JOB, "jobi.e1", LedgerState.DONE, [LedgerState.QUEUED])
    return ledger


def publish(client, settings, records):
    for rec in records:
        client.xadd(Keys(settings.key_prefix).results, {"r": rec.pack()})


def drain(ing, rounds=10):
    for _ in range(rounds):
        if not ing.poll_once(block_ms=50) and not ing.pending():
            return


def test_nul_answers_and_huge_token_counts_complete_the_episode(settings, redis_client, store_url, ledger_job):
    store = open_store(store_url)
    try:
        ing = Ingestor(redis_client, settings, store, name="c1")
        publish(redis_client, settings, [step(1, response="a\x00b", tokens=2**40), step(2, last=True),
                                         completed(2)])
        drain(ing)
        assert redis_client.xlen(Keys(settings.key_prefix).poison) == 0
        ep = store.episode("jobi.e1")
        assert ep["status"] == "completed" and ep["prompt_tokens"] == 2**40
        assert store.episode_trajectory("jobi.e1")[0]["response"] == "a\ufffdb"
        assert ing.reopen_lost_completions() == [] and ledger_job.state(JOB, "jobi.e1") == LedgerState.DONE
    finally:
        store.close()


def test_a_parked_step_fails_its_episode_instead_of_rerunning_it(settings, redis_client, store_url, ledger_job):
    # A token count past 64 bits is refused by both stores: steps 2 and 3 are parked (a batch
    # of records that all fail alone is parked too, not waited on). The completion is then
    # short of steps for good: the episode fails as steps_lost in the store and the ledger,
    # instead of being re-run forever.
    store = open_store(store_url)
    try:
        ing = Ingestor(redis_client, settings, store, name="c1")
        publish(redis_client, settings, [step(1)])
        drain(ing)
        publish(redis_client, settings, [step(2, tokens=2**63 + 5), step(3, tokens=2**63 + 7)])
        drain(ing)
        assert ing.pending() == 0
        assert redis_client.xlen(Keys(settings.key_prefix).poison) == 2
        publish(redis_client, settings, [completed(3)])
        drain(ing)
        ing.reopen_lost_completions()
        assert ing.stats["reopened"] == 0
        ep = store.episode("jobi.e1")
        assert ep["status"] == "failed" and ep["reason"] == "steps_lost", ep
        assert ledger_job.state(JOB, "jobi.e1") == LedgerState.FAILED
        assert ledger_job.counts(JOB)[LedgerState.FAILED] == 1 and ledger_job.counts(JOB)[LedgerState.QUEUED] == 0
        assert store.group("g1")["failed"] == 1
    finally:
        store.close()


def test_lost_steps_rerun_at_most_the_setting(settings, redis_client, tmp_path, ledger_job):
    store = open_store(str(tmp_path / "r.sqlite"))
    try:
        ing = Ingestor(redis_client, settings.replace(consumer_reopens_max=1), store, name="c1")
        publish(redis_client, settings, [step(1), completed(2)])  # step 2 lost in Redis
        drain(ing)
        ing.reopen_lost_completions()  # (the first poll may have done it already)
        assert ing.stats["reopened"] == 1 and store.episode("jobi.e1")["status"] == "retrying"
        assert ledger_job.state(JOB, "jobi.e1") == LedgerState.QUEUED
        assert ledger_job.move(JOB, "jobi.e1", LedgerState.DONE, [LedgerState.QUEUED])  # the re-run, short again
        publish(redis_client, settings, [step(1, aid="A2"), completed(2, aid="A2")])
        drain(ing)
        ing.reopen_lost_completions()
        assert ing.stats["reopened"] == 1
        ep = store.episode("jobi.e1")
        assert (ep["status"], ep["reason"], ep["reopens"]) == ("failed", "steps_lost", 1)
        assert ledger_job.state(JOB, "jobi.e1") == LedgerState.FAILED
    finally:
        store.close()


@pytest.mark.parametrize("fault", ["undefined table", "permission denied"])
def test_a_lone_record_the_store_cannot_write_stays_pending(settings, redis_client, pg_server, fault):
    # Neither is the record's fault: it must wait for the store, never be parked and acknowledged.
    import psycopg

    url = pg_server.create_database()
    open_store(url).close()
    with psycopg.connect(url, autocommit=True) as conn:
        if fault == "undefined table":
            conn.execute("DROP TABLE session_steps")
            writer_url = url
        else:
            # A writer whose grant on session_steps was revoked (roles are the server's, shared
            # by the session's databases).
            conn.execute("DO $$ BEGIN CREATE ROLE intr_writer LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; "
                         "END $$")
            conn.execute("GRANT USAGE, CREATE ON SCHEMA public TO intr_writer")
            conn.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO intr_writer")
            conn.execute("REVOKE INSERT ON session_steps FROM intr_writer")
            writer_url = url.replace("postgres@", "intr_writer@", 1)
            assert writer_url != url
    store = open_store(writer_url)
    try:
        ing = Ingestor(redis_client, settings, store, name="c1")
        publish(redis_client, settings, [step(1)])
        ing.poll_once(block_ms=50)
        assert redis_client.xlen(Keys(settings.key_prefix).poison) == 0
        assert ing.pending() == 1 and ing.stats["store_waits"] == 1
        assert redis_client.xpending(Keys(settings.key_prefix).results, GROUP)["pending"] == 1
    finally:
        store.close()
