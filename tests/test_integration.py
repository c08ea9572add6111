"""End to end: producer -> Redis -> Celery worker processes -> results stream -> consumer -> SQLite,
against the stand-in env server and model over loopback HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from consumer.storage import open_store
from producer.enqueue import submit
from tests.conftest import ROOT, interruptible, wait_for
from tests.storecheck import assert_trajectories_sound, db_rows, store_text
from tests.taskfiles import write_arith_tasks

pytestmark = pytest.mark.integration


def write_tasks(tmp_path, env_url: str, *, guess: int = 3, rows: int = 5, arith_num: int = 2) -> str:
    return write_arith_tasks(tmp_path, env_url, rows=rows, env_num=arith_num, guess=guess)


def wait_job_stored(settings, job_id: str, total: int, timeout: float = 90):
    store = open_store(settings.results_store)
    try:
        def finished():
            res = store.results(job_id)["job"]
            return res if res["completed"] + res["failed"] >= total else None

        return wait_for(finished, timeout, what=f"{total} episodes of {job_id} stored")
    finally:
        store.close()


def test_batch_end_to_end(settings, procs, env_server, model_server, redis_client, tmp_path, store_url):
    env, env_url = env_server
    model, model_url = model_server
    settings = settings.replace(llm_base_url=model_url + "/v1", llm_api_key="sk-test-planted-secret-123",
                                store_url=store_url)
    procs.settings = settings
    tasks = write_tasks(tmp_path, env_url)
    sub = submit(redis_client, settings, [tasks])
    total = 3 + 5 * 2
    assert sub.job.episodes == total and sub.job.groups == 1 + 5

    procs.worker("w1")
    procs.worker("w2")
    procs.consumer()
    res = wait_job_stored(settings, sub.job.job_id, total)
    assert res["completed"] == total, procs.log("w1")[-3000:]

    db = settings.results_store
    assert_trajectories_sound(db, sub.job.job_id)
    groups = db_rows(db, "SELECT size, completed, complete FROM groups WHERE job_id = ?", (sub.job.job_id,))
    assert len(groups) == 6 and all(size == done and complete == 1 for size, done, complete in groups)
    # The env owns the conversation: multi-turn prompts grow, and each step sent the env's turns.
    wv = db_rows(db, "SELECT DISTINCT weight_version FROM session_steps WHERE job_id = ?", (sub.job.job_id,))
    assert wv == [("v1",)]
    ledger = Ledger(redis_client, Keys(settings.key_prefix))
    assert ledger.counts(sub.job.job_id)["done"] == total
    # Every instance was reset once and closed.
    stats = env.stats()
    assert stats["resets"] == total and stats["live"] == 0
    # The key went to the model as a header and nowhere into Redis or the database.
    assert model.stats()["auth_headers_seen"] > 0
    for key in redis_client.scan_iter(f"{settings.key_prefix}:*"):
        assert b"planted-secret" not in redis_client.dump(key)
    assert "planted-secret" not in store_text(db)
    logs = procs.log("w1") + procs.log("w2") + procs.log("consumer")
    assert "planted-secret" not in logs
    # The Redis password (in every process's REDIS_URL) is redacted wherever the URL is logged.
    assert "s3cret-redis-pw" not in logs
    for key in redis_client.scan_iter(f"{settings.key_prefix}:*"):
        assert b"s3cret-redis-pw" not in redis_client.dump(key)


def test_full_history_episodes_that_outgrow_the_context_complete_truncated(settings, procs, env_server,
                                                                             redis_client, tmp_path):
    """Issue 14: with the whole history in every prompt, a long episode outgrows the model's
    context; the server's 400 ends it truncated, its steps kept and its group complete."""
    from consumer.export import export_training
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    model, model_url = start_in_thread(context_tokens=150)  # vLLM's wording
    try:
        settings = settings.replace(llm_base_url=model_url + "/v1", message_cut=0, llm_max_tokens=16)
        procs.settings = settings
        data = tmp_path / "arith.jsonl"
        data.write_text(json.dumps({"question": "What is 2 + 3?", "answer": 5}) + "\n")
        tasks = tmp_path / "long.yaml"
        tasks.write_text(textwrap.dedent(f"""\
            environments:
              - env_name: guess_number
                base_url: {env_url}
                env_params: {{low: 1, high: 1000000, max_turns: 30}}
                env_num: 4
              - env_name: arithmetic
                base_url: {env_url}
                dataset: arith.jsonl
                env_num: 2
            """))
        sub = submit(redis_client, settings, [str(tasks)])
        procs.worker("w1")
        procs.consumer()
        res = wait_job_stored(settings, sub.job.job_id, 6)
    finally:
        model.shutdown()
    job = sub.job.job_id
    assert res["completed"] == 6 and res["failed"] == 0, procs.log("w1")[-3000:]
    assert model.stats()["context_overflows"] == 4
    db = settings.results_store
    assert_trajectories_sound(db, job)
    assert db_rows(db, "SELECT env_name, ended_by, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY env_name, "
                       "ended_by ORDER BY env_name", (job,)) == [("arithmetic", "terminated", 2),
                                                               ("guess_number", "context_length", 4)]
    assert db_rows(db, "SELECT COUNT(*), SUM(complete) FROM groups WHERE job_id = ?", (job,)) == [(2, 2)]
    # The final step of each long episode: no answer, truncated, trainable, no usage; every other step has its usage.
    finals = db_rows(db, "SELECT response, step_reward, is_truncated, is_trainable, finish_reason, prompt_tokens "
                         "FROM session_steps WHERE job_id = ? AND ended_by = 'context_length'", (job,))
    assert finals == [("", 0.0, 1, 1, "context_length", None)] * 4
    assert db_rows(db, "SELECT COUNT(*) FROM session_steps WHERE job_id = ? AND ended_by IS DISTINCT FROM "
                       "'context_length' AND (prompt_tokens IS NULL OR completion_tokens IS NULL)", (job,)) == [(0,)]
    (p_tok, c_tok), = db_rows(db, "SELECT SUM(prompt_tokens), SUM(completion_tokens) FROM episodes WHERE job_id = ?",
                              (job,))
    assert p_tok > 0 and c_tok > 0
    assert DeadLetterQueue(redis_client, settings).list(job_id=job) == []
    # Exports carry why it ended and the token counts; full history: one trainable row an episode.
    out = tmp_path / "export.jsonl"
    export_training(db, job, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    long = [r for r in rows if r["env_name"] == "guess_number"]
    assert len(long) == 4 and all(r["ended_by"] == "context_length" and r["truncated"] for r in long)
    assert all(r["response"] == "" and r["prompt"][-1]["role"] == "user" for r in long)
    assert {r["ended_by"] for r in rows if r["env_name"] == "arithmetic"} == {"terminated"}
    assert all(r["prompt_tokens"] > 0 for r in rows if r["env_name"] == "arithmetic")
    # `interactor results` says why episodes ended and what they cost in tokens.
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())
    shown = subprocess.run([sys.executable, "-m", "interactor.cli", "results", job], env=env, cwd=str(ROOT),
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "ended by: context_length 4, terminated 2" in shown.stdout
    assert f"tokens: {p_tok + c_tok} ({p_tok} prompt, {c_tok} completion)" in shown.stdout
    assert "per episode" in shown.stdout and "tokens/s" in shown.stdout


def test_interactor_run_with_embedded_redis(env_server, model_server, tmp_path):
    """The README's `interactor run`: no REDIS_URL, so it starts and stops its own Redis."""
    _, env_url = env_server
    _, model_url = model_server
    tasks = write_tasks(tmp_path, env_url, guess=2, rows=3, arith_num=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    run_dir = tmp_path / "runs"
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "run", tasks, "--llm-base-url", model_url + "/v1",
                          "--run-dir", str(run_dir), "--concurrency", "4", "--workers", "1"],
                         env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "embedded Redis" in out.stdout
    assert "guess_number" in out.stdout and "arithmetic" in out.stdout
    assert f"results database: {(run_dir / 'results.sqlite').resolve()}" in out.stdout
    jobs = db_rows(str(run_dir / "results.sqlite"), "SELECT status, COUNT(*) FROM episodes GROUP BY status")
    assert jobs == [("completed", 2 + 3 * 2)]
    assert (run_dir / "redis" / "appendonly.aof").exists() or list((run_dir / "redis").glob("appendonly*"))
    # Group statistics, for people and for scripts.
    job_id = out.stdout.split("job ", 1)[1].split(":", 1)[0]
    res = subprocess.run([sys.executable, "-m", "interactor.cli", "results", job_id, "--groups", "--json",
                          "--run-dir", str(run_dir)], env=env, cwd=str(ROOT), capture_output=True, text=True)
    groups = json.loads(res.stdout)["group_rows"]
    assert len(groups) == 1 + 3 and all(g["complete"] == 1 and g["size"] == g["completed"] for g in groups)
    for g in groups:
        rewards = [r[0] for r in db_rows(str(run_dir / "results.sqlite"),
                                         "SELECT total_reward FROM episodes WHERE group_id = ?", (g["group_id"],))]
        mean = sum(rewards) / len(rewards)
        assert g["reward_mean"] == pytest.approx(mean)
        assert g["reward_std"] == pytest.approx((sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5)


def test_bad_task_file_enqueues_nothing(settings, redis_client, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("environments:\n  - env_name: guess_number\n    env_num: zero\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_")}
    env.update(settings.as_environ())
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "submit", str(bad), "--env-base-url",
                          "http://127.0.0.1:9"], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "bad.yaml" in out.stderr and "entry 1" in out.stderr and "env_num" in out.stderr
    assert list(redis_client.scan_iter(f"{settings.key_prefix}:*")) == []
    assert redis_client.llen(settings.queue) == 0


def test_ctrl_c_stops_cleanly_says_what_was_left_and_resume_finishes(env_server, tmp_path):
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=500)
    try:
        tasks = tmp_path / "long.yaml"
        tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                         f"    env_params: {{low: 1, high: 100000, max_turns: 20}}\n    env_num: 6\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
        run_dir = tmp_path / "runs"
        common = ["--llm-base-url", slow_url + "/v1", "--run-dir", str(run_dir), "--concurrency", "3",
                  "--workers", "1", "--shutdown-grace", "1"]
        proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "run", str(tasks), *common], env=env,
                                cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=interruptible)
        wait_for(lambda: _running(run_dir), 60, what="steps recorded")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 130, out[-3000:]
        assert "interrupted" in out and "left unfinished:" in out and "--resume" in out
        job_id = out.split("job ", 1)[1].split(":", 1)[0]
        resumed = subprocess.run([sys.executable, "-m", "interactor.cli", "run", "--resume", job_id, *common,
                                  "--concurrency", "6"], env=env, cwd=str(ROOT), capture_output=True, text=True,
                                 timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
        db = str(run_dir / "results.sqlite")
        assert db_rows(db, "SELECT status, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY status",
                       (job_id,)) == [("completed", 6)]
        assert_trajectories_sound(db, job_id)
    finally:
        slow.shutdown()


def _running(run_dir) -> bool:
    db = run_dir / "results.sqlite"
    if not db.exists():
        return False
    try:
        return bool(db_rows(str(db), "SELECT COUNT(*) FROM session_steps")[0][0])
    except Exception:  # noqa: BLE001 - the file is being created
        return False
