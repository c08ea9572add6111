"""The episode ledger's Lua transitions, against the real (embedded) Redis of the fixtures."""

from __future__ import annotations

import json

import time

import pytest

from broker.keys import Keys, member
from broker.ledger import Lease, Ledger
from broker.records import AttemptRecord, DeadLetter, EpisodeSpec, JobSpec, StepRecord, unpack
from broker.states import AttemptStatus, LedgerState

JOB = "job1"
N = 5


def ep_id(i: int) -> str:
    return f"{JOB}.1.1.1.{i}"


def make_job(n: int = N) -> tuple[JobSpec, list[EpisodeSpec]]:
    job = JobSpec(job_id=JOB, llm_base_url="http://127.0.0.1:1/v1", model="stand-in", episodes=n, groups=1)
    eps = [EpisodeSpec(job_id=JOB, episode_id=ep_id(i), group_id=f"{JOB}.1.1.1", group_size=n,
                       env_name="arith", base_url="http://127.0.0.1:2", env_params={"k": i}, seed=i,
                       queue="q", source=f"tasks.yaml entry 1 row {i}")
           for i in range(1, n + 1)]
    return job, eps


def attempt_rec(lease: Lease, status: str = AttemptStatus.COMPLETED, **kw) -> AttemptRecord:
    return AttemptRecord(job_id=lease.job_id, episode_id=lease.episode_id, attempt=lease.attempt, status=status,
                         group_id=f"{JOB}.1.1.1", group_size=N, env_name="arith", llm_model="stand-in", **kw)


def step_rec(lease: Lease, step_id: int = 1) -> bytes:
    return StepRecord(job_id=lease.job_id, env_id=lease.episode_id, attempt=lease.attempt, step_id=step_id,
                      env_name="arith", llm_model="stand-in", group_id=f"{JOB}.1.1.1", messages_json=b"[]",
                      response="a", step_reward=1.0, cumulative_reward=1.0, terminated=True, truncated=False,
                      episode_finished=True, is_trainable=True).pack()


@pytest.fixture
def keys(settings) -> Keys:
    return Keys(settings.key_prefix)


@pytest.fixture
def ledger(redis_client, keys) -> Ledger:
    return Ledger(redis_client, keys, lease_ttl_s=3.0)


@pytest.fixture
def job(ledger):
    job, eps = make_job()
    ledger.create_job(job, eps)
    return job, eps


def publish_one(ledger: Ledger, lease: Lease, payload: bytes) -> int:
    """One record through the ledger's publish script: the stream's length, or -1 when the lease
    refused it (and is flagged lost)."""
    (added,), length = ledger.publish_many([(lease, payload)])
    return length if added else -1


def stream_len(r, keys) -> int:
    return r.xlen(keys.results)


def stream_records(r, keys) -> list:
    return [unpack(fields[b"r"]) for _, fields in r.xrange(keys.results)]


def assert_counts_consistent(ledger: Ledger, n: int = N):
    counts = ledger.counts(JOB)
    assert sum(counts.values()) == n, counts
    assert all(v >= 0 for v in counts.values()), counts
    # and the counts agree with the per-episode states
    states = ledger.states(JOB)
    for s in LedgerState:
        assert counts[s] == sum(1 for v in states.values() if v == s), (s, counts, states)


def start_ok(ledger: Ledger, episode: str, worker: str = "w1") -> Lease:
    res = ledger.start(JOB, episode, worker)
    assert res.status == "ok", res
    assert res.lease is not None
    return res.lease


# --- create ------------------------------------------------------------------------------


def test_create_job_sets_every_episode_queued(ledger, job, redis_client, keys):
    spec, eps = job
    assert ledger.states(JOB) == {e.episode_id: LedgerState.QUEUED for e in eps}
    assert ledger.counts(JOB) == {LedgerState.QUEUED: N, LedgerState.RUNNING: 0, LedgerState.RETRYING: 0,
                                  LedgerState.DONE: 0, LedgerState.FAILED: 0, LedgerState.CANCELLED: 0}
    assert ledger.job_ids() == [JOB]
    assert ledger.job_spec(JOB) == spec
    assert ledger.episode_spec(JOB, ep_id(3)) == eps[2]
    assert ledger.episode_spec(JOB, "nope") is None
    assert ledger.job_spec("nope") is None
    recs = stream_records(redis_client, keys)
    # The job is announced, then its episodes (so the database lists them before they run).
    assert isinstance(recs[0], JobSpec) and recs[0].job_id == JOB
    assert [type(r).__name__ for r in recs[1:]] == ["EpisodesEnqueued"]
    assert [e[0] for e in recs[1].episodes] == [e.episode_id for e in eps]
    assert [json.loads(e[3]) for e in recs[1].episodes] == [e.env_params for e in eps]


