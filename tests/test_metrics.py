"""The fleet's metrics and `interactor status`: queue depth per priority sub-queue as kombu
writes it, the record-derived counters and histograms, and a real job scraped over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from broker.celery_app import EPISODE_TASK, make_app
from broker.embedded import free_port
from broker.records import AttemptRecord, StepRecord
from broker.queueing import PRIORITY_SEP, PRIORITY_STEPS, sub_queues
from consumer.stats import StatsRecorder, steps_rate
from interactor.fleet_reader import FleetReader
from interactor.metrics import METRIC_NAMES, exposition
from producer.enqueue import submit
from tests.conftest import ROOT, interruptible, wait_for
from tests.storecheck import db_rows
from tests.test_integration import wait_job_stored, write_tasks

pytestmark = pytest.mark.integration


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict, name: str, sample_name: str | None = None, **labels) -> float:
    fam = fams[name]
    sample_name = sample_name or name
    found = [s.value for s in fam.samples
             if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, f"no sample {sample_name}{labels} in {[(s.name, s.labels) for s in fam.samples][:20]}"
    return sum(found)


def value(fams: dict | None, name: str, sample_name: str | None = None, **labels) -> float:
    """Like sample(), but 0 when the sample is not there (yet): for polling."""
    if not fams or name not in fams:
        return 0.0
    sample_name = sample_name or name
    return sum(s.value for s in fams[name].samples
               if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_priority_sub_queues_are_kombus(settings, redis_client):
    """Celery with priorities puts messages in `q`, `q\\x06\\x163`, ... : every one is counted."""
    from kombu.transport import redis as kombu_redis

    assert kombu_redis.Channel.sep == PRIORITY_SEP
    assert tuple(kombu_redis.PRIORITY_STEPS) == PRIORITY_STEPS
    q = settings.queue
    assert [name for _, name in sub_queues(q)] == [q, f"{q}\x06\x163", f"{q}\x06\x166", f"{q}\x06\x169"]

    app = make_app(settings)
    for prio in (0, 0, 4, 7, 9):
        app.send_task(EPISODE_TASK, args=["job", f"e{prio}"], queue=q, priority=prio)
    # A queue no setting names and no worker serves, holding only high-priority tasks.
    other = q + "-elsewhere"
    app.send_task(EPISODE_TASK, args=["job", "x"], queue=other, priority=9)
    app.close()
    redis_client.lpush(q + "-not-ours", b"something else")
    reader = FleetReader(redis_client, settings)
    depths = reader.queue_depths([q])[q]
    assert depths == {0: 2, 3: 1, 6: 1, 9: 1}
    fams = families(exposition(reader))
    assert sample(fams, "interactor_queue_depth", queue=q) == 5
    assert sample(fams, "interactor_queue_depth", queue=q, priority="9") == 1
    assert sample(fams, "interactor_queue_depth", queue=other) == 1
    assert not [s for s in fams["interactor_queue_depth"].samples if s.labels["queue"] == q + "-not-ours"]
    for name in [n for _, n in sub_queues(q) + sub_queues(other)] + [q + "-not-ours"]:
        redis_client.delete(name)
    # Drained, a queue once seen still reports 0 rather than vanishing.
    assert sample(families(exposition(reader)), "interactor_queue_depth", queue=other) == 0


def test_records_fold_into_counters_and_histograms(settings, redis_client):
    rec = StatsRecorder(redis_client, settings)
    now = time.time()
    steps = [StepRecord(job_id="j", env_id=f"e{i}", attempt=1, step_id=1, env_name="arithmetic", llm_model="m",
                        group_id="g", messages_json=b"[]", response="", step_reward=1.0, cumulative_reward=1.0,
                        terminated=True, truncated=False, episode_finished=True, is_trainable=True,
                        env_latency_s=0.02, model_latency_s=0.3 if i < 3 else 7.0,
                        prompt_tokens=10 * (i + 1), completion_tokens=None if i == 3 else 2) for i in range(4)]
    attempts = [
        AttemptRecord(job_id="j", episode_id="e0", attempt=1, status="completed", group_id="g", group_size=1,
                      env_name="arithmetic", llm_model="m", started_at=now - 42, finished_at=now,
                      ended_by="context_length"),
        AttemptRecord(job_id="j", episode_id="e1", attempt=1, status="retrying", reason="model_unavailable",
                      group_id="g", group_size=1, env_name="arithmetic", llm_model="m", started_at=now - 3),
        AttemptRecord(job_id="j", episode_id="e1", attempt=2, status="failed", reason="model_unavailable",
                      group_id="g", group_size=1, env_name="arithmetic", llm_model="m", started_at=now - 2),
    ]
    rec(steps[:2])
    rec(steps[2:] + attempts)
    rec([])  # an empty batch (all poison) changes nothing
    fams = families(exposition(FleetReader(redis_client, settings)))
    assert sample(fams, "interactor_steps", "interactor_steps_total", env_name="arithmetic") == 4
    lat = "interactor_step_latency_seconds"
    assert sample(fams, lat, lat + "_count", part="model") == 4
    assert sample(fams, lat, lat + "_bucket", part="model", le="0.5") == 3
    assert sample(fams, lat, lat + "_bucket", part="model", le="+Inf") == 4
    assert sample(fams, lat, lat + "_sum", part="model") == pytest.approx(3 * 0.3 + 7.0)
    assert sample(fams, lat, lat + "_bucket", part="env", le="0.025") == 4
    dur = "interactor_episode_duration_seconds"
    assert sample(fams, dur, dur + "_bucket", status="completed", le="30.0") == 0
    assert sample(fams, dur, dur + "_bucket", status="completed", le="60.0") == 1
    assert sample(fams, "interactor_episodes_finished", "interactor_episodes_finished_total", status="completed") == 1
    assert sample(fams, "interactor_episodes_finished", "interactor_episodes_finished_total", status="failed") == 1
    assert sample(fams, "interactor_prompt_tokens", "interactor_prompt_tokens_total", model="m") == 100
    assert sample(fams, "interactor_completion_tokens", "interactor_completion_tokens_total", model="m") == 6
    ended = "interactor_episodes_ended"
    assert sample(fams, ended, ended + "_total", env_name="arithmetic", ended_by="context_length") == 1
    fail = "interactor_attempt_failures"
    assert sample(fams, fail, fail + "_total", reason="model_unavailable") == 2
    assert sample(fams, fail, fail + "_total", reason="model_unavailable", outcome="failed") == 1
    assert sample(fams, "interactor_steps_per_second") > 0


def test_steps_rate():
    assert steps_rate([], 100.0) == 0.0
    assert steps_rate([(99.0, 10)], 100.0) == 0.0
    # 15 s window: the base is the newest sample at or before now - 15.
    samples = [(50.0, 0), (80.0, 100), (85.0, 150), (95.0, 250)]
    assert steps_rate(samples, 100.0) == pytest.approx((250 - 150) / 15.0)
    # Nothing new for a long while: the rate decays to 0.
    assert steps_rate([(10.0, 100), (20.0, 200)], 100.0) == 0.0


def test_job_metrics_and_status_over_http(settings, procs, env_server, model_server, redis_client, tmp_path):
    env, env_url = env_server
    model, model_url = model_server
    model.latency_ms = 20
    settings = settings.replace(llm_base_url=model_url + "/v1")
    procs.settings = settings
    port = free_port()
    procs.start("consumer", "consumer", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape():
        try:
            r = requests.get(url, timeout=10)
        except requests.ConnectionError:
            return None
        return families(r.text) if r.status_code == 200 else None

    wait_for(scrape, 30, what="the consumer's metrics endpoint")
    tasks = write_tasks(tmp_path, env_url, guess=3, rows=4, arith_num=2)
    total = 3 + 4 * 2
    sub = submit(redis_client, settings, [tasks])
    job = sub.job.job_id
    # Before any worker: the whole job is queued, and the endpoint says so.
    fams = scrape()
    assert sample(fams, "interactor_queue_depth", queue=settings.queue) == total
    assert sample(fams, "interactor_job_episodes", job_id=job, state="queued") == total
    assert sample(fams, "interactor_job_size", job_id=job) == total
    assert sample(fams, "interactor_redis_up") == 1

    procs.worker("w1")
    # During the job: steps are counted while it runs.
    wait_for(lambda: value(scrape(), "interactor_steps", "interactor_steps_total") > 0, 60,
             what="steps counted")
    wait_job_stored(settings, job, total)
    db = settings.results_db
    (n_steps,) = db_rows(db, "SELECT COUNT(*) FROM session_steps WHERE job_id = ?", (job,))[0]

    def settled():  # the consumer folds a batch into the counters just after committing it
        f = scrape()
        return f if (value(f, "interactor_job_progress_ratio", job_id=job) == 1.0
                     and value(f, "interactor_steps", "interactor_steps_total") == n_steps
                     and value(f, "interactor_episodes_finished", "interactor_episodes_finished_total") == total) else None

    fams = wait_for(settled, 30, what="metrics to show the whole job")
    missing = set(METRIC_NAMES) - set(fams)
    assert not missing, missing
    unlisted = {f for f in fams if f.startswith("interactor_")} - set(METRIC_NAMES)
    assert not unlisted, f"exported but not in METRIC_NAMES (the docs and dashboards' list): {sorted(unlisted)}"
    assert sample(fams, "interactor_steps", "interactor_steps_total") == n_steps
    lat = "interactor_step_latency_seconds"
    assert sample(fams, lat, lat + "_count", part="model") == n_steps
    assert sample(fams, lat, lat + "_count", part="env") == n_steps
    # The model stand-in sleeps 20 ms per call: no model call is faster than that.
    assert sample(fams, lat, lat + "_bucket", part="model", le="0.01") == 0
    dur = "interactor_episode_duration_seconds"
    assert sample(fams, dur, dur + "_count", status="completed") == total
    assert sample(fams, "interactor_episodes_finished", "interactor_episodes_finished_total",
                  status="completed") == total
    assert sample(fams, "interactor_job_episodes", job_id=job, state="done") == total
    assert sample(fams, "interactor_queue_depth", queue=settings.queue) == 0
    assert sample(fams, "interactor_episodes_running") == 0
    assert sample(fams, "interactor_dead_letters") == 0
    assert sample(fams, "interactor_results_pending", group="consumers") == 0
    assert sample(fams, "interactor_results_lag", group="consumers") == 0
    assert sample(fams, "interactor_results_consumers", group="consumers") >= 1
    assert sample(fams, "interactor_steps_per_second") >= 0

    # The same numbers from the standalone exporter and from `interactor status`.
    env_vars = procs.env()
    once = subprocess.run([sys.executable, "-m", "interactor.cli", "metrics", "--once"], env=env_vars, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=60)
    assert once.returncode == 0, once.stderr[-2000:]
    assert sample(families(once.stdout), "interactor_job_episodes", job_id=job, state="done") == total
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "status"], env=env_vars, cwd=str(ROOT),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    for word in ("queue", "running=", "done=", "failed=", "dead=", "steps/s", "lag=", job):
        assert word in text, text
    job_line = next(line for line in text.splitlines() if job in line)
    assert f"{total}" in job_line and "100.0%" in job_line, text
    js = subprocess.run([sys.executable, "-m", "interactor.cli", "status", job, "--json"], env=env_vars,
                        cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    snap = json.loads(js.stdout)
    assert snap["jobs"][0]["counts"]["done"] == total and snap["steps_total"] == n_steps
    # --watch redraws until interrupted.
    out_path = tmp_path / "watch.txt"
    with open(out_path, "w") as out_file:
        watch = subprocess.Popen([sys.executable, "-m", "interactor.cli", "status", "--watch", "--interval", "0.5"],
                                 env=env_vars, cwd=str(ROOT), stdout=out_file, stderr=subprocess.STDOUT,
                                 preexec_fn=interruptible)
        try:
            wait_for(lambda: out_path.read_text().count("interactor status") >= 2, 60, what="two redraws")
        finally:
            watch.send_signal(signal.SIGINT)
            watch.wait(30)
    assert watch.returncode == 0 and job in out_path.read_text()
    assert os.path.exists(db)


def test_status_of_one_job_counts_only_its_episodes(settings, redis_client, tmp_path):
    """`interactor status JOB`: its episodes line is JOB's, not every job's in Redis."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = submit(redis_client, settings, [write_tasks(tmp_path / "a", "http://127.0.0.1:9", guess=2, rows=1)])
    b = submit(redis_client, settings, [write_tasks(tmp_path / "b", "http://127.0.0.1:9", guess=3, rows=2)])
    reader = FleetReader(redis_client, settings)
    assert reader.snapshot(a.job.job_id)["episodes"]["queued"] == a.job.episodes
    assert reader.snapshot(b.job.job_id)["episodes"]["queued"] == b.job.episodes
    assert reader.snapshot()["episodes"]["queued"] == a.job.episodes + b.job.episodes
    assert reader.snapshot("no-such-job")["episodes"]["queued"] == 0
