"""The rules behind resumable episodes, each on its own: whether a successor may continue
(broker/resume.py), where an attempt stopped (workers/progress.py), how the ledger keeps the
snapshots (fenced, never overwritten by an older one) and how the results store joins a
continued trajectory (consumer/storage/plan.py, on SQLite and PostgreSQL)."""

from __future__ import annotations

import orjson
import pytest

from broker import resume
from broker.ledger import Ledger
from broker.records import AttemptRecord, EpisodeSpec, JobSpec, Progress, StepRecord
from broker.states import AttemptStatus, LedgerState, ProgressPhase, ResumeNote
from consumer.storage import open_store
from workers.progress import ProgressTrack


def snap(phase, step=3, trajectory="1:a1", **kw) -> Progress:
    return Progress(trajectory=trajectory, phase=phase, step=step, **kw)


# --- whether a successor may continue ---------------------------------------------------------
@pytest.mark.parametrize("phase,resumes,note", [
    (ProgressPhase.READY, True, ""),
    (ProgressPhase.PROMPTED, True, ""),
    (ProgressPhase.PROMPTING, False, ResumeNote.CALL_IN_FLIGHT),
    (ProgressPhase.STEPPING, False, ResumeNote.CALL_IN_FLIGHT),
])
@pytest.mark.unit
def test_only_a_snapshot_with_no_call_in_flight_is_continued(phase, resumes, note):
    start = resume.decide(snap(phase), had_predecessor=True, enabled=True, inproc=False)
    assert (start.resume is not None) == resumes and start.note == note


@pytest.mark.unit
def test_nothing_to_continue_says_why_only_when_there_was_a_predecessor():
    assert resume.decide(None, had_predecessor=False, enabled=True, inproc=False) == resume.Start()
    for kw in ({"enabled": False, "inproc": False}, {"enabled": True, "inproc": True}):
        start = resume.decide(snap(ProgressPhase.PROMPTED), had_predecessor=True, **kw)
        assert start.resume is None and start.note == ResumeNote.NOT_RESUMABLE
    assert resume.decide(None, had_predecessor=True, enabled=True, inproc=False).note == ResumeNote.NOTHING_KEPT


# --- where an attempt stopped -----------------------------------------------------------------
@pytest.mark.unit
def test_an_attempt_stopped_between_calls_leaves_the_exact_point():
    marks = []
    first = ProgressTrack("1:a1", "a1", lambda s, urgent: None)
    assert first.at_rest() is None  # before the first step's record there is nothing to continue
    track = ProgressTrack("1:a1", "a1", lambda s, urgent: marks.append((s.phase, s.step, urgent)))
    track.stepped(1, total_reward=0.0)  # step 1 recorded
    with track.call(ProgressPhase.PROMPTING, 2):
        pass
    assert track.at_rest() is None  # the prompt came back, not kept yet: it was sent, and says nothing
    track.prompted(2, b'[{"role": "user", "content": "hi"}]', total_reward=0.0)
    rest = track.at_rest()
    assert rest.phase == ProgressPhase.PROMPTED and orjson.loads(rest.prompt_json)[0]["content"] == "hi"
    track.stepping(2, total_reward=0.0)
    assert track.at_rest().phase == ProgressPhase.PROMPTED  # stopped before the step was sent
    with pytest.raises(ConnectionError):
        with track.call(ProgressPhase.STEPPING, 2):
            raise ConnectionError("dropped mid-call")
    assert track.at_rest() is None  # it may have reached the server: no exact point
    with track.call(ProgressPhase.STEPPING, 2):
        pass
    assert track.at_rest() is None  # answered, its record not made yet
    track.stepped(2, total_reward=1.0, prev_tokens=[5, 6])  # the record queued: nothing written for it
    rest = track.at_rest()
    assert (rest.phase, rest.step, rest.total_reward) == (ProgressPhase.READY, 3, 1.0)
    assert marks == [(ProgressPhase.PROMPTED, 2, False), (ProgressPhase.STEPPING, 2, True)]


@pytest.mark.unit
def test_a_resumed_track_starts_where_its_predecessor_stopped():
    from broker.tokens import pack_ids

    prev = snap(ProgressPhase.PROMPTED, step=7, total_reward=2.5, prompt_tokens=10, completion_tokens=3,
                prompt_json=b'["p"]', weight_version="v3", prev_tokens=pack_ids([1, 2, 3]))
    track = ProgressTrack("1:a1", "b2", lambda s, u: None, resume=prev)
    assert track.step == 7 and track.resumed_prompt() == ["p"]
    assert track.resumed_totals() == (2.5, 10, 3, "v3", [1, 2, 3])


