"""A cancelled job in the results store, on both backends (consumer/storage/plan.py): the
episodes a cancel ended while they waited (an ``EpisodesCancelled`` record) and the attempts it
stopped (a ``cancelled`` close) are stored ``cancelled``, with no trajectory; what completed or
failed stays as it was; records that arrive late or out of order (several consumers) do not
bring a cancelled episode back; its group is incomplete, reason ``cancelled``."""

from __future__ import annotations

import pytest

from broker import errors
from broker.records import AttemptRecord, EpisodesCancelled
from broker.states import AttemptStatus, StoredStatus
from consumer.storage import open_store
from tests.test_store import JOB, announce, close, episode, job, step


@pytest.fixture
def store(store_url):
    s = open_store(store_url)
    yield s
    s.close()


def cancelled(*rows, at=2000.0) -> EpisodesCancelled:
    """rows: (episode, group, attempt, attempt_id)."""
    return EpisodesCancelled(job_id=JOB, episodes=[[ep, group, 2, "arith", n, aid] for ep, group, n, aid in rows],
                             llm_model="m", cancelled_at=at)


def cancelled_close(ep, *, attempt=1, group="g1") -> AttemptRecord:
    return AttemptRecord(job_id=JOB, episode_id=ep, attempt=attempt, status=AttemptStatus.CANCELLED, group_id=group,
                         group_size=2, env_name="arith", llm_model="m", reason=errors.CANCELLED,
                         error_class="JobCancelled", error="its job was cancelled", attempt_id=f"{ep}-a{attempt}",
                         started_at=1100.0, finished_at=1190.0)


def rows(store, ep) -> int:
    return store.sql("SELECT COUNT(*) FROM session_steps WHERE session_id = ?", (ep,))[0][0]


def test_waiting_and_running_episodes_end_cancelled_and_what_completed_stays(store):
    # g1: e1 completed, e2 cancelled while running; g2: e3 cancelled before it started, e4 retrying then cancelled
    store.write_batch([job(4, 2), announce(("e1", "arith", "g1"), ("e2", "arith", "g1"), ("e3", "arith", "g2"),
                                           ("e4", "arith", "g2"))])
    store.write_batch(episode("e1", [0.5, 0.5]) + [step("e2", 1), step("e2", 2)]
                      + [step("e4", 1, group="g2"), close("e4", AttemptStatus.RETRYING, group="g2",
                                                          reason=errors.ENV_UNREACHABLE)])
    store.write_batch([cancelled_close("e2"), cancelled(("e3", "g2", 0, ""), ("e4", "g2", 1, "e4-a1"))])

    e1, e2, e3, e4 = (store.episode(e) for e in ("e1", "e2", "e3", "e4"))
    assert errors.CANCELLED == StoredStatus.CANCELLED == "cancelled"  # the stored words (docs/protocol.md)
    assert e1["status"] == StoredStatus.COMPLETED and e1["steps"] == 2 and rows(store, "e1") == 2
    assert (e2["status"], e2["reason"], e2["attempts"], e2["steps"]) == (StoredStatus.CANCELLED, errors.CANCELLED, 1, 0)
    assert (e3["status"], e3["attempts"], e3["finished_at"]) == (StoredStatus.CANCELLED, 0, 2000.0)
    assert (e4["status"], e4["attempts"]) == (StoredStatus.CANCELLED, 1)
    # no trajectory kept for a cancelled episode; the stopped attempt's steps are set aside as such
    assert rows(store, "e2") == 0 and rows(store, "e3") == 0 and rows(store, "e4") == 0
    assert {s["superseded_reason"] for s in store.superseded_steps("e2")} == {
        f"closed:{AttemptStatus.CANCELLED}:{errors.CANCELLED}"}
    # the stopped attempt is recorded as cancelled; the episode that never started has no attempt
    assert [a["status"] for a in store.attempts("e2")] == [AttemptStatus.CANCELLED]
    assert store.attempts("e3") == [] and [a["status"] for a in store.attempts("e4")] == [AttemptStatus.RETRYING]

    groups = {g["group_id"]: g for g in store.groups(JOB)}
    g1, g2 = groups["g1"], groups["g2"]
    assert (g1["complete"], g1["incomplete_reason"], g1["completed"]) == (0, errors.CANCELLED, 1)
    assert (g2["complete"], g2["incomplete_reason"], g2["failed"]) == (0, errors.CANCELLED, 0)
    res = store.results(JOB)
    assert (res["job"][StoredStatus.COMPLETED], res["job"][StoredStatus.CANCELLED], res["job"]["queued"]) == (1, 3, 0)
    assert (res["groups"]["cancelled"], res["groups"]["failed"], res["groups"]["incomplete"]) == (2, 0, 2)
    assert res["failures"] == []  # a cancel is no failure


def test_a_cancel_changes_nothing_of_a_completed_or_failed_episode(store):
    store.write_batch(episode("e1", [1.0, 2.0]) + [step("e2", 1), close("e2", AttemptStatus.FAILED,
                                                                        reason=errors.ENV_MALFORMED)])
    # a cancel naming them (a pass that read them waiting just before they ended) and redelivered twice
    for _ in range(2):
        store.write_batch([cancelled(("e1", "g1", 1, "e1-a1"), ("e2", "g1", 1, "e2-a1"))])
    e1, e2 = store.episode("e1"), store.episode("e2")
    assert (e1["status"], e1["total_reward"], rows(store, "e1")) == (StoredStatus.COMPLETED, 3.0, 2)
    assert (e2["status"], e2["reason"]) == (StoredStatus.FAILED, errors.ENV_MALFORMED)


def test_late_records_of_the_attempt_a_cancel_closed_do_not_bring_it_back(store):
    """With several consumers a cancel can be stored before records the stream had before it:
    the retrying close of attempt 2, its steps. The cancel names attempt 2 (the ledger's
    latest), so they find the episode closed by it."""
    store.write_batch([step("e1", 1), close("e1", AttemptStatus.RETRYING, reason=errors.ENV_UNREACHABLE)])
    store.write_batch([cancelled(("e1", "g1", 2, "e1-a2"))])
    store.write_batch([step("e1", 1, attempt=2), step("e1", 2, attempt=2),
                       close("e1", AttemptStatus.RETRYING, attempt=2, reason=errors.ENV_UNREACHABLE),
                       step("e1", 3, attempt=2)])
    e1 = store.episode("e1")
    assert (e1["status"], e1["attempts"], e1["steps"]) == (StoredStatus.CANCELLED, 2, 0)
    assert rows(store, "e1") == 0
    assert {s["superseded_reason"] for s in store.superseded_steps("e1") if s["attempt"] == 2} == {
        f"closed:{AttemptStatus.CANCELLED}"}


def test_an_episode_cancelled_as_it_completed_keeps_its_completion(store):
    """What completed is never lost: a completion stored after the cancel record (the ledger
    cannot hold both, but a store must not throw a trajectory away for a record's order)."""
    store.write_batch([cancelled(("e1", "g1", 0, ""))])
    store.write_batch(episode("e1", [1.0]))
    e1 = store.episode("e1")
    assert (e1["status"], e1["total_reward"], rows(store, "e1")) == (StoredStatus.COMPLETED, 1.0, 1)
