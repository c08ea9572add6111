"""One attempt of one episode, from the lease START handed out to the attempt's close.

:class:`WorkerRuntime` (workers/runner.py) is the process; each delivery it STARTs becomes an
:class:`Attempt`, handed the process's parts it uses (workers/attempt_parts.py) and nothing
else: the trust checks (workers/allowlist.py), its ports (the env instance and the model
endpoint through the declared chain of policy layers, workers/port_layers.py), the step loop on
its trajectory (workers/trajectory.py), and its close. A delivery reads top-down in this file.

What an attempt can end as (broker/records.py):
* completed -> ledger ``done``;
* transient failure with attempts left -> ``retrying``; the sweeper enqueues it after a backoff;
* permanent failure, or transient with no attempts left -> ``failed`` + a dead letter;
* shutdown grace over -> ``queued`` again at once (handed back; does not use up an attempt);
* its job cancelled (broker/cancel.py; a renewal says so) -> ``cancelled``, stopped before its
  next call: no failure, no dead letter;
* lease lost -> nothing: whoever holds the lease now owns the episode.

An attempt that ends because a server went down under it (workers/breakers.py) is retried
without counting against ``max_attempts``: an outage is not the episode's fault. The rule that
decides among these is broker/closing.py's ``decide``, shared with the sweeper.

Fencing by local time: an attempt calls nothing once its lease may have lapsed by its own
clock (no renewal landed within the TTL less a margin; ``Lease.valid``). It waits for the
renewer instead; the renewal either extends the lease (Redis was slow or briefly away: the
attempt goes on, its budget paused) or finds another attempt holding the episode (this one
stops). A stalled or partitioned worker thus never acts on a lease that may be someone else's.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import traceback
from typing import Any, Callable

import redis

from broker import closing, errors, resume
from broker.keys import env_instance_id
from broker.lease import Lease
from broker.records import AttemptRecord, EpisodeSpec, JobSpec, Progress, StepRecord
from broker.settings import Settings
from broker.states import AttemptStatus, CloseAction, LedgerState, ResumeNote
from workers.agent_episode import is_agent, run_agent_attempt
from workers.attempt_parts import AttemptParts
from workers.budget import Budget
from workers.env_driven import is_env_driven, run_env_episode
from workers.hooks import load_hook
from workers.loop import EpisodeOutcome, PhaseTimings, run_episode
from workers.port_layers import PortContext, capped_env, env_port, policy_port
from workers.ports import Guard
from workers.trajectory import Trajectory

log = logging.getLogger("interactor.worker")

_FENCE_SLICE_S = 0.05


def retry_delay(settings: Settings, attempt: int) -> float:
    """Capped exponential backoff with full jitter between attempts of one episode."""
    cap = min(settings.retry_backoff_max_s, settings.retry_backoff_initial_s * (2 ** (attempt - 1)))
    return random.uniform(cap / 2, cap)


class Attempt:
    """One attempt: its lease, what the ledger says of its episode (spec, job, the attempt before
    it and that one's progress snapshot), its budget, and the fields of its attempt record."""

    def __init__(self, parts: AttemptParts, lease: Lease, spec: EpisodeSpec | None, job: JobSpec | None,
                 earlier: tuple[tuple[int, str], ...] = (), progress: Progress | None = None,
                 outage_since_progress: bool = False):
        self.parts, self.lease, self.spec, self.job = parts, lease, spec, job
        #: the attempts before this one whose env instance may still be open (StartResult.earlier)
        self.earlier, self.progress = tuple(earlier), progress
        self.outage_since_progress = outage_since_progress  # StartResult.outage_since_progress
        self.turned = False  # a turn of this attempt completed: its job's servers answer
        self.t_start = time.time()
        self.base = dict(job_id=lease.job_id, episode_id=lease.episode_id, attempt=lease.attempt,
                         group_id=spec.group_id if spec else "", group_size=spec.group_size if spec else 0,
                         env_name=spec.env_name if spec else "", llm_model=job.model if job else "",
                         started_at=self.t_start, worker=parts.worker, attempt_id=lease.attempt_id)
        self.budget = Budget(job.episode_budget_s if job else 0.0)
        self.guard = Guard(self.budget, self.check, parts.settings.outage_budget_s)
        self.ports = PortContext(parts, job, spec, self.budget, self.guard, self.check) if job and spec else None

    # --- running it ------------------------------------------------------------------
    def run(self) -> str:
        parts, lease, spec, job = self.parts, self.lease, self.spec, self.job
        if job is None or spec is None:
            err = errors.EpisodeError(errors.BAD_TASK, "job or episode spec missing from the ledger")
            return self.close_failed(err, "")
        refused = parts.trust.refused(job, spec)
        if refused:
            err = errors.EpisodeError(errors.BAD_TASK, refused, transient=False)
            parts.pause_watch.failed(job, lease.episode_id, err.reason, refused)
            self.orphan_earlier()  # this worker calls none of the job's servers; an orphan closer checks its own lists
            return self.close_failed(err, "")
        if is_env_driven(spec):
            return run_agent_attempt(self, run_env_episode)  # its env server calls the model: workers/env_driven.py
        if is_agent(spec):
            return run_agent_attempt(self)  # an agent owns the loop: workers/agent_episode.py

        base, progress = self.base, self.progress
        timings = PhaseTimings()  # where the attempt's time goes (records v5)
        if lease.attempt == 1:  # later attempts' waits are not timed
            base["queue_wait_s"] = max(0.0, self.t_start - job.created_at)
        # an inproc env, or a session of another protocol, cannot be continued by a successor
        resumable = job.resume and resume.outlives_worker(spec)
        start = resume.decide(progress, had_predecessor=bool(self.earlier), enabled=job.resume,
                              inproc=not resume.outlives_worker(spec), outage_since=self.outage_since_progress)
        run = Trajectory(lease, start.resume if resumable else None, resumable, self.mark,
                         supersedes=progress is not None)
        base.update(trajectory=run.recorded_under, resumed_at=run.resumed_at, resume_note=start.note)
        try:
            hook = load_hook(job.episode_hook)
            parts.jitter.wait(self.check)  # spreads the first wave so it does not hit the model at once
            if start.resume is None:
                # a fresh instance: those before it are closed first (a second close is a no-op)
                self.close_earlier()
            policy = policy_port(self.ports)
            try:
                outcome = self._drive(run, policy, hook, timings)
            except errors.EpisodeError as exc:
                if not run.instance_gone(exc):
                    raise
                # The env server no longer has the instance (it restarted): start afresh, in this attempt.
                log.warning("episode %s attempt %d: the instance it would continue is gone (%s); starting afresh",
                            lease.episode_id, lease.attempt, exc)
                run = Trajectory(lease, None, resumable, self.mark, supersedes=True)
                base.update(trajectory="", resumed_at=0, resume_note=ResumeNote.INSTANCE_GONE)
                outcome = self._drive(run, policy, hook, timings)
        except errors.EpisodeError as exc:
            base.update(timings.record_fields())
            return self.close_error(exc, "", outage_seen=self.guard.outage_seen, run=run)
        except redis.RedisError as exc:
            # Redis went away for longer than the client's retries: not the episode's doing.
            base.update(timings.record_fields())
            err = errors.EpisodeError(errors.BROKER_OUTAGE, f"Redis unreachable: {type(exc).__name__}: {exc}",
                                      transient=True, outage=True)
            return self.close_error(err, "", run=run)
        except Exception as exc:
            base.update(timings.record_fields())
            err = errors.EpisodeError(errors.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}", transient=False)
            err.__cause__ = exc
            return self.close_error(err, _traceback(exc), run=run)

        base.update(timings.record_fields())
        record = AttemptRecord(**base, status=AttemptStatus.COMPLETED, total_reward=outcome.total_reward,
                               steps=outcome.steps, last_info=outcome.last_info, ended_by=outcome.ended_by,
                               prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens)
        if not self.finish(record, LedgerState.DONE):
            log.warning("episode %s attempt %d: lease lost before completion was recorded", spec.episode_id, lease.attempt)
            return errors.LEASE_LOST
        parts.pause_watch.succeeded(job)
        log.info("episode %s attempt %d completed: reward=%.3f steps=%d", spec.episode_id, lease.attempt,
                 outcome.total_reward, outcome.steps)
        return AttemptStatus.COMPLETED

    # --- its trajectory ----------------------------------------------------------------
    def _drive(self, run: Trajectory, policy: Any, hook, timings: PhaseTimings) -> EpisodeOutcome:
        """The step loop (workers/loop.py) on ``run``'s instance, under the job's fleet-wide caps."""
        env = capped_env(self.ports, env_port(self.ports, run.key))
        run.driven_by(env)

        def publish(record: StepRecord, progress: Progress | None = None) -> None:
            run.published += 1
            self.publish(record, progress)

        def keeps_instance(error: BaseException | None) -> bool:
            # the loop's question at its end; the answer is what the attempt's close goes by
            run.instance_kept = self._keeps_instance(run, error)
            return run.instance_kept

        return run_episode(run.loop_config(self.job, self.spec), env=env, policy=policy, publish=publish, hook=hook,
                           check=self.check, timings=timings, track=run.track, keeps_instance=keeps_instance,
                           fault=self.parts.fault)

    def _keeps_instance(self, run: Trajectory, error: BaseException | None) -> bool:
        """The env instance outlives this attempt when the episode goes on elsewhere from where
        it stands: the worker hands the episode back (with a snapshot naming it), or the lease
        passed to another attempt while the ledger's snapshot names this trajectory (that
        attempt continues it, or closes it as its predecessor's). Whoever ends the episode closes
        it, once; one nobody would know of (a snapshot Redis lost, or none written yet) is
        closed here, and so is every instance of a job that caps live instances (the slot that
        counts it goes with this attempt; a successor continuing such an instance would find it
        gone and start afresh)."""
        decided = run.handed_on_when(error)
        if decided is not None:
            return decided
        lease = self.lease
        try:
            kept = self.parts.ledger.progress(lease.job_id, lease.episode_id)
        except redis.RedisError:
            return False  # closing one a successor continues costs it the instance (instance_gone), no more
        return kept is not None and kept.trajectory == run.track.trajectory

    def _close_instance(self, run: Trajectory) -> None:
        """Close the instance the loop kept (or, before the loop ran, the predecessor's it was
        to continue): this attempt ends the trajectory after all."""
        env = run.env if run.env is not None else env_port(self.ports, run.key)
        try:
            env.close()
        except Exception:  # noqa: BLE001 - best effort, as every close
            log.exception("episode %s: closing the env failed (ignored)", self.lease.episode_id)

    def close_earlier(self) -> None:
        """Close every instance an earlier trajectory may have left open: the one the progress
        snapshot names (its worker died, or handed it on, without closing it) and those of the
        attempts START listed, which may have reset one and died before any snapshot named it.
        Closing an instance that is gone, or was never made, is a no-op on the env server."""
        if self.spec.transport == "inproc":
            return
        keys = list(self.earlier)
        if self.progress is not None:
            keys.append(self.progress.trajectory_key)
        for number, attempt_id in dict.fromkeys(keys):
            if number > 0:
                self.parts.env.close(self.spec.base_url, self.spec.env_name,
                                     env_instance_id(self.spec.episode_id, number, attempt_id),
                                     protocol=self.spec.protocol)

    def orphan_earlier(self) -> None:
        """The instances :meth:`close_earlier` would close, queued for the orphan closers
        instead: for an attempt that ends before any call of its own, without which the FINISH
        that drops the snapshot would leave them open for good."""
        keys = list(self.earlier) + ([self.progress.trajectory_key] if self.progress is not None else [])
        entries = closing.orphans(self.spec, keys)
        if entries:
            self._through_outage("queueing earlier instances to close", lambda: self.parts.queue_orphans(entries))

    # --- its lease -------------------------------------------------------------------
    def check(self) -> None:
        lease, budget = self.lease, self.budget
        if lease.lost.is_set():
            raise errors.EpisodeError(errors.LEASE_LOST, "another attempt took over this episode")
        if lease.cancelled.is_set():
            raise errors.EpisodeError(errors.CANCELLED, "its job was cancelled (interactor cancel)", transient=False)
        if not lease.valid():
            self._await_renewal()
        if budget.left() <= 0:
            raise errors.EpisodeError(errors.EPISODE_TIMEOUT, "the attempt's wall-clock budget ran out")
        if self.parts.shutting_down():
            raise errors.EpisodeError(errors.WORKER_SHUTDOWN, "worker shutting down; episode handed back")

    def _await_renewal(self) -> None:
        """The lease may have lapsed by this process's clock: call nothing until a renewal says
        whether it is still ours. The wait pauses the attempt's budget (a Redis outage is not the
        episode's doing); past ``outage_budget_s`` the attempt ends as ``broker_outage``."""
        lease, budget, renewer = self.lease, self.budget, self.parts.renewer
        t0 = last = nudged = time.monotonic()
        renewer.nudge()
        warned = False
        while not lease.valid():
            if lease.lost.is_set():
                raise errors.EpisodeError(errors.LEASE_LOST, "another attempt took over this episode")
            now = time.monotonic()
            budget.pause(now - last)
            last = now
            if now - t0 > self.parts.settings.outage_budget_s:
                raise errors.EpisodeError(errors.BROKER_OUTAGE, f"lease not renewed for {now - t0:.0f}s: Redis "
                                          "unreachable past the outage budget", transient=True, outage=True)
            if not warned and now - t0 > 5:
                warned = True
                log.warning("episode %s: lease not renewed in time (Redis slow or unreachable, or this process "
                            "stalled); waiting before any further call", lease.episode_id)
            if now - nudged > 1.0:
                nudged = now
                renewer.nudge()
            time.sleep(_FENCE_SLICE_S)

    def mark(self, snapshot: Progress, urgent: bool) -> None:
        """A progress snapshot for the ledger; an urgent one is in Redis before this returns
        (or the attempt stops: a lapsed lease refused it). An urgent one goes straight to Redis
        once what this attempt queued before it has landed: a ``prompted`` snapshot still in the
        publisher's queue must never land after the ``stepping`` one that follows it."""
        publisher = self.parts.publisher
        if not urgent:
            publisher.mark(self.lease, snapshot)
            return
        while not publisher.flush(self.lease, timeout=_FENCE_SLICE_S * 20):
            self.check()
        self.check()
        self._through_outage("marking where it stands", lambda: self.parts.ledger.mark(self.lease, snapshot))
        self.check()  # refused: the lease is flagged lost, and this stops the attempt before its call

    def publish(self, record: StepRecord, progress: Progress | None = None) -> None:
        # Queued for the process's publisher (workers/publisher.py), which fences each record
        # by its lease; a refused one flags the lease lost and the next check stops the loop.
        # Backpressure: when the consumer falls behind, steps wait there instead of the stream
        # growing without bound in Redis memory; the wait pauses the budget (the consumer's
        # delay is not the episode's doing).
        self.parts.publisher.publish(self.lease, record.pack(), check=self.check, waited=self.budget.pause,
                                  progress=progress)
        if not self.turned:
            # A completed turn (the env gave a prompt, the model answered, the env stepped) ends
            # the job's failure streak as a completed attempt does: without it, a job whose
            # attempts often fail but get on (a flaky server, the episodes resumed where they
            # stopped) paused after N failures that came between rare completions.
            self.turned = True
            self.parts.pause_watch.succeeded(self.job)

    def finish(self, record: AttemptRecord, new_state: str, **kw) -> bool:
        """Close the attempt once its steps are in the stream (never the close before them).

        Redis errors are retried (``through_outage``, and redis-py's own retry before it): a
        FINISH whose reply was lost and that is sent again finds the episode moved on, so a
        refusal is checked against the ledger (``Ledger.finished_as``: the episode in
        ``new_state`` under this very attempt means the first one landed). Past the outage
        budget it gives up: the sweeper re-runs the episode."""
        lease, ledger = self.lease, self.parts.ledger
        self.parts.publisher.flush(lease)
        record = _encodable(record)

        def finish() -> bool:
            ok = ledger.finish(lease, record, new_state, **kw)
            # A refusal may be our own FINISH seen again: sent once by redis-py's retry or by
            # through_outage after its reply was lost, it ran the first time.
            if not ok and ledger.finished_as(lease, new_state):
                lease.lost.clear()
                return True
            return ok

        try:
            return self._through_outage("recording its end", finish)
        except redis.RedisError as exc:
            log.error("episode %s attempt %d: could not record its end, Redis unreachable (%s); the "
                      "sweeper will re-run it", lease.episode_id, lease.attempt, exc)
            return False

    def _through_outage(self, what: str, fn: Callable):
        return self.parts.through_outage(f"{self.lease.episode_id} attempt {self.lease.attempt}", what, fn)

    # --- closing an attempt that did not complete ------------------------------------
    def close_error(self, exc: errors.EpisodeError, tb: str, *, outage_seen: bool = False,
                    run: Trajectory | None = None) -> str:
        """Close an attempt that did not complete as the close policy (broker/closing.py) says.
        Handed back, an attempt that kept its env instance (``run``) leaves where it stopped for
        the next attempt to continue from."""
        parts, lease, job, base = self.parts, self.lease, self.job, self.base
        message = parts.redact(str(exc.args[0]) if exc.args else "")
        parts.pause_watch.failed(job, lease.episode_id, exc.reason, message)  # counts towards pausing the job (broker/pause.py)
        limit = 0
        if closing.limit_matters(exc):
            limit = self._through_outage("reading its attempt limit", lambda: parts.ledger.attempt_limit(
                lease.job_id, lease.episode_id, job.max_attempts))
        close = closing.decide(exc, lease.attempt, limit, outage_seen, max_attempts=job.max_attempts,
                               retry_on=job.retry_on)
        if close.action == CloseAction.ABANDON:
            log.warning("episode %s attempt %d abandoned: %s", lease.episode_id, lease.attempt, message)
            return errors.LEASE_LOST
        # A cancel a renewal told of while the attempt ended otherwise: nothing would run it again.
        # The loop never drove an instance: the predecessor's, if any, is as the ledger names it.
        untouched = run is None or run.env is None
        if close.action == CloseAction.CANCEL or (
                lease.cancelled.is_set() and close.action in (CloseAction.HAND_BACK, CloseAction.RETRY)):
            if untouched:
                self.orphan_earlier()
            elif run.instance_kept:
                self._close_instance(run)  # kept for a successor that will never come
            return self._close_cancelled(exc, message)
        error_class = type(exc.__cause__ or exc).__name__
        if close.uncounted:  # ended by a server going down (or by what its restart lost), or handed back
            self._through_outage("granting an uncounted attempt", lambda: parts.ledger.grant_extra_attempt(
                lease.job_id, lease.episode_id, job.max_attempts))
        if close.action == CloseAction.HAND_BACK:
            record = AttemptRecord(**base, status=AttemptStatus.ABANDONED, reason=exc.reason, error_class=error_class,
                                   error=message)
            kept = untouched or run.instance_kept
            # where it stands between calls; None keeps the ledger's snapshot as it is
            at_rest = run.track.at_rest() if kept and run is not None and run.track is not None else None
            if self.finish(record, LedgerState.QUEUED, keep_progress=kept, progress=at_rest):
                parts.requeue([(lease.job_id, lease.episode_id, parts.settings.queue_for(self.spec))])
            elif kept and not untouched and not self._keeps_instance(
                    run, errors.EpisodeError(errors.LEASE_LOST, "taken over")):
                self._close_instance(run)  # taken over before it could hand back, and nobody knows of it
            return errors.WORKER_SHUTDOWN
        message = close.message(exc, message, lease.attempt)
        if untouched:
            self.orphan_earlier()  # its close drops the snapshot that names them: nobody else would close them
        if close.action == CloseAction.RETRY:
            record = AttemptRecord(**base, status=AttemptStatus.RETRYING, reason=exc.reason, error_class=error_class,
                                   error=message)
            retry_at = time.time() + retry_delay(parts.settings, lease.attempt)
            self.finish(record, LedgerState.RETRYING, retry_at=retry_at)
            log.warning("episode %s attempt %d/%d failed (%s); retrying", lease.episode_id, lease.attempt,
                        close.limit, exc)
            return AttemptStatus.RETRYING
        return self.close_failed(exc, tb, message=message, error_class=error_class)

    def _close_cancelled(self, exc: errors.EpisodeError, message: str) -> str:
        """The job was cancelled (broker/cancel.py): the episode ends ``cancelled``, the attempt
        neither failed nor counted, no dead letter; its env instance is closed already (by the
        loop, or by :meth:`close_error` where the loop had kept it for a successor)."""
        lease = self.lease
        if exc.reason != errors.CANCELLED:
            message = f"its job was cancelled (interactor cancel); the attempt had ended with {exc.reason}: {message}"
        record = AttemptRecord(**self.base, status=AttemptStatus.CANCELLED, reason=errors.CANCELLED,
                               error_class="JobCancelled", error=message)
        if self.finish(record, LedgerState.CANCELLED):
            log.info("episode %s attempt %d stopped: its job was cancelled", lease.episode_id, lease.attempt)
        return AttemptStatus.CANCELLED

    def close_failed(self, exc, tb, *, message=None, error_class=None) -> str:
        lease, redact = self.lease, self.parts.redact
        message = redact(message if message is not None else str(exc.args[0]))
        error_class = error_class or type(exc).__name__
        record = AttemptRecord(**self.base, status=AttemptStatus.FAILED, reason=exc.reason, error_class=error_class,
                               error=message)
        letter = closing.dead_letter(record, self.spec, traceback=redact(tb))
        self.finish(record, LedgerState.FAILED, dead_letter=letter)
        log.error("episode %s attempt %d dead-lettered: %s: %s", lease.episode_id, lease.attempt, exc.reason, message)
        return AttemptStatus.FAILED


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-6))[-4000:]


def _encodable(record: AttemptRecord) -> AttemptRecord:
    """The record, or a copy whose ``last_info`` was replaced if it cannot be packed (an env
    that put an unencodable value there must not throw out of the close path, which would
    leave the attempt unrecorded)."""
    try:
        record.pack()
        return record
    except Exception as exc:  # noqa: BLE001 - msgpack raises OverflowError, UnicodeEncodeError, TypeError...
        log.warning("episode %s: the env's last info cannot be stored (%s: %s); replaced by a note",
                    record.episode_id, type(exc).__name__, exc)
        return dataclasses.replace(record, last_info={"_unencodable": f"{type(exc).__name__}: {exc}"[:300]})