# --- the ledger's snapshots ---------------------------------------------------------------------
@pytest.fixture
def started(settings, redis_client):
    job = JobSpec(job_id="rj", llm_base_url="http://llm/v1", model="m", episodes=1, groups=1)
    ep = EpisodeSpec(job_id="rj", episode_id="rj.1", group_id="rj.g", group_size=1, env_name="x",
                     base_url="http://env:1", env_params={})
    ledger = Ledger.for_settings(redis_client, settings)
    ledger.create_job(job, [ep])
    return ledger, ledger.start("rj", "rj.1", "w1")


@pytest.mark.integration
def test_a_snapshot_is_never_overwritten_by_an_older_one_and_only_its_holder_writes(started):
    ledger, st = started
    lease = st.lease
    mine = f"{lease.attempt}:{lease.attempt_id}"
    _, length = ledger.publish_many([(lease, b"", snap(ProgressPhase.STEPPING, 4, mine))])
    assert length == -1  # snapshots alone: the stream's length is not read
    ledger.publish_many([(lease, b"", snap(ProgressPhase.PROMPTED, 4, mine))])  # older, late
    assert ledger.progress("rj", "rj.1").phase == ProgressPhase.STEPPING
    ledger.publish_many([(lease, b"", snap(ProgressPhase.READY, 1, "9:fresh"))])  # another trajectory
    assert ledger.progress("rj", "rj.1").trajectory == "9:fresh"
    ledger.r.set(ledger.k.lease("rj.1"), "someone-else:2")
    ok, length = ledger.publish_many([(lease, b"r", None), (lease, b"", snap(ProgressPhase.PROMPTED, 2, "9:fresh"))])
    assert ok == [False, False] and length == -1 and lease.lost.is_set()  # fenced once for both, both refused
    assert ledger.progress("rj", "rj.1").step == 1


@pytest.mark.integration
def test_a_waited_mark_is_fenced_and_takes_back_a_lapsed_lease(started):
    """``Ledger.mark`` (the ``stepping`` write before a step) is fenced like the publisher's
    writes: a lease gone in an outage is taken back; one another attempt holds is refused, and
    the attempt learns it lost its episode before it sends the step."""
    ledger, st = started
    lease = st.lease
    mine = f"{lease.attempt}:{lease.attempt_id}"
    ledger.publish_many([(lease, b"", snap(ProgressPhase.PROMPTED, 4, mine))])
    assert ledger.mark(lease, snap(ProgressPhase.STEPPING, 4, mine))
    assert ledger.progress("rj", "rj.1").phase == ProgressPhase.STEPPING
    ledger.r.delete(ledger.k.lease("rj.1"))  # lapsed while Redis was away; nobody took the episode
    assert ledger.mark(lease, snap(ProgressPhase.STEPPING, 5, mine)) and not lease.lost.is_set()
    assert ledger.r.get(ledger.k.lease("rj.1")) == lease.token.encode()  # taken back
    assert ledger.r.zscore(ledger.k.running, lease.member) is not None
    ledger.r.set(ledger.k.lease("rj.1"), "someone-else:2")
    assert not ledger.mark(lease, snap(ProgressPhase.STEPPING, 6, mine)) and lease.lost.is_set()
    assert ledger.progress("rj", "rj.1").step == 5


@pytest.mark.integration
def test_a_hand_back_keeps_its_exact_snapshot_and_any_other_close_drops_it(started):
    ledger, st = started
    lease = st.lease
    mine = f"{lease.attempt}:{lease.attempt_id}"
    ledger.publish_many([(lease, b"", snap(ProgressPhase.PROMPTING, 5, mine))])
    rec = AttemptRecord(job_id="rj", episode_id="rj.1", attempt=lease.attempt, status=AttemptStatus.ABANDONED,
                        group_id="rj.g", group_size=1, env_name="x", llm_model="m", attempt_id=lease.attempt_id)
    assert ledger.finish(lease, rec, LedgerState.QUEUED, keep_progress=True, progress=snap(ProgressPhase.READY, 5, mine))
    p = ledger.progress("rj", "rj.1")
    assert (p.phase, p.step) == (ProgressPhase.READY, 5)  # lower in order than prompting, written all the same
    again = ledger.start("rj", "rj.1", "w2")
    assert again.progress is not None and again.progress.phase == ProgressPhase.READY
    done = AttemptRecord(job_id="rj", episode_id="rj.1", attempt=again.lease.attempt, status=AttemptStatus.COMPLETED,
                         group_id="rj.g", group_size=1, env_name="x", llm_model="m", attempt_id=again.lease.attempt_id)
    assert ledger.finish(again.lease, done, LedgerState.DONE)
    assert ledger.progress("rj", "rj.1") is None


