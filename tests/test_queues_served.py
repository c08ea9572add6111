"""Every queue a job uses is served or accounted for: a local run's workers serve the queues
its task file names (``queue:``), and reconcile never calls an episode lost that waits in a
queue it does not scan (a continuous job, whose episodes come after its creation, records its
queues too). Real Redis, real worker and consumer processes, loopback stand-ins."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from broker.keys import Keys
from broker.ledger import Ledger
from broker.recovery import reconcile
from broker.states import LedgerState
from producer.continuous import ContinuousProducer, create_continuous_job
from tests.conftest import ROOT
from tests.taskfiles import write_arith_tasks

pytestmark = pytest.mark.integration

def with_queue(path: str, queue: str) -> str:
    """The task file's arithmetic entry sent to ``queue`` (as the README's example does)."""
    text = open(path).read().replace("    env_num:", f"    queue: {queue}\n    env_num:")
    open(path, "w").write(text)
    return path


def test_a_local_run_serves_the_queues_its_task_file_names(tmp_path, env_server, model_server):
    """`interactor run` with an entry on `queue: fast` waited for ever (4/84 done, 80 waiting):
    its local workers served only the default queue. Now it finishes, and so does --resume."""
    _, env_url = env_server
    _, model_url = model_server
    tasks = with_queue(write_arith_tasks(tmp_path, env_url, rows=3, env_num=2, guess=2), "fast")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "run", tasks, "--llm-base-url", model_url + "/v1",
                          "--run-dir", str(tmp_path / "runs"), "--concurrency", "4", "--workers", "1"],
                         env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    db = sqlite3.connect(tmp_path / "runs" / "results.sqlite")
    assert db.execute("SELECT env_name, status, COUNT(*) FROM episodes GROUP BY env_name, status").fetchall() == [
        ("arithmetic", "completed", 6), ("guess_number", "completed", 2)]


def test_reconcile_leaves_a_continuous_jobs_episodes_waiting_in_a_queue_nobody_serves(settings, redis_client,
                                                                                    tmp_path, env_server, procs):
    """A continuous job recorded no queues, so every process's reconcile called the episodes
    waiting on `fast` (served by nobody here) lost and re-enqueued them every round: the queue
    grew from 1,760 to 2,000 copies of 80 episodes in a minute. Now the queue holds the episodes
    waiting, once each, round after round."""
    _, env_url = env_server
    tasks = with_queue(write_arith_tasks(tmp_path, env_url, rows=4, env_num=2), f"fast-{settings.queue}")
    job = create_continuous_job(redis_client, settings, [tasks], epochs=1)
    assert Ledger.for_settings(redis_client, settings).job_queues(job.job_id) == {f"fast-{settings.queue}"}
    producer = ContinuousProducer(redis_client, settings.replace(feed_max_ahead=4), job.job_id)
    stop = threading.Event()
    assert producer.fill() == 4  # max_ahead 4 from the job's feed config (64) is capped by what the file has
    queued = Ledger.for_settings(redis_client, settings).counts(job.job_id)[LedgerState.QUEUED]
    assert queued == 8
    procs.consumer()  # sweeps and reconciles every 2 s (tests' reconcile_interval_s), on the default queue
    procs.worker("w1")
    deadline = time.monotonic() + 20  # ten reconcile rounds
    while time.monotonic() < deadline:
        assert redis_client.llen(f"fast-{settings.queue}") == queued
        time.sleep(1)
    assert reconcile(redis_client, settings, job.job_id, dry_run=True) == []
    stop.set()


def test_reconcile_looks_in_an_episodes_own_queue_even_when_the_job_recorded_none(settings, redis_client, tmp_path,
                                                                                  env_server):
    """A job made before its queues were recorded: the episode's own queue is looked in."""
    _, env_url = env_server
    tasks = with_queue(write_arith_tasks(tmp_path, env_url, rows=2, env_num=1), f"own-{settings.queue}")
    job = create_continuous_job(redis_client, settings, [tasks], epochs=1)
    keys = Keys(settings.key_prefix)
    redis_client.delete(keys.job_queues(job.job_id))
    ContinuousProducer(redis_client, settings, job.job_id).fill()
    redis_client.delete(keys.job_queues(job.job_id))  # as an older producer left it
    assert redis_client.llen(f"own-{settings.queue}") == 2
    assert reconcile(redis_client, settings, job.job_id) == []
    assert redis_client.llen(f"own-{settings.queue}") == 2
