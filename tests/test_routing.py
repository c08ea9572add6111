"""Routing and isolation: queues per env family, workers that serve only some of them, and
workers that share nothing with the producer but Redis (other cwd, bare environment, task
files deleted before they start)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from broker.keys import Keys
from broker.ledger import Ledger
from interactor.autoscale import LocalScaler, Policy
from interactor.fleet_reader import FleetReader
from tests.conftest import ROOT, wait_for
from tests.storecheck import assert_trajectories_sound, db_rows
from tests.test_integration import wait_job_stored

pytestmark = pytest.mark.integration


def bare_worker_env(settings, queues: str) -> dict:
    """Only REDIS_URL and INTERACTOR_* settings: no PATH, HOME, PYTHONPATH, and no local paths."""
    env = {k: v for k, v in settings.as_environ().items()
           if k not in ("INTERACTOR_REDIS_URL", "INTERACTOR_RUN_DIR", "INTERACTOR_DB_PATH")}
    env["REDIS_URL"] = settings.redis_url
    env["INTERACTOR_QUEUES"] = queues
    return env


def start_bare_worker(procs, name: str, settings, queues: str, cwd) -> subprocess.Popen:
    log = open(procs.log_dir / f"{name}.log", "ab")
    p = subprocess.Popen([sys.executable, "-m", "interactor.cli", "worker", "--name", f"{name}@%h"],
                         env=bare_worker_env(settings, queues), cwd=str(cwd), stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    procs.procs[name] = p
    return p


def test_queues_isolate_env_families_and_workers_share_only_redis(settings, procs, env_server, model_server,
                                                                 redis_client, tmp_path):
    env, env_url = env_server
    _, model_url = model_server
    settings = settings.replace(llm_base_url=model_url + "/v1", concurrency=4)
    procs.settings = settings
    qa, qb = settings.queue + "-fast", settings.queue + "-slow"

    # The producer's side: a task folder with a dataset; one entry names its queue, the other
    # takes the producer's --queue.
    producer_dir = tmp_path / "producer"
    producer_dir.mkdir()
    (producer_dir / "arith.jsonl").write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": i + 1}) + "\n"
                                                      for i in range(3)))
    (producer_dir / "tasks.yaml").write_text(textwrap.dedent(f"""\
        environments:
          - env_name: arithmetic
            base_url: {env_url}
            env_params: {{}}
            dataset: arith.jsonl
            env_num: 1
            queue: {qa}
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{low: 1, high: 16, max_turns: 6}}
            env_num: 3
        """))
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "submit", "tasks.yaml", "--queue", qb],
                         env=procs.env(), cwd=str(producer_dir), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    job = json.loads(out.stdout.strip().splitlines()[-1])["job_id"]
    shutil.rmtree(producer_dir)  # nothing a worker could read from the producer's disk
    ledger = Ledger(redis_client, Keys(settings.key_prefix))
    queue_of = {e: ledger.episode_spec(job, e).queue for e in ledger.states(job)}
    fast = sorted(e for e, q in queue_of.items() if q == qa)
    slow = sorted(e for e, q in queue_of.items() if q == qb)
    assert len(fast) == 3 and len(slow) == 3
    assert redis_client.llen(qa) == 3 and redis_client.llen(qb) == 3

    # A worker serving only the fast queue, from elsewhere, knowing only REDIS_URL and settings.
    cwd_a = tmp_path / "worker-a"
    cwd_a.mkdir()
    wa = start_bare_worker(procs, "wa", settings, qa, cwd_a)
    procs.consumer()
    wait_for(lambda: all(ledger.state(job, e) == "done" for e in fast), 60, what="fast-queue episodes done")
    time.sleep(2.0)  # wa has free slots; it must still leave the slow queue alone
    assert all(ledger.state(job, e) == "queued" for e in slow)
    assert redis_client.llen(qb) == 3
    snap = FleetReader(redis_client, settings).snapshot(job)
    assert snap["queues"][qa]["depth"] == 0 and snap["queues"][qb]["depth"] == 3  # metrics see both queues
    both = LocalScaler(settings.replace(queues=f"{qa},{qb}"), Policy(max_workers=2, target_per_worker=4),
                       client=redis_client)
    assert both.load() == (3, 0)  # so does an autoscaler serving both

    # A second worker, on the other queue (and one more that nobody uses), runs them.
    cwd_b = tmp_path / "worker-b"
    cwd_b.mkdir()
    wb = start_bare_worker(procs, "wb", settings, f"{qb},{settings.queue}-unused", cwd_b)
    res = wait_job_stored(settings, job, 6, timeout=90)
    assert res["completed"] == 6, procs.log("wb")[-3000:]
    assert_trajectories_sound(settings.results_db, job)
    assert env.stats()["resets"] == 6

    # Who ran what: the fast episodes on wa, the slow ones on wb.
    ran = dict(db_rows(settings.results_db, "SELECT episode_id, worker FROM attempts WHERE job_id = ?", (job,)))
    def pids(p):  # `interactor worker` may run Celery in a child process
        return {str(p.pid)} | {str(c.pid) for c in psutil.Process(p.pid).children(recursive=True)}

    assert {ran[e].rsplit("-", 1)[1] for e in fast} <= pids(wa)
    assert {ran[e].rsplit("-", 1)[1] for e in slow} <= pids(wb)
    for p, cwd in ((wa, cwd_a), (wb, cwd_b)):
        proc = psutil.Process(p.pid)
        assert proc.cwd() == str(cwd)
        environ = proc.environ()
        assert "PATH" not in environ and "HOME" not in environ and "INTERACTOR_REDIS_URL" not in environ
        assert environ["REDIS_URL"] == settings.redis_url
    assert list(cwd_a.iterdir()) == [] and list(cwd_b.iterdir()) == []  # and wrote nothing locally
    assert str(ROOT) != str(cwd_a)
