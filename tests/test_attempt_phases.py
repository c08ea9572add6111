"""Where attempts' time went (records v5 timings) in the results store: the ``attempt_phases``
table (consumer/storage/phases.py) on real SQLite and PostgreSQL stores, its keep-or-replace
rule, ``results()`` / ``attempts()``, and a store made by the previous code gaining it on open."""

from __future__ import annotations

import sqlite3

import pytest

from broker.records import AttemptRecord, JobSpec, StepRecord
from broker.states import Phase
from consumer.storage import open_store
from consumer.storage import phases as attempt_phases_table
from consumer.storage import postgres as pg_backend
from consumer.storage import sqlite as sqlite_backend
from consumer.storage import step_tokens as step_tokens_table
from interactor.report import phases_line

JOB = "jp"


def step(ep, n, *, aid, last=False, attempt=1):
    return StepRecord(job_id=JOB, env_id=ep, attempt=attempt, step_id=n, env_name="arith", llm_model="m", group_id="g1",
                      messages_json=b'[{"role":"user","content":"q"}]', response="a", step_reward=1.0,
                      cumulative_reward=float(n), terminated=last, truncated=False, episode_finished=last,
                      is_trainable=True, attempt_id=aid, created_at=1000.0 + n)


def close(ep, *, aid, attempt=1, status="completed", steps=2, timed=True, scale=1.0, queue_wait=True):
    t = dict(queue_wait_s=0.5 * scale if queue_wait else None, reset_s=0.1 * scale, prompt_s=0.02 * scale,
             model_s=2.0 * scale, env_step_s=0.3 * scale, close_s=0.05 * scale) if timed else {}
    return AttemptRecord(job_id=JOB, episode_id=ep, attempt=attempt, status=status, group_id="g1", group_size=2,
                         env_name="arith", llm_model="m", total_reward=float(steps), steps=steps, attempt_id=aid,
                         started_at=1000.0, finished_at=1010.0, ended_by="terminated" if status == "completed" else "",
                         reason="" if status == "completed" else "env_error", **t)


def episode(ep, aid, attempt=1, **kw):
    return [step(ep, 1, aid=aid, attempt=attempt), step(ep, 2, aid=aid, last=True, attempt=attempt),
            close(ep, aid=aid, attempt=attempt, **kw)]


def phase_row(store, ep, aid):
    rows = store.query_dicts("SELECT * FROM attempt_phases WHERE episode_id = ? AND attempt_id = ?", (ep, aid))
    return rows[0] if rows else None


def test_phases_are_stored_per_attempt_and_summarised_per_job(store_url):
    s = open_store(store_url)
    try:
        s.write_batch([JobSpec(job_id=JOB, llm_base_url="http://llm", model="m", episodes=3, groups=2)])
        # e1: one timed attempt; e2: a retried first attempt (timed), then a re-run whose queue
        # wait is not timed (None, as the worker sends it); e3: a v4-style close, no timings.
        s.write_batch(episode("e1", "a1"))
        s.write_batch([close("e2", aid="b1", status="retrying", steps=0, scale=2.0)]
                      + episode("e2", "b2", attempt=2, queue_wait=False))
        s.write_batch(episode("e3", "c1", timed=False))
        att = {a["attempt_id"]: a for ep in ("e1", "e2", "e3") for a in s.attempts(ep)}
        assert att["a1"]["model_s"] == pytest.approx(2.0) and att["a1"]["queue_wait_s"] == pytest.approx(0.5)
        assert att["b1"]["reset_s"] == pytest.approx(0.2) and att["b1"]["status"] == "retrying"
        assert att["b2"]["queue_wait_s"] is None and att["b2"]["close_s"] == pytest.approx(0.05)
        assert all(att["c1"][c] is None for c in attempt_phases_table.PHASE_COLUMNS)  # not timed: no row
        assert phase_row(s, "e3", "c1") is None

        ph = s.results(JOB)["phases"]
        assert ph["attempts"] == 3  # the timed ones: a1, b1, b2
        assert ph["timed"] == {p: 3 for p in Phase} | {"queue_wait": 2}
        assert ph["mean_s"]["model"] == pytest.approx((2.0 + 4.0 + 2.0) / 3)
        assert ph["mean_s"]["queue_wait"] == pytest.approx((0.5 + 1.0) / 2)  # over the attempts that timed it
        assert ph["total_s"]["env_step"] == pytest.approx(0.3 + 0.6 + 0.3)
        line = phases_line(ph)
        assert line.startswith("phases (mean per attempt, 3 attempts): queue_wait 0.750s, reset 0.133s")
        assert "model 2.667s" in line and line.endswith("close 0.067s")
        assert s.results("no-such-job")["phases"] is None
    finally:
        s.close()