# --- the store joins a continued trajectory -----------------------------------------------------
def step(ep, n, attempt, attempt_id, reward=0.0):
    return StepRecord(job_id="j", env_id=ep, attempt=attempt, step_id=n, env_name="x", llm_model="m", group_id="g",
                      messages_json=b"[]", response=f"s{n}", step_reward=reward, cumulative_reward=0.0,
                      terminated=False, truncated=False, episode_finished=False, is_trainable=True,
                      attempt_id=attempt_id)


def close(ep, attempt, attempt_id, status, **kw):
    return AttemptRecord(job_id="j", episode_id=ep, attempt=attempt, status=status, group_id="g", group_size=1,
                         env_name="x", llm_model="m", attempt_id=attempt_id, **kw)


def rows(store, ep):
    return [tuple(r) for r in store.query("SELECT step_id, attempt_id FROM session_steps WHERE session_id = ? "
                                          "ORDER BY step_id", (ep,))]


def test_the_store_joins_a_continued_trajectory_and_sets_aside_a_fresh_ones_predecessor(store_url):
    store = open_store(store_url)
    try:
        # attempt a1 ran steps 1-3 and its worker died; a2 continued the same trajectory
        store.write_batch([step("e1", n, 1, "a1") for n in (1, 2, 3)])
        store.write_batch([close("e1", 1, "a1", AttemptStatus.ABANDONED, reason="worker_lost")])
        assert rows(store, "e1") == [(1, "a1"), (2, "a1"), (3, "a1")]  # kept for a successor
        store.write_batch([step("e1", n, 1, "a1") for n in (4, 5)])
        store.write_batch([close("e1", 2, "a2", AttemptStatus.COMPLETED, steps=5, total_reward=1.0,
                                 trajectory="1:a1", resumed_at=4)])
        ep = store.episode("e1")
        assert ep["status"] == "completed" and ep["steps"] == 5 and ep["completed_attempt_id"] == "a1"
        assert [r[0] for r in rows(store, "e1")] == [1, 2, 3, 4, 5]
        second = [a for a in store.attempts("e1") if a["attempt_id"] == "a2"][0]
        assert second["resumed_at"] == 4 and second["trajectory"] == "1:a1"
        assert store.resume_summary("j") == {"resumed": 1, "steps_saved": 3, "fallbacks": {}}
        # e2: a1 abandoned, then a2 started afresh (call_in_flight): a1's rows go aside
        store.write_batch([step("e2", n, 1, "b1") for n in (1, 2)] + [close("e2", 1, "b1", AttemptStatus.ABANDONED)])
        store.write_batch([step("e2", 1, 2, "b2"), close("e2", 2, "b2", AttemptStatus.COMPLETED, steps=1,
                                                         resume_note=ResumeNote.CALL_IN_FLIGHT)])
        assert rows(store, "e2") == [(1, "b2")]
        assert store.query("SELECT COUNT(*) FROM superseded_steps WHERE session_id = 'e2'")[0][0] == 2
        assert store.resume_summary("j")["fallbacks"] == {ResumeNote.CALL_IN_FLIGHT: 1}
    finally:
        store.close()


def test_a_step_the_dead_worker_published_last_is_kept_when_it_arrives_late(store_url):
    """Two consumers: the continuing attempt's steps can be stored before the last step of the
    attempt it continued; that step is the trajectory's all the same."""
    store = open_store(store_url)
    try:
        store.write_batch([step("e3", 1, 1, "c1"), close("e3", 1, "c1", AttemptStatus.ABANDONED)])
        store.write_batch([step("e3", 3, 1, "c1"), close("e3", 2, "c2", AttemptStatus.COMPLETED, steps=3,
                                                          trajectory="1:c1", resumed_at=3)])
        assert store.episode("e3")["status"] == "completing"
        store.write_batch([step("e3", 2, 1, "c1")])  # step 2, published before the crash, stored last
        assert [r[0] for r in rows(store, "e3")] == [1, 2, 3] and store.episode("e3")["status"] == "completed"
    finally:
        store.close()


