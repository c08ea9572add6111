"""The env instance an attempt drives and the trajectory its steps are recorded under.

An attempt (workers/attempt.py) runs its episode on its predecessor's instance, continued from
the ledger's snapshot (broker/resume.py decides), or on its own, from a fresh reset. This module
builds the env port for that instance, the loop's config and progress track, runs the step loop
(workers/loop.py), and knows whether the instance outlives the attempt.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import redis

from broker import errors
from broker.records import Progress, StepRecord
from workers.loop import EpisodeOutcome, LoopConfig, PhaseTimings, run_episode
from workers.progress import ProgressTrack

if TYPE_CHECKING:
    from workers.attempt import Attempt

log = logging.getLogger("interactor.worker")


class Trajectory:
    """One trajectory of an attempt: its predecessor's (``resume_from``, same instance, same
    trajectory key) or its own. ``resumable``: the job keeps progress snapshots for a successor.
    ``supersedes``: the ledger holds another trajectory's snapshot, which a fresh one replaces
    with its own before its reset (see :meth:`ProgressTrack.supersede`)."""

    def __init__(self, attempt: "Attempt", resume_from: Progress | None, resumable: bool, supersedes: bool = False):
        self.attempt = attempt
        lease = attempt.lease
        self.resume_from = resume_from
        self.supersedes = supersedes and resume_from is None
        number, attempt_id = resume_from.trajectory_key if resume_from else (lease.attempt, lease.attempt_id)
        self.key = (number, attempt_id)
        #: AttemptRecord.trajectory: "" when it is the attempt's own
        self.recorded_under = f"{number}:{attempt_id}" if resume_from else ""
        self.resumed_at = resume_from.step if resume_from else 0
        self.published = 0  # steps this attempt recorded on the trajectory
        self.env = None  # its env port, once the loop runs
        # Whether the instance outlives this attempt, as the loop decided at its end; until the
        # loop has run, a continued instance is still its predecessor's to hand on, untouched.
        self.instance_kept = resume_from is not None
        # A job that caps live instances (max_instances) counts them by the slots the attempts
        # driving them hold: an instance between attempts would hold none, so it is never handed
        # on (closed instead; the successor starts afresh) - see keeps_instance.
        self.instance_capped = False
        self.track = ProgressTrack(f"{number}:{attempt_id}", lease.attempt_id, attempt.mark,
                                   resume=resume_from) if resumable else None

    def episode(self, policy, hook, timings: PhaseTimings) -> EpisodeOutcome:
        a = self.attempt
        spec, job = a.spec, a.job
        env = a.env_port(self.key)
        policy, env = a.fleet_capped(policy, env)
        self.env = env
        self.instance_capped = bool(getattr(env, "instance_caps", None))
        if self.resume_from is not None and self.instance_capped:
            env.adopt()  # a predecessor's live instance: counted before any call on it
        if self.track is not None and self.supersedes:
            self.track.supersede()
        cfg = LoopConfig(job_id=job.job_id, episode_id=spec.episode_id, env_name=spec.env_name,
                         group_id=spec.group_id, llm_model=job.model, attempt=self.key[0],
                         max_steps=job.max_steps, message_cut=job.message_cut, attempt_id=self.key[1])
        return run_episode(cfg, env=env, policy=policy, publish=self._publish, hook=hook, check=a.check,
                           timings=timings, track=self.track, keeps_instance=self._kept_at_end, fault=a.rt.fault)

    def close_instance(self) -> None:
        """Close the instance the loop kept (or, before the loop ran, the predecessor's it was
        to continue): its attempt ends the trajectory after all."""
        env = self.env if self.env is not None else self.attempt.env_port(self.key)
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - best effort, as every close
                log.exception("episode %s: closing the env failed (ignored)", self.attempt.lease.episode_id)

    def _publish(self, record: StepRecord, progress: Progress | None = None) -> None:
        self.published += 1
        self.attempt.publish(record, progress)

    def _kept_at_end(self, error: BaseException | None) -> bool:
        """The loop's question at its end; the answer is what the attempt's close goes by."""
        self.instance_kept = self.keeps_instance(error)
        return self.instance_kept

    def keeps_instance(self, error: BaseException | None) -> bool:
        """The env instance outlives this attempt when the episode goes on elsewhere from where
        it stands: the worker hands the episode back (with a snapshot naming it), or the lease
        passed to another attempt while the ledger's snapshot names this trajectory (that
        attempt continues it, or closes it as its predecessor's). Whoever ends the episode closes
        it, once; one nobody would know of (a snapshot Redis lost, or none written yet) is
        closed here, and so is every instance of a job that caps live instances (the slot that
        counts it goes with this attempt; a successor continuing such an instance would find it
        gone and start afresh)."""
        if self.track is None or self.instance_capped or not isinstance(error, errors.EpisodeError):
            return False
        if error.reason == errors.WORKER_SHUTDOWN:
            return True
        if error.reason != errors.LEASE_LOST:
            return False
        lease = self.attempt.lease
        try:
            kept = self.attempt.rt.ledger.progress(lease.job_id, lease.episode_id)
        except redis.RedisError:
            return False  # closing one a successor continues costs it the instance (instance_gone), no more
        return kept is not None and kept.trajectory == self.track.trajectory

    def instance_gone(self, exc: errors.EpisodeError) -> bool:
        """A continued instance the env server no longer has, found at the first call on it."""
        return self.resume_from is not None and not self.published and exc.reason == errors.ENV_INSTANCE_LOST
