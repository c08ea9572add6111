"""One delivery of an episode task: lease, run the loop, close the attempt.

The Celery task is a one-line call into :meth:`WorkerRuntime.run`; everything that decides
what happens to an episode lives here, so it can be driven without Celery in tests.

What an attempt can end as (broker/records.py):
* completed -> ledger ``done``;
* transient failure with attempts left -> ``retrying``; the sweeper enqueues it after a backoff;
* permanent failure, or transient with no attempts left -> ``failed`` + a dead letter;
* shutdown grace over -> ``queued`` again at once (handed back; does not use up an attempt);
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
import os
import random
import socket
import time
import traceback
from typing import Any, Callable

import redis

from broker import closing, errors
from broker.caps import FleetSlots, Limits, server_name
from broker.keys import Keys, env_instance_id, member
from broker.ledger import Lease, Ledger
from broker.queueing import send_episodes
from broker.records import AttemptRecord, EpisodeSpec, JobSpec, StepRecord, new_attempt_id
from broker.pause import PARKED
from broker.ratelimit import RateLimits
from broker.recovery import SweepDuty, Sweeper
from broker.redisconn import connect
from broker.settings import Settings, origin_of, redact_url
from broker.states import AttemptStatus, CloseAction, LedgerState
from broker.urls import url_problem
from envs.base import valid_object_path
from workers import limits
from workers.allowlist import HostAllowlist, env_class_allowlist, hook_allowlist
from workers.breakers import BreakerBoard, BreakerHeartbeat
from workers.budget import Budget
from workers.envclient import EnvClient
from workers.fleetcaps import CappedEnv, CappedPolicy, FleetGate
from workers.hooks import load_hook
from workers.loop import LoopConfig, PhaseTimings, run_episode
from workers.modelclient import ModelClient
from workers.orphans import OrphanCloser
from workers.pacing import Pacing
from workers.pausing import PauseWatch
from workers.ports import BoundEnv, BoundPolicy, Guard, policy_url
from workers.versions import PolicyVersions
from workers.publisher import StepPublisher
from workers.renewer import LeaseRenewer

log = logging.getLogger("interactor.worker")

_FENCE_SLICE_S = 0.05


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
        self.ledger = Ledger.for_settings(self.redis, settings)
        self.env = EnvClient(settings)
        self.model = ModelClient(settings, session=limits.model_session(settings))
        self.model_gate = limits.shared_gate(settings.llm_max_concurrency)  # None: no cap
        self.jitter = limits.FirstWaveJitter.from_settings(settings)
        self.shutdown_at: float | None = None
        # Why this process must be replaced ("" while healthy), and what replaces it: the Celery
        # side sets on_unhealthy to a warm shutdown (workers/tasks.py), the supervisor restarts.
        self.unhealthy_reason = ""
        self.on_unhealthy: Callable[[str], None] | None = None
        self._jobs: dict[str, JobSpec] = {}
        self._untrusted_warned: set[str] = set()
        self._secrets = [s for s in (settings.llm_api_key.reveal(), _redis_password(settings.redis_url)) if s]
        # Trust boundaries: what a job may make this worker import, call and send the key to.
        self.env_classes = env_class_allowlist(settings.env_classes)
        self.hooks = hook_allowlist(settings.episode_hooks, settings.episode_hook)
        self.env_hosts = HostAllowlist(settings.env_hosts)
        self.key_origins = settings.trusted_model_origins()
        self.breakers = BreakerBoard(self.redis, self.keys, self.name, env_hosts=self.env_hosts)
        # Background duties, each on its own thread (broker/duty.py), started together below.
        self.renewer = LeaseRenewer(self.ledger, min(settings.lease_ttl_s / 3, settings.sweep_interval_s))
        self.sweeper = SweepDuty(Sweeper(self.redis, settings), settings.sweep_interval_s)
        self.orphans = OrphanCloser(self.redis, self.keys, self.env, env_hosts=self.env_hosts)
        self.breaker_heartbeat = BreakerHeartbeat(self.breakers)
        self.publisher = StepPublisher(self.ledger, backlog_max=settings.stream_backlog_max)
        self.versions = PolicyVersions(self.redis, self.keys)  # feed jobs' policy versions (workers/versions.py)
        # Fleet-wide limits: jobs that pause themselves, caps shared by every worker process.
        self.pause_watch = PauseWatch(self.redis, self.keys)
        self.pacing = Pacing(RateLimits(self.redis, self.keys))
        self.fleet = FleetGate(FleetSlots(self.redis, self.keys, int(settings.lease_ttl_s * 1000)), self.name,
                               settings.lease_ttl_s)
        # The one list of what runs in the background: the duties, and the parts that start their
        # threads when first needed (publisher, streak resets, fleet-slot keeper); stop() stops
        # them all, in this order.
        duties = [self.renewer, self.sweeper, self.orphans, self.breaker_heartbeat]
        for duty in duties:
            duty.start()
        self.background = [*duties, self.publisher, self.pause_watch, self.fleet]

    # --- lifecycle -------------------------------------------------------------------
    def begin_shutdown(self, grace_s: float | None = None) -> None:
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        at = time.monotonic() + grace
        self.shutdown_at = at if self.shutdown_at is None else min(self.shutdown_at, at)
        log.warning("shutdown: running episodes get %.0fs to finish, then are handed back", grace)

    def unhealthy(self, reason: str) -> None:
        """This process can no longer run its episodes properly (an inproc call that never
        returned holds the process-wide env lock, workers/inproc.py): hand every running episode
        back at once, uncounted (as at shutdown), and have the process replaced."""
        if self.unhealthy_reason:
            return
        self.unhealthy_reason = reason
        log.error("worker process unhealthy: %s; handing its episodes back and exiting to be restarted", reason)
        self.shutdown_at = time.monotonic()
        if self.on_unhealthy is not None:
            self.on_unhealthy(reason)

    def stop(self) -> None:
        for part in self.background:
            part.stop()

    def received(self, job_id: str, episode_id: str) -> None:
        """The broker handed us a task; the renewer holds a reservation on it until it starts."""
        self.renewer.received(member(job_id, episode_id))

    # --- one delivery ----------------------------------------------------------------
    def run(self, job_id: str, episode_id: str) -> str:
        if self._parked(job_id, episode_id):
            self.renewer.started(member(job_id, episode_id))  # handed back before START: nothing counted
            log.info("episode %s: its job is paused; parked until `interactor resume %s`", episode_id, job_id)
            return PARKED
        # START is retried through a Redis outage with one attempt_id: a START that ran but
        # whose reply was lost is then found again as ours, with its predecessor, rather than
        # left behind as a phantom lease that makes the next delivery count another attempt.
        attempt_id = new_attempt_id()
        started = self._through_outage(episode_id, "starting", lambda: self.ledger.start(
            job_id, episode_id, self.name, attempt_id=attempt_id),  # also ends the reservation
            give_up=lambda: self.shutdown_at is not None and time.monotonic() >= self.shutdown_at)
        self.renewer.started(member(job_id, episode_id))
        if started.status != "ok":
            log.info("episode %s: delivery dropped (%s %s)", episode_id, started.status, started.detail)
            return started.status
        lease = started.lease
        self.renewer.hold(lease)
        try:
            return self._run_attempt(lease, started.spec, started.previous)
        finally:
            self.renewer.release(lease)

    def _parked(self, job_id: str, episode_id: str) -> bool:
        try:
            return self.pause_watch.park(self._job(job_id), episode_id)
        except redis.RedisError:
            return False  # START finds out about Redis, through its outage handling

    def _job(self, job_id: str) -> JobSpec | None:
        job = self._jobs.get(job_id)
        if job is None:
            job = self.ledger.job_spec(job_id)
            if job is not None:
                if len(self._jobs) > 256:
                    self._jobs.clear()
                self._jobs[job_id] = job
        return job

    def _run_attempt(self, lease: Lease, spec: EpisodeSpec | None, previous: tuple[int, str] | None = None) -> str:
        t_start = time.time()
        job = self._job(lease.job_id)
        base = dict(job_id=lease.job_id, episode_id=lease.episode_id, attempt=lease.attempt,
                    group_id=spec.group_id if spec else "", group_size=spec.group_size if spec else 0,
                    env_name=spec.env_name if spec else "", llm_model=job.model if job else "",
                    started_at=t_start, worker=self.name, attempt_id=lease.attempt_id)
        if job is None or spec is None:
            err = errors.EpisodeError(errors.BAD_TASK, "job or episode spec missing from the ledger")
            return self._close_failed(lease, base, spec, err, "")
        refused = self._refused(job, spec)
        if refused:
            err = errors.EpisodeError(errors.BAD_TASK, refused, transient=False)
            self.pause_watch.failed(job, lease.episode_id, err.reason, refused)
            return self._close_failed(lease, base, spec, err, "")

        budget = Budget(job.episode_budget_s)
        cfg = LoopConfig(job_id=job.job_id, episode_id=spec.episode_id, env_name=spec.env_name,
                         group_id=spec.group_id, llm_model=job.model, attempt=lease.attempt,
                         max_steps=job.max_steps, message_cut=job.message_cut, attempt_id=lease.attempt_id)
        outcome = None
        timings = PhaseTimings()  # where the attempt's time goes (records v5)
        if lease.attempt == 1:  # later attempts' waits are not timed
            base["queue_wait_s"] = max(0.0, t_start - job.created_at)
        check = lambda: self._check(lease, budget)  # noqa: E731
        guard = Guard(budget, check, self.settings.outage_budget_s)
        try:
            hook = load_hook(job.episode_hook)
            self.jitter.wait(check)  # spreads the first wave so it does not hit the model at once
            if previous is not None:
                self._close_previous(spec, previous)
            policy = BoundPolicy(self.model, job, policy_url(job, spec.episode_id), self._api_key_for(job), budget,
                                 guard, self.breakers.for_model(job.llm_base_url),
                                 pacer=self._pacer(job, check, budget))
            env = self._env_port(spec, lease, budget, guard)
            policy = limits.LimitedPolicy(self.versions.wrap(policy, job.job_id), self.model_gate,
                                          lambda: budget.deadline, check)
            policy, env = self._fleet_capped(job, spec, policy, env, check, budget)
            outcome = run_episode(
                cfg,
                env=env,
                policy=policy,
                publish=lambda rec: self._publish(lease, rec, budget),
                hook=hook,
                check=check,
                timings=timings,
            )
        except errors.EpisodeError as exc:
            base.update(timings.record_fields())
            return self._close_error(lease, base, spec, job, exc, "", outage_seen=guard.outage_seen)
        except redis.RedisError as exc:
            # Redis went away for longer than the client's retries: not the episode's doing.
            base.update(timings.record_fields())
            err = errors.EpisodeError(errors.BROKER_OUTAGE, f"Redis unreachable: {type(exc).__name__}: {exc}",
                                      transient=True, outage=True)
            return self._close_error(lease, base, spec, job, err, "")
        except Exception as exc:
            base.update(timings.record_fields())
            err = errors.EpisodeError(errors.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}", transient=False)
            err.__cause__ = exc
            return self._close_error(lease, base, spec, job, err, self._traceback(exc))

        base.update(timings.record_fields())
        record = AttemptRecord(**base, status=AttemptStatus.COMPLETED, total_reward=outcome.total_reward,
                               steps=outcome.steps, last_info=outcome.last_info, ended_by=outcome.ended_by,
                               prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens)
        if not self._finish(lease, record, LedgerState.DONE):
            log.warning("episode %s attempt %d: lease lost before completion was recorded", spec.episode_id, lease.attempt)
            return errors.LEASE_LOST
        self.pause_watch.succeeded(job)
        log.info("episode %s attempt %d completed: reward=%.3f steps=%d", spec.episode_id, lease.attempt,
                 outcome.total_reward, outcome.steps)
        return AttemptStatus.COMPLETED

    # --- trust boundaries ------------------------------------------------------------
    def _refused(self, job: JobSpec, spec: EpisodeSpec) -> str:
        """Why this worker will not run the episode ("" = it will): code and hosts a job names
        must be on the worker's own allow-lists; nothing is imported before that check. URLs get
        the submit-time check again (broker/urls.py): the job may not have come from our producer."""
        problem = url_problem(job.llm_base_url)
        if problem:
            return f"model endpoint {redact_url(job.llm_base_url)!r}: {problem}; nothing was called"
        if spec.transport != "inproc":
            problem = url_problem(spec.base_url)
            if problem:
                return f"env server {redact_url(spec.base_url)!r}: {problem}; nothing was called"
        if job.episode_hook and not valid_object_path(job.episode_hook):
            return (f"episode hook {job.episode_hook!r} is not 'module:attribute' (one attribute, no dotted "
                    "path); it was not imported")
        if spec.transport == "inproc":
            if not valid_object_path(spec.env_class):
                return (f"env_class {spec.env_class!r} is not 'module:Class' (one attribute, no dotted path); "
                        "it was not imported")
            if not self.env_classes.allows(spec.env_class):
                return (f"env_class {spec.env_class!r} is not on this worker's allow-list "
                        f"(INTERACTOR_ENV_CLASSES: {self.env_classes}); it was not imported")
        elif not self.env_hosts.allows(spec.base_url):
            return (f"env server {redact_url(spec.base_url)} is not on this worker's allow-list "
                    f"(INTERACTOR_ENV_HOSTS: {self.env_hosts})")
        if job.episode_hook and not self.hooks.allows(job.episode_hook):
            return (f"episode hook {job.episode_hook!r} is not on this worker's allow-list "
                    f"(INTERACTOR_EPISODE_HOOKS: {self.hooks}); it was not imported")
        return ""

    def _api_key_for(self, job: JobSpec) -> str:
        """The API key, only for a model endpoint this worker trusts with it (a job may name any
        endpoint; the key must not go to one that would collect it)."""
        key = self.settings.llm_api_key.reveal()
        if key and origin_of(job.llm_base_url) not in self.key_origins:
            if job.job_id not in self._untrusted_warned:
                self._untrusted_warned.add(job.job_id)
                log.warning("job %s: model endpoint %s is not a trusted origin (INTERACTOR_LLM_TRUSTED_ORIGINS); "
                            "its requests go without the API key", job.job_id, redact_url(job.llm_base_url))
            return ""
        return key

    # --- ports -----------------------------------------------------------------------
    def _pacer(self, job: JobSpec, check, budget):
        """The job's model endpoint paced by its fleet-wide rate limits; None when it sets none."""
        if not job.limits:
            return None
        caps = Limits.from_dict(job.limits)
        if not (caps.model_rpm or caps.model_tpm):
            return None
        return self.pacing.pacer(server_name(job.llm_base_url), caps.model_rpm, caps.model_tpm, check, budget)

    def _fleet_capped(self, job: JobSpec, spec: EpisodeSpec, policy, env, check, budget):
        """The ports with the job's fleet-wide caps (workers/fleetcaps.py); as they are when it
        has none (no round trip then)."""
        if not job.limits:
            return policy, env
        caps = Limits.from_dict(job.limits)
        model_caps = caps.model_caps(self.keys, job.llm_base_url)
        if model_caps:
            policy = CappedPolicy(policy, self.fleet, model_caps, check, budget)
        if spec.transport != "inproc":
            call_caps = caps.env_call_caps(self.keys, spec.base_url, spec.env_name)
            instance_caps = caps.env_instance_caps(self.keys, spec.base_url)
            if call_caps or instance_caps:
                env = CappedEnv(env, self.fleet, call_caps, instance_caps, check, budget)
        return policy, env

    def _env_port(self, spec: EpisodeSpec, lease: Lease, budget: Budget, guard: Guard):
        if spec.transport == "inproc":
            from workers.inproc import InprocEnv  # the env class runs inside this worker process

            return InprocEnv(spec, budget, self.settings, on_wedged=self.unhealthy)
        return BoundEnv(self.env, spec, env_instance_id(spec.episode_id, lease.attempt, lease.attempt_id), budget,
                        guard, self.breakers.for_env(spec.base_url))

    def _close_previous(self, spec: EpisodeSpec, previous: tuple[int, str]) -> None:
        """Close the previous attempt's instance: it ended without closing it if its worker died
        (a second close of an instance that is gone is a no-op)."""
        if spec.transport != "inproc" and previous[0] > 0:
            self.env.close(spec.base_url, spec.env_name, env_instance_id(spec.episode_id, *previous))

    def _check(self, lease: Lease, budget: Budget) -> None:
        if lease.lost.is_set():
            raise errors.EpisodeError(errors.LEASE_LOST, "another attempt took over this episode")
        if not lease.valid():
            self._await_renewal(lease, budget)
        if budget.left() <= 0:
            raise errors.EpisodeError(errors.EPISODE_TIMEOUT, "the attempt's wall-clock budget ran out")
        if self.shutdown_at is not None and time.monotonic() >= self.shutdown_at:
            raise errors.EpisodeError(errors.WORKER_SHUTDOWN, "worker shutting down; episode handed back")

    def _await_renewal(self, lease: Lease, budget: Budget) -> None:
        """The lease may have lapsed by this process's clock: call nothing until a renewal says
        whether it is still ours. The wait pauses the attempt's budget (a Redis outage is not the
        episode's doing); past ``outage_budget_s`` the attempt ends as ``broker_outage``."""
        t0 = last = nudged = time.monotonic()
        self.renewer.nudge()
        warned = False
        while not lease.valid():
            if lease.lost.is_set():
                raise errors.EpisodeError(errors.LEASE_LOST, "another attempt took over this episode")
            now = time.monotonic()
            budget.pause(now - last)
            last = now
            if now - t0 > self.settings.outage_budget_s:
                raise errors.EpisodeError(errors.BROKER_OUTAGE, f"lease not renewed for {now - t0:.0f}s: Redis "
                                          "unreachable past the outage budget", transient=True, outage=True)
            if not warned and now - t0 > 5:
                warned = True
                log.warning("episode %s: lease not renewed in time (Redis slow or unreachable, or this process "
                            "stalled); waiting before any further call", lease.episode_id)
            if now - nudged > 1.0:
                nudged = now
                self.renewer.nudge()
            time.sleep(_FENCE_SLICE_S)

    def _publish(self, lease: Lease, record: StepRecord, budget: Budget) -> None:
        # Queued for the process's publisher (workers/publisher.py), which fences each record
        # by its lease; a refused one flags the lease lost and the next check stops the loop.
        # Backpressure: when the consumer falls behind, steps wait there instead of the stream
        # growing without bound in Redis memory; the wait pauses the budget (the consumer's
        # delay is not the episode's doing).
        self.publisher.publish(lease, record.pack(), check=lambda: self._check(lease, budget), waited=budget.pause)

    def _finish(self, lease: Lease, record: AttemptRecord, new_state: str, **kw) -> bool:
        """Close the attempt once its steps are in the stream (never the close before them).

        Redis errors are retried (``_through_outage``, and redis-py's own retry before it): a
        FINISH whose reply was lost and that is sent again finds the episode moved on, so a
        refusal is checked against the ledger (``Ledger.finished_as``: the episode in
        ``new_state`` under this very attempt means the first one landed). Past the outage
        budget it gives up: the sweeper re-runs the episode."""
        self.publisher.flush(lease)
        record = _encodable(record)

        def finish() -> bool:
            ok = self.ledger.finish(lease, record, new_state, **kw)
            # A refusal may be our own FINISH seen again: sent once by redis-py's retry or by
            # _through_outage after its reply was lost, it ran the first time.
            if not ok and self.ledger.finished_as(lease, new_state):
                lease.lost.clear()
                return True
            return ok

        try:
            return self._through_outage(lease, "recording its end", finish)
        except redis.RedisError as exc:
            log.error("episode %s attempt %d: could not record its end, Redis unreachable (%s); the "
                      "sweeper will re-run it", lease.episode_id, lease.attempt, exc)
            return False

    def _through_outage(self, lease: Lease | str, what: str, fn: Callable[[], Any],
                        give_up: Callable[[], bool] = lambda: False) -> Any:
        """``fn()``, retried with backoff on Redis errors for up to the outage budget (then the
        last error is raised): closing an attempt must outlast a Redis restart, or the episode
        would be reclaimed as a lost worker, an attempt counted against it for our outage.
        ``lease`` (or the episode id, before there is one) names it in the log; ``give_up()``
        true ends the retries early (the last error is raised)."""
        name = lease if isinstance(lease, str) else f"{lease.episode_id} attempt {lease.attempt}"
        t0, delay = time.monotonic(), 0.1
        while True:
            try:
                return fn()
            except redis.RedisError as exc:
                if time.monotonic() - t0 > self.settings.outage_budget_s or give_up():
                    raise
                log.warning("episode %s: %s failed (%s); retrying", name, what, exc)
                time.sleep(delay)
                delay = min(5.0, delay * 2)

    # --- closing an attempt that did not complete ------------------------------------
    def _close_error(self, lease, base, spec, job, exc: errors.EpisodeError, tb: str, *, outage_seen: bool = False) -> str:
        """Close an attempt that did not complete as the close policy (broker/closing.py) says."""
        message = self._redact(str(exc.args[0]) if exc.args else "")
        self.pause_watch.failed(job, lease.episode_id, exc.reason, message)  # counts towards pausing the job (broker/pause.py)
        limit = 0
        if closing.limit_matters(exc):
            limit = self._through_outage(lease, "reading its attempt limit", lambda: self.ledger.attempt_limit(
                lease.job_id, lease.episode_id, job.max_attempts))
        close = closing.decide(exc, lease.attempt, limit, outage_seen, max_attempts=job.max_attempts)
        if close.action == CloseAction.ABANDON:
            log.warning("episode %s attempt %d abandoned: %s", lease.episode_id, lease.attempt, message)
            return errors.LEASE_LOST
        error_class = type(exc.__cause__ or exc).__name__
        if close.uncounted:  # ended by a server going down (or by what its restart lost), or handed back
            self._through_outage(lease, "granting an uncounted attempt", lambda: self.ledger.grant_extra_attempt(
                lease.job_id, lease.episode_id, job.max_attempts))
        if close.action == CloseAction.HAND_BACK:
            record = AttemptRecord(**base, status=AttemptStatus.ABANDONED, reason=exc.reason, error_class=error_class, error=message)
            if self._finish(lease, record, LedgerState.QUEUED):
                send_episodes(self.redis, [(lease.job_id, lease.episode_id, self.settings.queue_for(spec))])
            return errors.WORKER_SHUTDOWN
        message = close.message(exc, message, lease.attempt)
        if close.action == CloseAction.RETRY:
            record = AttemptRecord(**base, status=AttemptStatus.RETRYING, reason=exc.reason, error_class=error_class,
                                   error=message)
            retry_at = time.time() + retry_delay(self.settings, lease.attempt)
            self._finish(lease, record, LedgerState.RETRYING, retry_at=retry_at)
            log.warning("episode %s attempt %d/%d failed (%s); retrying", lease.episode_id, lease.attempt,
                        close.limit, exc)
            return AttemptStatus.RETRYING
        return self._close_failed(lease, base, spec, exc, tb, message=message, error_class=error_class)

    def _close_failed(self, lease, base, spec, exc, tb, *, message=None, error_class=None) -> str:
        message = self._redact(message if message is not None else str(exc.args[0]))
        error_class = error_class or type(exc).__name__
        record = AttemptRecord(**base, status=AttemptStatus.FAILED, reason=exc.reason, error_class=error_class, error=message)
        letter = closing.dead_letter(record, spec, traceback=self._redact(tb))
        self._finish(lease, record, LedgerState.FAILED, dead_letter=letter)
        log.error("episode %s attempt %d dead-lettered: %s: %s", lease.episode_id, lease.attempt, exc.reason, message)
        return AttemptStatus.FAILED

    def _traceback(self, exc: BaseException) -> str:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-6))[-4000:]

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


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


def _redis_password(url: str) -> str:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).password or ""
    except ValueError:
        return ""

