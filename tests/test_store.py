"""The results store on both backends (a SQLite file, a real PostgreSQL): the original tables,
every rule of consumer/storage/plan.py, redelivery, migration of an old file, exports."""

from __future__ import annotations

import json
import math
import sqlite3

import msgpack
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from broker.records import AttemptRecord, EpisodesEnqueued, JobSpec, StepRecord, unpack
from consumer.export import export_training, parquet_schema
from consumer.storage import StoreError, open_store

JOB = "job1"

ORIGINAL_JOB_ENVIRONMENTS = ["id", "job_id", "env_id", "env_name", "env_params", "image", "group_id", "finished",
                             "is_deleted", "created_at"]
ORIGINAL_SESSION_STEPS = ["id", "session_id", "step_id", "env_name", "llm_model", "group_id", "job_id", "messages",
                          "response", "step_reward", "reward", "env_state", "is_terminal", "is_truncated",
                          "is_session_completed", "is_trainable", "created_at"]


def step(ep, n, *, attempt=1, aid=None, reward=1.0, cum=None, last=False, group="g1", env="arith", trainable=True,
         wv="v1", msgs=None, t=None, tokens=None):
    return StepRecord(
        job_id=JOB, env_id=ep, attempt=attempt, step_id=n, env_name=env, llm_model="m", group_id=group,
        messages_json=orjson.dumps(msgs if msgs is not None else [{"role": "system", "content": "sys"},
                                                                  {"role": "user", "content": f"turn {n}"}]),
        response=f"action {ep} a{attempt} s{n}", step_reward=reward, cumulative_reward=cum if cum is not None else reward * n,
        terminated=last, truncated=False, episode_finished=last, is_trainable=trainable, weight_version=wv,
        attempt_id=aid if aid is not None else f"{ep}-a{attempt}", created_at=t if t is not None else 1000.0 + attempt * 100 + n,
        prompt_tokens=tokens, completion_tokens=tokens and tokens // 2,
    )


def close(ep, status="completed", *, attempt=1, aid=None, total=1.0, steps=1, group="g1", size=2, env="arith",
          reason="", started=None):
    return AttemptRecord(job_id=JOB, episode_id=ep, attempt=attempt, status=status, group_id=group, group_size=size,
                         env_name=env, llm_model="m", total_reward=total, steps=steps, reason=reason,
                         attempt_id=aid if aid is not None else f"{ep}-a{attempt}",
                         started_at=started if started is not None else 1000.0 + attempt * 100,
                         finished_at=1000.0 + attempt * 100 + 50, ended_by="terminated" if status == "completed" else "")


def episode(ep, rewards, *, attempt=1, group="g1", size=2, env="arith", aid=None):
    recs, cum = [], 0.0
    for i, r in enumerate(rewards, 1):
        cum += r
        recs.append(step(ep, i, attempt=attempt, aid=aid, reward=r, cum=cum, last=i == len(rewards), group=group,
                         env=env))
    recs.append(close(ep, attempt=attempt, aid=aid, total=cum, steps=len(rewards), group=group, size=size, env=env))
    return recs


def job(n=4, groups=2):
    return JobSpec(job_id=JOB, llm_base_url="http://llm", model="m", episodes=n, groups=groups)


def announce(*episodes):
    return EpisodesEnqueued(JOB, [[ep, env, group, orjson.dumps({"dataset": {"q": ep}})]
                                  for ep, env, group in episodes], created_at=999.0)


@pytest.fixture
def store(store_url):
    s = open_store(store_url)
    yield s
    s.close()


def trajectory(store, ep):
    return [(r["step_id"], r["attempt_id"]) for r in store.episode_trajectory(ep)]


def set_aside(store, ep):
    return {(r["attempt_id"], r["step_id"]): r["superseded_reason"] for r in store.superseded_steps(ep)}


# --- the original tables --------------------------------------------------------------------

def test_original_tables_and_queries(store):
    store.write_batch([job(3, 2), announce(("e1", "arith", "g1"), ("e2", "arith", "g1"), ("f1", "guess", "g2"))]
                      + episode("e1", [0.5, 1.5]) + [step("f1", 1, group="g2", env="guess")])
    assert column_names(store, "job_environments")[:len(ORIGINAL_JOB_ENVIRONMENTS)] == ORIGINAL_JOB_ENVIRONMENTS
    assert column_names(store, "session_steps")[:len(ORIGINAL_SESSION_STEPS)] == ORIGINAL_SESSION_STEPS
    # The three queries of the original documentation, as written.
    rows = store.sql("SELECT id, env_name, group_id, finished, created_at FROM job_environments "
                     "ORDER BY created_at DESC LIMIT 20")
    assert sorted((r[1], r[2], r[3]) for r in rows) == [("arith", "g1", 0), ("arith", "g1", 1), ("guess", "g2", 0)]
    rows = store.sql("SELECT step_id, step_reward, reward, is_terminal, created_at FROM session_steps "
                     "WHERE session_id = 'e1' ORDER BY step_id")
    assert [tuple(r[:4]) for r in rows] == [(1, 0.5, 0.5, 0), (2, 1.5, 2.0, 1)]
    rows = store.sql("SELECT env_name, COUNT(*) AS episodes, AVG(reward) AS avg_reward, MAX(reward) AS best_reward "
                     "FROM session_steps WHERE is_session_completed = 1 GROUP BY env_name")
    assert [tuple(r) for r in rows] == [("arith", 1, 2.0, 2.0)]
    # The flags are booleans, as the original system's ORM declares them: its users filter on
    # them bare, and the documentation's "= 1" works too (on PostgreSQL through the schema's
    # boolean = integer operator).
    for table, flags in (("job_environments", ("finished", "is_deleted")),
                         ("session_steps", ("is_terminal", "is_truncated", "is_session_completed", "is_trainable"))):
        assert {c: t for c, t in column_types(store, table).items() if c in flags} == {c: "boolean" for c in flags}
    rows = store.sql("SELECT session_id, step_id FROM session_steps WHERE is_session_completed ORDER BY session_id")
    assert [tuple(r) for r in rows] == [("e1", 2)]
    rows = store.sql("SELECT session_id, step_id FROM session_steps WHERE NOT is_session_completed AND is_trainable "
                     "ORDER BY session_id, step_id")
    assert [tuple(r) for r in rows] == [("e1", 1), ("f1", 1)]
    assert [tuple(r) for r in store.sql("SELECT env_id FROM job_environments WHERE finished")] == [("e1",)]
    assert [tuple(r) for r in store.sql("SELECT env_id FROM job_environments WHERE finished = 1")] == [("e1",)]
    assert len(store.sql("SELECT env_id FROM job_environments WHERE finished = 0 AND is_deleted = 0")) == 2
    assert len(store.sql("SELECT env_id FROM job_environments WHERE finished <> 1 AND NOT is_deleted")) == 2
    assert store.sql("SELECT COUNT(*) FROM session_steps WHERE is_terminal = 1 OR is_truncated = 1")[0][0] == 1
    assert tuple(store.sql("SELECT COUNT(*), SUM(finished) FROM job_environments")[0]) == (3, 1)
    assert store.sql("SELECT SUM(is_trainable) FROM session_steps WHERE session_id = 'none'")[0][0] is None
    # env_params as the env got them, env_state as the original wrote it.
    params = store.sql("SELECT env_params FROM job_environments WHERE env_id = 'e2'")[0][0]
    assert json.loads(params) == {"dataset": {"q": "e2"}}
    assert {r["env_state"]["weight_version"] for r in store.episode_trajectory("e1")} == {"v1"}