def test_create_job_in_chunks(redis_client, keys, monkeypatch):
    import broker.ledger as bl

    monkeypatch.setattr(bl, "ANNOUNCE_CHUNK", 2)
    ledger = Ledger(redis_client, keys)
    spec, eps = make_job(7)
    ledger.create_job(spec, eps, chunk=3)
    assert ledger.states(JOB) == {e.episode_id: LedgerState.QUEUED for e in eps}
    assert ledger.counts(JOB)[LedgerState.QUEUED] == 7
    announced = [r for r in stream_records(redis_client, keys) if type(r).__name__ == "EpisodesEnqueued"]
    assert [len(r.episodes) for r in announced] == [2, 2, 2, 1]


def test_create_job_writes_nothing_when_a_value_cannot_travel(redis_client, keys):
    """An integer past 64 bits in a dataset row: refused before the first write, no orphans."""
    ledger = Ledger(redis_client, keys)
    spec, eps = make_job(3)
    eps[2].env_params = {"dataset": {"n": 2**70}}
    with pytest.raises((OverflowError, TypeError)):
        ledger.create_job(spec, eps)
    assert list(redis_client.scan_iter(f"{keys.prefix}:*")) == []


# --- start -------------------------------------------------------------------------------


def test_start_ok_takes_lease_with_ttl(ledger, job, redis_client, keys):
    lease = start_ok(ledger, ep_id(1), "w1@host")
    assert lease.attempt == 1
    assert lease.job_id == JOB and lease.episode_id == ep_id(1)
    assert lease.token.startswith("w1@host:") and lease.token.endswith(":1")
    assert redis_client.get(keys.lease(ep_id(1))).decode() == lease.token
    ttl = redis_client.pttl(keys.lease(ep_id(1)))
    assert 0 < ttl <= 3000
    assert ledger.state(JOB, ep_id(1)) == LedgerState.RUNNING
    assert ledger.attempts(JOB, ep_id(1)) == 1
    score = redis_client.zscore(keys.running, member(JOB, ep_id(1)))
    assert score is not None and abs(score - (time.time() * 1000 + 3000)) < 2000
    assert ledger.counts(JOB)[LedgerState.RUNNING] == 1 and ledger.counts(JOB)[LedgerState.QUEUED] == N - 1
    assert not lease.lost.is_set()
    assert_counts_consistent(ledger)


def test_second_start_while_lease_lives_is_busy(ledger, job):
    lease = start_ok(ledger, ep_id(1), "w1")
    res = ledger.start(JOB, ep_id(1), "w2")
    assert res.status == "busy" and res.lease is None
    assert res.detail == lease.token
    assert ledger.attempts(JOB, ep_id(1)) == 1
    assert ledger.state(JOB, ep_id(1)) == LedgerState.RUNNING
    assert_counts_consistent(ledger)


@pytest.mark.parametrize("state", [LedgerState.DONE, LedgerState.FAILED])
def test_start_on_finished_episode(ledger, job, state):
    lease = start_ok(ledger, ep_id(1))
    assert ledger.finish(lease, attempt_rec(lease), state)
    res = ledger.start(JOB, ep_id(1), "w2")
    assert res.status == "finished" and res.lease is None and res.detail == state
    assert ledger.attempts(JOB, ep_id(1)) == 1
    assert_counts_consistent(ledger)


def test_start_unknown_episode(ledger, job, redis_client, keys):
    res = ledger.start(JOB, "no-such-episode", "w1")
    assert res.status == "unknown" and res.lease is None
    assert redis_client.get(keys.lease("no-such-episode")) is None
    res = ledger.start("no-such-job", ep_id(1), "w1")
    assert res.status == "unknown"
    assert_counts_consistent(ledger)


def test_start_running_without_lease_takes_over(ledger, job, redis_client, keys):
    first = start_ok(ledger, ep_id(1))
    redis_client.delete(keys.lease(ep_id(1)))  # the holder died and its lease expired
    second = start_ok(ledger, ep_id(1), "w2")
    assert second.attempt == 2 and second.token != first.token
    assert ledger.counts(JOB)[LedgerState.RUNNING] == 1
    assert_counts_consistent(ledger)


def test_start_retrying_episode(ledger, job):
    lease = start_ok(ledger, ep_id(1))
    assert ledger.finish(lease, attempt_rec(lease, AttemptStatus.RETRYING), LedgerState.RETRYING, retry_at=time.time() + 60)
    again = start_ok(ledger, ep_id(1))
    assert again.attempt == 2
    assert ledger.state(JOB, ep_id(1)) == LedgerState.RUNNING
    assert_counts_consistent(ledger)


# --- publish -----------------------------------------------------------------------------


def test_publish_with_token_appends(ledger, job, redis_client, keys):
    lease = start_ok(ledger, ep_id(1))
    before = stream_len(redis_client, keys)
    n = publish_one(ledger, lease, step_rec(lease, 1))
    assert n == before + 1
    assert publish_one(ledger, lease, step_rec(lease, 2)) == before + 2
    recs = stream_records(redis_client, keys)
    assert [r.step_id for r in recs if isinstance(r, StepRecord)] == [1, 2]
    assert not lease.lost.is_set()