def test_a_completed_close_replaces_another_close_of_the_attempt_and_nothing_else_does(store_url):
    s = open_store(store_url)
    try:
        # an abandoned close first (lease lost), then the same attempt's completion: it wins
        s.write_batch([step("e1", 1, aid="a1"), step("e1", 2, aid="a1", last=True),
                       close("e1", aid="a1", status="abandoned", scale=3.0)])
        assert phase_row(s, "e1", "a1")["model_s"] == pytest.approx(6.0)
        s.write_batch([close("e1", aid="a1")])
        assert phase_row(s, "e1", "a1")["status"] == "completed"
        assert phase_row(s, "e1", "a1")["model_s"] == pytest.approx(2.0)
        # later closes of a completed attempt change nothing; the same batch again changes nothing
        s.write_batch([close("e1", aid="a1", status="failed", scale=5.0)])
        s.write_batch([close("e1", aid="a1", scale=7.0)])
        row = phase_row(s, "e1", "a1")
        assert row["status"] == "completed" and row["model_s"] == pytest.approx(2.0)
        # the attempts row and its phases agree
        (a,) = s.attempts("e1")
        assert a["status"] == "completed" and a["model_s"] == pytest.approx(2.0)
    finally:
        s.close()


def _previous_code_store(store_url: str) -> None:
    """A store exactly as the previous code (8f48904) made it: its tables are this code's
    unchanged DDL (SCHEMA, step_tokens) without attempt_phases, at schema version 3, holding
    one completed episode written as that code wrote it."""
    assert "attempt_phases" not in sqlite_backend.SCHEMA and "attempt_phases" not in pg_backend.SCHEMA
    rows = [
        "INSERT INTO jobs (job_id, created_at, episodes, groups, model) VALUES ('jp', 1.0, 2, 1, 'm')",
        "INSERT INTO episodes (episode_id, job_id, group_id, env_name, status, attempt, attempt_id, attempts, "
        "completed_attempt_id, expected_steps, steps, total_reward, started_at, finished_at) VALUES "
        "('old', 'jp', 'g1', 'arith', 'completed', 1, 'o1', 1, 'o1', 1, 1, 1.0, 1000.0, 1010.0)",
        "INSERT INTO attempts (episode_id, attempt_id, attempt, job_id, status, total_reward, steps, started_at, "
        "finished_at, worker) VALUES ('old', 'o1', 1, 'jp', 'completed', 1.0, 1, 1000.0, 1010.0, 'w1')",
    ]
    if "://" not in store_url:
        con = sqlite3.connect(store_url, isolation_level=None)
        for script in (sqlite_backend.SCHEMA, step_tokens_table.SQLITE_DDL):
            for stmt in script.split(";"):
                if stmt.strip():
                    con.execute(stmt)
        con.execute("PRAGMA user_version = 3")
        for stmt in rows:
            con.execute(stmt)
        con.close()
        return
    import psycopg

    with psycopg.connect(store_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE store_meta (key TEXT PRIMARY KEY, value TEXT)")
        for stmt in [*pg_backend.SCHEMA.split(";"), *pg_backend.BOOL_INT_OPERATORS,
                     *step_tokens_table.POSTGRES_DDL.split(";")]:
            if stmt.strip():
                conn.execute(stmt)
        conn.execute("INSERT INTO store_meta VALUES ('schema_version', '3')")
        for stmt in rows:
            conn.execute(stmt)


def test_a_store_made_by_the_previous_code_gains_the_table_on_open(store_url):
    _previous_code_store(store_url)
    # A reader of this code on it before any writer opened it: no timings, everything else read.
    r = open_store(store_url, readonly=True)
    try:
        assert not r.has_table("attempt_phases")
        assert r.results(JOB)["phases"] is None and r.results(JOB)["job"]["completed"] == 1
        (a,) = r.attempts("old")
        assert a["worker"] == "w1" and all(a[c] is None for c in attempt_phases_table.PHASE_COLUMNS)
    finally:
        r.close()
    s = open_store(store_url)
    try:
        assert s.has_table("attempt_phases") and s.schema_version() == 3  # additive: no new version
        assert s.results(JOB)["job"]["completed"] == 1 and s.attempts("old")[0]["worker"] == "w1"  # nothing lost
        assert s.results(JOB)["phases"] is None
        s.write_batch(episode("new", "n1"))
        ph = s.results(JOB)["phases"]
        assert ph["attempts"] == 1 and ph["mean_s"]["model"] == pytest.approx(2.0)
        assert s.results(JOB)["job"]["completed"] == 2
    finally:
        s.close()
    open_store(store_url).close()  # opened again: nothing left to add


@pytest.mark.unit
def test_the_browser_episode_page_shows_each_attempts_phases(tmp_path):
    from interactor.ui.app import create_app
    from interactor.ui.source import Source

    path = str(tmp_path / "results.sqlite")
    s = open_store(path)
    s.write_batch([close("e1", aid="a1", status="retrying", steps=0, scale=2.0)]
                  + episode("e1", "a2", attempt=2, queue_wait=False) + episode("e2", "x1", timed=False))
    s.close()
    client = create_app(Source(open_store(path, readonly=True), store_shown=path)).test_client()
    resp = client.get("/episodes/e1")
    assert resp.status_code == 200
    html = resp.get_data(as_text=True)
    assert "time by phase" in html
    # the retried attempt: every phase; the re-run: no queue wait (not timed), the rest
    assert "queue_wait 1.0 s" in html and "model 4.0 s" in html and "reset 200 ms" in html
    assert html.count("queue_wait") == 1 and "model 2.0 s" in html and "close 50 ms" in html
    html = client.get("/episodes/e2").get_data(as_text=True)
    assert "not timed" in html and "model 2.0 s" not in html


@pytest.mark.integration
def test_end_to_end_results_say_where_the_time_went(settings, procs, env_server, model_server, redis_client,
                                                     tmp_path):
    """Real worker processes and consumer, the stand-in env and model over HTTP: every phase
    of the job's attempts is stored, and `interactor results` (text and --json) shows it."""
    import json
    import os
    import subprocess
    import sys

    from producer.enqueue import submit
    from tests.conftest import ROOT, wait_for
    from tests.taskfiles import write_arith_tasks

    _env, env_url = env_server
    _model, model_url = model_server
    settings = settings.replace(llm_base_url=model_url + "/v1", store_url=str(tmp_path / "results.sqlite"))
    procs.settings = settings
    sub = submit(redis_client, settings, [write_arith_tasks(tmp_path, env_url, rows=3, env_num=2)])
    total = sub.job.episodes
    procs.worker("w1")
    procs.consumer()
    store = open_store(settings.results_store)  # a writer too: the consumer may not have opened it yet
    try:
        def stored():
            job = store.results(sub.job.job_id)["job"]
            return job["completed"] + job["failed"] >= total
        wait_for(stored, 90, what=f"{total} episodes stored")
    finally:
        store.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "interactor.cli", "results", sub.job.job_id, *args], env=env,
                             cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    ph = json.loads(cli("--json"))["phases"]
    assert ph["attempts"] == total
    for phase in ("queue_wait", "reset", "prompt", "model", "env_step", "close"):
        assert ph["timed"][phase] == total and ph["mean_s"][phase] > 0, (phase, ph)
    text = cli()
    assert f"phases (mean per attempt, {total} attempts): queue_wait " in text
    assert all(f" {p} " in text for p in ("reset", "prompt", "model", "env_step", "close"))