def test_job_environments_image_is_the_entrys_env_image_or_empty_as_the_original_stores_it(store):
    """An announced episode's image is its entry's env_image (the record's ``images``); an
    episode without one, or a record of an older producer (no ``images``), is stored "", as the
    original stores an entry without one."""
    params = orjson.dumps({"dataset": {}})
    newer = EpisodesEnqueued(JOB, [["i1", "qa_gym", "g1", params], ["i2", "dabstepgym", "g2", params]],
                             created_at=999.0, images={"i1": "registry.example/qa-gym:1.3"})
    older = newer.to_dict() | {"episodes": [["i3", "dabstepgym", "g3", params]]}
    del older["images"]
    store.write_batch([job(3, 3), newer, unpack(msgpack.packb(older, use_bin_type=True))])
    rows = store.sql("SELECT env_id, image FROM job_environments ORDER BY env_id")
    assert [tuple(r) for r in rows] == [("i1", "registry.example/qa-gym:1.3"), ("i2", ""), ("i3", "")]


def column_names(store, table):
    if hasattr(store, "path"):
        return [r[1] for r in store.sql(f"PRAGMA table_info({table})")]
    return [r[0] for r in store.sql("SELECT column_name FROM information_schema.columns WHERE table_name = ? "
                                    "ORDER BY ordinal_position", (table,))]


def column_types(store, table):
    """column -> type, lower case ("boolean", "bigint", "text", ...)."""
    if hasattr(store, "path"):
        return {r[1]: r[2].lower() for r in store.sql(f"PRAGMA table_info({table})")}
    return {r[0]: r[1] for r in store.sql("SELECT column_name, data_type FROM information_schema.columns "
                                          "WHERE table_name = ?", (table,))}


@pytest.mark.unit
def test_sqlite_commits_are_durable(tmp_path):
    s = open_store(str(tmp_path / "r.sqlite"))
    try:
        assert s.sql("PRAGMA journal_mode")[0][0] == "wal"
        assert s.sql("PRAGMA synchronous")[0][0] == 2  # FULL: synced before the consumer acknowledges
    finally:
        s.close()


def test_steps_in_order_and_redelivery_stores_once(store):
    recs = [job()] + episode("e1", [1.0, 2.0, 0.5])
    store.write_batch(recs)
    store.write_batch(recs)  # redelivered after a consumer crash
    store.write_batch(list(reversed(recs)))  # and out of order
    assert trajectory(store, "e1") == [(1, "e1-a1"), (2, "e1-a1"), (3, "e1-a1")]
    ep = store.episode("e1")
    assert ep["status"] == "completed" and ep["steps"] == 3 and ep["total_reward"] == 3.5 and ep["attempts"] == 1
    assert store.sql("SELECT COUNT(*) FROM attempts")[0][0] == 1
    assert store.sql("SELECT COUNT(*) FROM superseded_steps")[0][0] == 0


# --- attempts -----------------------------------------------------------------------------

def test_newer_attempt_takes_over_and_late_steps_are_set_aside(store):
    store.write_batch([step("e1", 1), step("e1", 2)])
    assert trajectory(store, "e1") == [(1, "e1-a1"), (2, "e1-a1")]
    store.write_batch([step("e1", 1, attempt=2)])  # attempt 2 starts: attempt 1 moves aside
    assert trajectory(store, "e1") == [(1, "e1-a2")]
    assert set_aside(store, "e1") == {("e1-a1", 1): "superseded", ("e1-a1", 2): "superseded"}
    store.write_batch([step("e1", 3)])  # a late attempt-1 step
    assert set_aside(store, "e1")[("e1-a1", 3)] == "stale"
    store.write_batch(episode("e1", [1.0, 1.0], attempt=2)[1:])
    ep = store.episode("e1")
    assert ep["status"] == "completed" and ep["attempt"] == 2 and ep["steps"] == 2 and ep["attempts"] == 2


def test_attempt_closed_without_completing_keeps_no_trajectory(store):
    store.write_batch([step("e1", 1), step("e1", 2), close("e1", "retrying", reason="env_unreachable", steps=2)])
    assert trajectory(store, "e1") == []
    assert set(set_aside(store, "e1").values()) == {"closed:retrying:env_unreachable"}
    ep = store.episode("e1")
    assert ep["status"] == "retrying" and ep["reason"] == "env_unreachable"
    store.write_batch([step("e1", 3)])  # a step of the closed attempt, late
    assert trajectory(store, "e1") == [] and ("e1-a1", 3) in set_aside(store, "e1")


