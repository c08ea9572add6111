"""The fault suite: 200 episodes (multi-turn and single-turn) while things break.

Each scenario ends with every episode either completed exactly once in the database or
dead-lettered with a reason, no duplicate steps, no superseded step in exports, and every group
accounted for. Each prints its figures (run with -s to see them).
"""

from __future__ import annotations

import json
import random
import textwrap
import time
from dataclasses import dataclass, field

import pytest

from broker.dlq import DeadLetterQueue
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.ledger import Ledger
from broker.redisconn import connect
from consumer.export import export_training
from producer.enqueue import submit
from tests.conftest import Procs
from consumer.storage import open_store
from tests.storecheck import assert_trajectories_sound

pytestmark = [pytest.mark.integration, pytest.mark.fault]

GUESS_ROWS, GUESS_NUM = 25, 4  # 100 multi-turn episodes in 25 groups
ARITH_ROWS, ARITH_NUM = 50, 2  # 100 single-turn episodes in 50 groups
EPISODES = GUESS_ROWS * GUESS_NUM + ARITH_ROWS * ARITH_NUM
GROUPS = GUESS_ROWS + ARITH_ROWS


def write_job(tmp_path, env_url: str) -> str:
    rng = random.Random(7)
    (tmp_path / "arith.jsonl").write_text("".join(
        json.dumps({"question": f"What is {a} + {b}?", "answer": a + b}) + "\n"
        for a, b in ((rng.randint(1, 99), rng.randint(1, 99)) for _ in range(ARITH_ROWS))))
    (tmp_path / "ranges.jsonl").write_text("".join(
        json.dumps({"low": 1, "high": rng.choice([16, 32, 64])}) + "\n" for _ in range(GUESS_ROWS)))
    path = tmp_path / "faults.yaml"
    path.write_text(textwrap.dedent(f"""\
        environments:
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{max_turns: 8}}
            dataset: ranges.jsonl
            env_num: {GUESS_NUM}
          - env_name: arithmetic
            base_url: {env_url}
            env_params: {{}}
            dataset: arith.jsonl
            env_num: {ARITH_NUM}
        """))
    return str(path)


@dataclass
class Figures:
    scenario: str
    episodes: int = 0
    completed: int = 0
    dead_lettered: int = 0
    attempts: int = 0
    steps: int = 0
    superseded_steps: int = 0
    duplicate_steps: int = 0
    superseded_in_export: int = 0
    groups_complete: int = 0
    groups_incomplete: int = 0
    faults: dict = field(default_factory=dict)
    seconds: float = 0.0

    def print(self) -> None:
        print(f"\n[fault:{self.scenario}] episodes={self.episodes} completed={self.completed} "
              f"dead-lettered={self.dead_lettered} attempts={self.attempts} steps={self.steps} "
              f"superseded(kept out)={self.superseded_steps} duplicate steps={self.duplicate_steps} "
              f"superseded in export={self.superseded_in_export} groups complete={self.groups_complete} "
              f"incomplete={self.groups_incomplete} faults={self.faults} in {self.seconds:.0f}s")


