"""A worker process's runtime: its connections, clients, allow-lists and background duties,
its lifecycle (shutdown, unhealthy), and the delivery of one episode task: START in the ledger,
then an :class:`~workers.attempt.Attempt` runs and closes it (workers/attempt.py), handed the
parts of this process it uses (:class:`~workers.attempt_parts.AttemptParts`, built once here).

The Celery task is a one-line call into :meth:`WorkerRuntime.run`; everything that decides
what happens to an episode lives here and in workers/attempt.py, so it can be driven without
Celery in tests.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable

import redis

from broker.cache import ResponseCache
from broker.caps import FleetSlots
from broker.keys import Keys, member
from broker.ledger import Ledger
from broker.queueing import push_episodes
from broker.records import JobSpec, new_attempt_id
from broker.ratelimit import RateLimits
from broker.recovery import SweepDuty, Sweeper
from broker.redisconn import connect
from broker.redisurl import redis_password
from broker.settings import Settings
from broker.states import StartStatus
from workers import faults, limits
from workers.allowlist import TrustBoundary
from workers.attempt import Attempt
from workers.attempt_parts import AttemptParts, through_outage
from workers.breakers import BreakerBoard, BreakerHeartbeat
from workers.envclient import EnvClient
from workers.fleetcaps import FleetGate
from workers.modelclient import ModelClient
from workers.orphans import OrphanCloser
from workers.pacing import Pacing
from workers.pausing import PauseWatch
from workers.versions import PolicyVersions
from workers.publisher import StepPublisher
from workers.renewer import LeaseRenewer

log = logging.getLogger("interactor.worker")


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
        # the step loop's fault port: a no-op but in the tests that stop a worker at a chosen point
        # (stopped there: as an unhealthy process is, every episode handed back at its next check,
        # and under Celery the process replaced)
        self.fault = faults.armed(settings.fault_point, lambda: self.unhealthy("stopped at a fault point (tests)"))
        # Why this process must be replaced ("" while healthy), and what replaces it: the Celery
        # side sets on_unhealthy to a warm shutdown (workers/tasks.py), the supervisor restarts.
        self.unhealthy_reason = ""
        self.on_unhealthy: Callable[[str], None] | None = None
        self._jobs: dict[str, JobSpec] = {}
        self._secrets = [s for s in (settings.llm_api_key.reveal(), redis_password(settings.redis_url),
                                     settings.redis_sentinel_password.reveal()) if s]
        # Trust boundaries: what a job may make this worker import, call and send the key to.
        self.trust = TrustBoundary(settings)
        self.breakers = BreakerBoard(self.redis, self.keys, self.name, env_hosts=self.trust.env_hosts)
        # Background duties, each on its own thread (broker/duty.py), started together below.
        self.renewer = LeaseRenewer(self.ledger, settings.renewal_interval_s)
        self.sweeper = SweepDuty(Sweeper(self.redis, settings), settings.sweep_interval_s)
        self.orphans = OrphanCloser(self.redis, self.keys, self.env, env_hosts=self.trust.env_hosts)
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
        # What an attempt uses of this process, and nothing more (workers/attempt_parts.py).
        self.parts = AttemptParts(
            settings=settings, worker=self.name, ledger=self.ledger, publisher=self.publisher,
            renewer=self.renewer, pause_watch=self.pause_watch, trust=self.trust, breakers=self.breakers,
            env=self.env, model=self.model, model_gate=self.model_gate, jitter=self.jitter, pacing=self.pacing,
            fleet=self.fleet, versions=self.versions, keys=self.keys,
            queue_orphans=lambda entries: self.redis.rpush(self.keys.orphans, *entries),
            requeue=lambda episodes: push_episodes(self.redis, episodes), fault=self.fault,
            shutting_down=self.shutting_down, unhealthy=self.unhealthy, redact=self.redact,
            cache=ResponseCache(self.redis, self.keys, settings.cache_max_entries))

    # --- lifecycle -------------------------------------------------------------------
    def begin_shutdown(self, grace_s: float | None = None) -> None:
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        at = time.monotonic() + grace
        self.shutdown_at = at if self.shutdown_at is None else min(self.shutdown_at, at)
        log.warning("shutdown: running episodes get %.0fs to finish, then are handed back", grace)

    def shutting_down(self) -> bool:
        """The shutdown grace is over: running episodes are handed back at their next check."""
        return self.shutdown_at is not None and time.monotonic() >= self.shutdown_at

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
        try:
            if self._parked(job_id, episode_id):
                log.info("episode %s: its job is paused; parked until `interactor resume %s`", episode_id, job_id)
                return StartStatus.PARKED  # handed back before START: nothing counted
            # START is retried through a Redis outage with one attempt_id: a START that ran but
            # whose reply was lost is then found again as ours, with its predecessor, rather than
            # left behind as a phantom lease that makes the next delivery count another attempt.
            attempt_id = new_attempt_id()
            started = through_outage(self.settings.outage_budget_s, episode_id, "starting", lambda: self.ledger.start(
                job_id, episode_id, self.name, attempt_id=attempt_id),  # also ends the reservation
                give_up=self.shutting_down)
        finally:
            # Whatever happened before START (parked, started, or raised: a job spec this worker
            # cannot read, Redis gone), the delivery is out of this process's hands: a
            # reservation renewed past here would keep the episode from the sweeper's re-send
            # for as long as the process lives.
            self.renewer.started(member(job_id, episode_id))
        if started.status != StartStatus.OK:
            log.info("episode %s: delivery dropped (%s %s)", episode_id, started.status, started.detail)
            return started.status
        lease = started.lease
        self.renewer.hold(lease)
        try:
            return Attempt(self.parts, lease, started.spec, self._job(lease.job_id), started.earlier,
                           started.progress, started.outage_since_progress).run()
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

    def redact(self, text: str) -> str:
        """``text`` with this process's secrets (API key, Redis passwords) starred out."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text