def test_first_completion_wins(store):
    """Redis lost the 'done' of a completion the database had stored; the sweeper ran the
    episode again. The first trajectory stays; the second is kept aside."""
    store.write_batch(episode("e1", [1.0, 1.0]))
    store.write_batch(episode("e1", [0.0, 0.0, 0.0], attempt=2))
    ep = store.episode("e1")
    assert ep["status"] == "completed" and ep["completed_attempt_id"] == "e1-a1" and ep["total_reward"] == 2.0
    assert trajectory(store, "e1") == [(1, "e1-a1"), (2, "e1-a1")]
    assert set(set_aside(store, "e1").values()) == {"completed_by_other"}
    assert {a["attempt_id"]: a["status"] for a in store.attempts("e1")} == {"e1-a1": "completed",
                                                                             "e1-a2": "completed"}


def test_same_attempt_number_twice_is_never_mixed(store):
    """A Redis rollback issued attempt number 1 twice: run A stored steps 1-2, then run B
    (same number, started later) runs the episode. B's trajectory alone, whatever the order."""
    a = [step("e1", 1, aid="A", t=1000.0), step("e1", 2, aid="A", t=1001.0)]
    b = [step("e1", 1, aid="B", t=2000.0, reward=0.0, cum=0.0), step("e1", 2, aid="B", t=2001.0, reward=0.0, cum=0.0),
         step("e1", 3, aid="B", t=2002.0, last=True, cum=1.0),
         close("e1", aid="B", total=1.0, steps=3, started=1999.0)]
    store.write_batch(a)
    store.write_batch(b[:1])
    store.write_batch(a[1:])  # A's step 2 again, late (another consumer's batch)
    store.write_batch(b[1:])
    assert trajectory(store, "e1") == [(1, "B"), (2, "B"), (3, "B")]
    assert set_aside(store, "e1") == {("A", 1): "rolled_back", ("A", 2): "rolled_back"}
    assert store.episode("e1")["status"] == "completed"


def test_close_before_its_steps_then_completed(store):
    """With several consumers, an attempt's close may be committed before its steps."""
    recs = episode("e1", [1.0, 2.0])
    res = store.write_batch([recs[-1]], ["5-0"])
    assert res.completing == [("e1", "e1-a1", "5-0")]
    ep = store.episode("e1")
    assert ep["status"] == "completing" and ep["total_reward"] == 3.0
    assert store.results(JOB)["job"]["short_trajectories"] == 1
    assert store.completing() == [("e1", JOB, "e1-a1", "5-0")]
    store.write_batch(recs[:-1])
    ep = store.episode("e1")
    assert ep["status"] == "completed" and ep["steps"] == 2
    assert store.results(JOB)["job"]["short_trajectories"] == 0 and store.completing() == []


def test_lost_steps_reopen_the_episode(store):
    store.write_batch([announce(("e1", "arith", "g1"))])
    recs = episode("e1", [1.0, 2.0, 3.0])
    store.write_batch([recs[0], recs[2], recs[3]], ["1-0", "1-2", "1-3"])  # step 2 never arrives
    assert store.episode("e1")["status"] == "completing"
    assert store.reopen_lost_completion("e1", "e1-a1")
    ep = store.episode("e1")
    assert ep["status"] == "retrying" and ep["reason"] == "steps_lost"
    assert trajectory(store, "e1") == [] and set(set_aside(store, "e1").values()) == {"steps_lost"}
    assert not store.reopen_lost_completion("e1", "e1-a1")  # once
    assert store.sql("SELECT finished FROM job_environments WHERE env_id = 'e1'")[0][0] == 0
    store.write_batch(episode("e1", [1.0], attempt=2))  # the re-run completes
    assert store.episode("e1")["status"] == "completed"
    assert store.sql("SELECT finished FROM job_environments WHERE env_id = 'e1'")[0][0] == 1


def test_nul_characters_and_large_token_counts_are_stored(store):
    # A model may answer with a NUL character and count tokens past 2^31; an env's error text
    # may hold a NUL too. PostgreSQL's text cannot hold NUL: both backends store U+FFFD instead.
    ok = step("e1", 1, last=True, tokens=2**40)
    ok.response = "a\x00b"
    bad = close("e2", "failed", reason="env_server_error", steps=0, total=0.0)
    bad.error = "HTTP 500: boom\x00tail"
    store.write_batch([announce(("e1", "arith", "g1"), ("e2", "arith", "g1")), ok, close("e1"), bad])
    (row,) = store.episode_trajectory("e1")
    assert row["response"] == "a\ufffdb" and row["prompt_tokens"] == 2**40 and row["completion_tokens"] == 2**39
    assert store.episode("e1")["status"] == "completed" and store.episode("e1")["prompt_tokens"] == 2**40
    assert store.attempts("e2")[0]["error"] == "HTTP 500: boom\ufffdtail"
    assert store.episode("e2")["status"] == "failed" and store.episode("e2")["error"] == "HTTP 500: boom\ufffdtail"
    assert store.results(JOB)["job"]["prompt_tokens"] == 2**40


def test_lost_steps_fail_the_episode_once_reruns_run_out(store):
    store.write_batch([announce(("e1", "arith", "g1"))])
    recs = episode("e1", [1.0, 2.0], size=1)
    store.write_batch([recs[0], recs[2]], ["1-0", "1-2"])  # step 2 never arrives
    assert store.reopen_lost_completion("e1", "e1-a1", max_reopens=1) == "retrying"
    assert store.episode("e1")["reopens"] == 1
    recs = episode("e1", [1.0, 2.0], attempt=2, size=1)
    store.write_batch([recs[0], recs[2]], ["2-0", "2-2"])  # lost again
    assert store.reopen_lost_completion("e1", "e1-a2", max_reopens=1) == "failed"
    ep = store.episode("e1")
    assert ep["status"] == "failed" and ep["reason"] == "steps_lost" and "after 1 re-run" in ep["error"]
    assert ep["finished_at"] is not None
    assert trajectory(store, "e1") == [] and set(set_aside(store, "e1").values()) == {"steps_lost"}
    g = store.group("g1")
    assert not g["complete"] and g["failed"] == 1 and "steps_lost" in g["incomplete_reason"]
    assert not store.sql("SELECT finished FROM job_environments WHERE env_id = 'e1'")[0][0]
    assert store.completing() == []