class Scenario:
    def __init__(self, name, tmp_path, settings, *, env_knobs=None, model_knobs=None, workers=2,
                 model_latency_ms=40, consumers=1, redis=None, **overrides):
        """``redis``: a started Redis of the test's own (anything with ``url`` and ``stop()``, say a
        tests/sentinel.py SentinelCluster), stopped with the scenario; else an embedded one."""
        from examples.envserver import start_in_thread as start_env
        from examples.model_standin import start_in_thread as start_model

        self.name = name
        self.tmp_path = tmp_path
        self.redis = redis or EmbeddedRedis(tmp_path / "redis", password="fault-pw").start()
        self.env, self.env_url = start_env(latency_ms=5, **(env_knobs or {}))
        # The chaos scenarios slow the model down so that the job outlasts their faults.
        self.model, model_url = start_model(latency_ms=model_latency_ms, **(model_knobs or {}))
        self.settings = settings.replace(redis_url=self.redis.url, llm_base_url=model_url + "/v1", **overrides)
        self.client = connect(self.settings)
        self.procs = Procs(self.settings, tmp_path / "logs")
        self.n_workers = workers
        self.n_consumers = consumers
        self.t0 = time.monotonic()
        self.faults: dict[str, int] = {}

    def start(self) -> str:
        sub = submit(self.client, self.settings, [write_job(self.tmp_path, self.env_url)])
        assert sub.job.episodes == EPISODES
        self.job_id = sub.job.job_id
        for i in range(self.n_workers):
            self.procs.worker(f"w{i + 1}")
        for i in range(self.n_consumers):
            self.procs.consumer("consumer" if i == 0 else f"consumer{i + 1}")
        return self.job_id

    def counts(self) -> dict:
        return Ledger(self.client, Keys(self.settings.key_prefix)).counts(self.job_id)

    def settled(self) -> bool:
        c = self.counts()
        return c["done"] + c["failed"] >= EPISODES

    def db_settled(self) -> bool:
        """Every episode final in the database, no record left pending or unread, no trajectory
        short. (Unread too: an episode the database holds as final may still have records on
        their way, a re-run's after Redis lost writes, say, which the figures must count.)"""
        from consumer.ingest import GROUP
        from consumer.storage import open_store

        stream = Keys(self.settings.key_prefix).results
        if self.client.xpending(stream, GROUP)["pending"]:
            return False
        read = {g["name"]: g["last-delivered-id"] for g in self.client.xinfo_groups(stream)}.get(GROUP.encode())
        if read != self.client.xinfo_stream(stream)["last-generated-id"]:
            return False
        store = open_store(self.settings.results_store)
        try:
            job = store.results(self.job_id)["job"]
        finally:
            store.close()
        return job["completed"] + job["failed"] >= EPISODES and job["short_trajectories"] == 0

    def wait(self, chaos=None, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not self.settled():
            if chaos:
                chaos(self)
            if time.monotonic() > deadline:
                keys = Keys(self.settings.key_prefix)
                paused = self.client.hgetall(keys.job_pause(self.job_id))
                raise AssertionError(f"{self.name}: not settled after {timeout}s: {self.counts()}\n"
                                     f"pause: {paused}\n" + self.procs.log("w1")[-4000:])
            time.sleep(0.5)
        while not self.db_settled():
            assert time.monotonic() < deadline + 60, f"{self.name}: database never caught up"
            time.sleep(0.5)

    def check(self) -> Figures:
        f = Figures(self.name, faults=self.faults)
        f.seconds = time.monotonic() - self.t0
        c = self.counts()
        assert c["queued"] == c["running"] == c["retrying"] == 0, c
        store = open_store(self.settings.results_store, readonly=True)
        q = lambda sql: [tuple(r) for r in store.sql(sql, (self.job_id,))]  # noqa: E731
        try:
            rows = dict(q("SELECT status, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY status"))
            f.episodes = sum(rows.values())
            f.completed, f.dead_lettered = rows.get("completed", 0), rows.get("failed", 0)
            assert f.episodes == EPISODES and f.completed + f.dead_lettered == EPISODES, rows
            assert f.completed == c["done"] and f.dead_lettered == c["failed"]
            (f.attempts,) = q("SELECT COUNT(*) FROM attempts WHERE job_id = ?")[0]
            (f.steps,) = q("SELECT COUNT(*) FROM session_steps WHERE job_id = ?")[0]
            (f.superseded_steps,) = q("SELECT COUNT(*) FROM superseded_steps WHERE job_id = ?")[0]
            # Exactly one trajectory per episode: its session_steps rows are one attempt's, 1..n.
            f.duplicate_steps = len(q("SELECT session_id, step_id FROM session_steps WHERE job_id = ? "
                                      "GROUP BY session_id, step_id HAVING COUNT(*) > 1"))
            assert f.duplicate_steps == 0
            mixed = q("SELECT session_id FROM session_steps WHERE job_id = ? "
                      "GROUP BY session_id HAVING COUNT(DISTINCT attempt_id) > 1")
            assert mixed == []
            # Every episode listed from enqueue on, finished exactly when completed.
            assert q("SELECT COUNT(*), SUM(finished) FROM job_environments WHERE job_id = ?")[0] == (EPISODES,
                                                                                                   f.completed)
            # Every group accounted for: complete, or incomplete with the reason.
            groups = q("SELECT complete, incomplete_reason FROM groups WHERE job_id = ?")
            assert len(groups) == GROUPS
            f.groups_complete = sum(1 for complete, _ in groups if complete)
            f.groups_incomplete = len(groups) - f.groups_complete
            assert all(complete or reason for complete, reason in groups)
            trajectory = {(e, s) for e, s in q("SELECT session_id, step_id FROM session_steps WHERE job_id = ?")}
        finally:
            store.close()
        assert_trajectories_sound(self.settings.results_store, self.job_id)
        # Exports never carry a superseded step.
        out = self.tmp_path / "export.jsonl"
        export_training(self.settings.results_store, self.job_id, str(out), fmt="jsonl")
        exported = [json.loads(line) for line in out.read_text().splitlines()]
        f.superseded_in_export = sum(1 for r in exported if (r["episode_id"], r["step_id"]) not in trajectory)
        assert f.superseded_in_export == 0 and len(exported) == f.steps
        # Every dead-lettered episode is in the dead-letter queue with a reason.
        letters = DeadLetterQueue(self.client, self.settings).list(job_id=self.job_id)
        assert len(letters) == f.dead_lettered and all(d.reason for d in letters)
        # Every env instance the episodes created was closed in the end.
        assert self.env.stats()["live"] == 0
        f.print()
        return f

    def close(self) -> None:
        self.procs.stop_all()
        self.env.shutdown()
        self.model.shutdown()
        self.redis.stop()


@pytest.fixture
def scenario(request, settings, tmp_path, store_url):
    """Each scenario runs on both results backends (a SQLite file, a real PostgreSQL)."""
    made = []

    def make(name, **kw):
        s = Scenario(name, tmp_path, settings.replace(store_url=store_url), **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def every(seconds: float):
    """A chaos step that runs its action at most once per `seconds`."""
    def wrap(action):
        last = [time.monotonic()]

        def step(s: Scenario):
            if time.monotonic() - last[0] >= seconds:
                last[0] = time.monotonic()
                action(s)
        return step
    return wrap


def test_workers_sigkilled_again_and_again(scenario):
    s = scenario("worker-sigkill", max_attempts=10, model_latency_ms=100)
    s.start()
    rng = random.Random(1)

    starts = {f"w{i + 1}": 1 for i in range(s.n_workers)}

    @every(2.0)
    def kill_a_worker(s: Scenario):
        if s.faults.get("worker_kills", 0) >= 8:
            return
        name = f"w{rng.randint(1, s.n_workers)}"
        # Only a worker that is up again since its last start: on a busy machine a restart takes
        # seconds, and killing a worker that is still starting costs no episode anything.
        if s.procs.log(name).count(" ready.") < starts[name]:
            return
        s.procs.kill(name)
        s.faults["worker_kills"] = s.faults.get("worker_kills", 0) + 1
        s.procs.worker(name)
        starts[name] += 1

    s.wait(kill_a_worker)
    f = s.check()
    assert f.completed == EPISODES  # killed workers cost attempts, never episodes
    assert f.attempts > EPISODES  # the kills did land mid-episode


def test_consumer_sigkilled(scenario):
    s = scenario("consumer-sigkill", model_latency_ms=100)
    s.start()

    @every(1.5)
    def kill_consumer(s: Scenario):
        if s.faults.get("consumer_kills", 0) >= 4:
            return
        s.procs.kill("consumer")
        s.faults["consumer_kills"] = s.faults.get("consumer_kills", 0) + 1
        s.procs.consumer()

    s.wait(kill_consumer)
    f = s.check()
    assert f.completed == EPISODES


def test_one_of_two_consumers_sigkilled_mid_batch(scenario):
    """Two consumers in one group write the same store; one is killed again and again while it
    holds a batch: its records are claimed by the other or re-read on restart, stored once."""
    s = scenario("two-consumers-one-killed", consumers=2, model_latency_ms=100)
    s.start()

    @every(1.5)
    def kill_one(s: Scenario):
        if s.faults.get("consumer_kills", 0) >= 4:
            return
        s.procs.kill("consumer2")
        s.faults["consumer_kills"] = s.faults.get("consumer_kills", 0) + 1
        s.procs.consumer("consumer2")

    s.wait(kill_one)
    f = s.check()
    assert s.faults["consumer_kills"] >= 3
    assert f.completed == EPISODES and f.duplicate_steps == 0


def test_redis_restarted_mid_run(scenario):
    s = scenario("redis-restart", model_latency_ms=250)
    s.start()

    @every(3.0)
    def restart_redis(s: Scenario):
        if s.faults.get("redis_restarts", 0) >= 2:
            return
        s.redis.restart(kill=True, down_s=1.0)
        s.faults["redis_restarts"] = s.faults.get("redis_restarts", 0) + 1

    s.wait(restart_redis, timeout=400)
    f = s.check()
    assert s.faults["redis_restarts"] == 2
    assert f.completed == EPISODES


def test_env_server_5xx_and_dropped_connections(scenario):
    # The server never goes down here: a dropped connection asks its readiness route, which on a
    # loaded machine can time out and open the breaker for a moment. That is weather, not the
    # outage this test is about, so the outage budget is the default's order, not the suite's 5 s.
    s = scenario("env-faults", env_knobs={"error_rate": 0.2, "drop_rate": 0.05, "fault_seed": 3}, max_attempts=8,
                 outage_budget_s=120)
    s.start()
    s.wait()
    s.faults.update(s.env.stats()["faults"])
    f = s.check()
    assert sum(s.faults.values()) > 50  # the faults happened
    assert f.completed > EPISODES // 2


def test_model_429_and_5xx(scenario):
    s = scenario("model-faults", model_knobs={"error_rate": 0.2, "fault_seed": 5})
    s.start()
    s.wait()
    s.faults.update(s.model.stats()["by_status"])
    f = s.check()
    assert sum(v for k, v in s.faults.items() if k in ("429", "500", "503")) > 20
    # Model errors are retried inside the call: no attempt is lost to them.
    assert f.completed == EPISODES


def test_lease_counts_from_when_start_was_sent_not_from_its_reply(redis_client, settings):
    """A worker stopped (SIGSTOP, a VM pause, a long GC) while its START is in flight gets the
    reply late: the lease was taken in Redis when START ran, and may have expired and passed to
    another attempt meanwhile. The attempt must fence itself by when START was sent, or it goes
    on calling its env and model for another TTL on a lease that is no longer its own."""
    from broker.records import EpisodeSpec, JobSpec

    ledger = Ledger(redis_client, Keys(settings.key_prefix), lease_ttl_s=1.2)  # valid 0.9 s after sending
    job = JobSpec(job_id="stalled", llm_base_url="http://127.0.0.1:1/v1", model="stand-in", episodes=1, groups=1)
    eps = [EpisodeSpec(job_id="stalled", episode_id="stalled.1.1.1.1", group_id="stalled.1.1.1", group_size=1,
                       env_name="arith", base_url="http://127.0.0.1:2", env_params={}, seed=1, queue="q",
                       source="tasks.yaml entry 1 row 1")]
    ledger.create_job(job, eps)
    real_start = ledger._start

    def start_reply_held_up(**kw):
        out = real_start(**kw)
        time.sleep(1.0)  # the process stopped before it read the reply
        return out

    ledger._start = start_reply_held_up
    started = ledger.start(job.job_id, eps[0].episode_id, "w-stalled")
    assert started.status == "ok"
    assert not started.lease.valid()  # past its TTL less the margin, counted from the send


def test_start_sent_again_after_a_lost_reply_gives_the_lease_a_full_ttl(redis_client, settings):
    """START sent again with the same attempt id (its first reply was lost) returns the attempt
    the first one started; the worker counts that lease from the second send, so Redis must
    hold it a full TTL from there too, or the attempt would call on after its lease expired."""
    from broker.records import EpisodeSpec, JobSpec

    keys = Keys(settings.key_prefix)
    ledger = Ledger(redis_client, keys, lease_ttl_s=1.2)
    job = JobSpec(job_id="again", llm_base_url="http://127.0.0.1:1/v1", model="stand-in", episodes=1, groups=1)
    eps = [EpisodeSpec(job_id="again", episode_id="again.1.1.1.1", group_id="again.1.1.1", group_size=1,
                       env_name="arith", base_url="http://127.0.0.1:2", env_params={}, seed=1, queue="q",
                       source="tasks.yaml entry 1 row 1")]
    ledger.create_job(job, eps)
    first = ledger.start(job.job_id, eps[0].episode_id, "w-retrying", attempt_id="a1")
    time.sleep(0.6)  # the reply was lost; the runner sends START again after a backoff
    again = ledger.start(job.job_id, eps[0].episode_id, "w-retrying", attempt_id="a1")
    assert again.status == "ok" and again.lease.token == first.lease.token
    expires = time.monotonic() + redis_client.pttl(keys.lease(eps[0].episode_id)) / 1000
    assert expires >= again.lease.valid_until
