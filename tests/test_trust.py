"""Trust boundaries and bookkeeping a shared fleet relies on: what a job may make workers
import or call, job ids that cannot be reused, retention of finished jobs, re-driving failures
whose letters are gone, and secrets kept out of what is shown. Real Redis, real servers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from broker import errors
from broker.dlq import DeadLetterQueue
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.ledger import JobExists, Ledger
from broker.recovery import Sweeper
from broker.settings import Settings, redact_url
from broker.states import LedgerState
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.test_runner import make_job
from workers.runner import WorkerRuntime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def runtime_with(settings):
    made = []

    def make(**overrides):
        rt = WorkerRuntime(settings.replace(**overrides), name=f"trust-{len(made)}")
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.stop()


def only_letter(client, settings, job_id):
    (letter,) = DeadLetterQueue(client, settings).list(job_id=job_id)
    return letter


def test_env_server_off_the_allow_list_is_never_called(settings, redis_client, env_server, model_server,
                                                       runtime_with):
    env, env_url = env_server
    _, model_url = model_server
    rt = runtime_with(env_hosts="envs.internal:8080")
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1")
    before = env.stats()["requests"]
    assert rt.run(job.job_id, ep.episode_id) == "failed"
    letter = only_letter(redis_client, settings, job.job_id)
    assert letter.reason == errors.BAD_TASK and "INTERACTOR_ENV_HOSTS" in letter.error
    assert env.stats()["requests"] == before
    # The same host on the list: the episode runs.
    rt2 = runtime_with(env_hosts=env_url)
    job2, (ep2,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1", job_id="job2")
    assert rt2.run(job2.job_id, ep2.episode_id) == "completed"


def test_episode_hook_off_the_allow_list_is_never_imported(settings, redis_client, env_server, model_server,
                                                          runtime_with):
    _, env_url = env_server
    _, model_url = model_server
    rt = runtime_with()
    assert "this" not in sys.modules
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1",
                          episode_hook="this:Hook")
    assert rt.run(job.job_id, ep.episode_id) == "failed"
    letter = only_letter(redis_client, settings, job.job_id)
    assert letter.reason == errors.BAD_TASK and "episode hook 'this:Hook'" in letter.error
    assert "this" not in sys.modules  # importing it would have run its module code


def test_an_existing_job_id_is_refused_and_nothing_changes(settings, redis_client, env_server, tmp_path):
    _, env_url = env_server
    tasks = tmp_path / "t.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                     f"    env_params: {{low: 1, high: 8}}\n    env_num: 2\n")
    submit(redis_client, settings, [str(tasks)], job_id="jobx")
    ledger = Ledger(redis_client, Keys(settings.key_prefix))
    states = ledger.states("jobx")
    queue_len = redis_client.llen(settings.queue)
    assert len(states) == 2 and queue_len == 2
    with pytest.raises(JobExists, match="exists already"):
        submit(redis_client, settings, [str(tasks)], job_id="jobx")
    assert ledger.states("jobx") == states and redis_client.llen(settings.queue) == queue_len
    # The command line says so and exits 2.
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "submit", str(tasks), "--job-id", "jobx",
                          "--no-preflight"],  # no servers here: the id is what is refused
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "job id 'jobx' exists already" in out.stderr
    assert redis_client.llen(settings.queue) == queue_len


def test_finished_jobs_expire_and_are_forgotten(settings, redis_client, env_server, model_server, runtime_with):
    _, env_url = env_server
    _, model_url = model_server
    s = settings.replace(job_retention_s=1)
    rt = runtime_with(job_retention_s=1)
    keys = Keys(s.key_prefix)
    ledger = Ledger(redis_client, keys)

    def swept_until(check, what):
        # A sweep finds the sweep lock taken while the runtime's own sweeper (every 0.5 s) holds
        # it, and then does nothing: sweep again until one ran.
        wait_for(lambda: Sweeper(redis_client, s).tick() is not None and check(), 20, 0.05, what)

    job, (ep,) = make_job(redis_client, s, env_url=env_url, llm_url=model_url + "/v1")
    bad, (bad_ep,) = make_job(redis_client, s, env_url=env_url, llm_url=model_url + "/v1", env_name="nope",
                              job_id="job2")
    active, _ = make_job(redis_client, s, env_url=env_url, llm_url=model_url + "/v1", job_id="job3")
    assert rt.run(job.job_id, ep.episode_id) == "completed"
    assert rt.run(bad.job_id, bad_ep.episode_id) == "failed"
    # within the retention, or already past it (gone) on a slow machine; never without an expiry (-1)
    swept_until(lambda: redis_client.ttl(keys.job_spec("job1")) in (-2, 0, 1), "the finished job's expiry")
    assert redis_client.ttl(keys.job_spec("job3")) == -1
    wait_for(lambda: not redis_client.exists(*keys.job_keys("job1"), *keys.job_keys("job2")), 10, 0.1,
             "the finished jobs' keys to expire")
    swept_until(lambda: set(ledger.job_ids()) == {"job3"}, "the expired jobs forgotten")  # the unfinished job is kept
    assert DeadLetterQueue(redis_client, s).list(job_id="job2") == []


def test_failed_episodes_redriven_after_their_letters_were_purged(settings, redis_client, env_server,
                                                                  model_server, runtime_with):
    _, env_url = env_server
    _, model_url = model_server
    rt = runtime_with()
    job, eps = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1", env_name="nope", n=2)
    for e in eps:
        assert rt.run(job.job_id, e.episode_id) == "failed"
    dlq = DeadLetterQueue(redis_client, settings)
    assert dlq.purge(dlq.list(job_id=job.job_id)) == 2 and dlq.list(job_id=job.job_id) == []
    redriven = dlq.redrive_failed(job.job_id)
    assert sorted(redriven) == sorted(e.episode_id for e in eps)
    states = Ledger(redis_client, Keys(settings.key_prefix)).states(job.job_id)
    assert set(states.values()) == {LedgerState.QUEUED}


@pytest.mark.unit
def test_urls_and_settings_are_shown_without_secrets():
    assert redact_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert "s3cret" not in redact_url("postgresql://u:s3cret@db/x?sslmode=require")
    assert "tok123" not in redact_url("http://m:8000/v1?api_key=tok123&x=1")
    s = Settings.from_env({}, redis_url="redis://:s3cret@h:1/0", store_url="postgresql://u:pw9@db/x",
                          llm_api_key="sk-abcdef")
    text = repr(s)
    assert "s3cret" not in text and "pw9" not in text and "sk-abcdef" not in text


def test_embedded_redis_refuses_config_and_keeps_files_private(tmp_path):
    with EmbeddedRedis(tmp_path / "r", password="pw") as server:
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.config_get("dir")
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command("MODULE", "LIST")
        client.set("k", "v")
        client.close()
        assert (tmp_path / "r").stat().st_mode & 0o777 == 0o700
        aof = tmp_path / "r" / "appendonly.aof"
        assert aof.exists() and aof.stat().st_mode & 0o077 == 0


@pytest.mark.unit
def test_sqlite_results_file_is_private(tmp_path):
    from consumer.storage import open_store

    store = open_store(str(tmp_path / "results.sqlite"))
    store.close()
    assert (tmp_path / "results.sqlite").stat().st_mode & 0o077 == 0