def test_a_lost_step_refused_by_the_store_fails_the_episode_at_once(store):
    store.write_batch([announce(("e1", "arith", "g1"))])
    recs = episode("e1", [1.0, 2.0], size=1)
    store.write_batch([recs[0], recs[2]], ["1-0", "1-2"])
    assert store.reopen_lost_completion("e1", "e1-a1", max_reopens=3, poisoned=True) == "failed"
    ep = store.episode("e1")
    assert ep["status"] == "failed" and ep["reason"] == "steps_lost" and "poison" in ep["error"]
    assert store.group("g1")["failed"] == 1


@pytest.mark.parametrize("batches", ["one batch", "close later"])
def test_rerun_numbered_lower_after_a_rollback_completes_the_episode(store, batches):
    # Attempts 1 and 2 of e1 ran and their steps were stored; Redis then lost both STARTs, so
    # the re-run is numbered 1 again (and its worker's clock says it started earlier still).
    store.write_batch([job(2, 1), announce(("e1", "arith", "g1"), ("e2", "arith", "g1"))]
                      + episode("e2", [1.0], size=2))
    store.write_batch([step("e1", 1, attempt=1, aid="A1"), step("e1", 1, attempt=2, aid="A2")])
    assert trajectory(store, "e1") == [(1, "A2")]
    rerun = [step("e1", 1, attempt=1, aid="A3", t=900.0, reward=0.5),
             step("e1", 2, attempt=1, aid="A3", t=901.0, reward=0.5, cum=1.0, last=True),
             close("e1", attempt=1, aid="A3", total=1.0, steps=2, started=899.0)]
    if batches == "one batch":
        store.write_batch(rerun)
    else:
        store.write_batch(rerun[:2])
        assert trajectory(store, "e1") == [(1, "A2")]  # a lower number, running: not the trajectory yet
        store.write_batch(rerun[2:])
    ep = store.episode("e1")
    assert (ep["status"], ep["attempt_id"], ep["steps"], ep["total_reward"]) == ("completed", "A3", 2, 1.0)
    assert trajectory(store, "e1") == [(1, "A3"), (2, "A3")]
    assert set_aside(store, "e1") == {("A1", 1): "superseded", ("A2", 1): "completed_by_other"}
    assert store.group("g1")["complete"] and store.results(JOB)["job"]["completed"] == 2
    assert store.sql("SELECT finished FROM job_environments WHERE env_id = 'e1'")[0][0]
    # The attempt it displaced closing later changes nothing.
    store.write_batch([step("e1", 2, attempt=2, aid="A2"), close("e1", "retrying", attempt=2, aid="A2", steps=0)])
    assert trajectory(store, "e1") == [(1, "A3"), (2, "A3")] and store.episode("e1")["status"] == "completed"


def test_dead_letter_of_a_rerun_numbered_lower_fails_the_episode(store):
    # As above, but the re-run numbered 1 fails for good: the ledger holds the episode failed,
    # so must the database (its group incomplete), or the job never ends.
    store.write_batch([job(2, 1), announce(("e1", "arith", "g1"), ("e2", "arith", "g1"))]
                      + episode("e2", [1.0], size=2))
    store.write_batch([step("e1", 1, attempt=1, aid="A1"), step("e1", 1, attempt=2, aid="A2")])
    store.write_batch([step("e1", 1, attempt=1, aid="A3", t=900.0)])
    store.write_batch([close("e1", "failed", attempt=1, aid="A3", reason="env_bad_request", steps=0, total=0.0,
                             started=899.0)])
    ep = store.episode("e1")
    assert (ep["status"], ep["attempt_id"], ep["reason"]) == ("failed", "A3", "env_bad_request")
    assert trajectory(store, "e1") == []
    g = store.group("g1")
    assert not g["complete"] and g["failed"] == 1
    # A re-drive (attempt 3 by the ledger's count) takes over and completes it.
    store.write_batch(episode("e1", [1.0], attempt=3, aid="A4"))
    assert store.episode("e1")["status"] == "completed" and store.group("g1")["complete"]


def test_running_attempt_set_aside_by_a_late_dead_letter_takes_its_rows_back(store):
    # Two consumers: attempt 1's dead letter is committed after the first steps of the
    # attempt that followed it (a re-drive, numbered 2). The episode shows failed for a moment;
    # attempt 2's next records take over again with all of its rows.
    store.write_batch([announce(("e1", "arith", "g1"))] + [step("e1", 1, attempt=2)])
    store.write_batch([close("e1", "failed", attempt=1, reason="env_bad_request", steps=0, total=0.0)])
    assert store.episode("e1")["status"] == "failed" and trajectory(store, "e1") == []
    store.write_batch([step("e1", 2, attempt=2, last=True), close("e1", attempt=2, steps=2, total=2.0, size=1)])
    ep = store.episode("e1")
    assert (ep["status"], ep["attempt_id"], ep["steps"]) == ("completed", "e1-a2", 2)
    assert trajectory(store, "e1") == [(1, "e1-a2"), (2, "e1-a2")] and set_aside(store, "e1") == {}