def test_publish_with_wrong_token_refused(ledger, job, redis_client, keys):
    lease = start_ok(ledger, ep_id(1))
    bogus = Lease(JOB, ep_id(1), lease.attempt, lease.token + "x")
    before = stream_len(redis_client, keys)
    assert publish_one(ledger, bogus, step_rec(lease)) == -1
    assert stream_len(redis_client, keys) == before
    assert bogus.lost.is_set()
    assert not lease.lost.is_set()


def test_publish_with_stale_token_after_takeover(ledger, job, redis_client, keys):
    old = start_ok(ledger, ep_id(1), "w1")
    redis_client.delete(keys.lease(ep_id(1)))
    new = start_ok(ledger, ep_id(1), "w2")
    before = stream_len(redis_client, keys)
    assert publish_one(ledger, old, step_rec(old)) == -1
    assert old.lost.is_set()
    assert stream_len(redis_client, keys) == before
    assert publish_one(ledger, new, step_rec(new)) == before + 1


def test_publish_after_finish_refused(ledger, job, redis_client, keys):
    lease = start_ok(ledger, ep_id(1))
    assert ledger.finish(lease, attempt_rec(lease), LedgerState.DONE)
    before = stream_len(redis_client, keys)
    assert publish_one(ledger, lease, step_rec(lease)) == -1
    assert stream_len(redis_client, keys) == before


# --- finish ------------------------------------------------------------------------------


def test_finish_done(ledger, job, redis_client, keys):
    lease = start_ok(ledger, ep_id(2))
    before = stream_len(redis_client, keys)
    rec = attempt_rec(lease, AttemptStatus.COMPLETED, total_reward=3.0, steps=2)
    assert ledger.finish(lease, rec, LedgerState.DONE) is True
    assert ledger.state(JOB, ep_id(2)) == LedgerState.DONE
    assert ledger.counts(JOB) == {LedgerState.QUEUED: N - 1, LedgerState.RUNNING: 0, LedgerState.RETRYING: 0,
                                  LedgerState.DONE: 1, LedgerState.FAILED: 0, LedgerState.CANCELLED: 0}
    assert redis_client.exists(keys.lease(ep_id(2))) == 0
    assert redis_client.zscore(keys.running, member(JOB, ep_id(2))) is None
    assert redis_client.zcard(keys.retry) == 0
    assert redis_client.hlen(keys.dlq) == 0
    assert stream_len(redis_client, keys) == before + 1
    last = stream_records(redis_client, keys)[-1]
    assert isinstance(last, AttemptRecord) and last.status == AttemptStatus.COMPLETED and last.total_reward == 3.0
    assert not lease.lost.is_set()
    assert_counts_consistent(ledger)


def test_finish_retrying_schedules_retry(ledger, job, redis_client, keys):
    lease = start_ok(ledger, ep_id(1))
    at = time.time() + 5
    assert ledger.finish(lease, attempt_rec(lease, AttemptStatus.RETRYING, reason="env_error"), LedgerState.RETRYING, retry_at=at)
    assert ledger.state(JOB, ep_id(1)) == LedgerState.RETRYING
    assert redis_client.zscore(keys.retry, member(JOB, ep_id(1))) == int(at * 1000)
    assert ledger.due_retries() == []  # not due yet
    assert redis_client.exists(keys.lease(ep_id(1))) == 0
    assert redis_client.zcard(keys.running) == 0
    assert_counts_consistent(ledger)


def test_due_retries_and_take_retry(ledger, job):
    lease = start_ok(ledger, ep_id(1))
    assert ledger.finish(lease, attempt_rec(lease, AttemptStatus.RETRYING), LedgerState.RETRYING, retry_at=time.time() - 1)
    m = member(JOB, ep_id(1))
    assert ledger.due_retries() == [m]
    assert ledger.take_retry(m) is True
    assert ledger.take_retry(m) is False
    assert ledger.due_retries() == []


def test_finish_failed_with_dead_letter(ledger, job, redis_client, keys):
    spec = ledger.episode_spec(JOB, ep_id(4))
    lease = start_ok(ledger, ep_id(4))
    letter = DeadLetter(job_id=JOB, episode_id=ep_id(4), group_id=spec.group_id, env_name="arith",
                        reason="env_error", error="boom", attempts=1, spec=spec.to_dict())
    t0 = time.time()
    assert ledger.finish(lease, attempt_rec(lease, AttemptStatus.FAILED, reason="env_error"), LedgerState.FAILED, dead_letter=letter)
    m = member(JOB, ep_id(4))
    assert ledger.state(JOB, ep_id(4)) == LedgerState.FAILED
    stored = unpack(redis_client.hget(keys.dlq, m))
    assert isinstance(stored, DeadLetter) and stored.reason == "env_error" and stored.spec["episode_id"] == ep_id(4)
    score = redis_client.zscore(keys.dlq_index, m)
    assert score is not None and t0 - 1 <= score <= time.time() + 1
    assert redis_client.zcard(keys.retry) == 0
    assert ledger.counts(JOB)[LedgerState.FAILED] == 1
    assert_counts_consistent(ledger)


