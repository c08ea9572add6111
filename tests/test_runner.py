"""The worker runtime without Celery: what each kind of failure does to an episode.

Real Redis, real stand-in servers over loopback HTTP; the runtime is driven in-process so
each test can look at the ledger, the stream and the dead-letter queue right after."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest

from broker import errors
from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from broker.queueing import decode_task_args
from broker.records import AttemptRecord, EpisodeSpec, JobSpec, StepRecord, unpack
from workers.attempt import Attempt
from workers.runner import WorkerRuntime


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_job(client, settings, *, env_url, llm_url, env_name="guess_number", n=1, env_params=None,
             max_attempts=3, job_id="job1", **job_kw):
    job = JobSpec(job_id=job_id, llm_base_url=llm_url, model="stand-in", max_attempts=max_attempts,
                  episodes=n, groups=1, **job_kw)
    eps = [EpisodeSpec(job_id=job_id, episode_id=f"{job_id}.1.1.1.{k}", group_id=f"{job_id}.1.1.1", group_size=n,
                       env_name=env_name, base_url=env_url,
                       env_params=env_params if env_params is not None else {"low": 1, "high": 32}, seed=k,
                       queue=settings.queue)
           for k in range(1, n + 1)]
    Ledger(client, Keys(settings.key_prefix)).create_job(job, eps)
    return job, eps


def stream_records(client, settings) -> list:
    return [unpack(f[b"r"]) for _, f in client.xrange(Keys(settings.key_prefix).results)]


@pytest.fixture
def runtime(settings):
    rt = WorkerRuntime(settings, name="test-worker")
    yield rt
    rt.stop()


def test_completed_episode_publishes_steps_then_attempt(runtime, settings, redis_client, env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1")
    assert runtime.run(job.job_id, ep.episode_id) == "completed"
    recs = stream_records(redis_client, settings)
    steps = [r for r in recs if isinstance(r, StepRecord)]
    (closing,) = [r for r in recs if isinstance(r, AttemptRecord)]
    assert [s.step_id for s in steps] == list(range(1, len(steps) + 1))
    assert closing.status == "completed" and closing.steps == len(steps) and closing.attempt == 1
    assert closing.total_reward == pytest.approx(sum(s.step_reward for s in steps)) == 1.0
    ledger = Ledger(redis_client, Keys(settings.key_prefix))
    assert ledger.state(job.job_id, ep.episode_id) == "done"
    assert redis_client.exists(Keys(settings.key_prefix).lease(ep.episode_id)) == 0


@pytest.mark.parametrize("style", ["vllm", "llama.cpp"])
def test_prompt_outgrowing_the_context_completes_the_episode_truncated(runtime, settings, redis_client, env_server,
                                                                       style):
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    model, model_url = start_in_thread(context_tokens=120, overflow_style=style)
    try:
        job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1", message_cut=0,
                              env_params={"low": 1, "high": 10**9, "max_turns": 40},
                              llm_params={"max_tokens": 16})
        assert runtime.run(job.job_id, ep.episode_id) == "completed"
    finally:
        model.shutdown()
    recs = stream_records(redis_client, settings)
    steps = [r for r in recs if isinstance(r, StepRecord)]
    (closing,) = [r for r in recs if isinstance(r, AttemptRecord)]
    assert len(steps) > 2 and model.stats()["context_overflows"] == 1
    last = steps[-1]
    assert (last.ended_by, last.truncated, last.is_trainable, last.response) == ("context_length", True, True, "")
    assert not any(s.is_trainable for s in steps[:-1])  # the full history: only the last row is a sample
    assert closing.status == "completed" and closing.ended_by == "context_length" and closing.steps == len(steps)
    # usage from every answered step; the refused one has none.
    assert closing.prompt_tokens == sum(s.prompt_tokens for s in steps[:-1]) > 0
    assert closing.completion_tokens == sum(s.completion_tokens for s in steps[:-1]) > 0
    assert last.prompt_tokens is None
    assert Ledger(redis_client, Keys(settings.key_prefix)).state(job.job_id, ep.episode_id) == "done"
    assert DeadLetterQueue(redis_client, settings).list(job_id=job.job_id) == []


def test_duplicate_delivery_of_running_episode_is_dropped(runtime, settings, redis_client, env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1")
    ledger = Ledger(redis_client, Keys(settings.key_prefix), settings.lease_ttl_s)
    first = ledger.start(job.job_id, ep.episode_id, "other-worker")
    assert first.status == "ok"
    assert runtime.run(job.job_id, ep.episode_id) == "busy"
    assert ledger.attempts(job.job_id, ep.episode_id) == 1  # no second attempt started
    assert stream_records(redis_client, settings)[2:] == []  # only the announcements of the job and its episode


def test_finished_episode_redelivered_is_not_rerun(runtime, settings, redis_client, env_server, model_server):
    env, env_url = env_server
    _, model_url = model_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1")
    assert runtime.run(job.job_id, ep.episode_id) == "completed"
    resets = env.stats()["resets"]
    assert runtime.run(job.job_id, ep.episode_id) == "finished"
    assert env.stats()["resets"] == resets


def test_bad_params_go_straight_to_dead_letters(runtime, settings, redis_client, env_server, model_server):
    env, env_url = env_server
    _, model_url = model_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1",
                          env_name="no_such_env")
    assert runtime.run(job.job_id, ep.episode_id) == "failed"
    dlq = DeadLetterQueue(redis_client, settings)
    (letter,) = dlq.list(job_id=job.job_id)
    assert letter.reason == errors.ENV_BAD_REQUEST and letter.attempts == 1
    assert "no_such_env" in letter.error and letter.spec["episode_id"] == ep.episode_id
    assert Ledger(redis_client, Keys(settings.key_prefix)).state(job.job_id, ep.episode_id) == "failed"
    (closing,) = [r for r in stream_records(redis_client, settings) if isinstance(r, AttemptRecord)]
    assert closing.status == "failed" and closing.reason == errors.ENV_BAD_REQUEST


def test_model_down_waits_as_an_outage_then_dead_letters_with_that_reason(runtime, settings, redis_client,
                                                                          env_server):
    """A model endpoint nobody answers at (its readiness route neither) is an outage: the episode
    waits for it without spending attempts, the open breaker is visible in Redis, and only past
    the outage budget is the episode dead-lettered, as model_outage naming the server."""
    env, env_url = env_server
    port = closed_port()
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=f"http://127.0.0.1:{port}/v1",
                          max_attempts=2)
    keys = Keys(settings.key_prefix)
    seen_open = []

    def watch():
        while not seen_open and not done.is_set():
            seen_open.extend(redis_client.hkeys(keys.breakers))
            time.sleep(0.1)

    done = threading.Event()
    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.monotonic()
    try:
        assert runtime.run(job.job_id, ep.episode_id) == "failed"
    finally:
        done.set()
        watcher.join()
    assert time.monotonic() - t0 >= settings.outage_budget_s
    (letter,) = DeadLetterQueue(redis_client, settings).list()
    assert letter.reason == errors.MODEL_OUTAGE and letter.attempts == 1
    assert f"127.0.0.1:{port}" in letter.error and "outage budget" in letter.error
    assert seen_open and seen_open[0].decode().startswith(f"model http://127.0.0.1:{port}/v1 ")
    # The attempt's instance was reset and closed; the breaker is still open (nothing answered).
    assert env.stats()["resets"] == 1 and env.stats()["live"] == 0
    assert [b.server for b in runtime.breakers.open_breakers()] == [f"http://127.0.0.1:{port}/v1"]


def test_redrive_keeps_ids_and_completes(runtime, settings, redis_client, env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url,
                          llm_url=f"http://127.0.0.1:{closed_port()}/v1", max_attempts=1)
    assert runtime.run(job.job_id, ep.episode_id) == "failed"
    dlq = DeadLetterQueue(redis_client, settings)
    # Fix the cause (the job's model URL), then re-drive.
    fixed = dataclasses.replace(job, llm_base_url=model_url + "/v1")
    redis_client.set(Keys(settings.key_prefix).job_spec(job.job_id), fixed.pack())
    runtime._jobs.clear()
    assert dlq.redrive(dlq.list(job_id=job.job_id)) == [ep.episode_id]
    assert len(dlq) == 0
    assert decode_task_args(redis_client.rpop(settings.queue)) == (job.job_id, ep.episode_id)
    assert runtime.run(job.job_id, ep.episode_id) == "completed"
    attempts = [r for r in stream_records(redis_client, settings) if isinstance(r, AttemptRecord)]
    assert [(a.attempt, a.status) for a in attempts] == [(1, "failed"), (2, "completed")]
    assert {a.group_id for a in attempts} == {ep.group_id}


def test_shutdown_hands_episode_back(runtime, settings, redis_client, env_server, model_server):
    env, env_url = env_server
    _, model_url = model_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1", max_attempts=1)
    runtime.begin_shutdown(grace_s=0)
    assert runtime.run(job.job_id, ep.episode_id) == errors.WORKER_SHUTDOWN
    ledger = Ledger(redis_client, Keys(settings.key_prefix))
    assert ledger.state(job.job_id, ep.episode_id) == "queued"
    assert decode_task_args(redis_client.rpop(settings.queue)) == (job.job_id, ep.episode_id)
    # Handing back does not use up the episode's attempts: with max_attempts=1 it still runs.
    assert ledger.attempt_limit(job.job_id, ep.episode_id, 1) == 2
    assert env.stats()["live"] == 0
    runtime.shutdown_at = None
    assert runtime.run(job.job_id, ep.episode_id) == "completed"


def test_lost_lease_stops_publishing(runtime, settings, redis_client, env_server):
    """Another attempt takes over mid-episode: the old one may not write a single record more."""
    from examples.model_standin import start_in_thread

    env, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=400)
    try:
        job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=slow_url + "/v1",
                              env_params={"low": 1, "high": 1000, "max_turns": 10})
        keys = Keys(settings.key_prefix)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", runtime.run(job.job_id, ep.episode_id)))
        t.start()
        time.sleep(1.0)
        redis_client.set(keys.lease(ep.episode_id), b"someone-else:2:x")  # the lease moved on
        t.join(30)
        assert result["r"] == errors.LEASE_LOST
        before = len(stream_records(redis_client, settings))
        time.sleep(0.6)
        assert len(stream_records(redis_client, settings)) == before
        assert not [r for r in stream_records(redis_client, settings) if isinstance(r, AttemptRecord)]
        # The instance outlives the abandoned attempt: the attempt that holds the episode now may
        # continue it (broker/resume.py), and whoever ends the episode closes it.
        assert env.stats()["live"] == 1
    finally:
        slow.shutdown()


def test_episode_budget_is_enforced_by_the_loop(settings, redis_client, env_server):
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=3000)
    rt = WorkerRuntime(settings.replace(llm_read_timeout_s=30), name="budget-worker")
    try:
        job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=slow_url + "/v1",
                              episode_budget_s=1.0)
        t0 = time.monotonic()
        assert rt.run(job.job_id, ep.episode_id) == "failed"
        assert time.monotonic() - t0 < 2.5
        (letter,) = DeadLetterQueue(redis_client, settings).list()
        assert letter.reason == errors.EPISODE_TIMEOUT
    finally:
        rt.stop()
        slow.shutdown()


def test_secrets_never_reach_redis_or_records(settings, redis_client, env_server, model_server, caplog):
    _, env_url = env_server
    model, model_url = model_server
    secret = "sk-planted-" + "x" * 20
    rt = WorkerRuntime(settings.replace(llm_api_key=secret, llm_base_url=model_url + "/v1"), name="secret-worker")
    try:
        job, eps = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1", n=2)
        bad, _ = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1",
                          env_name="nope", job_id="job2")
        for e in eps:
            assert rt.run(job.job_id, e.episode_id) == "completed"
        assert rt.run("job2", "job2.1.1.1.1") == "failed"
    finally:
        rt.stop()
    assert model.stats()["auth_headers_seen"] >= 2
    for key in redis_client.scan_iter(f"{settings.key_prefix}:*"):
        assert secret.encode() not in redis_client.dump(key), key
    assert secret not in caplog.text
    assert secret not in repr(rt.settings) and secret not in str(rt.settings.as_dict())


def test_api_key_goes_only_to_trusted_model_hosts(settings, redis_client, env_server, model_server):
    """A job naming a model endpoint of its own choosing gets answers from it, but the worker's
    API key is not sent there (a job must not be able to collect it); an origin added to
    llm_trusted_origins gets it."""
    from examples.model_standin import start_in_thread as start_model

    _, env_url = env_server
    trusted, trusted_url = model_server
    other, other_url = start_model()
    secret = "sk-planted-" + "y" * 20
    rt = WorkerRuntime(settings.replace(llm_api_key=secret, llm_base_url=trusted_url + "/v1"), name="key-worker")
    rt2 = WorkerRuntime(settings.replace(llm_api_key=secret, llm_base_url=trusted_url + "/v1",
                                         llm_trusted_origins=other_url), name="key-worker-2")
    try:
        job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=trusted_url + "/v1")
        stolen, (ep2,) = make_job(redis_client, settings, env_url=env_url, llm_url=other_url + "/v1", job_id="job2")
        allowed, (ep3,) = make_job(redis_client, settings, env_url=env_url, llm_url=other_url + "/v1", job_id="job3")
        assert rt.run(job.job_id, ep.episode_id) == "completed"
        assert rt.run(stolen.job_id, ep2.episode_id) == "completed"
        assert trusted.stats()["auth_headers_seen"] >= 1
        assert other.stats()["auth_headers_seen"] == 0 and other.stats()["requests"] >= 1
        assert rt2.run(allowed.job_id, ep3.episode_id) == "completed"
        assert other.stats()["auth_headers_seen"] >= 1
    finally:
        rt.stop()
        rt2.stop()
        other.shutdown()


def test_an_attempt_ended_by_redis_being_away_is_not_counted(runtime, settings, redis_client, env_server):
    """Redis unreachable past the outage budget ends the attempt as broker_outage, however the
    attempt noticed it (here its lease was never renewed, so no breaker saw anything): that is
    our own outage, so even the last allowed attempt is retried, never dead-lettered."""
    _, env_url = env_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url="http://127.0.0.1:9/v1", max_attempts=1)
    started = runtime.ledger.start(job.job_id, ep.episode_id, runtime.name)
    lease = started.lease
    err = errors.EpisodeError(errors.BROKER_OUTAGE, "lease not renewed for 900s", transient=True, outage=True)
    assert Attempt(runtime.parts, lease, ep, job).close_error(err, "") == "retrying"
    assert DeadLetterQueue(redis_client, settings).list(job_id=job.job_id) == []
    assert Ledger(redis_client, Keys(settings.key_prefix)).states(job.job_id)[ep.episode_id] == "retrying"


def test_closing_an_attempt_outlasts_redis_errors(runtime, settings, redis_client, env_server, monkeypatch):
    """Redis still failing while an attempt closes (here: its first two writes) must not throw
    the close away: the episode would be reclaimed as a lost worker, an attempt counted for our
    own outage. The close path's Redis calls are retried like FINISH."""
    import redis as redis_lib

    _, env_url = env_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url="http://127.0.0.1:9/v1", max_attempts=1)
    lease = runtime.ledger.start(job.job_id, ep.episode_id, runtime.name).lease
    failures = {"grant": 1, "limit": 1}

    def flaky(name, real):
        def call(*a, **kw):
            if failures[name]:
                failures[name] -= 1
                raise redis_lib.ConnectionError("Connection refused (injected)")
            return real(*a, **kw)
        return call

    monkeypatch.setattr(runtime.ledger, "grant_extra_attempt", flaky("grant", runtime.ledger.grant_extra_attempt))
    monkeypatch.setattr(runtime.ledger, "attempt_limit", flaky("limit", runtime.ledger.attempt_limit))
    err = errors.EpisodeError(errors.BROKER_OUTAGE, "Redis unreachable", transient=True, outage=True)
    assert Attempt(runtime.parts, lease, ep, job).close_error(err, "") == "retrying"
    assert failures == {"grant": 0, "limit": 0}
    assert DeadLetterQueue(redis_client, settings).list(job_id=job.job_id) == []
    assert Ledger(redis_client, Keys(settings.key_prefix)).states(job.job_id)[ep.episode_id] == "retrying"


