"""One delivery of an episode task: lease, run the loop, close the attempt.

The Celery task is a one-line call into :meth:`WorkerRuntime.run`; everything that decides
what happens to an episode lives here, so it can be driven without Celery in tests.

What an attempt can end as (broker/records.py):
* completed -> ledger ``done``;
* transient failure with attempts left -> ``retrying``; the sweeper enqueues it after a backoff;
* permanent failure, or transient with no attempts left -> ``failed`` + a dead letter;
* shutdown grace over -> ``queued`` again at once (handed back; does not use up an attempt);
* lease lost -> nothing: whoever holds the lease now owns the episode.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import traceback
from dataclasses import dataclass

from broker import errors
from broker.keys import Keys, member
from broker.ledger import Lease, Ledger
from broker.queueing import send_episodes
from broker.records import (
    ABANDONED,
    ATTEMPT_FAILED,
    ATTEMPT_RETRYING,
    COMPLETED,
    DONE,
    FAILED,
    QUEUED,
    RETRYING,
    AttemptRecord,
    DeadLetter,
    EpisodeSpec,
    JobSpec,
    StepRecord,
)
from broker.recovery import SweepDuty, Sweeper
from broker.redisconn import connect
from broker.settings import Settings
from workers import limits
from workers.envclient import EnvClient
from workers.hooks import load_hook
from workers.loop import LoopConfig, run_episode
from workers.modelclient import ModelClient
from workers.publisher import StepPublisher
from workers.renewer import LeaseRenewer

log = logging.getLogger("interactor.worker")


@dataclass
class BoundEnv:
    """The env port of the loop: one instance on one server, under one deadline."""

    client: EnvClient
    spec: EpisodeSpec
    deadline: float

    def reset(self):
        s = self.spec
        return self.client.reset(s.base_url, s.env_name, s.episode_id, s.env_params, s.seed, deadline=self.deadline)

    def get_task_prompt(self):
        s = self.spec
        return self.client.get_task_prompt(s.base_url, s.env_name, s.episode_id, deadline=self.deadline)

    def step(self, action: str):
        s = self.spec
        return self.client.step(s.base_url, s.env_name, s.episode_id, action, deadline=self.deadline)

    def close(self) -> None:
        s = self.spec
        self.client.close(s.base_url, s.env_name, s.episode_id)


@dataclass
class BoundPolicy:
    client: ModelClient
    job: JobSpec
    base_url: str
    api_key: str
    deadline: float

    def complete(self, messages: list[dict]):
        j = self.job
        return self.client.complete(self.base_url, messages, model=j.model, temperature=j.temperature,
                                    params=j.llm_params, deadline=self.deadline, api_key=self.api_key)


def policy_url(job: JobSpec, episode_id: str) -> str:
    root = job.llm_base_url.rstrip("/")
    return f"{root}/{episode_id}" if job.session_routing else root


def retry_delay(settings: Settings, attempt: int) -> float:
    """Capped exponential backoff with full jitter between attempts of one episode."""
    cap = min(settings.retry_backoff_max_s, settings.retry_backoff_initial_s * (2 ** (attempt - 1)))
    return random.uniform(cap / 2, cap)


class WorkerRuntime:
    """Per-process state: connections, clients, live leases and the shutdown clock."""

    def __init__(self, settings: Settings, name: str | None = None):
        self.settings = settings
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.redis = connect(settings)
        self.keys = Keys(settings.key_prefix)
        self.ledger = Ledger(self.redis, self.keys, settings.lease_ttl_s)
        self.env = EnvClient(settings)
        self.model = ModelClient(settings, session=limits.model_session(settings))
        self.model_gate = limits.shared_gate(settings.llm_max_concurrency)  # None: no cap
        self.jitter = limits.FirstWaveJitter.from_settings(settings)
        self.shutdown_at: float | None = None
        self._jobs: dict[str, JobSpec] = {}
        self._secrets = [s for s in (settings.llm_api_key.reveal(), _redis_password(settings.redis_url)) if s]
        # Background duties, each on its own thread (broker/duty.py).
        self.renewer = LeaseRenewer(self.ledger, min(settings.lease_ttl_s / 3, settings.sweep_interval_s)).start()
        self.sweeper = SweepDuty(Sweeper(self.redis, settings), settings.sweep_interval_s).start()
        self.publisher = StepPublisher(self.ledger, backlog_max=settings.stream_backlog_max)

    # --- lifecycle -------------------------------------------------------------------
    def begin_shutdown(self, grace_s: float | None = None) -> None:
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        self.shutdown_at = time.monotonic() + grace
        log.warning("shutdown: running episodes get %.0fs to finish, then are handed back", grace)

    def stop(self) -> None:
        self.renewer.stop()
        self.sweeper.stop()
        self.publisher.stop()

    def received(self, job_id: str, episode_id: str) -> None:
        """The broker handed us a task; the renewer holds a reservation on it until it starts."""
        self.renewer.received(member(job_id, episode_id))

    # --- one delivery ----------------------------------------------------------------
    def run(self, job_id: str, episode_id: str) -> str:
        started = self.ledger.start(job_id, episode_id, self.name)  # also ends the reservation
        self.renewer.started(member(job_id, episode_id))
        if started.status != "ok":
            log.info("episode %s: delivery dropped (%s %s)", episode_id, started.status, started.detail)
            return started.status
        lease = started.lease
        self.renewer.hold(lease)
        try:
            return self._run_attempt(lease, started.spec)
        finally:
            self.renewer.release(lease)

    def _job(self, job_id: str) -> JobSpec | None:
        job = self._jobs.get(job_id)
        if job is None:
            job = self.ledger.job_spec(job_id)
            if job is not None:
                if len(self._jobs) > 256:
                    self._jobs.clear()
                self._jobs[job_id] = job
        return job

    def _run_attempt(self, lease: Lease, spec: EpisodeSpec | None) -> str:
        t_start = time.time()
        job = self._job(lease.job_id)
        base = dict(job_id=lease.job_id, episode_id=lease.episode_id, attempt=lease.attempt,
                    group_id=spec.group_id if spec else "", group_size=spec.group_size if spec else 0,
                    env_name=spec.env_name if spec else "", llm_model=job.model if job else "",
                    started_at=t_start, worker=self.name, attempt_id=lease.attempt_id)
        if job is None or spec is None:
            err = errors.EpisodeError(errors.BAD_TASK, "job or episode spec missing from the ledger")
            return self._close_failed(lease, base, spec, err, "", limit=lease.attempt)

        deadline = time.monotonic() + job.episode_budget_s
        cfg = LoopConfig(job_id=job.job_id, episode_id=spec.episode_id, env_name=spec.env_name,
                         group_id=spec.group_id, llm_model=job.model, attempt=lease.attempt,
                         max_steps=job.max_steps, message_cut=job.message_cut, attempt_id=lease.attempt_id)
        outcome = None
        check = lambda: self._check(lease, deadline)  # noqa: E731
        try:
            hook = load_hook(job.episode_hook)
            self.jitter.wait(check)  # spreads the first wave so it does not hit the model at once
            policy = BoundPolicy(self.model, job, policy_url(job, spec.episode_id),
                                 self.settings.llm_api_key.reveal(), deadline)
            outcome = run_episode(
                cfg,
                env=self._env_port(spec, deadline),
                policy=limits.LimitedPolicy(policy, self.model_gate, deadline, check),
                publish=lambda rec: self._publish(lease, rec, deadline),
                hook=hook,
                check=check,
            )
        except errors.EpisodeError as exc:
            return self._close_error(lease, base, spec, job, exc, "")
        except Exception as exc:
            err = errors.EpisodeError(errors.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}", transient=False)
            err.__cause__ = exc
            return self._close_error(lease, base, spec, job, err, self._traceback(exc))

        record = AttemptRecord(**base, status=COMPLETED, total_reward=outcome.total_reward,
                               steps=outcome.steps, last_info=outcome.last_info, ended_by=outcome.ended_by,
                               prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens)
        if not self._finish(lease, record, DONE):
            log.warning("episode %s attempt %d: lease lost before completion was recorded", spec.episode_id, lease.attempt)
            return errors.LEASE_LOST
        log.info("episode %s attempt %d completed: reward=%.3f steps=%d", spec.episode_id, lease.attempt,
                 outcome.total_reward, outcome.steps)
        return COMPLETED

    def _env_port(self, spec: EpisodeSpec, deadline: float):
        if spec.transport == "inproc":
            from workers.inproc import InprocEnv  # the env class runs inside this worker process

            return InprocEnv(spec, deadline, self.settings)
        return BoundEnv(self.env, spec, deadline)

    def _check(self, lease: Lease, deadline: float) -> None:
        if lease.lost.is_set():
            raise errors.EpisodeError(errors.LEASE_LOST, "another attempt took over this episode")
        now = time.monotonic()
        if now >= deadline:
            raise errors.EpisodeError(errors.EPISODE_TIMEOUT, "the attempt's wall-clock budget ran out")
        if self.shutdown_at is not None and now >= self.shutdown_at:
            raise errors.EpisodeError(errors.WORKER_SHUTDOWN, "worker shutting down; episode handed back")

    def _publish(self, lease: Lease, record: StepRecord, deadline: float) -> None:
        # Queued for the process's publisher (workers/publisher.py), which fences each record
        # by its lease; a refused one flags the lease lost and the next check stops the loop.
        # Backpressure: when the consumer falls behind, steps wait there instead of the stream
        # growing without bound in Redis memory.
        self.publisher.publish(lease, record.pack(), check=lambda: self._check(lease, deadline))

    def _finish(self, lease: Lease, record: AttemptRecord, new_state: str, **kw) -> bool:
        """Close the attempt once its steps are in the stream (never the close before them)."""
        self.publisher.flush(lease)
        return self.ledger.finish(lease, record, new_state, **kw)

    # --- closing an attempt that did not complete ------------------------------------
    def _close_error(self, lease, base, spec, job, exc: errors.EpisodeError, tb: str) -> str:
        message = self._redact(str(exc.args[0]) if exc.args else "")
        if exc.reason == errors.LEASE_LOST:
            log.warning("episode %s attempt %d abandoned: %s", lease.episode_id, lease.attempt, message)
            return errors.LEASE_LOST
        error_class = type(exc.__cause__ or exc).__name__
        if exc.reason == errors.WORKER_SHUTDOWN:
            record = AttemptRecord(**base, status=ABANDONED, reason=exc.reason, error_class=error_class, error=message)
            self.ledger.grant_extra_attempt(lease.job_id, lease.episode_id, job.max_attempts)
            if self._finish(lease, record, QUEUED):
                send_episodes(self.redis, [(lease.job_id, lease.episode_id, spec.queue or self.settings.queue)])
            return errors.WORKER_SHUTDOWN
        limit = self.ledger.attempt_limit(lease.job_id, lease.episode_id, job.max_attempts)
        if exc.transient and lease.attempt < limit:
            record = AttemptRecord(**base, status=ATTEMPT_RETRYING, reason=exc.reason, error_class=error_class,
                                   error=message)
            retry_at = time.time() + retry_delay(self.settings, lease.attempt)
            self._finish(lease, record, RETRYING, retry_at=retry_at)
            log.warning("episode %s attempt %d/%d failed (%s); retrying", lease.episode_id, lease.attempt, limit, exc)
            return ATTEMPT_RETRYING
        if exc.transient:
            message = f"{message} (after {lease.attempt} attempts)"
        return self._close_failed(lease, base, spec, exc, tb, limit=limit, message=message, error_class=error_class)

    def _close_failed(self, lease, base, spec, exc, tb, *, limit, message=None, error_class=None) -> str:
        message = self._redact(message if message is not None else str(exc.args[0]))
        error_class = error_class or type(exc).__name__
        record = AttemptRecord(**base, status=ATTEMPT_FAILED, reason=exc.reason, error_class=error_class, error=message)
        letter = DeadLetter(job_id=lease.job_id, episode_id=lease.episode_id, group_id=base["group_id"],
                            env_name=base["env_name"], reason=exc.reason, error_class=error_class, error=message,
                            traceback=self._redact(tb), attempts=lease.attempt,
                            spec=spec.to_dict() if spec else {}, first_attempt_at=base["started_at"])
        self._finish(lease, record, FAILED, dead_letter=letter)
        log.error("episode %s attempt %d dead-lettered: %s: %s", lease.episode_id, lease.attempt, exc.reason, message)
        return ATTEMPT_FAILED

    def _traceback(self, exc: BaseException) -> str:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-6))[-4000:]

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


def _redis_password(url: str) -> str:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).password or ""
    except ValueError:
        return ""

