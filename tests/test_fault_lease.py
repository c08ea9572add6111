"""Redis away for longer than the lease TTL, mid-run: the running attempts go on.

Redis is frozen (SIGSTOP: its clock jumps when it resumes, every lease has lapsed) or stopped
and started again on the same port from its append-only file, for three lease TTLs while real
worker processes run multi-turn episodes. Nobody could renew, so nobody lost anything: every
episode completes under the attempt it started with (attempts == episodes), nothing is
reclaimed, nothing dead-lettered - whether the lapsed lease is taken back first by a renewal,
a step record or a FINISH, and however the sweepers in every process saw the outage.
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