class ReplyCutter:
    """A TCP proxy in front of the real Redis that can lose replies: a request containing a
    given byte string goes through and runs, then the connection is cut before its reply
    reaches the client - what a network failure right after a command looks like."""

    def __init__(self, port: int):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cuts: dict[bytes, int] = {}
        self.cut = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, needle: bytes, times: int) -> None:
        with self._lock:
            self.cuts[needle] = times

    def _take(self, data: bytes) -> bool:
        with self._lock:
            for needle, left in self.cuts.items():
                if left and needle in data:
                    self.cuts[needle] = left - 1
                    return True
        return False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        import select

        server = socket.create_connection(("127.0.0.1", self.target))
        drop_reply = False
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [], 60)
                if client in ready:
                    data = client.recv(65536)
                    if not data:
                        return
                    drop_reply = drop_reply or self._take(data)
                    server.sendall(data)
                if server in ready:
                    data = server.recv(65536)
                    if not data:
                        return
                    if drop_reply:  # it ran; its reply is lost with the connection
                        self.cut += 1
                        return
                    client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def cutter(redis_server):
    c = ReplyCutter(redis_server.port)
    yield c
    c.close()


def through(runtime, settings, cutter) -> Ledger:
    """The runtime's own ledger calls (start, finish) go through the cutter, with one retry
    of redis-py's (so that a few cuts exhaust it)."""
    from broker.redisconn import connect

    url = settings.redis_url.replace(f"127.0.0.1:{cutter.target}/", f"127.0.0.1:{cutter.port}/")
    assert url != settings.redis_url
    runtime.ledger = Ledger.for_settings(connect(settings.replace(redis_url=url), retries=1), settings)
    # Scripts loaded first: a cut EVALSHA must be one that ran, not one refused as NOSCRIPT.
    for script in vars(runtime.ledger).values():
        if hasattr(script, "sha") and hasattr(script, "script"):
            runtime.ledger.r.script_load(script.script)
    runtime.parts = dataclasses.replace(runtime.parts, ledger=runtime.ledger)
    return runtime.ledger


