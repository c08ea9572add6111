"""Small things a new user meets in the first hour, each checked as they would meet it: a worker
log that opens without alarming warnings, `results | head` without a traceback, flags that
would be ignored refused, an empty token-stream export explained."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, wait_for

pytestmark = pytest.mark.integration


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}


def test_a_worker_log_opens_without_gevents_or_celerys_warnings(procs):
    """gevent's MonkeyPatchWarning ("may lead to errors, including RecursionError": ssl was
    loaded before the patching) and Celery's "worker_pool setting shouldn't be used" opened
    every worker's log."""
    procs.worker("w1")
    wait_for(lambda: "ready." in procs.log("w1"), 60, what="the worker ready")
    log = procs.log("w1")
    assert "MonkeyPatchWarning" not in log and "RecursionError" not in log, log[:3000]
    assert "worker_pool setting" not in log, log[:3000]


def test_results_piped_into_head_ends_quietly(tmp_path):
    from consumer.storage import open_store
    from tests.test_ui import JOB, fill

    store = open_store(str(tmp_path / "results.sqlite"))
    fill(store)
    store.close()
    out = subprocess.run(f"{sys.executable} -m interactor.cli results {JOB} --groups --db {tmp_path / 'results.sqlite'}"
                         " | head -1", shell=True, cwd=str(ROOT), env=clean_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() and "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_feed_serve_refuses_epochs_it_would_ignore(tmp_path):
    """Started without task files, the job comes from POST /start_rollout with its own epochs:
    --epochs was silently ignored."""
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "feed", "serve", "--epochs", "1", "--port", "0",
                          "--run-dir", str(tmp_path)], cwd=str(tmp_path), env=clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--epochs" in out.stderr and "start_rollout" in out.stderr, out.stderr


def test_a_token_stream_export_of_a_job_without_tokens_says_why_it_is_empty(tmp_path):
    from consumer.storage import open_store
    from tests.test_ui import JOB, fill

    store = open_store(str(tmp_path / "results.sqlite"))
    fill(store)
    store.close()
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "export", JOB, "--streams", "--db",
                          str(tmp_path / "results.sqlite"), "--out", str(tmp_path / "s.jsonl")], cwd=str(ROOT),
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "wrote 0 token-stream rows" in out.stdout, out.stdout + out.stderr
    assert "--tokens" in out.stdout


# --- issue 48, finding 10: how lists, jobs, errors and exports read ---------------------------

def test_results_groups_are_in_task_file_order_not_text_order(tmp_path):
    """`results --groups` listed ….1.2.1, ….1.2.10, ….1.2.11, ….1.2.2."""
    import json

    from consumer.storage import open_store
    from tests.test_ui import JOB, rec_close, rec_step

    store = open_store(str(tmp_path / "results.sqlite"))
    rows = (1, 2, 10, 11, 3)
    recs = []
    for row in rows:
        group, ep = f"{JOB}.1.2.{row}", f"{JOB}.1.2.{row}.1"
        recs += [rec_step(ep, 1, [{"role": "user", "content": "q"}], "a", last=True, group=group),
                 rec_close(ep, 1.0, 1, group=group, size=1)]
    store.write_batch(recs)
    store.close()
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "results", JOB, "--groups", "--json", "--db",
                          str(tmp_path / "results.sqlite")], cwd=str(ROOT), env=clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [g["group_id"].rsplit(".", 1)[1] for g in json.loads(out.stdout)["group_rows"]] == ["1", "2", "3", "10", "11"]


def test_status_shows_a_continuous_feed_job_as_continuous(settings, redis_client, tmp_path):
    """A running continuous feed job read `total 0 ... progress 100.0%`."""
    from producer.continuous import ContinuousProducer, create_continuous_job
    from tests.taskfiles import write_arith_tasks
    from tests.test_recovery import cli

    tasks = write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=4, env_num=2)
    job_id = create_continuous_job(redis_client, settings.replace(feed_max_ahead=2), [tasks]).job_id
    assert ContinuousProducer(redis_client, settings, job_id).fill() == 2
    out = cli(settings, "status")
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.strip().startswith(job_id)]
    assert "continuous" in line and "100.0%" not in line and "%" not in line, out.stdout


def test_dlq_list_shows_the_head_and_the_exception_that_ended_the_attempt(settings, redis_client):
    """`dlq list` cut the error at 100 characters, just before the task name that said what was
    wrong (`HTTP 400: unknown reasoning-gym task `)."""
    from broker import errors
    from broker.ledger import Ledger
    from broker.records import DeadLetter
    from broker.states import AttemptStatus, LedgerState
    from tests.test_ledger import JOB, attempt_rec, ep_id, make_job
    from tests.test_recovery import cli

    ledger = Ledger.for_settings(redis_client, settings)
    job, eps = make_job()
    ledger.create_job(job, eps)
    lease = ledger.start(JOB, ep_id(1), "w1").lease
    error = ("env server http://127.0.0.1:8001/reasoning_gym.leg_countin/20261128-000809-a98e5d.1.1.1.1~1-9f3e07a1/reset "
             "answered HTTP 400: unknown reasoning-gym task 'leg_countin'\n"
             "Traceback (most recent call last):\n" + "  File \"x.py\", line 1, in f\n" * 20 +
             "workers.errors.EpisodeError: env_bad_request: unknown reasoning-gym task 'leg_countin'; "
             "did you mean 'leg_counting'?")
    letter = DeadLetter(job_id=JOB, episode_id=ep_id(1), group_id=eps[0].group_id, env_name="arith",
                        reason=errors.ENV_BAD_REQUEST, error=error, spec=eps[0].to_dict())
    record = attempt_rec(lease, AttemptStatus.FAILED, reason=errors.ENV_BAD_REQUEST)
    assert ledger.finish(lease, record, LedgerState.FAILED, dead_letter=letter)
    out = cli(settings, "dlq", "list")
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.startswith(ep_id(1))]
    assert "env server http://127.0.0.1:8001/reasoning_gym.leg_countin" in line  # the head
    assert "did you mean 'leg_counting'?" in line and "File \"x.py\"" not in line  # the exception, not the stack
    assert len(line) < 400


def test_export_streams_is_written_beside_the_plain_export(tmp_path):
    """`export JOB` and `export JOB --streams` both wrote RUN_DIR/JOB.jsonl: the second
    overwrote the first."""
    from consumer.storage import open_store
    from tests.test_ui import JOB, fill

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    store = open_store(str(run_dir / "results.sqlite"))
    fill(store)
    store.close()

    def export(*flags):
        return subprocess.run([sys.executable, "-m", "interactor.cli", "export", JOB, *flags, "--run-dir", str(run_dir)],
                              cwd=str(ROOT), env=clean_env(), capture_output=True, text=True, timeout=60)

    plain = export()
    assert plain.returncode == 0, plain.stderr
    written = (run_dir / f"{JOB}.jsonl").read_bytes()
    assert written and str(run_dir / f"{JOB}.jsonl") in plain.stdout
    streams = export("--streams")
    assert streams.returncode == 0, streams.stderr
    assert str(run_dir / f"{JOB}.streams.jsonl") in streams.stdout and (run_dir / f"{JOB}.streams.jsonl").exists()
    assert (run_dir / f"{JOB}.jsonl").read_bytes() == written