def test_finish_with_stale_token_does_nothing(ledger, job, redis_client, keys):
    old = start_ok(ledger, ep_id(1), "w1")
    redis_client.delete(keys.lease(ep_id(1)))
    new = start_ok(ledger, ep_id(1), "w2")
    before_len = stream_len(redis_client, keys)
    before_counts = ledger.counts(JOB)
    letter = DeadLetter(job_id=JOB, episode_id=ep_id(1), group_id="g", env_name="arith", reason="x")
    ok = ledger.finish(old, attempt_rec(old, AttemptStatus.FAILED), LedgerState.FAILED, retry_at=time.time(), dead_letter=letter)
    assert ok is False
    assert old.lost.is_set()
    assert ledger.state(JOB, ep_id(1)) == LedgerState.RUNNING
    assert ledger.counts(JOB) == before_counts
    assert stream_len(redis_client, keys) == before_len
    assert redis_client.get(keys.lease(ep_id(1))).decode() == new.token
    assert redis_client.zscore(keys.running, member(JOB, ep_id(1))) is not None
    assert redis_client.zcard(keys.retry) == 0
    assert redis_client.hlen(keys.dlq) == 0 and redis_client.zcard(keys.dlq_index) == 0
    # finishing twice with the same lease: the second is stale too
    assert ledger.finish(new, attempt_rec(new), LedgerState.DONE) is True
    assert ledger.finish(new, attempt_rec(new), LedgerState.FAILED) is False
    assert ledger.state(JOB, ep_id(1)) == LedgerState.DONE
    assert_counts_consistent(ledger)


# --- renew -------------------------------------------------------------------------------


def test_renew_extends_ttl_and_flags_lost(ledger, job, redis_client, keys):
    a = start_ok(ledger, ep_id(1))
    b = start_ok(ledger, ep_id(2))
    redis_client.pexpire(keys.lease(ep_id(1)), 200)
    redis_client.zadd(keys.running, {a.member: 1})
    bogus = Lease(JOB, ep_id(2), b.attempt, "someone-else:1")
    ledger.renew([a, b, bogus])
    assert redis_client.pttl(keys.lease(ep_id(1))) > 2000
    assert redis_client.zscore(keys.running, a.member) > time.time() * 1000
    assert not a.lost.is_set() and not b.lost.is_set()
    assert bogus.lost.is_set()
    assert redis_client.get(keys.lease(ep_id(2))).decode() == b.token
    ledger.renew([])  # no-op


def test_renew_resumes_a_lapsed_lease_nobody_took(ledger, job, redis_client, keys):
    """A lease that lapsed (Redis outage, stalled renewer) while the episode is still running
    under this very attempt is taken back: the attempt goes on, no attempt is spent."""
    c = start_ok(ledger, ep_id(3))
    redis_client.delete(keys.lease(ep_id(3)))  # expired
    ledger.renew([c])
    assert not c.lost.is_set()
    assert redis_client.get(keys.lease(ep_id(3))).decode() == c.token
    assert redis_client.pttl(keys.lease(ep_id(3))) > 2000


def test_renew_never_resurrects_a_lease_the_sweeper_took(ledger, job, redis_client, keys):
    c = start_ok(ledger, ep_id(3))
    redis_client.delete(keys.lease(ep_id(3)))
    assert ledger.reclaim(JOB, ep_id(3), LedgerState.QUEUED, None)  # the sweeper re-queued it
    ledger.renew([c])
    assert c.lost.is_set()
    assert redis_client.exists(keys.lease(ep_id(3))) == 0


def test_renew_never_resumes_over_a_later_attempt(ledger, job, redis_client, keys):
    """Expired, re-queued and started again: the old attempt's renewal finds another
    attempt's id in the ledger (even once that attempt's lease lapsed too) and is lost."""
    old = start_ok(ledger, ep_id(4))
    redis_client.delete(keys.lease(ep_id(4)))
    assert ledger.reclaim(JOB, ep_id(4), LedgerState.QUEUED, None)
    new = start_ok(ledger, ep_id(4))
    redis_client.delete(keys.lease(ep_id(4)))
    ledger.renew([old])
    assert old.lost.is_set()
    ledger.renew([new])
    assert not new.lost.is_set()
    assert redis_client.get(keys.lease(ep_id(4))).decode() == new.token


def test_start_returns_the_previous_attempt(ledger, job, redis_client, keys):
    first = ledger.start(JOB, ep_id(5), "w1")
    assert first.status == "ok" and first.previous is None
    redis_client.delete(keys.lease(ep_id(5)))
    assert ledger.reclaim(JOB, ep_id(5), LedgerState.QUEUED, None)
    second = ledger.start(JOB, ep_id(5), "w2")
    assert second.previous == (1, first.lease.attempt_id)
    assert ledger.latest_attempt(JOB, ep_id(5)) == (2, second.lease.attempt_id)