def test_a_finish_whose_reply_was_lost_is_recognised(runtime, settings, redis_client, env_server, model_server,
                                                     cutter):
    """The FINISH of a completed attempt runs, its reply is lost, redis-py sends it again, the
    repeat is cut too, and the runtime retries it through the outage: every repeat is refused
    (the episode is done already). The runtime reads how the episode ended and reports the
    completion, instead of a lost lease (or an AttributeError)."""
    _, env_url = env_server
    _, model_url = model_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1")
    through(runtime, settings, cutter)
    cutter.arm(b":dlq:index", 3)  # the keys only FINISH (and the sweeper's reclaim) name
    assert runtime.run(job.job_id, ep.episode_id) == "completed"
    assert cutter.cut == 3
    ledger = Ledger(redis_client, Keys(settings.key_prefix))
    assert ledger.state(job.job_id, ep.episode_id) == "done" and ledger.attempts(job.job_id, ep.episode_id) == 1
    closing = [r for r in stream_records(redis_client, settings) if isinstance(r, AttemptRecord)]
    assert len(closing) == 1 and closing[0].status == "completed"


def test_a_start_whose_reply_was_lost_is_not_a_second_attempt(runtime, settings, redis_client, env_server,
                                                              model_server, cutter):
    """START runs but its replies are lost until redis-py gives up. The runtime sends it again
    with the same attempt_id and gets that attempt back - not requeued to find a phantom lease
    busy, not a further attempt counted - and with it the predecessor, whose env instance it
    closes."""
    from broker.keys import env_instance_id
    from workers.envclient import EnvClient

    env, env_url = env_server
    _, model_url = model_server
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1")
    ledger = Ledger(redis_client, Keys(settings.key_prefix))
    # A first attempt whose worker died: its instance is live, its lease gone, the sweeper re-queued it.
    first = ledger.start(job.job_id, ep.episode_id, "dead-worker").lease
    client = EnvClient(settings)
    client.reset(env_url, ep.env_name, env_instance_id(ep.episode_id, first.attempt, first.attempt_id),
                 ep.env_params, ep.seed, deadline=time.monotonic() + 10)
    client.shutdown()
    redis_client.delete(Keys(settings.key_prefix).lease(ep.episode_id))
    assert ledger.reclaim(job.job_id, ep.episode_id, "queued", None)
    live = env.stats()["live"]
    through(runtime, settings, cutter)
    cutter.arm(b":reserved", 3)  # of the runtime's own calls, only START names it
    assert runtime.run(job.job_id, ep.episode_id) == "completed"
    assert cutter.cut == 3
    assert ledger.attempts(job.job_id, ep.episode_id) == 2
    assert ledger.state(job.job_id, ep.episode_id) == "done"
    assert env.stats()["live"] == live - 1  # the predecessor's instance was closed
