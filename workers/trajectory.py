"""The trajectory an attempt's steps are recorded under, and what is known of its env instance.

An attempt (workers/attempt.py) runs its episode on its predecessor's instance, continued from
the ledger's snapshot (broker/resume.py decides), or on its own, from a fresh reset. A
:class:`Trajectory` holds which (its key, where it resumes, its progress track) and what the
attempt learns while it drives it (its env port, whether the instance outlives the attempt);
the attempt drives it and asks nothing back.
"""

from __future__ import annotations

from typing import Any, Callable

from broker import errors
from broker.lease import Lease
from broker.records import EpisodeSpec, JobSpec, Progress
from workers.loop import LoopConfig
from workers.progress import ProgressTrack


class Trajectory:
    """One trajectory of an attempt: its predecessor's (``resume_from``, same instance, same
    trajectory key) or its own. ``resumable``: the job keeps progress snapshots for a successor,
    written through ``mark``. ``supersedes``: the ledger holds another trajectory's snapshot,
    which a fresh one replaces with its own before its reset (see :meth:`ProgressTrack.supersede`)."""

    def __init__(self, lease: Lease, resume_from: Progress | None, resumable: bool,
                 mark: Callable[[Progress, bool], None], supersedes: bool = False):
        self.resume_from = resume_from
        self.supersedes = supersedes and resume_from is None
        number, attempt_id = resume_from.trajectory_key if resume_from else (lease.attempt, lease.attempt_id)
        self.key = (number, attempt_id)
        #: AttemptRecord.trajectory: "" when it is the attempt's own
        self.recorded_under = f"{number}:{attempt_id}" if resume_from else ""
        self.resumed_at = resume_from.step if resume_from else 0
        self.published = 0  # steps this attempt recorded on the trajectory
        self.env: Any = None  # its env port, once the loop runs
        # Whether the instance outlives this attempt, as the loop decided at its end; until the
        # loop has run, a continued instance is still its predecessor's to hand on, untouched.
        self.instance_kept = resume_from is not None
        # A job that caps live instances (max_instances) counts them by the slots the attempts
        # driving them hold: an instance between attempts would hold none, so it is never handed
        # on (closed instead; the successor starts afresh).
        self.instance_capped = False
        self.track = ProgressTrack(f"{number}:{attempt_id}", lease.attempt_id, mark,
                                   resume=resume_from) if resumable else None

    def loop_config(self, job: JobSpec, spec: EpisodeSpec) -> LoopConfig:
        return LoopConfig(job_id=job.job_id, episode_id=spec.episode_id, env_name=spec.env_name,
                          group_id=spec.group_id, llm_model=job.model, attempt=self.key[0],
                          max_steps=job.max_steps, message_cut=job.message_cut, attempt_id=self.key[1])

    def driven_by(self, env: Any) -> None:
        """The loop is about to drive ``env``; a predecessor's live instance of a job that caps
        instances is counted before any call on it."""
        self.env = env
        self.instance_capped = bool(getattr(env, "instance_caps", None))
        if self.resume_from is not None and self.instance_capped:
            env.adopt()
        if self.track is not None and self.supersedes:
            self.track.supersede()

    def handed_on_when(self, error: BaseException | None) -> bool | None:
        """Whether the instance outlives the attempt, where the error alone decides; None when it
        depends on whose trajectory the ledger's snapshot names (the lease passed on)."""
        if self.track is None or self.instance_capped or not isinstance(error, errors.EpisodeError):
            return False
        if error.reason == errors.WORKER_SHUTDOWN:
            return True
        if error.reason != errors.LEASE_LOST:
            return False
        return None

    def instance_gone(self, exc: errors.EpisodeError) -> bool:
        """A continued instance the env server no longer has, found at the first call on it."""
        return self.resume_from is not None and not self.published and exc.reason == errors.ENV_INSTANCE_LOST