def test_start_lists_every_earlier_attempt_whose_instance_may_be_open(ledger, job, redis_client, keys):
    """Without a progress snapshot, an attempt killed in its first step left an instance nobody
    names; were its successor killed before closing it, the third must still know of it. START
    lists them all; once a snapshot names the trajectory that lives on, the latest alone."""
    from broker.records import Progress
    from broker.states import ProgressPhase

    def lapse():
        redis_client.delete(keys.lease(ep_id(3)))
        assert ledger.reclaim(JOB, ep_id(3), LedgerState.QUEUED, None)

    first = ledger.start(JOB, ep_id(3), "w1")
    assert first.earlier == ()
    lapse()
    second = ledger.start(JOB, ep_id(3), "w2")
    lapse()
    third = ledger.start(JOB, ep_id(3), "w3")
    ids = [(s.lease.attempt, s.lease.attempt_id) for s in (first, second, third)]
    assert second.earlier == tuple(ids[:1]) and second.previous == ids[0]
    assert third.earlier == tuple(ids[:2]) and third.previous == ids[1]
    again = ledger.start(JOB, ep_id(3), "w3", attempt_id=third.lease.attempt_id)  # its reply lost
    assert again.earlier == third.earlier
    mine = f"{third.lease.attempt}:{third.lease.attempt_id}"
    ok, _ = ledger.publish_many([(third.lease, b"", Progress(trajectory=mine, phase=ProgressPhase.PROMPTING,
                                                               step=1, writer=third.lease.attempt_id))])
    assert ok == [True]
    lapse()
    fourth = ledger.start(JOB, ep_id(3), "w4")
    assert fourth.earlier == (ids[2],) and fourth.progress.trajectory == mine
    for _ in range(20):  # the list stays bounded however many attempts die without a snapshot
        redis_client.hdel(keys.job_progress(JOB), ep_id(3))
        lapse()
        last = ledger.start(JOB, ep_id(3), "w5")
    assert len(last.earlier) == 16 and last.previous == (last.lease.attempt - 1, last.earlier[-1][1])


def test_start_whose_reply_was_lost_is_retried_as_ours(ledger, job, redis_client, keys):
    """redis-py repeats a START whose reply was lost (same worker, same attempt id); the
    repeat finds our own lease and carries on with it instead of dropping the delivery."""
    first = ledger.start(JOB, ep_id(2), "w1")
    again = ledger.start(JOB, ep_id(2), "w1", attempt_id=first.lease.attempt_id)
    assert again.status == "ok" and again.lease.token == first.lease.token
    assert ledger.attempts(JOB, ep_id(2)) == 1
    assert again.spec is not None and again.previous is None


def test_lease_is_valid_only_within_its_ttl_by_local_clock(ledger, job):
    lease = start_ok(ledger, ep_id(3))
    assert lease.valid()
    lease.valid_until = time.monotonic() - 0.01
    assert not lease.valid()
    lease.renewed(time.monotonic())
    assert lease.valid()
    lease.lost.set()
    assert not lease.valid()


# --- reclaim -----------------------------------------------------------------------------


def test_reclaim_refused_while_lease_lives(ledger, job, redis_client, keys):
    lease = start_ok(ledger, ep_id(1))
    before = stream_len(redis_client, keys)
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, attempt_rec(lease, AttemptStatus.ABANDONED)) is False
    assert ledger.state(JOB, ep_id(1)) == LedgerState.RUNNING
    assert redis_client.zscore(keys.running, lease.member) is not None
    assert stream_len(redis_client, keys) == before
    assert_counts_consistent(ledger)


def test_reclaim_after_lease_gone(ledger, job, redis_client, keys):
    lease = start_ok(ledger, ep_id(1))
    redis_client.delete(keys.lease(ep_id(1)))
    before = stream_len(redis_client, keys)
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, attempt_rec(lease, AttemptStatus.ABANDONED, reason="lease_expired")) is True
    assert ledger.state(JOB, ep_id(1)) == LedgerState.QUEUED
    assert redis_client.zscore(keys.running, lease.member) is None
    assert stream_len(redis_client, keys) == before + 1
    assert stream_records(redis_client, keys)[-1].status == AttemptStatus.ABANDONED
    assert ledger.counts(JOB)[LedgerState.QUEUED] == N and ledger.counts(JOB)[LedgerState.RUNNING] == 0
    # a second reclaim finds nothing running
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, None) is False
    assert_counts_consistent(ledger)


