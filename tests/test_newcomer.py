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