def test_a_job_id_submitted_again_after_retention_is_flagged(store, caplog):
    first = job()
    store.write_batch([first] + episode("e1", [1.0]))
    store.write_batch([first])  # the same record delivered again: nothing to say
    assert "submitted again" not in caplog.text
    again = job()
    again.created_at = first.created_at + 3600 * 24 * 8
    store.write_batch([again] + episode("e1", [0.0], aid="rerun"))
    assert f"job {JOB} was submitted again" in caplog.text
    # Accepted (README, limits): the first run's trajectory stays.
    assert trajectory(store, "e1") == [(1, "e1-a1")]
    assert set_aside(store, "e1") == {("rerun", 1): "completed_by_other"}


def test_attempts_counted(store):
    store.write_batch([step("e1", 1), close("e1", "retrying", reason="env_unreachable")])
    store.write_batch([step("e1", 1, attempt=3)])  # attempt 2 never published anything
    assert store.episode("e1")["attempts"] == 3
    store.write_batch([close("e1", "abandoned", attempt=2, reason="worker_lost")])  # late, stale
    ep = store.episode("e1")
    assert ep["attempts"] == 3 and ep["attempt"] == 3 and ep["status"] == "running"
    store.write_batch([step("e1", 2, attempt=3)])
    assert store.episode("e1")["steps"] == 2


# --- groups, jobs, results --------------------------------------------------------------------

def test_failed_episode_marks_group_then_redrive_completes(store):
    store.write_batch([job()] + episode("a", [1.0]) + [step("b", 1, reward=0.0),
                                                       close("b", "failed", total=0.0, steps=1, reason="env_bad_request")])
    g = store.group("g1")
    assert g["size"] == 2 and g["completed"] == 1 and g["failed"] == 1 and g["complete"] == 0
    assert g["incomplete_reason"] == "episode b failed: env_bad_request"
    assert store.episode("b")["status"] == "failed" and trajectory(store, "b") == []
    store.write_batch(episode("b", [0.0, 3.0], attempt=2))  # re-driven
    ep = store.episode("b")
    assert ep["status"] == "completed" and ep["attempt"] == 2 and ep["reason"] is None and ep["total_reward"] == 3.0
    g = store.group("g1")
    assert g["complete"] == 1 and g["failed"] == 0 and g["incomplete_reason"] is None and g["completed"] == 2
    assert g["reward_mean"] == pytest.approx(2.0) and g["reward_std"] == pytest.approx(1.0)


def test_group_statistics_of_huge_and_infinite_totals(store):
    """Totals of 1e200 and -1e200 are finite and their squares are not: the group's mean and
    std are still stored (the writer does not stop on them). A total that is not finite (a
    worker from before totals were checked) leaves the group without statistics: NULL, never
    NaN or infinity."""
    store.write_batch(episode("h1", [1e200], group="gh") + episode("h2", [-1e200], group="gh"))
    g = store.group("gh")
    assert g["complete"] == 1 and g["reward_mean"] == 0.0 and g["reward_std"] == pytest.approx(1e200)
    store.write_batch(episode("i1", [math.inf], group="gi") + episode("i2", [1.0], group="gi"))
    g = store.group("gi")
    assert g["complete"] == 1 and g["completed"] == 2
    assert g["reward_mean"] is None and g["reward_std"] is None


def test_group_size_from_announced_episodes(store):
    store.write_batch([announce(("x1", "arith", "gx"), ("x2", "arith", "gx"), ("x3", "arith", "gx"))])
    store.write_batch(episode("x1", [1.0], group="gx", size=0) + episode("x2", [2.0], group="gx", size=0))
    assert store.group("gx")["size"] == 3 and store.group("gx")["complete"] == 0
    store.write_batch(episode("x3", [3.0], group="gx", size=0))
    g = store.group("gx")
    assert g["complete"] == 1 and g["reward_mean"] == pytest.approx(2.0)
    assert g["reward_std"] == pytest.approx(math.sqrt(2 / 3))


def test_results_numbers_and_tokens(store):
    recs = [job(5, 3)]
    recs += episode("a1", [1.0, 1.0], group="ga", env="alpha") + episode("a2", [0.0, 0.0], group="ga", env="alpha")
    recs += episode("b1", [3.0], group="gb", env="beta")
    recs += [step("b2", 1, group="gb", env="beta", tokens=100)]
    recs += [step("c1", 1, group="gc", env="beta", reward=9.0),
             close("c1", "failed", total=9.0, steps=1, group="gc", size=1, env="beta", reason="model_bad_request")]
    store.write_batch(recs)
    assert store.job_ids() == [JOB]
    r = store.results(JOB)
    j = r["job"]
    assert (j["episodes"], j["completed"], j["failed"], j["running"]) == (5, 3, 1, 1)
    assert j["steps"] == 2 + 2 + 1 + 1  # the failed episode keeps no trajectory
    assert j["mean_reward"] == pytest.approx((2.0 + 0.0 + 3.0) / 3)
    assert j["prompt_tokens"] == 100 and j["completion_tokens"] == 50
    assert j["tokens_per_episode"] == pytest.approx(150 / 5)
    assert j["ended_by"] == {"terminated": 3}
    assert r["by_env"]["alpha"]["completed"] == 2 and r["by_env"]["alpha"]["max"] == 2.0
    assert r["by_env"]["beta"] | {} == r["by_env"]["beta"] and r["by_env"]["beta"]["failed"] == 1
    g = r["groups"]
    assert (g["total"], g["complete"], g["failed"]) == (3, 1, 1)
    assert store.results("nope")["job"]["episodes"] == 0


def test_listing_filters_and_pages(store):
    recs = [job(30, 10)]
    for i in range(30):
        recs += episode(f"e{i:02d}", [float(i % 5)], group=f"g{i // 3}", size=3, env="alpha" if i % 2 else "beta")
    store.write_batch(recs)
    assert store.count_episodes(JOB) == 30
    assert store.count_episodes(JOB, env_names=["alpha"]) == 15
    page = store.list_episodes(JOB, sort="reward", descending=True, limit=5, offset=0, reward_min=3)
    assert [p["total_reward"] for p in page] == [4.0] * 5
    assert store.count_episodes(JOB, reward_min=3, reward_max=3) == 6
    with pytest.raises(ValueError):
        store.list_episodes(JOB, sort="nope")


