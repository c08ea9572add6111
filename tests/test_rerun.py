"""``interactor job JOB rerun EPISODE``: a completed episode runs again as a new attempt from a
fresh reset (broker/rerun.py), its earlier trajectory kept in the store as superseded
(consumer/storage/plan.py), the audit log saying who and when; refused with a clear line and
exit 2 for a cancelled job, a feed job, an unknown episode or job, and an episode that has not
finished. Real Redis, a real worker and consumer, the stand-in servers on loopback."""

from __future__ import annotations

import sqlite3

import pytest

from broker.audit import JobAudit
from broker.keys import Keys
from broker.ledger import Ledger
from broker.states import LedgerState, StoredStatus
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.taskfiles import write_arith_tasks
from tests.test_ledger import JOB, ep_id, make_job
from tests.test_recovery import cli


def _rows(db: str, sql: str, *args):
    con = sqlite3.connect(db)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


@pytest.mark.integration
def test_rerun_of_a_completed_episode_of_a_finished_job(settings, procs, env_server, model_server, redis_client,
                                                        tmp_path):
    _, env_url = env_server
    _, model_url = model_server
    settings = settings.replace(llm_base_url=model_url + "/v1", store_url=str(tmp_path / "results.sqlite"))
    procs.settings = settings
    sub = submit(redis_client, settings, [write_arith_tasks(tmp_path, env_url, rows=2, env_num=2)])
    job = sub.job.job_id
    ledger = Ledger.for_settings(redis_client, settings)
    procs.worker("w1")
    procs.consumer()
    db = settings.results_store

    def store_status(status: str, n: int) -> bool:
        try:
            got = _rows(db, "SELECT COUNT(*) FROM episodes WHERE job_id = ? AND status = ?", job, status)
        except sqlite3.OperationalError:  # the consumer has not made its tables yet
            return False
        return got[0][0] == n

    total = sub.job.episodes
    wait_for(lambda: store_status(StoredStatus.COMPLETED, total), 120, what="the job completed in the store")
    assert ledger.counts(job)[LedgerState.DONE] == total
    episode = sorted(ledger.states(job))[0]
    ((old_attempt, old_reward, old_steps),) = _rows(
        db, "SELECT completed_attempt_id, total_reward, steps FROM episodes WHERE episode_id = ?", episode)
    assert old_steps >= 1

    out = cli(settings, "job", job, "rerun", episode, "--as", "dana")
    assert out.returncode == 0, out.stderr
    assert "1 completed episodes run again" in out.stdout
    entry = JobAudit(redis_client, Keys(settings.key_prefix)).entries(job)[0]
    assert (entry["action"], entry["who"], entry["detail"]["episodes"]) == ("rerun", "dana", [episode])
    assert entry["at"] > 0

    def rerun_completed() -> bool:
        row = _rows(db, "SELECT status, completed_attempt_id FROM episodes WHERE episode_id = ?", episode)
        return row[0][0] == StoredStatus.COMPLETED and row[0][1] not in ("", old_attempt)

    wait_for(rerun_completed, 120, what="the rerun's attempt completed in the store")
    wait_for(lambda: ledger.counts(job)[LedgerState.DONE] == total, 30, what="the job finished again in the ledger")
    ((new_attempt, reward, steps, attempts),) = _rows(
        db, "SELECT completed_attempt_id, total_reward, steps, attempts FROM episodes WHERE episode_id = ?", episode)
    assert attempts >= 2 and steps >= 1
    # the trajectory is the new attempt's alone; the old one is kept aside, as a rerun
    assert {a for (a,) in _rows(db, "SELECT DISTINCT attempt_id FROM session_steps WHERE session_id = ?",
                                episode)} == {new_attempt}
    assert _rows(db, "SELECT DISTINCT attempt_id, superseded_reason FROM superseded_steps WHERE session_id = ?",
                 episode) == [(old_attempt, "rerun")]
    (((stored_reward,),)) = _rows(db, "SELECT SUM(step_reward) FROM session_steps WHERE session_id = ?", episode)
    assert reward == pytest.approx(stored_reward) and old_reward == pytest.approx(reward)  # the stand-in is exact
    # the other episodes are as they were
    assert store_status(StoredStatus.COMPLETED, total)


def test_rerun_refusals_say_why_and_change_nothing(settings, redis_client):
    keys = Keys(settings.key_prefix)
    ledger = Ledger.for_settings(redis_client, settings)
    job, eps = make_job()
    ledger.create_job(job, eps)
    lease = ledger.start(JOB, ep_id(2), "w1").lease
    assert lease is not None
    before = ledger.states(JOB)

    def refused(*args: str, says: str) -> None:
        out = cli(settings, "job", *args)
        assert out.returncode == 2, out.stdout + out.stderr
        assert says in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, \
            out.stderr

    refused(JOB, "rerun", ep_id(1), says="not finished, so not run again: " + f"{ep_id(1)} (queued)")
    refused(JOB, "rerun", ep_id(2), says=f"{ep_id(2)} (running)")
    refused(JOB, "rerun", "nope", says=f"job {JOB!r} has no episode 'nope'")
    refused("no-such-job", "rerun", ep_id(1), says="no job 'no-such-job' in Redis")
    refused(JOB, "rerun", says="say which episodes")
    redis_client.sadd(keys.feeds, JOB)
    refused(JOB, "rerun", ep_id(1), says="serves an online-RL feed")
    redis_client.srem(keys.feeds, JOB)
    assert cli(settings, "cancel", JOB, "--wait", "0").returncode == 0
    refused(JOB, "rerun", ep_id(1), says="was cancelled")
    assert {e: s for e, s in ledger.states(JOB).items() if e != ep_id(1) and e != ep_id(2)} == \
        {e: s for e, s in ledger.states(JOB).items() if e != ep_id(1) and e != ep_id(2)}
    assert before[ep_id(2)] == LedgerState.RUNNING
    assert [e["action"] for e in JobAudit(redis_client, keys).entries(JOB)] == ["cancel"]  # no rerun logged
