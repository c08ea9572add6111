"""Bringing episodes back: dead workers' leases, due retries, and reconcile.

A killed worker's Celery messages are gone with it (the transport keeps no copy of a delivered
message: broker/kombu_redis.py). Its leases expire within ``lease_ttl_s``, and the sweeper
re-queues those episodes; the reservations of the episodes it received and had not started
expire too, and the sweeper sends them again; reconcile sends any episode the ledger holds as
queued or retrying that no queue, reservation or schedule accounts for. A message sent twice is
harmless: the ledger drops the delivery of an episode running under another lease, or done.

Every worker process and the consumer run ``Sweeper.tick`` every ``sweep_interval_s``; a Redis
lock lets any number of them run it without doing the work twice, and recovery does not
depend on any one process being up.

**When the sweeper reclaims**: a running episode whose lease expired more than a third of the
TTL ago - unless the sweep clock shows an outage. Every sweep, in every process, stamps the
clock with Redis' time; a gap of more than half the TTL (at least two sweep intervals) means
nobody reached Redis, so every lease may have lapsed under a live holder that could not renew.
(A lease lapses under a live holder only after about two thirds of the TTL without Redis, so
this sees every such outage as long as ``sweep_interval_s`` is under a third of the TTL, as by
default: 5 s and 30 s.) Reclaims are then held for two TTLs, time for the holders to take their
leases back, and the check runs inside the reclaim script too, so a sweep that stalled across
the outage cannot reclaim on the far side of it. Holders take a lease back on their next renewal
(every third of the TTL), step record or FINISH. A lease that lapsed in such a gap and that
nobody took back during the hold had a holder that died with Redis away (stopped during the
outage and killed at its shutdown deadline while it waited to hand its episode back, say): it is
reclaimed with its attempt not counted (up to ``closing.OUTAGE_EXTRA_ATTEMPTS`` beyond the
limit), as the gaps are kept (``Keys.outages``, ``lapsed_in_outage``). So Redis being away -
frozen, restarted, unreachable from everyone - never costs an attempt. What it cannot tell apart
from a dead worker: a worker cut off from Redis while the sweepers still reach it (its attempts
fence themselves by their own clock and are re-run, counted), and a worker whose renewer does
not get to run for the whole hold after an outage. A gap is also what a fleet with no process up
leaves; a lease that lapsed then is not counted either.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import redis

from broker import closing, errors, feed
from broker.cancel import JobCancel
from broker.duty import Duty
from broker.keys import Keys, member, split_member
from broker.ledger import Ledger
from broker.lua_scripts import lua_file, lua_script
from broker.pause import JobPause
from broker.queueing import push_episodes, waiting_episodes
from broker.records import AttemptRecord
from broker.settings import Settings
from broker.states import AttemptStatus, CloseAction, LedgerState

log = logging.getLogger("interactor.recovery")

_RELEASE_LOCK = lua_script(lua_file("recovery_release_lock"))  # its Lua: broker/lua/recovery_release_lock.lua


@dataclass
class SweepReport:
    reclaimed: list[str] = field(default_factory=list)  # members re-queued after a lost worker
    dead: list[str] = field(default_factory=list)  # members dead-lettered (attempts exhausted)
    retried: list[str] = field(default_factory=list)  # members enqueued after their backoff
    resent: list[str] = field(default_factory=list)  # received by a dead worker, never started
    reconciled: list[str] = field(default_factory=list)  # episode ids lost on the way, sent again
    cancelled: list[str] = field(default_factory=list)  # members of cancelled jobs ended cancelled (lost workers)
    stragglers: int = 0  # waiting episodes of cancelled jobs cancelled (broker/cancel.py)

    def __bool__(self) -> bool:
        return bool(self.reclaimed or self.dead or self.retried or self.resent or self.reconciled or self.cancelled
                    or self.stragglers)


class Sweeper:
    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.ledger = Ledger.for_settings(client, settings)
        self.cancels = JobCancel(client, settings)
        self._last_reconcile = time.monotonic()
        self._last_housekeeping = 0.0
        self._reconcile_rounds = 0
        # (gap, hold) in seconds. A lease lapses under a live holder only if Redis was away for
        # about two thirds of its TTL (renewals come every third): a gap of half the TTL is an
        # outage. Sweeps come every sweep_interval_s from each process; twice that is no gap.
        self.outage = (max(settings.lease_ttl_s / 2, 2 * settings.sweep_interval_s), 2 * settings.lease_ttl_s)

    def tick(self, *, reclaim: bool = True) -> SweepReport:
        """One sweep, by whichever process takes the sweep lock first. The lock is released
        only by its holder (token-checked) and expires soon (a frozen holder must not stop
        every sweep); a second sweeper entering meanwhile only repeats guarded moves.

        ``reclaim=False`` skips re-queuing expired leases: right after Redis was unreachable
        the workers' renewers need a round to take back leases that lapsed meanwhile (their
        attempts are alive and waiting, see Ledger.renew).

        The same holds fleet-wide by Redis' own clock: every tick stamps the sweep clock, and a
        gap in it longer than ``self.outage[0]`` seconds (nobody swept: Redis was away) holds
        reclaims for ``self.outage[1]``, however little this process saw of the outage (a
        sweeper that slept through it, or started after it). The check is repeated inside each
        reclaim (Ledger.sweep_clock, Ledger.reclaim)."""
        report = SweepReport()
        if self.ledger.sweep_clock(*self.outage):
            reclaim = False
        token = os.urandom(8).hex()
        # Short: a holder that is frozen or killed mid-sweep stops every sweep (and with it
        # every reclaim) until the lock expires. A sweep that outlasts it may overlap the next
        # one, which is safe: every move is a checked Lua script, a double resend a dropped
        # duplicate.
        lock_ms = int(max(self.settings.sweep_interval_s * 4, self.settings.lease_ttl_s / 2) * 1000)
        if not self.r.set(self.keys.sweep_lock, token, nx=True, px=lock_ms):
            return report
        try:
            self._note_fading_holders()
            if reclaim:
                self._reclaim_lost(report)
            self._resend_unstarted(report)
            self._enqueue_due(report)
            self._reconcile_jobs(report)
            self._housekeeping()
        finally:
            self._release(token)
        return report

    def _release(self, token: str) -> None:
        _RELEASE_LOCK(keys=[self.keys.sweep_lock], args=[token], client=self.r)

    def _note_fading_holders(self) -> None:
        """Who holds the leases that are running out, kept until past their reclaim: an expired
        lease takes its token, the one place that names the worker, with it, and the reclaim's
        attempt record names the worker that was lost from this note. Running out: not renewed
        for half a TTL (a live holder renews every third, ``Settings.renewal_interval_s``), so
        a lease is seen in at least one sweep before it expires while sweeps come as often."""
        seconds, micros = self.r.time()
        now_ms = seconds * 1000 + micros // 1000
        ttl_ms = int(self.settings.lease_ttl_s * 1000)
        fading = [m.decode() for m in self.r.zrangebyscore(self.keys.running, now_ms, now_ms + ttl_ms // 2)]
        if not fading:
            return
        episodes = [split_member(m)[1] for m in fading]
        tokens = self.r.mget([self.keys.lease(e) for e in episodes])
        pipe = self.r.pipeline(transaction=False)
        for episode_id, token in zip(episodes, tokens):
            if token:
                pipe.set(self.keys.fading_holder(episode_id), token, px=2 * ttl_ms)
        pipe.execute()

    def _lost_worker(self, episode_id: str, attempt_id: str) -> str:
        """The worker that held attempt ``attempt_id``'s lease, as a sweep noted it running out
        ("" when no sweep saw it before it expired)."""
        token = self.r.get(self.keys.fading_holder(episode_id))
        parts = token.decode().rsplit(":", 2) if token else []
        return parts[0] if len(parts) == 3 and parts[1] == attempt_id else ""

    def _reclaim_lost(self, report: SweepReport) -> None:
        # Grace past the lease's expiry: a live worker's attempts stop calling anything before
        # its lease can expire (they fence themselves by their own clock), and its renewer gets
        # a last chance to take the lease back (Ledger.renew) before the episode moves on.
        grace_ms = int(self.settings.lease_ttl_s * 1000 / 3)
        for m in self.ledger.expired_running(grace_ms=grace_ms):
            job_id, episode_id = split_member(m)
            job = self.ledger.job_spec(job_id)
            spec = self.ledger.episode_spec(job_id, episode_id)
            if job is None or spec is None:
                self.ledger.forget_running(m)
                continue
            attempt, attempt_id = self.ledger.latest_attempt(job_id, episode_id)
            attempt = attempt or self.ledger.attempts(job_id, episode_id)
            if self.cancels.is_cancelled(job_id):
                self._reclaim_cancelled(m, job, spec, attempt, attempt_id, report)
                continue
            limit = self.ledger.attempt_limit(job_id, episode_id, job.max_attempts)
            # A lease that lapsed while Redis was away, and that its holder did not take back in
            # the hold that followed: the holder died during the outage (stopped while it waited
            # to hand the episode back, killed at its shutdown deadline). Redis being away is not
            # the episode's doing: the attempt is not counted (closing's outage rule, capped).
            # Any other expired lease says nothing about an outage.
            in_outage = self.ledger.lapsed_in_outage(m)
            what = "worker lost (lease expired" + (" while Redis was unreachable)" if in_outage else ")")
            lost = errors.EpisodeError(errors.WORKER_LOST, what, transient=True)
            close = closing.decide(lost, attempt, limit, in_outage, max_attempts=job.max_attempts,
                                   retry_on=job.retry_on)
            # Its trajectory may be continued by the next attempt (broker/resume.py): the close
            # names it, so that the store keeps its steps for that attempt to add to.
            progress = self.ledger.progress(job_id, episode_id)
            trajectory = progress.trajectory if progress is not None else ""
            base = dict(job_id=job_id, episode_id=episode_id, attempt=attempt, group_id=spec.group_id,
                        group_size=spec.group_size, env_name=spec.env_name, llm_model=job.model,
                        reason=errors.WORKER_LOST, error_class="LeaseExpired", attempt_id=attempt_id,
                        trajectory=trajectory if trajectory != f"{attempt}:{attempt_id}" else "",
                        worker=self._lost_worker(episode_id, attempt_id))
            if close.action == CloseAction.FAIL:
                message = f"{what} on attempt {attempt} of {close.limit}"
                message += closing.OUTAGE_NOTE if close.uncounted else ""
                record = AttemptRecord(**base, status=AttemptStatus.FAILED, error=message)
                letter = closing.dead_letter(record, spec)
                if self.ledger.reclaim(job_id, episode_id, LedgerState.FAILED, record, letter, outage=self.outage):
                    report.dead.append(m)
                    self._orphaned(spec, *(progress.trajectory_key if progress is not None else (attempt, attempt_id)))
                    log.error("episode %s dead-lettered: %s", episode_id, message)
            else:
                message = close.message(lost, what, attempt)
                record = AttemptRecord(**base, status=AttemptStatus.ABANDONED, error=message)
                if self.ledger.reclaim(job_id, episode_id, LedgerState.QUEUED, record, outage=self.outage,
                                       uncounted_default=job.max_attempts if close.uncounted else None):
                    push_episodes(self.r, [(job_id, episode_id, self.settings.queue_for(spec))])
                    report.reclaimed.append(m)
                    # its env instance is left to the next attempt: continued, or closed by it
                    log.warning("episode %s: %s on attempt %d; re-queued%s", episode_id, what, attempt,
                                closing.OUTAGE_NOTE if close.uncounted else "")

    def _reclaim_cancelled(self, m: str, job, spec, attempt: int, attempt_id: str, report: SweepReport) -> None:
        """A lost worker's episode of a cancelled job (broker/cancel.py) ends cancelled: not run
        again, no attempt counted against it, no dead letter."""
        job_id, episode_id = split_member(m)
        record = AttemptRecord(job_id=job_id, episode_id=episode_id, attempt=attempt, group_id=spec.group_id,
                               group_size=spec.group_size, env_name=spec.env_name, llm_model=job.model,
                               status=AttemptStatus.CANCELLED, reason=errors.CANCELLED, error_class="LeaseExpired",
                               error="its job was cancelled; its worker was lost (lease expired) before it stopped",
                               attempt_id=attempt_id, worker=self._lost_worker(episode_id, attempt_id))
        progress = self.ledger.progress(job_id, episode_id)  # read before the reclaim drops it
        if self.ledger.reclaim(job_id, episode_id, LedgerState.CANCELLED, record, outage=self.outage):
            report.cancelled.append(m)
            self._orphaned(spec, *(progress.trajectory_key if progress is not None else (attempt, attempt_id)))
            log.warning("episode %s of cancelled job %s: its worker was lost; ended cancelled", episode_id, job_id)

    def _orphaned(self, spec, attempt: int, attempt_id: str) -> None:
        """The env instance of a trajectory nobody will continue (its episode dead-lettered): a
        worker closes it (workers/orphans.py). ``attempt``, ``attempt_id``: the attempt that reset it."""
        entries = closing.orphans(spec, [(attempt, attempt_id)])
        if entries:
            self.r.rpush(self.keys.orphans, *entries)

    def _resend_unstarted(self, report: SweepReport) -> None:
        """Episodes a dead worker had received but not started: send them again."""
        for m in self.ledger.expired_reservations():
            if not self.ledger.reclaim_reservation(m):
                continue
            job_id, episode_id = split_member(m)
            spec = self.ledger.episode_spec(job_id, episode_id)
            push_episodes(self.r, [(job_id, episode_id, self.settings.queue_for(spec))])
            report.resent.append(m)
            log.warning("episode %s: received by a worker that died before starting it; sent again", episode_id)

    def _reconcile_jobs(self, report: SweepReport, max_queue: int = 10_000, big_every: int = 10) -> None:
        """Reconcile every job with queued or retrying episodes, not only the most recent ones
        (an older job's lost episodes would otherwise wait forever). A job whose queues hold more than ``max_queue`` messages costs a scan of
        them, so it is reconciled every ``big_every``-th round only, never postponed forever."""
        now = time.monotonic()
        if now - self._last_reconcile < self.settings.reconcile_interval_s:
            return
        self._last_reconcile = now
        self._reconcile_rounds += 1
        job_ids = self.ledger.job_ids()
        waiting = [j for j, counts in zip(job_ids, self.ledger.counts_many(job_ids))
                   if counts[LedgerState.QUEUED] or counts[LedgerState.RETRYING]]
        cancelled = self.cancels.cancelled(waiting)
        for job_id in waiting:
            if job_id in cancelled:
                # Not sent again: what a cancel left waiting (an attempt that closed handed back
                # or retrying in its very moment) ends cancelled.
                report.stragglers += self.cancels.cancel_waiting(job_id)
                continue
            queues = set(self.settings.served_queues) | self.ledger.job_queues(job_id)
            if sum(self.r.llen(q) for q in queues) > max_queue and self._reconcile_rounds % big_every:
                continue
            # confirmed over two rounds: a reservation is written within a renewal round of the
            # message being taken (workers/renewer.py), so one missing for longer is lost
            report.reconciled.extend(reconcile(self.r, self.settings, job_id,
                                               confirm_after_s=2 * self.settings.renewal_interval_s))

    def _housekeeping(self) -> None:
        """Retention, so that Redis memory does not grow with every job ever run: a finished job's keys expire ``job_retention_s`` after it
        finished (a re-drive makes it active again and takes the expiry back); the jobs index
        and the dead-letter queue forget jobs whose keys are gone; the poison stream is capped.

        A job with an online-RL feed (broker/feed.py) is finished only when its feed holds
        nothing more (``feed.holds``: no group ready or taken, nothing left to produce, or no
        trainer for a retention period); its feed's keys expire with the job's, and settled
        groups older than the retention leave the feed's stream meanwhile (``feed.trim``).

        A job indexed without a spec is gone (retention expired its keys), or its submit died
        after claiming the id (its keys are deleted), unless its submitting marker says it is
        being written right now (Ledger.create_job): that one is left alone."""
        now = time.monotonic()
        if now - self._last_housekeeping < max(self.settings.reconcile_interval_s, 10.0):
            return
        self._last_housekeeping = now
        job_ids = self.ledger.job_ids()
        if not job_ids:
            return
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            # The marker before the spec: a submit deletes its marker as it writes its spec (in
            # one transaction), so a job seen with neither has no submit under way.
            pipe.exists(self.keys.job_submitting(job_id))
            pipe.exists(self.keys.job_spec(job_id))
            pipe.ttl(self.keys.job_spec(job_id))
        answers = pipe.execute()
        counts = self.ledger.counts_many(job_ids)
        retention = int(self.settings.job_retention_s)
        feeds = {m.decode() if isinstance(m, bytes) else m for m in self.r.smembers(self.keys.feeds)}
        gone = []
        pipe = self.r.pipeline(transaction=False)
        for job_id, submitting, exists, ttl, c in zip(job_ids, answers[0::3], answers[1::3], answers[2::3], counts):
            keys = self.keys.job_keys(job_id) + (self.keys.feed_keys(job_id) if job_id in feeds else [])
            if not exists:
                if not submitting:
                    gone.append(job_id)
                    pipe.delete(*keys)  # a dead submit's partial writes
                continue
            if job_id in feeds:
                feed.trim(self.r, self.keys, job_id, retention)
                active = not feed.finished(self.r, self.keys, job_id, c, retention)
            else:
                active = c[LedgerState.QUEUED] or c[LedgerState.RUNNING] or c[LedgerState.RETRYING]
            if not active and ttl == -1:
                for key in keys:
                    pipe.expire(key, retention)
            elif active and ttl >= 0:
                for key in keys:
                    pipe.persist(key)
        pipe.execute()
        if gone:
            self._forget_jobs(gone)
            gone_feeds = [j for j in gone if j in feeds]
            if gone_feeds:
                self.r.srem(self.keys.feeds, *gone_feeds)
        self.r.xtrim(self.keys.poison, maxlen=10_000, approximate=True)

    def _forget_jobs(self, job_ids: list[str]) -> None:
        self.r.zrem(self.keys.jobs, *job_ids)
        prefixes = tuple(f"{j} " for j in job_ids)
        stale = [k for k, _ in self.r.zscan_iter(self.keys.dlq_index) if k.decode().startswith(prefixes)]
        for i in range(0, len(stale), 1000):
            chunk = stale[i:i + 1000]
            pipe = self.r.pipeline(transaction=True)
            pipe.hdel(self.keys.dlq, *chunk)
            pipe.zrem(self.keys.dlq_index, *chunk)
            pipe.execute()
        log.info("retention: forgot %d expired jobs (%d dead letters)", len(job_ids), len(stale))

    def _enqueue_due(self, report: SweepReport) -> None:
        for m in self.ledger.due_retries():
            if not self.ledger.take_retry(m):
                continue
            job_id, episode_id = split_member(m)
            if self.cancels.is_cancelled(job_id):
                continue  # left retrying: the reconcile's pass over cancelled jobs ends it cancelled
            if not self.ledger.move(job_id, episode_id, LedgerState.QUEUED, [LedgerState.RETRYING]):
                continue  # started early by a duplicate delivery, or finished meanwhile
            spec = self.ledger.episode_spec(job_id, episode_id)
            push_episodes(self.r, [(job_id, episode_id, self.settings.queue_for(spec))])
            report.retried.append(m)


class SweepDuty(Duty):
    """Runs :meth:`Sweeper.tick` on its own thread (workers and the consumer), so that a long
    reconcile holds up neither lease renewal nor ingestion.

    After its own Redis errors it leaves expired leases alone for one lease TTL: if Redis was
    away, leases lapsed on every live worker too, and their renewers take them back on their
    next round; re-queuing them first would restart every running episode of the fleet."""

    name = "sweeper"

    def __init__(self, sweeper: Sweeper, interval_s: float):
        super().__init__(interval_s)
        self.sweeper = sweeper
        self.last_report: SweepReport | None = None
        self._hold_reclaim_until = 0.0

    def tick(self) -> None:
        try:
            self.last_report = self.sweeper.tick(reclaim=time.monotonic() >= self._hold_reclaim_until)
        except redis.RedisError:
            self._hold_reclaim_until = time.monotonic() + self.sweeper.settings.lease_ttl_s
            raise


def _confirmed(client: redis.Redis, keys: Keys, job_id: str, lost: list, after_s: float) -> list:
    """Those of ``lost`` found lost at least ``after_s`` ago; the others are remembered, and the
    episodes no longer lost forgotten."""
    now = time.time()
    key = keys.job_suspects(job_id)
    seen = {k.decode(): float(v) for k, v in client.hgetall(key).items()}
    lost_ids = {e for e, _ in lost}
    pipe = client.pipeline(transaction=False)
    gone = [e for e in seen if e not in lost_ids]
    if gone:
        pipe.hdel(key, *gone)
    new = {e: now for e in lost_ids if e not in seen}
    if new:
        pipe.hset(key, mapping=new)
    confirmed = [(e, st) for e, st in lost if e in seen and now - seen[e] >= after_s]
    if confirmed:
        pipe.hdel(key, *(e for e, _ in confirmed))
    pipe.execute()
    return confirmed


def reconcile(client: redis.Redis, settings: Settings, job_id: str, *, dry_run: bool = False,
              confirm_after_s: float | None = None) -> list[str]:
    """Re-enqueue episodes of a job that nothing will ever run again.

    ``confirm_after_s`` (the sweeper's): an episode is sent again only once it has been found
    lost for that long (``Keys.job_suspects``, kept in Redis so that any process's next sweep
    confirms it). A worker takes a message from its queue before the reservation of its episode
    is written (the renewer writes them in rounds, and most episodes start first), so a sweep in
    that moment sees an episode with no message and no reservation; sent again at once, it would
    run as a duplicate delivery (dropped by the ledger, but a message and a START for nothing).

    An episode is accounted for when it is done, failed (dead-lettered) or cancelled, running
    (a dead worker's lease is the sweeper's business), waiting in the retry schedule, reserved by
    a live worker, parked while its job is paused (broker/pause.py), or has a task message waiting
    (see ``broker.queueing.waiting_episodes``). A cancelled job has nothing to send again
    (broker/cancel.py: what it left waiting ends cancelled). Anything else was lost
    on the way: a worker killed between receiving and reserving, a message popped by BRPOP
    while Redis went down, a crash between a ledger write and a send, a flushed queue. It is
    sent again; a duplicate message, should the old one resurface, is dropped by the ledger.
    """
    keys = Keys(settings.key_prefix)
    ledger = Ledger.for_settings(client, settings)
    if JobCancel(client, settings).is_cancelled(job_id):
        return []
    # Order matters: schedules first, queues next, states last, so that an episode moving
    # along meanwhile is seen in at least one place.
    scheduled = {m.decode() for m in client.zrange(keys.retry, 0, -1)}
    scheduled |= {m.decode() for m in client.zrange(keys.reserved, 0, -1)}
    scheduled |= {member(job_id, e) for e in JobPause(client, keys).parked(job_id)}  # waiting for a resume
    queues = set(settings.served_queues) | ledger.job_queues(job_id)
    states = ledger.states(job_id)
    accounted = {member(*w) for w in waiting_episodes(client, sorted(queues))}
    accounted |= scheduled
    lost = [(episode_id, state) for episode_id, state in states.items()
            if state in (LedgerState.QUEUED, LedgerState.RETRYING) and member(job_id, episode_id) not in accounted]
    specs = ledger.episode_specs(job_id, [e for e, _ in lost]) if lost else {}
    # An episode's own queue is looked in too, scanned or not by this process and recorded or
    # not for the job (jobs made before their queues were recorded): one waiting there is not lost.
    unscanned = {specs[e].queue for e, _ in lost if e in specs and specs[e].queue} - queues
    if unscanned:
        accounted |= {member(*w) for w in waiting_episodes(client, sorted(unscanned))}
        lost = [(e, st) for e, st in lost if member(job_id, e) not in accounted]
    if dry_run:
        return [e for e, _ in lost]
    if confirm_after_s is not None:
        lost = _confirmed(client, keys, job_id, lost, confirm_after_s)
    # Batched: a guarded move each (pipelined), the specs in one read, one push per queue.
    moved = [e for (e, _), ok in zip(lost, ledger.move_many(job_id, lost, LedgerState.QUEUED)) if ok]
    push_episodes(client, ((job_id, e, settings.queue_for(specs.get(e))) for e in moved))
    if moved:
        log.warning("reconcile %s: re-enqueued %d lost episodes", job_id, len(moved))
    return moved