def test_reclaim_to_failed_with_dead_letter(ledger, job, redis_client, keys):
    lease = start_ok(ledger, ep_id(1))
    redis_client.delete(keys.lease(ep_id(1)))
    letter = DeadLetter(job_id=JOB, episode_id=ep_id(1), group_id="g", env_name="arith", reason="attempts_exhausted")
    before = stream_len(redis_client, keys)
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.FAILED, None, letter) is True
    assert ledger.state(JOB, ep_id(1)) == LedgerState.FAILED
    assert stream_len(redis_client, keys) == before  # no record given, none written
    assert unpack(redis_client.hget(keys.dlq, lease.member)).reason == "attempts_exhausted"
    assert redis_client.zscore(keys.dlq_index, lease.member) is not None
    assert_counts_consistent(ledger)


def test_reclaim_ignores_non_running_but_clears_running_member(ledger, job, redis_client, keys):
    m = member(JOB, ep_id(1))
    redis_client.zadd(keys.running, {m: 1})  # a leftover entry for a queued episode
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.FAILED, None) is False
    assert ledger.state(JOB, ep_id(1)) == LedgerState.QUEUED
    assert redis_client.zscore(keys.running, m) is None
    assert_counts_consistent(ledger)


# --- move --------------------------------------------------------------------------------


def test_move_only_from_allowed_states(ledger, job):
    assert ledger.move(JOB, ep_id(1), LedgerState.FAILED, [LedgerState.RUNNING]) is False
    assert ledger.state(JOB, ep_id(1)) == LedgerState.QUEUED
    assert ledger.move(JOB, ep_id(1), LedgerState.FAILED, [LedgerState.RUNNING, LedgerState.QUEUED]) is True
    assert ledger.state(JOB, ep_id(1)) == LedgerState.FAILED
    assert ledger.move(JOB, ep_id(1), LedgerState.QUEUED, []) is False
    assert ledger.move(JOB, ep_id(1), LedgerState.QUEUED, [LedgerState.DONE]) is False
    assert ledger.move(JOB, ep_id(1), LedgerState.QUEUED, [LedgerState.FAILED]) is True
    assert ledger.move(JOB, "unknown", LedgerState.QUEUED, list(LedgerState)) is False
    assert "unknown" not in ledger.states(JOB)
    assert ledger.move(JOB, ep_id(1), LedgerState.QUEUED, [LedgerState.QUEUED]) is True  # same state: counts unchanged
    assert_counts_consistent(ledger)


# --- counts ------------------------------------------------------------------------------


def test_counts_sum_after_a_sequence_of_transitions(ledger, job, redis_client, keys):
    a = start_ok(ledger, ep_id(1))
    assert_counts_consistent(ledger)
    b = start_ok(ledger, ep_id(2))
    ledger.start(JOB, ep_id(2), "dup")  # busy
    assert ledger.finish(a, attempt_rec(a), LedgerState.DONE)
    assert_counts_consistent(ledger)
    assert ledger.finish(b, attempt_rec(b, AttemptStatus.RETRYING), LedgerState.RETRYING, retry_at=time.time())
    assert ledger.finish(b, attempt_rec(b), LedgerState.DONE) is False  # stale
    assert_counts_consistent(ledger)
    assert ledger.move(JOB, ep_id(2), LedgerState.QUEUED, [LedgerState.RETRYING])
    b2 = start_ok(ledger, ep_id(2))
    c = start_ok(ledger, ep_id(3))
    redis_client.delete(keys.lease(ep_id(3)))
    assert ledger.reclaim(JOB, ep_id(3), LedgerState.QUEUED, None)
    c2 = start_ok(ledger, ep_id(3))
    assert c2.attempt == 2
    assert ledger.finish(c2, attempt_rec(c2, AttemptStatus.FAILED), LedgerState.FAILED)
    assert ledger.finish(c, attempt_rec(c), LedgerState.DONE) is False
    ledger.start(JOB, ep_id(1), "late")  # finished
    assert ledger.move(JOB, ep_id(3), LedgerState.QUEUED, [LedgerState.FAILED])  # re-drive
    d = start_ok(ledger, ep_id(4))
    assert ledger.finish(b2, attempt_rec(b2), LedgerState.DONE)
    assert_counts_consistent(ledger)
    assert ledger.counts(JOB) == {LedgerState.QUEUED: 2, LedgerState.RUNNING: 1, LedgerState.RETRYING: 0,
                                  LedgerState.DONE: 2, LedgerState.FAILED: 0, LedgerState.CANCELLED: 0}
    assert d.attempt == 1


# --- attempt limits ----------------------------------------------------------------------


def test_attempt_limit_and_grant_extra(ledger, job):
    assert ledger.attempt_limit(JOB, ep_id(1), 3) == 3
    assert ledger.grant_extra_attempt(JOB, ep_id(1), 3) == 4
    assert ledger.attempt_limit(JOB, ep_id(1), 3) == 4
    assert ledger.attempt_limit(JOB, ep_id(1), 10) == 4  # stored limit wins over the default
    assert ledger.grant_extra_attempt(JOB, ep_id(1), 99, n=2) == 6  # default only seeds
    assert ledger.attempt_limit(JOB, ep_id(2), 5) == 5  # others untouched


# --- expiry ------------------------------------------------------------------------------


