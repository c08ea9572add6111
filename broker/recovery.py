"""Bringing episodes back: dead workers' leases, due retries, and reconcile.

A killed worker's Celery message only returns after the broker's visibility timeout, which is
longer than the episode budget (hours). Its lease expires within ``lease_ttl_s`` instead, and
the sweeper re-queues the episode from a fresh reset. If the old message comes back later,
the ledger drops it (the episode is running under another lease, or done).

The consumer runs ``Sweeper.tick`` every ``sweep_interval_s``; a Redis lock lets any number of
consumers run it without doing the work twice.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import redis

from broker import errors
from broker.keys import Keys, member, split_member
from broker.ledger import Ledger
from broker.queueing import decode_task_args, send_episodes
from broker.records import (
    ABANDONED,
    ATTEMPT_FAILED,
    FAILED,
    QUEUED,
    RETRYING,
    RUNNING,
    AttemptRecord,
    DeadLetter,
    unpack,
)
from broker.settings import Settings

log = logging.getLogger("interactor.recovery")


@dataclass
class SweepReport:
    reclaimed: list[str] = field(default_factory=list)  # members re-queued after a lost worker
    dead: list[str] = field(default_factory=list)  # members dead-lettered (attempts exhausted)
    retried: list[str] = field(default_factory=list)  # members enqueued after their backoff

    def __bool__(self) -> bool:
        return bool(self.reclaimed or self.dead or self.retried)


class Sweeper:
    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.ledger = Ledger(client, self.keys, settings.lease_ttl_s)

    def tick(self) -> SweepReport:
        report = SweepReport()
        lock_ms = int(max(self.settings.sweep_interval_s * 2, 10) * 1000)
        if not self.r.set(self.keys.sweep_lock, b"1", nx=True, px=lock_ms):
            return report
        try:
            self._reclaim_lost(report)
            self._enqueue_due(report)
        finally:
            self.r.delete(self.keys.sweep_lock)
        return report

    def _reclaim_lost(self, report: SweepReport) -> None:
        for m in self.ledger.expired_running():
            job_id, episode_id = split_member(m)
            job = self.ledger.job_spec(job_id)
            spec = self.ledger.episode_spec(job_id, episode_id)
            if job is None or spec is None:
                self.r.zrem(self.keys.running, m)
                continue
            attempt = self.ledger.attempts(job_id, episode_id)
            limit = self.ledger.attempt_limit(job_id, episode_id, job.max_attempts)
            exhausted = attempt >= limit
            base = dict(job_id=job_id, episode_id=episode_id, attempt=attempt, group_id=spec.group_id,
                        group_size=spec.group_size, env_name=spec.env_name, llm_model=job.model,
                        reason=errors.WORKER_LOST, error_class="LeaseExpired")
            if exhausted:
                message = f"worker lost (lease expired) on attempt {attempt} of {limit}"
                record = AttemptRecord(**base, status=ATTEMPT_FAILED, error=message)
                letter = DeadLetter(job_id=job_id, episode_id=episode_id, group_id=spec.group_id,
                                    env_name=spec.env_name, reason=errors.WORKER_LOST, error_class="LeaseExpired",
                                    error=message, attempts=attempt, spec=spec.to_dict())
                if self.ledger.reclaim(job_id, episode_id, FAILED, record, letter):
                    report.dead.append(m)
                    log.error("episode %s dead-lettered: %s", episode_id, message)
            else:
                record = AttemptRecord(**base, status=ABANDONED, error="worker lost (lease expired)")
                if self.ledger.reclaim(job_id, episode_id, QUEUED, record):
                    send_episodes(self.r, [(job_id, episode_id, spec.queue or self.settings.queue)])
                    report.reclaimed.append(m)
                    log.warning("episode %s: worker lost on attempt %d; re-queued", episode_id, attempt)

    def _enqueue_due(self, report: SweepReport) -> None:
        for m in self.ledger.due_retries():
            if not self.ledger.take_retry(m):
                continue
            job_id, episode_id = split_member(m)
            if not self.ledger.move(job_id, episode_id, QUEUED, [RETRYING]):
                continue  # started early by a duplicate delivery, or finished meanwhile
            spec = self.ledger.episode_spec(job_id, episode_id)
            send_episodes(self.r, [(job_id, episode_id, (spec.queue if spec else "") or self.settings.queue)])
            report.retried.append(m)


def queued_members(client: redis.Redis, queues: list[str]) -> set[str]:
    """Episodes that have a Celery message waiting or in flight (kombu's unacked hash)."""
    found: set[str] = set()
    names = set(queues)
    for q in queues:
        names.update(k.decode() for k in client.scan_iter(match=f"{q}\x06\x16*"))
    for q in names:
        for raw in client.lrange(q, 0, -1):
            args = decode_task_args(raw)
            if args:
                found.add(member(*args))
    for _, raw in client.hscan_iter("unacked"):
        try:
            envelope = json.loads(raw)[0]
        except (ValueError, IndexError, TypeError):
            continue
        args = decode_task_args(json.dumps(envelope).encode())
        if args:
            found.add(member(*args))
    return found


def reconcile(client: redis.Redis, settings: Settings, job_id: str, *, dry_run: bool = False) -> list[str]:
    """Re-enqueue episodes of a job that nothing will ever run again.

    An episode is accounted for when it is done or failed (dead-lettered), running under a live
    lease, waiting in the retry schedule, or has a task message in a queue or in flight.
    Anything else was lost on the way (a crash between a ledger write and a send, a flushed
    queue) and is sent again. Running without a live lease is left to the sweeper.
    """
    keys = Keys(settings.key_prefix)
    ledger = Ledger(client, keys, settings.lease_ttl_s)
    queues = sorted(set(settings.served_queues) | _job_queues(ledger, job_id))
    waiting = queued_members(client, queues)
    scheduled = {m.decode() for m in client.zrange(keys.retry, 0, -1)}
    lost: list[tuple[str, str, str]] = []
    for episode_id, state in ledger.states(job_id).items():
        m = member(job_id, episode_id)
        if state in ("done", FAILED) or m in waiting or m in scheduled:
            continue
        if state == RUNNING:
            continue
        lost.append((job_id, episode_id, state))
    if dry_run:
        return [e for _, e, _ in lost]
    sent = []
    for _, episode_id, state in lost:
        if ledger.move(job_id, episode_id, QUEUED, [state]):
            spec = ledger.episode_spec(job_id, episode_id)
            send_episodes(client, [(job_id, episode_id, (spec.queue if spec else "") or settings.queue)])
            sent.append(episode_id)
    if sent:
        log.warning("reconcile %s: re-enqueued %d lost episodes", job_id, len(sent))
    return sent


def _job_queues(ledger: Ledger, job_id: str) -> set[str]:
    queues = set()
    for raw in ledger.r.hvals(ledger.k.job_episodes(job_id)):
        q = unpack(raw).queue
        if q:
            queues.add(q)
    return queues
