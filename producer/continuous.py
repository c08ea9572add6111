"""Continuous jobs: groups drawn from the task files' templates epoch after epoch, paced by the
trainer (the online-RL feed, broker/feed.py).

Why not submit everything up front: a trainer consumes groups as its weights move, so a group
produced far ahead of it is sampled by a policy it will have left behind. The producer keeps at
most ``max_ahead`` groups produced and not settled (queued, running, ready, or taken and not
acknowledged) and waits beyond that; nothing is produced to be thrown away.

Its position (sequence number, epoch, index in the epoch's shuffled order) lives in Redis and
moves in the same transaction that writes the group's episodes to the ledger, so a restarted
producer neither repeats nor skips a task. Groups to run again (stale, or with a dead-lettered
member under ``failed_policy=refill``) wait in ``Keys.feed_redo`` and go first: each becomes a
fresh group (new episode ids, the same tasks), since a stored completion is never replaced; one
whose episode specs are gone is dropped, logged and counted (``redo_dropped``).

The producer runs on a thread of the feed server; a failed round does not end it (``run``), a
cancel of its job does (broker/cancel.py: it reports itself stopped), and it reports its state
in Redis (broker/feed.py ``note_producer``) for ``/stats`` and ``interactor status`` to show.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import msgpack
import orjson
import redis

from broker import feed
from broker.keys import Keys
from broker.ledger import Ledger
from broker.queueing import push_episodes
from broker.records import EpisodesEnqueued, EpisodeSpec, JobSpec, RecordError, unpack
from broker.redact import store_identity
from broker.settings import Settings
from broker.states import ProducerState
from producer.enqueue import job_spec, plan

log = logging.getLogger("interactor.producer")

_SEED_MOD = 2**31


def create_continuous_job(client: redis.Redis, settings: Settings, paths: list[str], *, job_id: str | None = None,
                          epochs: int = 0, seed: int = 0, planned=None) -> JobSpec:
    """Validate the task files, keep one epoch's groups as templates, create the job with no
    episode yet, and give it a feed. Episodes come from :class:`ContinuousProducer`.
    ``planned``: the files already read by ``producer.enqueue.plan`` (a caller that checked the
    servers they name first)."""
    planned = planned if planned is not None else plan(settings, paths, job_id)
    if not planned.episodes:
        raise ValueError("the task files plan no episode")
    templates: dict[str, list[EpisodeSpec]] = {}
    for e in planned.episodes:
        templates.setdefault(e.group_id, []).append(e)
    job = job_spec(settings, planned.episodes[0].job_id, planned)
    job.episodes, job.groups = 0, 0  # open-ended: the feed's counters say how many so far
    keys = Keys(settings.key_prefix)
    # Its queues are recorded now, though its episodes come later: reconcile scans them, and a
    # local fleet serves them.
    Ledger.for_settings(client, settings).create_job(
        job, [], queues=sorted({e.queue for e in planned.episodes if e.queue}))
    pipe = client.pipeline(transaction=True)
    # Where its feed will read the steps, until a consumer says where it writes them.
    pipe.set(keys.job_store(job.job_id), store_identity(settings.results_store))
    pipe.hset(keys.feed_templates(job.job_id), mapping={
        str(i): msgpack.packb([s.to_dict() for s in group], use_bin_type=True)
        for i, group in enumerate(templates.values())})
    pipe.execute()
    feed.enable(client, keys, job.job_id,
                feed.FeedConfig.from_settings(settings, continuous=True, epochs=max(0, epochs), seed=seed))
    return job


class FeedGone(ValueError):
    """The job has no feed (any more: retention expired it with its job, broker/recovery.py),
    or it was cancelled (broker/cancel.py): nothing more is produced for it."""


class ContinuousProducer:
    """Produces a continuous job's groups while fewer than ``max_ahead`` are in flight."""

    def __init__(self, client: redis.Redis, settings: Settings, job_id: str):
        self.r = client
        self.settings = settings
        self.job_id = job_id
        self.keys = Keys(settings.key_prefix)
        self._orders: dict[int, list[int]] = {}
        self.produced = 0
        self.ledger = Ledger.for_settings(client, settings)
        self.errors = 0  # rounds that failed with an error not Redis'
        self.redo_dropped = 0
        self._reported_at = 0.0

    def config(self) -> feed.FeedConfig:
        cfg = feed.config(self.r, self.keys, self.job_id)
        if cfg is None:
            raise FeedGone(f"job {self.job_id!r} has no feed (its job's retention ran out, or it was deleted)")
        if self.r.exists(self.keys.job_cancel(self.job_id)):  # seen each round, also with max_ahead in flight
            raise FeedGone(f"job {self.job_id!r} was cancelled (interactor cancel)")
        return cfg

    def _order(self, epoch: int, n: int, seed: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None or len(order) != n:
            order = list(range(n))
            random.Random(f"{seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}
        return order

    def exhausted(self, cfg: feed.FeedConfig | None = None) -> bool:
        """No template left to draw (only a job with ``epochs`` ends) and nothing to run again."""
        cfg = cfg or self.config()
        if self.r.llen(self.keys.feed_redo(self.job_id)):
            return False
        epoch = int(self.r.hget(self.keys.feed_position(self.job_id), "epoch") or 0)
        return bool(cfg.epochs) and epoch >= cfg.epochs

    def produce_one(self, cfg: feed.FeedConfig) -> str | None:
        """Write one group to the ledger and enqueue it; None when there is nothing to produce."""
        k, job = self.keys, self.job_id
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    # The cancel mark watched too: a group is never added after the job was cancelled.
                    pipe.watch(k.feed_position(job), k.feed_redo(job), k.job_cancel(job))
                    if pipe.exists(k.job_cancel(job)):
                        pipe.unwatch()
                        raise FeedGone(f"job {job!r} was cancelled (interactor cancel)")
                    pos = {a.decode(): int(b) for a, b in pipe.hgetall(k.feed_position(job)).items()}
                    seq, epoch, index = pos.get("seq", 0), pos.get("epoch", 0), pos.get("index", 0)
                    redo = pipe.lindex(k.feed_redo(job), 0)
                    refills = 0
                    if redo is not None:
                        found = self._redo_specs(pipe, redo)
                        if isinstance(found, str):  # nothing to run it from: dropped, counted, and on
                            self._drop_redo(pipe, redo, found)
                            continue
                        specs, source, refills = found
                        nxt = {"seq": seq + 1, "epoch": epoch, "index": index}
                    else:
                        if cfg.epochs and epoch >= cfg.epochs:
                            pipe.unwatch()
                            return None
                        n = int(pipe.hlen(k.feed_templates(job)))
                        if not n:
                            raise ValueError(f"job {job!r} has no task templates: not a continuous job")
                        t = self._order(epoch, n, cfg.seed)[index]
                        specs = [EpisodeSpec.from_dict(d) for d in
                                 msgpack.unpackb(pipe.hget(k.feed_templates(job), str(t)), raw=False,
                                                 strict_map_key=False)]
                        source = f"epoch {epoch + 1} task {t + 1}"
                        index += 1
                        if index >= n:
                            epoch, index = epoch + 1, 0
                        nxt = {"seq": seq + 1, "epoch": epoch, "index": index}
                    if not specs:
                        raise ValueError(f"job {job!r}: group to produce has no episode specs")
                    gid = f"{job}.s{seq + 1}"
                    fresh = []
                    for i, s in enumerate(specs, 1):
                        d = s.to_dict()
                        d.update(episode_id=f"{gid}.{i}", group_id=gid, group_size=len(specs),
                                 source=f"{s.source}; {source}")
                        if s.seed is not None:  # a new sample of the same task, not a replay
                            d["seed"] = (s.seed * 1_000_003 + seq + 1) % _SEED_MOD
                        fresh.append(EpisodeSpec.from_dict(d))
                    ann = EpisodesEnqueued(job, [[e.episode_id, e.env_name, e.group_id, orjson.dumps(e.env_params)]
                                                 for e in fresh], images={e.episode_id: e.image for e in fresh if e.image})
                    pipe.multi()
                    self.ledger.add_episodes(pipe, job, fresh)
                    pipe.xadd(k.results, {"r": ann.pack()})
                    pipe.hset(k.feed_position(job), mapping=nxt)
                    pipe.hincrby(k.feed_stats(job), feed.C_PRODUCED, 1)
                    if redo is not None:
                        pipe.lpop(k.feed_redo(job))
                    if refills:  # the feed reports this group, not re-runs it, once refill_max is reached
                        pipe.hset(k.feed_refills(job), gid, refills)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        # After the ledger: a crash here leaves queued episodes no queue holds, which the
        # sweeper's reconcile sends (as for any submit).
        push_episodes(self.r, [(job, e.episode_id, self.settings.queue_for(e)) for e in fresh])
        self.produced += 1
        return gid

    def _redo_specs(self, pipe, redo: bytes) -> tuple[list[EpisodeSpec], str, int] | str:
        """A group to run again: its members' specs, what it re-runs and its refills so far; or
        why it cannot be run (an entry we cannot read, or members whose specs are gone)."""
        try:
            old_group, old_ids, why, *rest = msgpack.unpackb(redo, raw=False)
            refills = int(rest[0]) if rest else 0
            if not isinstance(old_ids, list) or not old_ids or not all(isinstance(e, str) for e in old_ids):
                raise ValueError(f"episode ids {old_ids!r}")
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            return f"unreadable entry ({type(exc).__name__}: {exc})"
        specs, missing = [], []
        for episode_id, raw in zip(old_ids, pipe.hmget(self.keys.job_episodes(self.job_id), old_ids)):
            try:
                specs.append(unpack(raw) if raw else None)
            except RecordError:
                specs.append(None)
            if specs[-1] is None:
                missing.append(episode_id)
        if missing:
            return (f"re-run of group {old_group} ({why}): the specs of {len(missing)} of its {len(old_ids)} "
                    f"episodes are gone ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        return specs, f"re-run of group {old_group} ({why})", refills

    def _drop_redo(self, pipe, redo: bytes, why: str) -> None:
        """Take a group that cannot be run again off the redo list (under the WATCH of the
        caller's transaction; a change meanwhile raises WatchError and the round starts over)."""
        k, job = self.keys, self.job_id
        pipe.multi()
        pipe.lrem(k.feed_redo(job), 1, redo)
        pipe.hincrby(k.feed_stats(job), feed.C_REDO_DROPPED, 1)
        pipe.execute()
        self.redo_dropped += 1
        log.error("producer for job %s: a group to run again was dropped: %s", job, why)

    def fill(self) -> int:
        """Produce until ``max_ahead`` groups are in flight or nothing is left; returns how many."""
        cfg = self.config()
        n = 0
        while feed.inflight(self.r, self.keys, self.job_id) < cfg.max_ahead:
            if self.produce_one(cfg) is None:
                break
            n += 1
        return n

    def run(self, stop: threading.Event, interval_s: float = 0.1) -> None:
        """Produce until ``stop``. Nothing but the feed being gone ends it: a round that fails
        (Redis away, or anything else: a job without templates, a bug) is logged, counted in
        its report (``/stats``, ``interactor status``) and tried again after a pause that
        doubles up to a minute, so a fault that lasts neither spins nor stops the feed."""
        log.info("continuous producer for job %s started", self.job_id)
        delay = interval_s
        self._report(ProducerState.RUNNING)
        while not stop.is_set():
            try:
                self.fill()
                if delay != interval_s or time.monotonic() - self._reported_at > feed.PRODUCER_BEAT_S:
                    self._report(ProducerState.RUNNING)
                delay = interval_s
            except FeedGone as exc:
                log.warning("producer stops: %s", exc)
                if self.r.exists(self.keys.job_cancel(self.job_id)):
                    break  # reported stopped, below: /stats and status say why nothing more comes
                return
            except redis.RedisError as exc:
                delay = min(10.0, max(1.0, delay * 2))
                log.warning("producer: Redis unavailable (%s); retrying in %.0fs", exc, delay)
            except Exception as exc:  # noqa: BLE001 - logged with its traceback, counted, tried again
                delay = min(60.0, max(1.0, delay * 2))
                self.errors += 1
                log.exception("producer for job %s: a round failed; retrying in %.0fs", self.job_id, delay)
                self._report(ProducerState.BACKING_OFF, f"{type(exc).__name__}: {exc}")
            stop.wait(delay)
        self._report(ProducerState.STOPPED)

    def _report(self, state: str, error: str = "") -> None:
        """Best effort: Redis away is the one fault a report cannot be written through."""
        try:
            feed.note_producer(self.r, self.keys, self.job_id, state, self.settings.job_retention_s, error)
            self._reported_at = time.monotonic()
        except redis.RedisError:
            pass