# --- schema versions ------------------------------------------------------------------------

V1_DDL = """
CREATE TABLE session_steps (id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, env_id TEXT NOT NULL, step_id INTEGER NOT NULL,
  env_name TEXT, llm_model TEXT, group_id TEXT, messages TEXT, response TEXT, step_reward REAL, cumulative_reward REAL,
  env_state TEXT, weight_version TEXT, terminated INTEGER, truncated INTEGER, episode_finished INTEGER,
  is_trainable INTEGER, created_at REAL, attempt INTEGER NOT NULL DEFAULT 1, superseded INTEGER NOT NULL DEFAULT 0,
  finish_reason TEXT, env_latency_s REAL, model_latency_s REAL, UNIQUE (env_id, attempt, step_id));
CREATE INDEX session_steps_job_trainable ON session_steps (job_id, is_trainable);
CREATE TABLE attempt_steps (env_id TEXT NOT NULL, attempt INTEGER NOT NULL, steps INTEGER NOT NULL, reward REAL NOT NULL,
  PRIMARY KEY (env_id, attempt)) WITHOUT ROWID;
CREATE TRIGGER session_steps_count AFTER INSERT ON session_steps BEGIN
  INSERT INTO attempt_steps (env_id, attempt, steps, reward) VALUES (NEW.env_id, NEW.attempt, 1, COALESCE(NEW.step_reward, 0.0))
  ON CONFLICT (env_id, attempt) DO UPDATE SET steps = steps + 1, reward = reward + excluded.reward; END;
CREATE TABLE jobs (job_id TEXT PRIMARY KEY, created_at REAL, episodes INTEGER, groups INTEGER, model TEXT,
  llm_base_url TEXT, sources TEXT, spec TEXT);
CREATE TABLE episodes (episode_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, group_id TEXT, env_name TEXT, llm_model TEXT,
  status TEXT NOT NULL, attempt INTEGER NOT NULL, attempts INTEGER NOT NULL, total_reward REAL, steps INTEGER,
  reason TEXT, error_class TEXT, error TEXT, started_at REAL, finished_at REAL, duration_s REAL, updated_at REAL);
CREATE INDEX episodes_job ON episodes (job_id);
CREATE INDEX episodes_group ON episodes (group_id);
CREATE TABLE attempts (episode_id TEXT NOT NULL, attempt INTEGER NOT NULL, job_id TEXT, status TEXT NOT NULL,
  reason TEXT, error_class TEXT, error TEXT, total_reward REAL, steps INTEGER, started_at REAL, finished_at REAL,
  worker TEXT, PRIMARY KEY (episode_id, attempt)) WITHOUT ROWID;
CREATE TABLE groups (group_id TEXT PRIMARY KEY, job_id TEXT, env_name TEXT, size INTEGER, completed INTEGER,
  failed INTEGER, reward_mean REAL, reward_std REAL, complete INTEGER NOT NULL DEFAULT 0, incomplete_reason TEXT);
PRAGMA user_version = 1;
"""


