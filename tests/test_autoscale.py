"""Queue-depth autoscaling: the policy on its own, idle-only scale-down, and a real burst that
takes the local autoscaler to its maximum and back to its minimum without losing or repeating
an episode."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from broker.embedded import free_port
from broker.keys import Keys, member
from broker.ledger import Ledger
from interactor.autoscale import Decider, LocalScaler, Policy, WorkerProc, descendants, leases_by_pid
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.storecheck import assert_trajectories_sound, db_rows
from tests.test_integration import wait_job_stored


# --- the policy ----------------------------------------------------------------------------
@pytest.mark.unit
def test_policy_recommendation():
    p = Policy(min_workers=1, max_workers=5, target_per_worker=4, scale_down_cooldown_s=30)
    assert p.recommend(0, 0) == 1  # the minimum, even idle
    assert p.recommend(1, 0) == 1
    assert p.recommend(4, 0) == 1
    assert p.recommend(5, 0) == 2  # ceil
    assert p.recommend(3, 6) == 3  # running episodes count as load: they need their workers
    assert p.recommend(10_000, 0) == 5  # the maximum
    assert Policy(min_workers=0, max_workers=3, target_per_worker=2).recommend(0, 0) == 0  # scale to zero
    for bad in (dict(min_workers=3, max_workers=2), dict(max_workers=0), dict(target_per_worker=0),
                dict(min_workers=-1), dict(scale_down_cooldown_s=-1)):
        with pytest.raises(ValueError):
            Policy(**bad)


@pytest.mark.unit
def test_scale_up_is_immediate_scale_down_waits_for_the_cooldown():
    d = Decider(Policy(min_workers=0, max_workers=10, target_per_worker=10, scale_down_cooldown_s=60))
    assert d.desired(0, 0, now=0) == 0
    assert d.desired(95, 0, now=1) == 10  # up at once
    assert d.desired(0, 12, now=10) == 10  # load fell: still 10 within the window
    assert d.desired(0, 0, now=30) == 10  # a short lull does not shed workers
    assert d.desired(40, 0, now=40) == 10
    assert d.desired(0, 12, now=62) == 4  # 60 s after the last 10: the highest since (40 queued)
    assert d.desired(0, 12, now=101) == 2  # and 60 s after that, what the load needs now
    assert d.desired(0, 0, now=200) == 0
    # Without a cooldown the policy follows the load both ways.
    d0 = Decider(Policy(min_workers=1, max_workers=4, target_per_worker=1, scale_down_cooldown_s=0))
    assert [d0.desired(q, 0, now=t) for t, q in enumerate([0, 3, 9, 2, 0])] == [1, 3, 4, 2, 1]


def test_scale_down_stops_only_idle_workers(settings, redis_client):
    """Workers holding a lease (running an episode) are never chosen to stop."""
    scaler = LocalScaler(settings, Policy(min_workers=0, max_workers=3, target_per_worker=1,
                                          scale_down_cooldown_s=0), client=redis_client)
    sleeper = "import time; time.sleep(120)"
    # The busy one runs its episode in a child process, as `interactor worker` (a supervisor
    # over the Celery process) or a prefork pool do: the lease names the child's pid.
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); time.sleep(120)"
    fakes = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
             for code in (sleeper, sleeper, parent)]
    grandchild = []
    try:
        scaler.workers = [WorkerProc(f"w{i}", p, started_at=i) for i, p in enumerate(fakes)]
        keys = Keys(settings.key_prefix)
        busy = fakes[2]  # the youngest, which an idle-blind policy would stop first
        grandchild = wait_for(lambda: psutil.Process(busy.pid).children(), 10, what="the busy worker's child")
        token = f"{scaler.hostname}-{grandchild[0].pid}:abcd1234:1"
        redis_client.set(keys.lease("ep1"), token, px=60_000)
        redis_client.zadd(keys.running, {member("job", "ep1"): int(time.time() * 1000) + 60_000})
        assert leases_by_pid(redis_client, keys, scaler.hostname) == {grandchild[0].pid: 1}
        assert descendants(busy.pid) == {busy.pid, grandchild[0].pid}

        scaler._scale_down(3)
        assert [w.proc for w in scaler.workers] == [busy]
        assert {w.proc for w in scaler.stopping} == {fakes[0], fakes[1]}
        for p in fakes[:2]:
            assert p.wait(10) == -signal.SIGTERM  # warm shutdown is SIGTERM
        assert busy.poll() is None
        scaler._reap()
        assert scaler.stopping == []
        # Once it has finished its episode, it may go too.
        redis_client.delete(keys.lease("ep1"))
        redis_client.zrem(keys.running, member("job", "ep1"))
        scaler._scale_down(1)
        assert scaler.workers == [] and busy.wait(10) == -signal.SIGTERM
    finally:
        for p in grandchild:
            p.kill()
        for p in fakes:
            if p.poll() is None:
                p.kill()
                p.wait()


# --- the local autoscaler under a real burst -------------------------------------------------
@pytest.mark.integration
def test_burst_scales_to_max_and_back_to_min_without_losing_or_repeating(settings, procs, redis_client,
                                                                          tmp_path):
    from examples.envserver import start_in_thread as start_env
    from examples.model_standin import start_in_thread as start_model

    env, env_url = start_env()
    model, model_url = start_model(latency_ms=300)
    try:
        # Warm shutdown must never cut an episode short here: the grace outlasts any episode.
        settings = settings.replace(llm_base_url=model_url + "/v1", concurrency=2, shutdown_grace_s=60)
        procs.settings = settings
        port = free_port()
        autoscaler = procs.start("autoscaler", "autoscale", "--min", "1", "--max", "3", "--target-per-worker", "2",
                                 "--cooldown", "2", "--interval", "0.5", "--metrics-port", str(port),
                                 "--metrics-host", "127.0.0.1", "--log-dir", str(tmp_path / "workers"))
        procs.consumer()

        def gauges() -> dict:
            try:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            except requests.ConnectionError:
                return {}
            out = {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    out[s.name + "".join(f"/{v}" for v in s.labels.values())] = s.value
            return out

        # Idle: the minimum.
        wait_for(lambda: gauges().get("interactor_autoscaler_workers/serving") == 1, 30, what="min workers")
        assert gauges()["interactor_autoscaler_desired_workers"] == 1

        tasks = tmp_path / "burst.yaml"
        tasks.write_text(textwrap.dedent(f"""\
            environments:
              - env_name: guess_number
                base_url: {env_url}
                env_params: {{low: 1, high: 32, max_turns: 8}}
                env_num: 24
            """))
        total = 24
        sub = submit(redis_client, settings, [str(tasks)])
        job = sub.job.job_id

        # The burst: straight to the maximum.
        wait_for(lambda: gauges().get("interactor_autoscaler_workers/serving") == 3, 30, what="max workers")
        children_at_peak = {p.pid for p in psutil.Process(autoscaler.pid).children()}
        assert len(children_at_peak) >= 3

        wait_job_stored(settings, job, total, timeout=120)
        # Drained: back to the minimum, the extra workers warm-stopped and gone.
        wait_for(lambda: (g := gauges()).get("interactor_autoscaler_workers/serving") == 1
                 and g.get("interactor_autoscaler_workers/stopping") == 0, 40, what="back to min workers")
        g = gauges()
        assert g["interactor_autoscaler_peak_workers"] == 3
        assert g["interactor_autoscaler_desired_workers"] == 1
        assert len(psutil.Process(autoscaler.pid).children()) == 1

        # Nothing lost, nothing run twice.
        db = settings.results_db
        eps = db_rows(db, "SELECT status, attempt, attempts FROM episodes WHERE job_id = ?", (job,))
        assert len(eps) == total
        assert all(e == ("completed", 1, 1) for e in eps), eps
        attempts = db_rows(db, "SELECT status, COUNT(*) FROM attempts WHERE job_id = ? GROUP BY status", (job,))
        assert attempts == [("completed", total)]
        assert db_rows(db, "SELECT COUNT(*) FROM superseded_steps WHERE job_id = ?", (job,)) == [(0,)]
        assert_trajectories_sound(db, job)
        ledger = Ledger(redis_client, Keys(settings.key_prefix))
        assert ledger.counts(job)["done"] == total
        assert all(ledger.attempts(job, e) == 1 for e in ledger.states(job))
        stats = env.stats()
        assert stats["resets"] == total and stats["live"] == 0
        workers = db_rows(db, "SELECT COUNT(DISTINCT worker) FROM attempts WHERE job_id = ?", (job,))[0][0]
        assert workers >= 2  # the burst was shared out

        # Stopping the autoscaler warm-stops its last worker.
        procs.kill("autoscaler", signal.SIGTERM)
        assert autoscaler.returncode == 0
        for pid in children_at_peak:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        env.shutdown()
        model.shutdown()
        for p in psutil.Process().children(recursive=True):
            if "interactor.cli" in " ".join(p.cmdline()) and "worker" in p.cmdline():
                p.kill()
