"""Resumable episodes: a worker that dies or stalls mid-episode costs at most the call it was in,
not the episode (broker/resume.py). Real Redis, real worker and consumer processes, loopback
env and model servers that log every call, so that what the env saw can be compared with what
was stored: an instance reset once, every step applied once, stored steps 1..n once each."""

from __future__ import annotations

import signal
import time
from collections import Counter

import pytest

from broker.keys import Keys
from broker.ledger import Ledger
from broker.states import LedgerState, ProgressPhase, ResumeNote
from consumer.storage import open_store
from interactor.children import signal_group
from producer.enqueue import submit
from tests.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.fault]

LONG = "{low: 1, high: 1073741824, max_turns: 30}"  # about 30 guesses of a binary search




def job_of(redis_client, settings, tmp_path, env_url: str, n: int, extra: str = ""):
    tasks = tmp_path / "long.yaml"
    tasks.write_text(f"{extra}environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                     f"    env_params: {LONG}\n    env_num: {n}\n")
    return submit(redis_client, settings, [str(tasks)]).job


def calls(env) -> dict[str, Counter]:
    """Per env instance id: how many of each call the env server saw."""
    out: dict[str, Counter] = {}
    for _, op, _, env_id in list(env.request_log):
        out.setdefault(env_id, Counter())[op] += 1
    return out


def instances_of(env, episode_id: str) -> dict[str, Counter]:
    return {i: c for i, c in calls(env).items() if i.split("~", 1)[0] == episode_id}


def signal_tree(proc, sig) -> None:
    """``sig`` to a worker's whole tree: its supervisor and the Celery process it runs (in a
    session of its own), as SIGSTOP must reach the one that holds the episodes."""
    import psutil

    root = psutil.Process(proc.pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def snapshots(ledger: Ledger, job_id: str, episodes) -> dict:
    return {e: ledger.progress(job_id, e) for e in episodes}


def all_in_model_call(ledger, model, job_id, episodes) -> bool:
    """Every episode is inside a (held) model call, with its prompt kept in the ledger."""
    snaps = snapshots(ledger, job_id, episodes)
    return model.held == len(episodes) and all(
        p is not None and p.phase == ProgressPhase.PROMPTED and p.step >= 4 for p in snaps.values())


class Run:
    """A job of ``n`` long episodes on worker w1 (and a consumer), for a test to stop mid-way."""

    def __init__(self, settings, procs, redis_client, tmp_path, servers, n: int, extra: str = "", **overrides):
        self.env, env_url, self.model, model_url = servers
        self.s = settings.replace(llm_base_url=model_url + "/v1", **overrides)
        procs.settings = self.s
        self.procs = procs
        self.job = job_of(redis_client, self.s, tmp_path, env_url, n, extra=extra)
        self.ledger = Ledger.for_settings(redis_client, self.s)
        self.episodes = list(self.ledger.states(self.job.job_id))
        procs.consumer()
        procs.worker("w1")

    def a_few_steps_in(self) -> None:
        wait_for(lambda: all((p := self.ledger.progress(self.job.job_id, e)) is not None and p.step >= 4
                             for e in self.episodes), 120, what="every episode a few steps in")

    def hold_in_model_call(self) -> None:
        """Every episode inside a model call the stand-in holds, its prompt kept in the ledger."""
        self.a_few_steps_in()
        self.model.hold()
        wait_for(lambda: all_in_model_call(self.ledger, self.model, self.job.job_id, self.episodes), 60,
                 what="every episode inside a model call")

    def finish(self) -> tuple:
        """Waits for the job to end, in the ledger and in the store; what the store holds."""
        n = len(self.episodes)
        wait_for(lambda: finished(self.ledger, self.job.job_id, n), 240, what="the job finished")
        wait_for(lambda: (got := stored(self.s, self.job.job_id)[0]) and len(got) == n and all(
            e["status"] == "completed" for e in got.values()), 60, what="stored")
        return stored(self.s, self.job.job_id)


def finished(ledger, job_id, n) -> bool:
    return ledger.counts(job_id)[LedgerState.DONE] == n


def stored(settings, job_id):
    store = open_store(settings.results_store, readonly=True)
    try:
        eps = {d["episode_id"]: d for d in store.query_dicts("SELECT * FROM episodes WHERE job_id = ?", (job_id,))}
        steps = {e: [r[0] for r in store.query("SELECT step_id FROM session_steps WHERE session_id = ? "
                                               "ORDER BY step_id", (e,))] for e in eps}
        attempts = {e: store.attempts(e) for e in eps}
        set_aside = {e: store.query("SELECT COUNT(*) FROM superseded_steps WHERE session_id = ?", (e,))[0][0]
                     for e in eps}
        results = store.results(job_id)
    finally:
        store.close()
    return eps, steps, attempts, set_aside, results


def test_a_worker_killed_mid_episode_costs_no_step(settings, procs, redis_client, tmp_path, servers):
    """Four 30-step episodes, their worker SIGKILLed while all four are inside a model call:
    the next attempts continue the same instances. Each instance is reset once and closed
    once, the env sees every step once, and the stored steps are exactly the env's."""
    run = Run(settings, procs, redis_client, tmp_path, servers, 4)
    env, s, episodes = run.env, run.s, run.episodes
    run.hold_in_model_call()
    procs.kill("w1")
    run.model.release()
    procs.worker("w2")
    eps, steps, attempts, set_aside, results = run.finish()
    for e in episodes:
        (instance, seen), = instances_of(env, e).items()  # one instance for the whole episode
        n = eps[e]["steps"]
        assert steps[e] == list(range(1, n + 1)), (e, steps[e])
        assert seen["reset"] == 1 and seen["close"] == 1 and seen["step"] == n, (e, seen, n)
        assert set_aside[e] == 0
        first, second = sorted(attempts[e], key=lambda a: a["attempt"])
        assert first["status"] == "abandoned" and second["status"] == "completed"
        assert second["resumed_at"] >= 4 and second["trajectory"].endswith(first["attempt_id"])
        assert second["steps"] == n
    assert results["resumes"]["resumed"] == 4 and results["resumes"]["steps_saved"] >= 4 * 3
    assert not results["resumes"]["fallbacks"]
    # Visible: the summary, the metrics and the browser's episode page say what crashes cost.
    from interactor.report import resumes_line
    from tests.test_ui import client_for

    assert resumes_line(results["resumes"]).startswith("resumed: 4 attempts continued")
    page = client_for(s.results_store).get(f"/episodes/{episodes[0]}").get_data(as_text=True)
    assert f"resumed at step {sorted(attempts[episodes[0]], key=lambda a: a['attempt'])[1]['resumed_at']}" in page
    from interactor.fleet_reader import FleetReader
    from interactor.metrics import exposition

    text = exposition(FleetReader(redis_client, s))
    assert 'interactor_resumes_total{env_name="guess_number"} 4.0' in text
    assert "interactor_resume_steps_saved_total" in text


def test_a_step_in_flight_is_never_sent_again(settings, procs, redis_client, tmp_path, servers):
    """The worker dies while a step call is in flight (the env answers it slowly): its outcome is
    unknown, so the next attempt starts afresh on a new instance and says call_in_flight; the old
    instance got that step at most once."""
    servers[0].slow_step_at, servers[0].slow_step_s = 5, 6.0
    run = Run(settings, procs, redis_client, tmp_path, servers, 1)
    env, job, ledger, (episode,) = run.env, run.job, run.ledger, run.episodes
    wait_for(lambda: env.stats()["slow_steps"] == 1, 120, what="step 5 in flight")
    assert ledger.progress(job.job_id, episode).phase == ProgressPhase.STEPPING
    procs.kill("w1")
    env.slow_step_at = 0
    procs.worker("w2")
    eps, steps, attempts, _, results = run.finish()
    second = max(attempts[episode], key=lambda a: a["attempt"])
    assert second["resume_note"] == ResumeNote.CALL_IN_FLIGHT and not second["resumed_at"]
    seen = instances_of(env, episode)
    assert len(seen) == 2 and all(c["reset"] == 1 for c in seen.values())
    old = [c for i, c in seen.items() if c["step"] <= 5 and not c["get_task_prompt"] > 5]
    assert old and max(c["step"] for c in old) <= 5  # step 5 sent once, never again
    new = [c for c in seen.values() if c["step"] == eps[episode]["steps"]]
    assert new and steps[episode] == list(range(1, eps[episode]["steps"] + 1))
    assert results["resumes"]["fallbacks"] == {ResumeNote.CALL_IN_FLIGHT: 1}


def test_a_fresh_attempt_killed_in_its_first_step_leaves_no_instance_behind(settings, procs, redis_client, tmp_path,
                                                                             servers):
    """The first attempt dies with a step in flight (its snapshot says stepping); the second starts
    afresh and is killed inside its first model call, before any snapshot of its own would be
    written; the third closes that second instance too. Every instance the episode reset is
    closed in the end: the second attempt named its trajectory in the ledger before its reset
    (it left the first attempt's snapshot there before, and the third closed only that one)."""
    servers[0].slow_step_at, servers[0].slow_step_s = 5, 6.0
    run = Run(settings, procs, redis_client, tmp_path, servers, 1)
    env, model, job, ledger, (episode,) = run.env, run.model, run.job, run.ledger, run.episodes
    wait_for(lambda: env.stats()["slow_steps"] == 1, 120, what="step 5 in flight")
    procs.kill("w1")
    env.slow_step_at = 0
    model.hold()
    procs.worker("w2")
    wait_for(lambda: model.held == 1 and len(instances_of(env, episode)) == 2, 120,
             what="the second attempt inside its first model call")
    assert ledger.progress(job.job_id, episode).phase == ProgressPhase.PROMPTING
    procs.kill("w2")
    model.release()
    procs.worker("w3")
    eps, steps, attempts, _, _ = run.finish()
    seen = instances_of(env, episode)
    assert len(seen) == 3 and all(c["reset"] == 1 and c["close"] >= 1 for c in seen.values()), seen
    assert env.stats()["live"] == 0
    *_, last = sorted(attempts[episode], key=lambda a: a["attempt"])
    assert len(attempts[episode]) == 3 and last["resume_note"] == ResumeNote.CALL_IN_FLIGHT
    assert steps[episode] == list(range(1, eps[episode]["steps"] + 1))


def test_an_instance_left_before_any_snapshot_is_closed_by_the_third_attempt(settings, procs, redis_client,
                                                                            tmp_path, servers):
    """The first attempt is killed inside its first model call: no snapshot names its instance.
    The second is killed after its START, before it closed that instance (held here by the
    startup jitter). The third closes it: START lists every earlier attempt whose instance
    may be open, not only the one just before (which made none)."""
    run = Run(settings, procs, redis_client, tmp_path, servers, 1)
    env, model, job, ledger, (episode,) = run.env, run.model, run.job, run.ledger, run.episodes
    model.hold()
    wait_for(lambda: model.held == 1, 120, what="the first attempt inside its first model call")
    assert ledger.progress(job.job_id, episode) is None and len(instances_of(env, episode)) == 1
    procs.kill("w1")
    model.release()
    procs.worker("w2", llm_startup_jitter_s=1e6)  # its first episode waits, after START, before any call
    wait_for(lambda: ledger.attempts(job.job_id, episode) == 2, 120, what="the second attempt started")
    time.sleep(0.5)
    procs.kill("w2")
    (first,) = instances_of(env, episode).values()
    assert first["close"] == 0  # the second attempt died before closing it
    procs.worker("w3")
    eps, steps, attempts, _, _ = run.finish()
    made = {i: c for i, c in instances_of(env, episode).items() if c["reset"]}  # the second made none
    assert len(made) == 2 and all(c["reset"] == 1 and c["close"] >= 1 for c in made.values()), made
    assert env.stats()["live"] == 0
    assert len(attempts[episode]) == 3 and steps[episode] == list(range(1, eps[episode]["steps"] + 1))


def test_a_stalled_worker_calls_nothing_once_its_episode_was_taken_over(settings, procs, redis_client, tmp_path,
                                                                        servers):
    """SIGSTOP past the lease, then SIGCONT: the successor continued the instance meanwhile; the
    stalled worker finds its lease gone and makes no env call on it (no extra step, no close)."""
    run = Run(settings, procs, redis_client, tmp_path, servers, 1)
    env, model, s, job, ledger, (episode,) = run.env, run.model, run.s, run.job, run.ledger, run.episodes
    run.hold_in_model_call()
    signal_tree(procs.procs["w1"], signal.SIGSTOP)
    try:
        model.release()  # its answer waits in the stopped worker's socket
        procs.worker("w2")
        wait_for(lambda: ledger.attempts(job.job_id, episode) >= 2 and (p := ledger.progress(job.job_id, episode))
                 is not None and p.writer != "" and p.step >= 6, 120, what="the successor a few steps further")
    finally:
        signal_tree(procs.procs["w1"], signal.SIGCONT)
    wait_for(lambda: finished(ledger, job.job_id, 1), 240, what="the episode finished")
    wait_for(lambda: "another attempt took over" in procs.log("w1") or "lease lost" in procs.log("w1"), 60,
             what="the stalled worker told its lease is gone")
    time.sleep(1.0)  # time for a stray call of the stalled worker, were there one
    eps, steps, attempts, _, _ = stored(s, job.job_id)
    (instance, seen), = instances_of(env, episode).items()
    n = eps[episode]["steps"]
    assert seen["reset"] == 1 and seen["step"] == n and seen["close"] == 1, (seen, n)
    assert steps[episode] == list(range(1, n + 1))


def test_an_instance_the_env_server_lost_is_not_continued(settings, procs, redis_client, tmp_path, servers):
    """The env server restarted between the crash and the next attempt: the instance is gone,
    found at the first call on it; the attempt starts afresh (instance_gone) and completes."""
    from examples.envserver import EnvServer

    run = Run(settings, procs, redis_client, tmp_path, servers, 2)
    env, model, job, ledger, episodes = run.env, run.model, run.job, run.ledger, run.episodes
    run.hold_in_model_call()
    held_at = {e: p.step for e, p in snapshots(ledger, job.job_id, episodes).items()}
    procs.kill("w1")
    port = env.server_address[1]
    env.shutdown()
    env.server_close()
    fresh = EnvServer(port=port, log_requests=True).serve_in_thread("envserver")[0]
    try:
        model.release()
        procs.worker("w2")
        eps, steps, attempts, set_aside, results = run.finish()
        for e in episodes:
            second = max(attempts[e], key=lambda a: a["attempt"])
            assert second["resume_note"] == ResumeNote.INSTANCE_GONE and not second["resumed_at"]
            calls_on = instances_of(fresh, e)
            assert sum(c["step"] for c in calls_on.values() if not c["reset"]) == 1  # the one that found it gone
            (seen,) = [c for c in calls_on.values() if c["reset"]]
            assert seen["reset"] == 1 and seen["step"] == eps[e]["steps"]
            # the lost instance's steps, stored before its worker was killed, are set aside
            assert steps[e] == list(range(1, eps[e]["steps"] + 1)) and set_aside[e] == held_at[e] - 1 >= 3
        assert results["resumes"]["fallbacks"] == {ResumeNote.INSTANCE_GONE: 2}
    finally:
        fresh.shutdown()


def test_a_worker_stopped_between_calls_hands_back_exactly_where_it_was(settings, procs, redis_client, tmp_path,
                                                                          servers):
    """SIGTERM with a short grace while the episodes wait on the model: at the next call boundary
    each attempt hands its episode back with its instance and an exact snapshot, uncounted, and
    the next attempt continues from there."""
    run = Run(settings, procs, redis_client, tmp_path, servers, 2, shutdown_grace_s=1)
    env, model, s, job, ledger, episodes = run.env, run.model, run.s, run.job, run.ledger, run.episodes
    run.hold_in_model_call()
    signal_group(procs.procs["w1"], signal.SIGTERM)
    time.sleep(2.0)  # past the grace: the answers come back to a worker handing back
    model.release()
    wait_for(lambda: procs.procs["w1"].poll() is not None, 120, what="w1 exited")
    procs.worker("w2")
    eps, steps, attempts, set_aside, results = run.finish()
    for e in episodes:
        (seen,) = instances_of(env, e).values()
        assert seen["reset"] == 1 and seen["step"] == eps[e]["steps"] and seen["close"] == 1
        first, second = sorted(attempts[e], key=lambda a: a["attempt"])
        assert first["status"] == "abandoned" and first["reason"] == "worker_shutdown"
        assert second["resumed_at"] >= 4
        assert ledger.attempt_limit(job.job_id, e, s.max_attempts) > s.max_attempts  # the hand-back was not counted
    assert results["resumes"]["resumed"] == 2


def test_resume_off_starts_every_attempt_afresh(settings, procs, redis_client, tmp_path, servers):
    """`resume: false` in the task file: the next attempt resets a fresh instance, says why."""
    run = Run(settings, procs, redis_client, tmp_path, servers, 1, extra="resume: false\n")
    env, s, job, ledger, (episode,) = run.env, run.s, run.job, run.ledger, run.episodes
    assert job.resume is False
    wait_for(lambda: any(c["step"] >= 3 for c in instances_of(env, episode).values()), 120, what="a few steps in")
    procs.kill("w1")
    procs.worker("w2")
    _, _, attempts, _, _ = run.finish()
    assert ledger.progress(job.job_id, episode) is None  # nothing kept for a successor
    second = max(attempts[episode], key=lambda a: a["attempt"])
    assert second["resume_note"] == ResumeNote.NOT_RESUMABLE  # resume off, not merely nothing kept
    assert len(instances_of(env, episode)) == 2
    keys = Keys(s.key_prefix)
    assert not redis_client.hlen(keys.job_progress(job.job_id))