# --- what the loop writes --------------------------------------------------------------------
@pytest.mark.unit
def test_the_loop_keeps_snapshots_from_its_second_step_and_continues_where_told():
    """A single-turn episode writes no snapshot (continuing one at its first step would save a
    reset and a prompt only, and single-turn RL is most of the load); from the second step on,
    each turn leaves prompted and stepping, and a step's record goes alone. A resumed loop
    starts at the snapshot's step with its prompt, without reset or prompt call."""
    from tests.test_loop import FakeEnv, FakePolicy, RecHook, Result, conv
    from workers.loop import LoopConfig, run_episode

    cfg = LoopConfig(job_id="j", episode_id="e", env_name="x", group_id="g", llm_model="m", message_cut=0)
    marks, published = [], []
    track = ProgressTrack("1:a1", "a1", lambda s, urgent: marks.append((s.phase, s.step)))
    env = FakeEnv(results=[Result(reward=1.0, terminated=True)])
    run_episode(cfg, env=env, policy=FakePolicy(), publish=lambda r, p=None: published.append(p), hook=RecHook(),
                track=track)
    assert marks == [] and published == [None]  # one step: nothing kept for a successor

    marks, published = [], []
    track = ProgressTrack("1:a1", "a1", lambda s, urgent: marks.append((s.phase, s.step)))
    env = FakeEnv(results=[Result(), Result(), Result(reward=1.0, terminated=True)])
    run_episode(cfg, env=env, policy=FakePolicy(), publish=lambda r, p=None: published.append(p), hook=RecHook(),
                track=track)
    assert marks == [(ProgressPhase.PROMPTED, 2), (ProgressPhase.STEPPING, 2),
                     (ProgressPhase.PROMPTED, 3), (ProgressPhase.STEPPING, 3)]
    assert published == [None, None, None]

    prompt = conv(3)
    prev = snap(ProgressPhase.PROMPTED, step=2, total_reward=0.5, prompt_json=orjson.dumps(prompt))
    track = ProgressTrack("1:a1", "b2", lambda s, urgent: None, resume=prev)
    env, policy, records = FakeEnv(results=[Result(reward=1.0, terminated=True)]), FakePolicy(), []
    out = run_episode(cfg, env=env, policy=policy, publish=lambda r, p=None: records.append(r), hook=RecHook(),
                      track=track)
    assert env.calls[0][0] == "step" and ("reset",) not in env.calls  # went on from the kept prompt
    assert policy.seen == [prompt] and [r.step_id for r in records] == [2]
    assert out.total_reward == 1.5 and out.steps == 2


# --- the model: every point a worker can stop at (broker/resume.py) ------------------------------
@pytest.mark.parametrize("point", resume.TURN_POINTS)
@pytest.mark.parametrize("fault", resume.FAULTS)
@pytest.mark.parametrize("replica_wait", [True, False])
@pytest.mark.parametrize("landed", [True, False])
@pytest.mark.unit
def test_no_point_a_worker_stops_at_has_its_successor_send_a_call_again(point, fault, replica_wait, landed):
    out = resume.successor_at(point, fault, replica_wait=replica_wait, landed=landed)
    assert not out.prompt_sent_twice and not out.step_sent_twice, out
    assert (out.resume_at is None) == bool(out.note)


@pytest.mark.unit
def test_the_model_resumes_where_it_can():
    """Killed while the model thinks (the long part of a turn) and stopped anywhere between
    calls, the successor continues; the points that cost a fresh start are those the README
    names."""
    at = resume.successor_at
    assert at("after_prompt", "killed", replica_wait=False).resume_at == (ProgressPhase.PROMPTED, 3)
    assert at("after_model", "killed", replica_wait=False).resume_at == (ProgressPhase.PROMPTED, 3)
    for point in resume.TURN_POINTS:
        assert at(point, "stopped", replica_wait=False).resume_at is not None
    fresh = {p for p in resume.TURN_POINTS if at(p, "killed", replica_wait=False).resume_at is None}
    assert fresh == {"before_prompt", "after_stepping_mark", "after_step", "after_publish"}
    assert at("after_stepping_mark", "write_lost", replica_wait=False).note == ResumeNote.OUTAGE_SINCE_SNAPSHOT
    assert at("after_stepping_mark", "write_lost", replica_wait=True).note == ResumeNote.CALL_IN_FLIGHT


@pytest.mark.unit
def test_a_prompted_snapshot_after_an_outage_would_send_the_step_again_without_the_rule():
    """Why the outage rule is there: a lost ``stepping`` write leaves ``prompted`` k while the
    step k may have been applied; taken as it is, the successor sends it again."""
    left = snap(ProgressPhase.PROMPTED, 3)
    assert resume.decide(left, had_predecessor=True, enabled=True, inproc=False).resume is left
    assert resume.decide(left, had_predecessor=True, enabled=True, inproc=False,
                         outage_since=True).note == ResumeNote.OUTAGE_SINCE_SNAPSHOT


@pytest.mark.unit
def test_nothing_kept_is_said_apart_from_resume_being_off():
    assert resume.decide(None, had_predecessor=True, enabled=True, inproc=False).note == ResumeNote.NOTHING_KEPT
    assert resume.decide(None, had_predecessor=True, enabled=False, inproc=False).note == ResumeNote.NOT_RESUMABLE
