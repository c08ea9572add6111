"""Faults a worker's attempts must outlive without being counted against their episodes.

**Redis away for longer than the lease TTL, mid-run: the running attempts go on.**

Redis is frozen (SIGSTOP: its clock jumps when it resumes, every lease has lapsed) or stopped
and started again on the same port from its append-only file, for three lease TTLs while real
worker processes run multi-turn episodes. Nobody could renew, so nobody lost anything: every
episode completes under the attempt it started with (attempts == episodes), nothing is
reclaimed, nothing dead-lettered - whether the lapsed lease is taken back first by a renewal,
a step record or a FINISH, and however the sweepers in every process saw the outage.

**A worker stopped while Redis is away** is killed at its hard exit before it can hand its
episode back; the sweeper reclaims the lease that lapsed in the outage without counting the
attempt.

**An inproc call that never returns** holds the gevent worker's process-wide env lock for
good: the process hands its other episodes back uncounted and exits, and its supervisor
starts a fresh one that runs them.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import pytest

from broker.dlq import DeadLetterQueue
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import AttemptRecord, StepRecord, unpack
from broker.redisconn import connect
from producer.enqueue import submit
from tests.conftest import Procs, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.fault]

EPISODES = 8


def write_job(tmp_path, env_url: str) -> str:
    (tmp_path / "ranges.jsonl").write_text("".join(json.dumps({"low": 1, "high": 64}) + "\n"
                                                   for _ in range(EPISODES // 2)))
    path = tmp_path / "lease.yaml"
    path.write_text(textwrap.dedent(f"""\
        environments:
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{max_turns: 10}}
            dataset: ranges.jsonl
            env_num: 2
        """))
    return str(path)


@pytest.mark.parametrize("how", ["frozen", "restarted"])
def test_redis_away_three_lease_ttls_mid_run_costs_no_attempt(settings, tmp_path, how):
    from examples.envserver import start_in_thread as start_env
    from examples.model_standin import start_in_thread as start_model

    server = EmbeddedRedis(tmp_path / "redis", password="lease-pw").start()
    env, env_url = start_env(latency_ms=5)
    # Slow model turns: every episode is still running when Redis goes away.
    model, model_url = start_model(latency_ms=700)
    # The outage budget is well past the outage: waiting it out is the behaviour under test.
    s = settings.replace(redis_url=server.url, llm_base_url=model_url + "/v1", outage_budget_s=300,
                         max_attempts=3, episode_budget_s=600)
    procs = Procs(s, tmp_path / "logs")
    client = connect(s)
    keys = Keys(s.key_prefix)
    frozen = False
    try:
        job_id = submit(client, s, [write_job(tmp_path, env_url)]).job.job_id
        assert len(Ledger(client, keys).states(job_id)) == EPISODES
        procs.worker("w1")
        procs.worker("w2")
        ledger = Ledger.for_settings(client, s)

        def all_running_with_steps() -> bool:
            running = [e for e, st in ledger.states(job_id).items() if st == "running"]
            stepped = {r.env_id for _, f in client.xrange(keys.results) if isinstance(r := unpack(f[b"r"]), StepRecord)}
            return len(running) == EPISODES and stepped >= set(running)

        wait_for(all_running_with_steps, 180, what="every episode running, each with a step stored")
        away_s = 3 * s.lease_ttl_s
        if how == "frozen":
            os.kill(server.proc.pid, signal.SIGSTOP)
            frozen = True
            time.sleep(away_s)
            os.kill(server.proc.pid, signal.SIGCONT)
            frozen = False
        else:
            server.stop()  # SIGTERM: Redis writes its append-only file out before it exits
            time.sleep(away_s)
            server.start()

        def settled() -> bool:
            c = ledger.counts(job_id)
            return c["done"] + c["failed"] == EPISODES

        wait_for(settled, 300, interval=0.5, what="every episode finished after the outage")
        states = ledger.states(job_id)
        assert set(states.values()) == {"done"}, states
        attempts = {e: ledger.attempts(job_id, e) for e in states}
        assert sum(attempts.values()) == EPISODES, attempts
        closing = [r for _, f in client.xrange(keys.results) if isinstance(r := unpack(f[b"r"]), AttemptRecord)]
        assert [r.status for r in closing] == ["completed"] * EPISODES, [(r.episode_id, r.status, r.reason)
                                                                        for r in closing]
        assert DeadLetterQueue(client, s).list(job_id=job_id) == []
        log = procs.log("w1") + procs.log("w2")
        assert "re-queued" not in log and "abandoned" not in log
    finally:
        if frozen:
            os.kill(server.proc.pid, signal.SIGCONT)
        procs.stop_all()
        env.shutdown()
        model.shutdown()
        client.close()
        server.stop()


def test_a_worker_stopped_during_a_redis_outage_costs_its_episode_no_attempt(settings, tmp_path):
    """A worker is stopped (SIGTERM) while Redis is frozen. It cannot hand its running episode
    back (that needs Redis), and its hard exit (grace + shutdown_hard_exit_s) ends it while it
    still waits. Redis resumes and another worker's sweeper finds the lease lapsed in the gap
    its clock shows: the episode runs again, the lost attempt not counted. It was on its last
    attempt (max_attempts=1), and is completed, not dead-lettered."""
    from examples.envserver import start_in_thread as start_env
    from examples.model_standin import start_in_thread as start_model
    from interactor.children import signal_group

    server = EmbeddedRedis(tmp_path / "redis", password="stop-pw").start()
    env, env_url = start_env(latency_ms=5)
    model, model_url = start_model(latency_ms=700)  # each turn is slow: the episode runs for a while
    s = settings.replace(redis_url=server.url, llm_base_url=model_url + "/v1", outage_budget_s=300,
                         max_attempts=1, episode_budget_s=600, shutdown_grace_s=1, shutdown_hard_exit_s=2)
    procs = Procs(s, tmp_path / "logs")
    client = connect(s)
    keys = Keys(s.key_prefix)
    frozen = False
    path = tmp_path / "slow.yaml"
    path.write_text(textwrap.dedent(f"""\
        environments:
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{low: 1, high: 1000000, max_turns: 40}}
            env_num: 1
        """))
    try:
        job_id = submit(client, s, [str(path)]).job.job_id
        ledger = Ledger.for_settings(client, s)
        (episode_id,) = ledger.states(job_id)
        procs.worker("w1")

        def running_with_a_step() -> bool:
            return ledger.state(job_id, episode_id) == "running" and any(
                isinstance(unpack(f[b"r"]), StepRecord) for _, f in client.xrange(keys.results))

        wait_for(running_with_a_step, 180, what="the episode running, a step stored")
        os.kill(server.proc.pid, signal.SIGSTOP)
        frozen = True
        w1 = procs.procs["w1"]
        signal_group(w1, signal.SIGTERM)
        w1.wait(120)  # its hard exit, 3 s after the SIGTERM, while it waits for Redis
        os.kill(server.proc.pid, signal.SIGCONT)
        frozen = False
        assert ledger.state(job_id, episode_id) == "running"  # nothing was handed back
        procs.worker("w2")
        wait_for(lambda: ledger.state(job_id, episode_id) in ("done", "failed"), 300, interval=0.5,
                 what="the episode run again to its end")
        assert ledger.state(job_id, episode_id) == "done"
        assert DeadLetterQueue(client, s).list(job_id=job_id) == []
        assert ledger.attempts(job_id, episode_id) == 2
        assert ledger.attempt_limit(job_id, episode_id, 1) == 2  # the lost attempt was not counted
        closing = [r for _, f in client.xrange(keys.results) if isinstance(r := unpack(f[b"r"]), AttemptRecord)]
        assert [(r.attempt, r.status, r.reason) for r in closing] == [(1, "abandoned", "worker_lost"),
                                                                      (2, "completed", "")], closing
        assert "while Redis was unreachable" in closing[0].error and "not counted" in closing[0].error
    finally:
        if frozen:
            os.kill(server.proc.pid, signal.SIGCONT)
        procs.stop_all()
        env.shutdown()
        model.shutdown()
        client.close()
        server.stop()


class HangsOnce:
    """A two-turn env class whose first reset (one per marker file, across processes) never
    returns: it sleeps until its process is gone."""

    def __init__(self, env_name: str = ""):
        self.turn = 0

    def reset(self, env_param, seed):
        try:
            os.close(os.open(env_param["marker"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return {"observation": {}, "info": {}}
        while True:
            time.sleep(1)

    def get_task_prompt(self):
        return [{"role": "user", "content": "say something"}]

    def step(self, action):
        self.turn += 1
        return {"observation": {}, "reward": 0.5, "terminated": self.turn >= 2, "truncated": False, "info": {}}


def test_an_inproc_call_that_never_returns_replaces_the_process_not_the_episodes(settings, procs, redis_client,
                                                                                model_server, tmp_path):
    """Six inproc episodes on one gevent worker; the first reset hangs. Its attempt ends as
    env_unreachable (max_attempts=1: dead-lettered, as a hung env server's would be); every
    other episode, stuck behind the process-wide env lock, is handed back uncounted, and the
    worker process exits and is restarted by its supervisor, which completes them all."""
    from broker.queueing import push_episodes
    from broker.records import EpisodeSpec, JobSpec

    _, model_url = model_server
    n = 6
    job = JobSpec(job_id="hang", llm_base_url=model_url + "/v1", model="stand-in", max_attempts=1, episodes=n,
                  groups=1)
    eps = [EpisodeSpec(job_id="hang", episode_id=f"hang.1.1.1.{k}", group_id="hang.1.1.1", group_size=n,
                       env_name="hangs", base_url="", env_params={"marker": str(tmp_path / "hung")}, seed=k,
                       queue=settings.queue, transport="inproc", env_class="tests.test_fault_lease:HangsOnce")
           for k in range(1, n + 1)]
    ledger = Ledger.for_settings(redis_client, settings)
    ledger.create_job(job, eps)
    push_episodes(redis_client, [("hang", e.episode_id, settings.queue) for e in eps])
    procs.worker("w1", pool="gevent", env_read_timeout_s=4)

    def settled() -> bool:
        c = ledger.counts("hang")
        return c["done"] + c["failed"] == n

    wait_for(settled, 240, interval=0.5, what="every episode finished")
    log = procs.log("w1")
    assert "worker process unhealthy" in log and "restarting (1)" in log, log[-3000:]
    letters = DeadLetterQueue(redis_client, settings).list(job_id="hang")
    assert len(letters) == 1 and letters[0].reason == "env_unreachable", letters
    states = ledger.states("hang")
    assert sorted(states.values()) == ["done"] * (n - 1) + ["failed"], states
    closing = [r for _, f in redis_client.xrange(Keys(settings.key_prefix).results)
               if isinstance(r := unpack(f[b"r"]), AttemptRecord)]
    reasons = sorted(r.reason for r in closing if r.status != "completed")
    assert reasons.count("env_unreachable") == 1
    assert set(reasons) - {"env_unreachable"} <= {"worker_shutdown"}, reasons
    assert "worker_shutdown" in reasons  # episodes besides the hung one were in the process, handed back