def test_lease_expiry_then_reclaim_and_restart(redis_client, keys):
    ledger = Ledger(redis_client, keys, lease_ttl_s=0.3)
    spec, eps = make_job(2)
    ledger.create_job(spec, eps)
    lease = start_ok(ledger, ep_id(1))
    assert ledger.expired_running() == []
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, None) is False
    time.sleep(0.5)
    assert redis_client.exists(keys.lease(ep_id(1))) == 0
    assert ledger.expired_running() == [lease.member]
    assert ledger.expired_running(grace_ms=60_000) == []
    # the sweeper re-queued it: the holder cannot write once its lease expired and was reclaimed
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, attempt_rec(lease, AttemptStatus.ABANDONED)) is True
    assert publish_one(ledger, lease, step_rec(lease)) == -1 and lease.lost.is_set()
    assert ledger.expired_running() == []
    again = start_ok(ledger, ep_id(1), "w2")
    assert again.attempt == 2
    assert ledger.attempts(JOB, ep_id(1)) == 2
    assert_counts_consistent(ledger, 2)


# --- a lapsed lease is taken back by publish and finish too --------------------------------


def test_publish_takes_back_a_lapsed_lease_nobody_took(ledger, job, redis_client, keys):
    """Redis away past the TTL: the lease key is gone, the episode still running under this
    attempt. The attempt's next record (not only its renewer) takes the lease back."""
    a = start_ok(ledger, ep_id(1))
    b = start_ok(ledger, ep_id(2))
    redis_client.delete(keys.lease(ep_id(1)), keys.lease(ep_id(2)))
    assert publish_one(ledger, a, step_rec(a)) > 0 and not a.lost.is_set()
    assert redis_client.get(keys.lease(ep_id(1))).decode() == a.token
    assert redis_client.pttl(keys.lease(ep_id(1))) > 2000
    assert redis_client.zscore(keys.running, a.member) > time.time() * 1000
    added, _ = ledger.publish_many([(b, step_rec(b)), (a, step_rec(a, 2))])
    assert added == [True, True] and not b.lost.is_set()
    assert redis_client.get(keys.lease(ep_id(2))).decode() == b.token


def test_publish_many_refuses_only_the_attempts_that_lost_their_episode(ledger, job, redis_client, keys):
    a = start_ok(ledger, ep_id(1))
    b = start_ok(ledger, ep_id(2))
    c = start_ok(ledger, ep_id(3))
    redis_client.delete(keys.lease(ep_id(1)), keys.lease(ep_id(2)), keys.lease(ep_id(3)))
    assert ledger.reclaim(JOB, ep_id(2), LedgerState.QUEUED, None)  # the sweeper re-queued b's episode
    redis_client.set(keys.lease(ep_id(3)), "other-worker:x:2")  # someone else holds c's
    n0 = stream_len(redis_client, keys)
    added, n = ledger.publish_many([(a, step_rec(a)), (b, step_rec(b)), (c, step_rec(c))])
    assert added == [True, False, False] and n == n0 + 1
    assert not a.lost.is_set() and b.lost.is_set() and c.lost.is_set()
    assert redis_client.exists(keys.lease(ep_id(2))) == 0
    assert redis_client.get(keys.lease(ep_id(3))) == b"other-worker:x:2"


def test_finish_takes_back_a_lapsed_lease_nobody_took(ledger, job, redis_client, keys):
    a = start_ok(ledger, ep_id(1))
    redis_client.delete(keys.lease(ep_id(1)))
    assert ledger.finish(a, attempt_rec(a), LedgerState.DONE)
    assert ledger.state(JOB, ep_id(1)) == LedgerState.DONE and not a.lost.is_set()
    assert redis_client.exists(keys.lease(ep_id(1))) == 0
    assert redis_client.zscore(keys.running, a.member) is None
    assert_counts_consistent(ledger)


def test_finish_never_takes_back_a_lease_over_a_later_attempt(ledger, job, redis_client, keys):
    old = start_ok(ledger, ep_id(1))
    redis_client.delete(keys.lease(ep_id(1)))
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, None)
    new = start_ok(ledger, ep_id(1), "w2")
    redis_client.delete(keys.lease(ep_id(1)))  # the new attempt's lapsed too
    assert not ledger.finish(old, attempt_rec(old), LedgerState.DONE) and old.lost.is_set()
    assert ledger.state(JOB, ep_id(1)) == LedgerState.RUNNING
    assert ledger.finish(new, attempt_rec(new), LedgerState.DONE)


# --- a FINISH sent again after its reply was lost -----------------------------------------


