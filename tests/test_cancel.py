"""``interactor cancel``: a job stopped cleanly (broker/cancel.py), against the session's real
Redis, real worker and consumer processes and the stand-in servers on loopback.

Queued and retrying episodes end cancelled at once; running ones are told by their lease
renewal and stop at their next call; what completed stays, with all its steps; nothing is
dead-lettered and no attempt is spent on a cancelled episode; nothing of the job starts again
(a stale message's START is refused, reconcile sends nothing, a re-drive and ``run --resume``
are refused); ``interactor run`` stops waiting for a cancelled job."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from broker import errors, feed
from broker.cancel import JobCancel, JobCancelled
from broker.control_records import AuditEntry
from broker.dlq import DeadLetterQueue
from broker.keys import Keys, env_instance_id, member
from broker.ledger import Ledger
from broker.queueing import push_episodes
from broker.records import DeadLetter, EpisodesCancelled, unpack
from broker.recovery import Sweeper, reconcile
from broker.states import AttemptStatus, LedgerState, ProducerState, StoredStatus
from consumer.storage import open_store
from producer.continuous import ContinuousProducer, FeedGone, create_continuous_job
from producer.enqueue import submit
from tests.conftest import ROOT, interruptible, wait_for
from tests.storecheck import assert_trajectories_sound
from tests.taskfiles import write_arith_tasks
from tests.test_cli_redis import clean_env, interactor
from tests.test_ledger import JOB, attempt_rec, ep_id, make_job
from tests.test_recovery import cli

pytestmark = pytest.mark.integration

RUNNING_OR_WAITING = (LedgerState.RUNNING, LedgerState.QUEUED, LedgerState.RETRYING)


def write_long_tasks(tmp_path, env_url: str, *, groups: int, size: int) -> str:
    """``groups`` groups of ``size`` guess_number episodes of about 20 turns each (the stand-in
    searches 1..1,000,000 by halves): long enough to be caught running."""
    entry = textwrap.dedent(f"""\
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{low: 1, high: 1000000, max_turns: 40}}
            env_num: {size}
        """)
    path = tmp_path / "long.yaml"
    path.write_text("environments:\n" + textwrap.indent(entry, "  ") * groups)
    return str(path)


def cli_env(settings) -> dict:
    return clean_env() | settings.as_environ()


# --- the ledger's side, no worker ------------------------------------------------------------
def test_waiting_episodes_end_at_once_running_ones_are_told_and_nothing_starts_again(settings, redis_client):
    """Two running (one whose worker will hand it back in the cancel's very moment, one whose
    worker dies), one retrying, one received by a worker, one queued. The cancel ends the three
    waiting at once; renewals tell the running; a stale START is refused; reconcile sends
    nothing; the straggler the hand-back leaves and the dead worker's episode end cancelled by
    the sweeper, neither counted nor dead-lettered."""
    keys = Keys(settings.key_prefix)
    ledger = Ledger.for_settings(redis_client, settings)
    job, eps = make_job()
    ledger.create_job(job, eps)
    handing_back = ledger.start(JOB, ep_id(1), "w1").lease
    dying = ledger.start(JOB, ep_id(2), "w2").lease
    retrying = ledger.start(JOB, ep_id(3), "w1").lease
    assert ledger.finish(retrying, attempt_rec(retrying, AttemptStatus.RETRYING, reason=errors.ENV_UNREACHABLE),
                         LedgerState.RETRYING, retry_at=time.time() + 3600)
    ledger.reserve([member(JOB, ep_id(4))])
    sweeper = Sweeper(redis_client, settings)

    report = JobCancel(redis_client, settings).cancel(JOB)
    assert (report.already, report.waiting, report.running) == (False, 3, 2)
    counts = ledger.counts(JOB)
    assert (counts[LedgerState.CANCELLED], counts[LedgerState.RUNNING], counts[LedgerState.QUEUED],
            counts[LedgerState.RETRYING]) == (3, 2, 0, 0)
    assert redis_client.zcard(keys.retry) == 0 and redis_client.zcard(keys.reserved) == 0
    # the store learns it in the same step, with the attempt each last ran (the cancel's audit
    # entry, broker/audit.py, follows it on the stream)
    newest = [unpack(fields[b"r"]) for _, fields in redis_client.xrevrange(keys.results, count=2)]
    assert isinstance(newest[0], AuditEntry) and isinstance(newest[1], EpisodesCancelled)
    last = newest[1]
    assert sorted((row[0], row[4], row[5]) for row in last.episodes) == [
        (ep_id(3), 1, retrying.attempt_id), (ep_id(4), 0, ""), (ep_id(5), 0, "")]

    # a stale message of a cancelled episode: refused, no attempt spent
    stale = ledger.start(JOB, ep_id(5), "w3")
    assert (stale.status, stale.detail) == ("finished", LedgerState.CANCELLED) and ledger.attempts(JOB, ep_id(5)) == 0
    # the running attempts learn it from their renewal, and keep their lease to close under
    ledger.renew([handing_back])
    assert handing_back.cancelled.is_set() and not handing_back.lost.is_set() and handing_back.valid()

    # One attempt closed as handed back in the cancel's very moment (as a worker shutting down
    # before its renewal told it would): waiting again, its message sent.
    assert ledger.finish(handing_back, attempt_rec(handing_back, AttemptStatus.ABANDONED,
                                                   reason=errors.WORKER_SHUTDOWN), LedgerState.QUEUED)
    push_episodes(redis_client, [(JOB, ep_id(1), "q")])
    assert ledger.start(JOB, ep_id(1), "w3").status == "refused"  # nothing of a cancelled job starts
    queued = redis_client.llen("q")
    assert reconcile(redis_client, settings, JOB) == [] and redis_client.llen("q") == queued

    # The sweeper: the straggler ends cancelled at its reconcile, the dead worker's episode
    # once its lease expired; neither is sent again nor dead-lettered.
    done = {"stragglers": 0, "reclaimed": []}

    def swept():
        r = sweeper.tick()
        done["stragglers"] += r.stragglers
        done["reclaimed"] += r.cancelled + r.reclaimed + r.dead
        assert not (r.reclaimed or r.dead or r.reconciled or r.retried), r
        return ledger.counts(JOB)[LedgerState.CANCELLED] == 5

    wait_for(swept, 60, what="the straggler and the lost worker's episode cancelled")
    assert done == {"stragglers": 1, "reclaimed": [member(JOB, ep_id(2))]}
    assert ledger.counts(JOB)[LedgerState.CANCELLED] == 5 and redis_client.llen("q") == queued
    assert DeadLetterQueue(redis_client, settings).list(job_id=JOB) == []
    assert [ledger.attempts(JOB, ep_id(i)) for i in range(1, 6)] == [1, 1, 1, 0, 0]
    assert ledger.attempt_limit(JOB, ep_id(2), job.max_attempts) == job.max_attempts  # no attempt granted or spent
    records = [unpack(f[b"r"]) for _, f in redis_client.xrange(keys.results)]
    lost = [r for r in records if getattr(r, "episode_id", "") == ep_id(2)]
    assert [(r.status, r.reason) for r in lost] == [(AttemptStatus.CANCELLED, errors.CANCELLED)]
    # the env instances a worker closes: the lost worker's, and the one the straggler was handed
    # back with (kept for a next attempt that will never come); the retrying one closed its own
    closing = sorted(unpack(raw).instance_id for raw in redis_client.lrange(keys.orphans, 0, -1))
    assert closing == sorted([env_instance_id(ep_id(2), dying.attempt, dying.attempt_id),
                              env_instance_id(ep_id(1), handing_back.attempt, handing_back.attempt_id)])

    # finished: retention applies to every key of the job, its cancel mark too
    sweeper._last_housekeeping = 0.0
    sweeper.tick()
    assert 0 < redis_client.ttl(keys.job_spec(JOB)) <= settings.job_retention_s
    assert 0 < redis_client.ttl(keys.job_cancel(JOB)) <= settings.job_retention_s

    again = JobCancel(redis_client, settings).cancel(JOB)  # twice: harmless
    assert (again.already, again.waiting, again.running) == (True, 0, 0)
    assert JobCancel(redis_client, settings).cancel("no-such-job") is None


def test_a_cancelled_jobs_dead_letters_are_not_re_driven(settings, redis_client):
    ledger = Ledger.for_settings(redis_client, settings)
    job, eps = make_job()
    ledger.create_job(job, eps)
    lease = ledger.start(JOB, ep_id(1), "w1").lease
    record = attempt_rec(lease, AttemptStatus.FAILED, reason=errors.ENV_MALFORMED)
    letter = DeadLetter(job_id=JOB, episode_id=ep_id(1), group_id=eps[0].group_id, env_name="arith",
                        reason=errors.ENV_MALFORMED, spec=eps[0].to_dict())
    assert ledger.finish(lease, record, LedgerState.FAILED, dead_letter=letter)
    JobCancel(redis_client, settings).cancel(JOB)
    dlq = DeadLetterQueue(redis_client, settings)
    with pytest.raises(JobCancelled, match="was cancelled"):
        dlq.redrive_failed(JOB)
    assert dlq.redrive(dlq.list(job_id=JOB)) == []  # left as it is, letter kept
    assert ledger.state(JOB, ep_id(1)) == LedgerState.FAILED and len(dlq.list(job_id=JOB)) == 1
    out = cli(settings, "dlq", "redrive", "--job", JOB)
    assert out.returncode == 2 and "was cancelled" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    resumed = cli(settings, "run", "--resume", JOB, "--no-preflight")
    assert resumed.returncode == 2 and "was cancelled" in resumed.stderr and "not resumed" in resumed.stderr, (
        resumed.stdout + resumed.stderr)
    assert ledger.counts(JOB)[LedgerState.QUEUED] == 0


def test_a_feed_jobs_producer_stops_producing_for_a_cancelled_job(settings, redis_client, tmp_path):
    keys = Keys(settings.key_prefix)
    tasks = write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=4, env_num=2)
    job_id = create_continuous_job(redis_client, settings.replace(feed_max_ahead=2), [tasks]).job_id
    producer = ContinuousProducer(redis_client, settings, job_id)
    assert producer.fill() == 2
    JobCancel(redis_client, settings).cancel(job_id)
    with pytest.raises(FeedGone, match="cancelled"):
        producer.produce_one(producer.config())
    stop = threading.Event()
    running = threading.Thread(target=producer.run, args=(stop,), daemon=True)
    running.start()
    running.join(30)  # it ends by itself: nothing more to produce, ever
    stop.set()
    assert not running.is_alive()
    assert feed.producer_status(redis_client, keys, job_id)["state"] == ProducerState.STOPPED
    counts = Ledger.for_settings(redis_client, settings).counts(job_id)
    assert counts[LedgerState.CANCELLED] == 4 and not any(counts[s] for s in RUNNING_OR_WAITING)
    # finished for retention: its feed holds nothing more to produce
    assert feed.finished(redis_client, keys, job_id, counts, settings.job_retention_s)


# --- the whole system ------------------------------------------------------------------------
def test_cancel_mid_run_stops_a_job_cleanly(settings, procs, env_server, redis_client, tmp_path):
    """20 episodes of about 20 turns on a slow model, 4 at a time; cancelled once some have
    completed and others run."""
    from examples.model_standin import start_in_thread

    env, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=150)
    try:
        s = settings.replace(llm_base_url=slow_url + "/v1", concurrency=4)
        procs.settings = s
        sub = submit(redis_client, s, [write_long_tasks(tmp_path, env_url, groups=5, size=4)])
        job, total = sub.job.job_id, sub.job.episodes
        assert total == 20
        ledger = Ledger.for_settings(redis_client, s)
        procs.worker("w1")
        procs.consumer()

        def some_done_some_running():
            c = ledger.counts(job)
            return c[LedgerState.DONE] >= 2 and c[LedgerState.RUNNING] >= 2

        wait_for(some_done_some_running, 180, interval=0.1, what="episodes completed and running")
        t0 = time.monotonic()
        cancel = subprocess.Popen([sys.executable, "-m", "interactor.cli", "cancel", job, "--wait", "120"],
                                  env=cli_env(s), cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        said = cancel.stdout.readline()
        # At once, while the command still waits for the running ones: nothing of the job waits,
        # and every episode never started is cancelled, none of them with an attempt.
        counts, states = ledger.counts(job), ledger.states(job)
        m = re.search(r"(\d+) queued or retrying episodes cancelled.*?(\d+) running told to stop", said)
        assert m, said
        waiting, running = int(m[1]), int(m[2])
        never_started = [e for e in states if ledger.attempts(job, e) == 0]
        assert counts[LedgerState.QUEUED] == counts[LedgerState.RETRYING] == 0, counts
        assert waiting == len(never_started) >= 1 and running >= 1, (said, counts)
        assert {states[e] for e in never_started} == {LedgerState.CANCELLED}
        ran = [e for e in states if e not in never_started]
        out, err = cancel.communicate(timeout=180)
        took = time.monotonic() - t0
        assert cancel.returncode == 0, err
        # running ones told by their next renewal (every 0.5 s here) and stopped at their next
        # call: seconds, whatever the machine's load, not the 20 turns they had left
        assert took < 10 * s.lease_ttl_s, took
        final = ledger.counts(job)
        assert "running=0" in out and f"cancelled={final[LedgerState.CANCELLED]}" in out, out
        # Every episode that had started ended: completed, or stopped by the cancel. No failure,
        # one attempt each (a stopped one is not counted again), nothing dead-lettered.
        assert final[LedgerState.FAILED] == 0 and final[LedgerState.DONE] + final[LedgerState.CANCELLED] == total
        stopped = [e for e in ran if ledger.state(job, e) == LedgerState.CANCELLED]
        assert 1 <= len(stopped) <= running, (stopped, running)
        assert {ledger.attempts(job, e) for e in ran} == {1}
        assert DeadLetterQueue(redis_client, s).list(job_id=job) == []
        status = cli(s, "status", job)
        assert f"{job} (cancelled)" in status.stdout and "100.0%" in status.stdout, status.stdout + status.stderr

        # The stale task messages left in the queue are received and dropped, none started.
        wait_for(lambda: redis_client.llen(s.queue) == 0, 60, what="the stale messages consumed")
        wait_for(lambda: "delivery dropped (finished cancelled)" in procs.log("w1"), 60, what="a stale START refused")
        assert sum(ledger.attempts(job, e) for e in states) == len(ran)
        # reconcile after the cancel sends nothing
        assert reconcile(redis_client, s, job) == [] and redis_client.llen(s.queue) == 0
        # the stopped episodes closed their env instances
        wait_for(lambda: env.stats()["live"] == 0, 30, what="every env instance closed")

        store = open_store(s.results_store, readonly=True)
        try:
            def stored():
                j = store.results(job)["job"]
                return j if j[StoredStatus.COMPLETED] + j[StoredStatus.CANCELLED] == total else None

            res = wait_for(stored, 60, what="every episode stored as ended")
            assert res[StoredStatus.COMPLETED] == final[LedgerState.DONE] >= 2
            assert res[StoredStatus.CANCELLED] == final[LedgerState.CANCELLED] and res[StoredStatus.FAILED] == 0
            assert_trajectories_sound(s.results_store, job)  # what completed: all its steps, as before
            for e in states:
                row = store.episode(e)
                if row["status"] == StoredStatus.CANCELLED:
                    assert store.episode_trajectory(e) == [] and row["reason"] == errors.CANCELLED
                    assert row["attempts"] == (0 if e in never_started else 1)
                    assert [a["status"] for a in store.attempts(e)] == ([] if e in never_started
                                                                        else [AttemptStatus.CANCELLED])
            for g in store.groups(job):
                members = {m["status"] for m in store.group_members(g["group_id"])}
                if StoredStatus.CANCELLED in members:
                    assert (g["complete"], g["incomplete_reason"]) == (0, errors.CANCELLED)
            assert store.failure_reasons(job) == []
        finally:
            store.close()
    finally:
        slow.shutdown()


def test_the_cancel_command_answers_in_one_line_and_cancelling_twice_is_harmless(settings, redis_client, tmp_path):
    unknown = cli(settings, "cancel", "no-such-job")
    assert unknown.returncode == 2 and "no job 'no-such-job'" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1 and unknown.stdout == ""
    sub = submit(redis_client, settings, [write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=3, env_num=2)])
    first = cli(settings, "cancel", sub.job.job_id, "--wait", "0")
    assert first.returncode == 0, first.stderr
    assert f"job {sub.job.job_id} cancelled: 6 queued or retrying episodes cancelled" in first.stdout
    assert "0 running told to stop" in first.stdout and "cancelled=6" in first.stdout
    second = cli(settings, "cancel", sub.job.job_id)
    assert second.returncode == 0 and "was cancelled already" in second.stdout, second.stdout + second.stderr
    assert Ledger.for_settings(redis_client, settings).counts(sub.job.job_id)[LedgerState.CANCELLED] == 6
    resume = cli(settings, "resume", sub.job.job_id)
    assert resume.returncode == 2 and "was cancelled" in resume.stderr


def test_a_local_run_ends_when_its_job_is_cancelled_and_its_results_are_found(tmp_path, env_server):
    """``interactor run`` in one terminal, ``interactor cancel`` in another: the run stops
    waiting, says what was cancelled, exits 1 (not every episode completed). Then, from the
    folder a new user would be in: ``results`` and ``export`` with the default store name the
    run folder that has one; ``jobs`` lists the job."""
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=200)
    run_dir = tmp_path / "runs" / "demo"
    job = "cancel-me"
    proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "run",
                             write_long_tasks(tmp_path, env_url, groups=4, size=2), "--llm-base-url",
                             slow_url + "/v1", "--run-dir", str(run_dir), "--concurrency", "2", "--workers", "1",
                             "--shutdown-grace", "1", "--job-id", job], env=clean_env(), cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
    try:
        def one_completed():
            if not (run_dir / "results.sqlite").exists():
                return False
            store = open_store(run_dir / "results.sqlite", readonly=True)
            try:
                return job in store.job_ids() and store.results(job)["job"][StoredStatus.COMPLETED] >= 1
            except sqlite3.OperationalError as exc:  # the file is there before the consumer's tables
                if "no such table" in str(exc):
                    return False
                raise
            finally:
                store.close()

        wait_for(one_completed, 180, interval=0.5, what="a completed episode")
        cancelled = interactor("cancel", job, "--run-dir", str(run_dir), cwd=tmp_path, timeout=180)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
        slow.shutdown()
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"cancelled: \d+ episodes", out), out[-3000:]

    for command in (["results", job], ["export", job]):
        missing = interactor(*command, cwd=tmp_path)
        assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
        assert "no results database at runs/results.sqlite" in missing.stderr
        assert os.path.join("runs", "demo") in missing.stderr and "--run-dir runs/demo" in missing.stderr
    # jobs reads every run folder below runs/ (the default --run-dir), and the one named
    for listed in (interactor("jobs", cwd=tmp_path), interactor("jobs", "--run-dir", str(run_dir), cwd=tmp_path)):
        assert listed.returncode == 0, listed.stderr
        header, row = listed.stdout.splitlines()
        assert header.split()[:4] == ["job", "created", "(UTC)", "model"] and row.split()[0] == job
        assert row.split()[-1] == "cancelled", row