def old_file(path):
    """A results file as the previous schema (v1) left it: a completed episode whose attempt 2
    superseded attempt 1, a failed one, a running one."""
    con = sqlite3.connect(path)
    con.executescript(V1_DDL)
    rows = [("J", "e1", 1, "arith", "m", "g1", '[{"role": "user", "content": "old"}]', "x", 1.0, 1.0, None, None,
             0, 0, 0, 1, 1000.0, 1, 1, "stop", 0.01, 0.2),
            ("J", "e1", 1, "arith", "m", "g1", '[{"role": "user", "content": "q"}]', "a", 0.5, 0.5,
             '{"weight_version": "v3"}', "v3", 0, 0, 0, 1, 1001.0, 2, 0, "stop", 0.01, 0.2),
            ("J", "e1", 2, "arith", "m", "g1", '[{"role": "user", "content": "q2"}]', "b", 0.5, 1.0,
             '{"weight_version": "v3"}', "v3", 1, 0, 1, 1, 1002.0, 2, 0, "stop", 0.01, 0.2),
            ("J", "e2", 1, "arith", "m", "g1", "[]", "c", 0.0, 0.0, None, None, 0, 0, 0, 1, 1003.0, 1, 0, "stop", 0, 0),
            ("J", "e3", 1, "arith", "m", "g2", "[]", "d", 0.0, 0.0, None, None, 0, 0, 0, 1, 1004.0, 1, 0, "stop", 0, 0)]
    con.executemany("INSERT INTO session_steps (job_id, env_id, step_id, env_name, llm_model, group_id, messages, "
                    "response, step_reward, cumulative_reward, env_state, weight_version, terminated, truncated, "
                    "episode_finished, is_trainable, created_at, attempt, superseded, finish_reason, env_latency_s, "
                    "model_latency_s) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    con.execute("INSERT INTO jobs VALUES ('J', 999.0, 3, 2, 'm', 'http://llm', '[]', '{\"job_id\": \"J\", \"episodes\": 3}')")
    con.executemany("INSERT INTO episodes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", [
        ("e1", "J", "g1", "arith", "m", "completed", 2, 2, 1.0, 2, None, None, None, 1000.0, 1005.0, 5.0, 1005.0),
        ("e2", "J", "g1", "arith", "m", "failed", 1, 1, 0.0, 1, "env_bad_request", "EpisodeError", "bad", 1003.0, 1006.0,
         3.0, 1006.0),
        ("e3", "J", "g2", "arith", "m", "running", 1, 1, 0.0, 1, None, None, None, 1004.0, None, None, 1004.0)])
    con.executemany("INSERT INTO attempts VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", [
        ("e1", 1, "J", "abandoned", "worker_lost", "LeaseExpired", "", 0.0, 0, 1000.0, 1001.0, ""),
        ("e1", 2, "J", "completed", "", "", "", 1.0, 2, 1001.0, 1005.0, "w1"),
        ("e2", 1, "J", "failed", "env_bad_request", "EpisodeError", "bad", 0.0, 1, 1003.0, 1006.0, "w1")])
    con.executemany("INSERT INTO groups VALUES (?,?,?,?,?,?,?,?,?,?)", [
        ("g1", "J", "arith", 2, 1, 1, 1.0, 0.0, 0, "episode e2 failed: env_bad_request"),
        ("g2", "J", "arith", 1, 0, 0, None, None, 0, None)])
    con.commit()
    con.close()


@pytest.mark.unit
def test_a_results_file_of_the_previous_schema_is_migrated_in_place(tmp_path):
    path = str(tmp_path / "old.sqlite")
    old_file(path)
    s = open_store(path)
    try:
        assert s.schema_version() == 3
        assert column_names(s, "session_steps")[:len(ORIGINAL_SESSION_STEPS)] == ORIGINAL_SESSION_STEPS
        assert [(r["step_id"], r["attempt"], r["attempt_id"]) for r in s.episode_trajectory("e1")] == [
            (1, 2, "n2"), (2, 2, "n2")]
        assert s.episode_trajectory("e1")[1]["reward"] == 1.0 and s.episode_trajectory("e1")[1]["is_session_completed"]
        assert {(r["attempt_id"], r["superseded_reason"]) for r in s.superseded_steps("e1")} == {("n1", "superseded")}
        assert s.episode_trajectory("e2") == [] and s.superseded_steps("e2")[0]["superseded_reason"] == "closed:failed"
        assert [r["step_id"] for r in s.episode_trajectory("e3")] == [1]
        jenv = {r["env_id"]: r["finished"] for r in s.job_environments("J")}
        assert jenv == {"e1": 1, "e2": 0, "e3": 0}
        r = s.results("J")["job"]
        assert (r["completed"], r["failed"], r["running"], r["steps"]) == (1, 1, 1, 3)
        assert s.sql("SELECT env_name, COUNT(*), AVG(reward), MAX(reward) FROM session_steps "
                     "WHERE is_session_completed = 1 GROUP BY env_name") == [("arith", 1, 1.0, 1.0)]
        # The migrated file keeps working: attempt 2 of e3 supersedes its attempt 1 ("n1").
        s.write_batch([StepRecord(job_id="J", env_id="e3", attempt=2, step_id=1, env_name="arith", llm_model="m",
                                  group_id="g2", messages_json=b"[]", response="z", step_reward=1.0, cumulative_reward=1.0,
                                  terminated=True, truncated=False, episode_finished=True, is_trainable=True,
                                  attempt_id="new")])
        assert [r["attempt_id"] for r in s.episode_trajectory("e3")] == ["new"]
        assert s.superseded_steps("e3")[0]["attempt_id"] == "n1"
    finally:
        s.close()
    tables = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "attempt_steps" not in tables and "v1_session_steps" not in tables


@pytest.mark.unit
def test_a_results_file_of_schema_v2_gains_the_reopen_count(tmp_path):
    path = str(tmp_path / "v2.sqlite")
    open_store(path).close()
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE episodes DROP COLUMN reopens")  # what v2 made
    con.execute("INSERT INTO episodes (episode_id, job_id, status, attempt, attempts) VALUES ('e1', 'J', 'running', 1, 1)")
    con.execute("PRAGMA user_version = 2")
    con.commit()
    con.close()
    s = open_store(path)
    try:
        assert s.schema_version() == 3 and s.episode("e1")["reopens"] == 0
    finally:
        s.close()


def test_a_postgres_store_of_the_previous_schema_is_migrated_in_place(pg_server):
    import pathlib

    import psycopg

    url = pg_server.create_database()
    ddl = (pathlib.Path(__file__).parent / "postgres_schema_v2.sql").read_text()
    with psycopg.connect(url, autocommit=True) as conn:
        for stmt in ddl.split(";"):
            if stmt.strip():
                conn.execute(stmt)
        conn.execute("INSERT INTO store_meta VALUES ('schema_version', '2')")
        conn.execute("INSERT INTO job_environments (job_id, env_id, env_name, env_params, group_id, finished, "
                     "is_deleted, created_at) VALUES ('job1', 'e1', 'arith', '{}', 'g1', 1, 0, now()), "
                     "('job1', 'e2', 'arith', '{}', 'g1', 0, 0, now())")
        conn.execute("INSERT INTO session_steps (session_id, step_id, env_name, group_id, job_id, response, step_reward, "
                     "reward, is_terminal, is_truncated, is_session_completed, is_trainable, attempt, attempt_id, "
                     "prompt_tokens) VALUES ('e1', 1, 'arith', 'g1', 'job1', 'a', 1.0, 1.0, 0, 0, 0, 1, 1, 'x', 7), "
                     "('e1', 2, 'arith', 'g1', 'job1', 'b', 1.0, 2.0, 1, 0, 1, 1, 1, 'x', 7)")
        conn.execute("INSERT INTO episodes (episode_id, job_id, group_id, env_name, status, attempt, attempt_id, "
                     "attempts, completed_attempt_id, expected_steps, steps, total_reward) VALUES "
                     "('e1', 'job1', 'g1', 'arith', 'completed', 1, 'x', 1, 'x', 2, 2, 2.0)")
    # Readers of this code on a store no writer has migrated yet.
    r = open_store(url, readonly=True)
    try:
        assert [row[4] for row in r.export_steps("e1", trainable_only=True)] == [1, 2]
        assert [row["is_session_completed"] for row in r.episode_trajectory("e1")] == [False, True]
        assert r.results("job1")["job"]["completed"] == 1
    finally:
        r.close()
    s = open_store(url)
    try:
        assert s.schema_version() == 3
        types = column_types(s, "session_steps")
        assert {types[c] for c in ("is_terminal", "is_truncated", "is_session_completed", "is_trainable")} == {"boolean"}
        assert types["prompt_tokens"] == types["completion_tokens"] == "bigint"
        assert column_types(s, "superseded_steps")["is_trainable"] == "boolean"
        assert {column_types(s, "job_environments")[c] for c in ("finished", "is_deleted")} == {"boolean"}
        assert [tuple(r) for r in s.sql("SELECT env_id FROM job_environments WHERE finished")] == [("e1",)]
        assert tuple(s.sql("SELECT COUNT(*), SUM(finished) FROM job_environments")[0]) == (2, 1)
        assert s.sql("SELECT env_name, COUNT(*) AS episodes, AVG(reward) AS avg_reward, MAX(reward) AS best_reward "
                     "FROM session_steps WHERE is_session_completed = 1 GROUP BY env_name") == [("arith", 1, 2.0, 2.0)]
        assert [tuple(r) for r in s.sql("SELECT step_id FROM session_steps WHERE is_session_completed")] == [(2,)]
        assert s.episode("e1")["reopens"] == 0
        # Readers and the writer work on the migrated store.
        assert [r["is_session_completed"] for r in s.episode_trajectory("e1")] == [False, True]
        assert [row[4] for row in s.export_steps("e1", trainable_only=True)] == [1, 2]
        s.write_batch(episode("e2", [1.0], aid="y") + [step("e3", 1, tokens=2**40)])
        assert s.episode("e2")["status"] == "completed" and s.episode_trajectory("e3")[0]["prompt_tokens"] == 2**40
        assert [tuple(r) for r in s.sql("SELECT env_id FROM job_environments WHERE finished = 1 ORDER BY env_id")] == [
            ("e1",), ("e2",)]
    finally:
        s.close()
    open_store(url).close()  # opened again: nothing left to migrate


@pytest.mark.unit
def test_a_newer_schema_is_refused(tmp_path):
    path = str(tmp_path / "new.sqlite")
    con = sqlite3.connect(path)
    con.execute("PRAGMA user_version = 99")
    con.close()
    with pytest.raises(StoreError, match="newer than this code"):
        open_store(path)


@pytest.mark.unit
def test_bad_store_targets_are_named(tmp_path):
    with pytest.raises(StoreError, match="unknown results store"):
        open_store("mysql://db/x")
    with pytest.raises(StoreError, match="no results database"):
        open_store(str(tmp_path / "missing.sqlite"), readonly=True)
    with pytest.raises(StoreError, match="cannot connect"):
        open_store("postgresql://nobody@127.0.0.1:1/none")


# --- exports --------------------------------------------------------------------------------

def _export_fixture(store):
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    recs = [job()]
    # group g1: complete; e1's attempt 1 was superseded by attempt 2
    recs += [step("e1", 1, reward=7.0), step("e1", 2, reward=7.0)]
    recs += [step("e1", 1, attempt=2, reward=1.0, msgs=[{"role": "user", "content": parts}]),
             step("e1", 2, attempt=2, reward=0.0, cum=1.0, last=True, wv=None)]
    recs += [close("e1", "completed", attempt=2, total=1.0, steps=2)]
    recs += episode("e2", [0.5])
    # group g2: one completed, one failed -> incomplete
    recs += episode("f1", [1.0], group="g2")
    recs += [step("f2", 1, group="g2"), close("f2", "failed", group="g2", steps=1, total=1.0, reason="env_bad_request")]
    # a non-trainable step
    recs += [step("e3", 1, group="g3", trainable=False), step("e3", 2, group="g3", last=True),
             close("e3", "completed", total=2.0, steps=2, group="g3", size=1)]
    store.write_batch(recs)


def test_export_jsonl(store, tmp_path):
    _export_fixture(store)
    out = tmp_path / "out.jsonl"
    n = export_training(store, JOB, out).rows
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == len(rows) == 2 + 1 + 1 + 1
    assert {(r["episode_id"], r["attempt"], r["step_id"]) for r in rows} == {
        ("e1", 2, 1), ("e1", 2, 2), ("e2", 1, 1), ("f1", 1, 1), ("e3", 1, 2)}
    e1 = [r for r in rows if r["episode_id"] == "e1"]
    assert e1[0]["messages"][-1] == {"role": "assistant", "content": "action e1 a2 s1"}
    assert e1[0]["messages"][:-1] == e1[0]["prompt"]
    assert isinstance(e1[0]["prompt"][0]["content"], list)  # jsonl keeps parts as they are
    assert e1[0]["episode_reward"] == 1.0 and e1[0]["weight_version"] == "v1" and e1[1]["weight_version"] is None
    assert {r["episode_id"]: r["group_complete"] for r in rows} == {"e1": True, "e2": True, "f1": False, "e3": True}
    assert set(rows[0]) == set(parquet_schema().names)
    n = export_training(store.url, JOB, out, complete_groups_only=True).rows
    assert n == 4
    n = export_training(store, JOB, out, trainable_only=False, episode_statuses=None).rows
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == 2 + 1 + 1 + 2  # the failed episode has no trajectory to export
    assert not any(r["attempt"] == 1 and r["episode_id"] == "e1" for r in rows)


def test_export_parquet(store, tmp_path):
    _export_fixture(store)
    out = tmp_path / "out.parquet"
    n = export_training(store, JOB, out, fmt="parquet").rows
    t = pq.read_table(out)
    assert t.num_rows == n == 5 and t.schema.equals(parquet_schema())
    msg_type = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
    assert t.schema.field("messages").type == msg_type
    rows = t.to_pylist()
    assert not any(r["reward"] == 7.0 for r in rows)  # the superseded attempt's rows are not exported
    e1s1 = next(r for r in rows if r["episode_id"] == "e1" and r["step_id"] == 1)
    assert json.loads(e1s1["prompt"][0]["content"])[0] == {"type": "text", "text": "look"}
    n = export_training(store, "no-such-job", out, fmt="parquet").rows
    assert n == 0 and pq.read_table(out).schema.equals(parquet_schema())