@pytest.mark.parametrize("new_state", [LedgerState.DONE, LedgerState.RETRYING, LedgerState.QUEUED, LedgerState.FAILED])
def test_finished_as_recognises_our_own_finish(ledger, job, redis_client, keys, new_state):
    """The first FINISH ran, its reply was lost; sent again it is refused (the attempt no
    longer holds a running episode). finished_as reads how the episode ended: by this attempt."""
    a = start_ok(ledger, ep_id(1))
    assert ledger.finish(a, attempt_rec(a), new_state, retry_at=time.time() + 60 if new_state == LedgerState.RETRYING else None)
    n = stream_len(redis_client, keys)
    assert not ledger.finish(a, attempt_rec(a), new_state)  # the repeat writes nothing
    assert stream_len(redis_client, keys) == n
    assert ledger.finished_as(a, new_state)
    assert not ledger.finished_as(a, LedgerState.DONE if new_state != LedgerState.DONE else LedgerState.FAILED)


def test_finished_as_is_false_when_another_attempt_ended_it(ledger, job, redis_client, keys):
    old = start_ok(ledger, ep_id(1))
    redis_client.delete(keys.lease(ep_id(1)))
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, None)
    new = start_ok(ledger, ep_id(1), "w2")
    assert ledger.finish(new, attempt_rec(new), LedgerState.DONE)
    assert not ledger.finish(old, attempt_rec(old), LedgerState.DONE)
    assert not ledger.finished_as(old, LedgerState.DONE)
    assert ledger.finished_as(new, LedgerState.DONE)


# --- a START sent again after its reply was lost ------------------------------------------


def test_start_sent_again_returns_its_attempt_and_predecessor(ledger, job, redis_client, keys):
    """A START whose reply was lost, sent again with its attempt_id, gets its own attempt
    back with the predecessor's (number, id): not 'busy', not a second attempt counted, and
    the predecessor's env instance can still be closed."""
    first = start_ok(ledger, ep_id(1))
    redis_client.delete(keys.lease(ep_id(1)))
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, None)
    second = ledger.start(JOB, ep_id(1), "w2", attempt_id="a" * 24)
    assert second.status == "ok" and second.previous == (1, first.attempt_id)
    again = ledger.start(JOB, ep_id(1), "w2", attempt_id="a" * 24)
    assert again.status == "ok" and again.lease.token == second.lease.token and again.lease.attempt == 2
    assert again.previous == (1, first.attempt_id) and again.spec is not None
    # and after its lease lapsed during the outage that lost the reply, nobody else holding it
    redis_client.delete(keys.lease(ep_id(1)))
    late = ledger.start(JOB, ep_id(1), "w2", attempt_id="a" * 24)
    assert late.status == "ok" and late.lease.token == second.lease.token
    assert redis_client.get(keys.lease(ep_id(1))).decode() == second.lease.token
    assert ledger.attempts(JOB, ep_id(1)) == 2
    assert late.previous == (1, first.attempt_id)
    # another delivery (another attempt id) still finds the episode busy
    assert ledger.start(JOB, ep_id(1), "w3").status == "busy"
    assert_counts_consistent(ledger)


# --- the sweeper's outage rule ------------------------------------------------------------


def test_a_gap_in_the_sweep_clock_holds_reclaims(ledger, job, redis_client, keys):
    """No sweeper reached Redis for longer than the gap: leases may have lapsed under live
    attempts, so reclaims are held - also inside reclaim itself (a sweep that stalled across
    the outage) - until the hold ends."""
    a = start_ok(ledger, ep_id(1))
    redis_client.delete(keys.lease(ep_id(1)))
    outage = (0.3, 1.0)
    assert ledger.sweep_clock(*outage) is False  # first stamp
    assert ledger.sweep_clock(*outage) is False  # no gap
    time.sleep(0.5)
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, None, outage=outage) is False  # the gap, seen by reclaim
    assert ledger.sweep_clock(*outage) is True  # held
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, None, outage=outage) is False
    assert ledger.renew([a]) is None and not a.lost.is_set()  # the renewer takes it back meanwhile
    deadline = time.monotonic() + 10
    while ledger.sweep_clock(*outage):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, None, outage=outage) is False  # live lease: refused
    redis_client.delete(keys.lease(ep_id(1)))
    assert ledger.sweep_clock(*outage) is False
    assert ledger.reclaim(JOB, ep_id(1), LedgerState.QUEUED, None, outage=outage) is True


def test_no_other_delivery_takes_over_a_lease_lapsed_in_an_outage(ledger, job, redis_client, keys):
    """While reclaims are held after an outage, a second delivery of a running episode whose
    lease lapsed is dropped like the sweeper's reclaim would be: the attempt takes it back."""
    a = start_ok(ledger, ep_id(1))
    redis_client.delete(keys.lease(ep_id(1)))
    redis_client.set(keys.reclaim_hold, "1", px=60_000)
    assert ledger.start(JOB, ep_id(1), "w2").status == "busy"
    assert ledger.attempts(JOB, ep_id(1)) == 1
    ledger.renew([a])
    assert not a.lost.is_set()
    redis_client.delete(keys.lease(ep_id(1)), keys.reclaim_hold)
    assert ledger.start(JOB, ep_id(1), "w2").status == "ok"  # no outage: a lapsed lease is a dead worker's
