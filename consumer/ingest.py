"""Reading the results stream into the store: batch, commit, then acknowledge.

* A consumer group gives each record to one consumer; XACK happens only after the store's
  commit, so a consumer killed mid-batch leaves its records pending, and another consumer (or
  the same one restarted under its name) claims them with XAUTOCLAIM once they idle.
* The store ignores a record it already has, so a claimed batch that was in fact committed
  is stored once.
* The stream is trimmed only below the oldest entry not yet acknowledged by every group
  (XTRIM MINID): trimming by length would delete records nobody has read.
* Bad records never block the stream: one that cannot be decoded, or that the store rejects
  (it fails alone while the rest of its batch is stored), is moved to ``<prefix>:results:poison``
  with the error and acknowledged. A store that is unavailable (disk full, read-only, database
  down) is waited for with backoff, its records left pending: the consumer never crash-loops.
* Lost steps: a completion whose steps are not all stored once every record before its close
  has been committed can never get them (a Redis failover lost them). The episode is set back
  to retrying in the store and re-queued in the ledger (``reopen_lost_completions``), at most
  ``consumer_reopens_max`` times; after that, or at once when a missing step is in the poison
  stream (the store refused it: a re-run would bring the same data), it is failed as
  ``steps_lost`` in the store and the ledger, so that its group and job end.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import redis

from broker.keys import Keys
from broker.ledger import Ledger
from broker.queueing import push_episodes
from broker.dlq import DeadLetterQueue
from broker.records import AttemptRecord, RecordError, StepRecord, unpack
from broker.recovery import SweepDuty, Sweeper
from broker.settings import Settings
from broker.errors import STEPS_LOST
from broker.states import LedgerState, StoredStatus
from consumer.storage import ResultStore, StoreError
from consumer.storage.write_errors import StoreUnavailable, classify
from consumer.announce import FeedAnnouncer

log = logging.getLogger("interactor.consumer")

GROUP = "consumers"
# While the consumer keeps up, it reads at most every GATHER_S: batches of tens of records
# instead of ones and twos, for at most this much more record latency.
GATHER_S = 0.05
LOST_STEPS_CHECK_S = 2.0
_MAX_WAIT_S = 30.0
STALE_GROUP_S = 3600.0  # another consumer group idle this long no longer holds the trim floor


class Ingestor:
    def __init__(self, client: redis.Redis, settings: Settings, store: ResultStore, *, name: str | None = None,
                 observers: list | None = None, sweep: bool = False):
        self.r = client
        self.settings = settings
        self.store = store
        self.keys = Keys(settings.key_prefix)
        self.stream = self.keys.results
        self.ledger = Ledger.for_settings(client, settings)
        self.dlq = DeadLetterQueue(client, settings)
        # Stable per host: a restarted consumer re-reads its own pending entries at once instead
        # of waiting for them to idle long enough for XAUTOCLAIM.
        self.name = name or f"consumer@{socket.gethostname()}"
        self._own_pending_done = False
        # The consumer process sweeps too (dead workers' episodes are re-queued even when no
        # worker is up), on its own thread so that a long sweep never stalls ingestion.
        self.sweeper = SweepDuty(Sweeper(client, settings), settings.sweep_interval_s) if sweep else None
        # Called with each committed batch of records (metrics); their errors never stop ingest.
        self.observers = list(observers or [])
        # Groups of jobs with an online-RL feed are announced once settled (consumer/announce.py).
        self.feed = FeedAnnouncer(client, self.keys, store)
        self.stats = {"records": 0, "batches": 0, "poison": 0, "claimed": 0, "store_waits": 0, "reopened": 0,
                      "feed_errors": 0}
        self._last_claim = 0.0
        self._last_read = 0.0
        self._last_partial = False
        self._last_trim = 0.0
        self._last_lost_check = 0.0
        self._wait_s = 0.0  # current backoff while the store is unavailable
        self._stale_groups: set[str] = set()
        self.ensure_group()

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- one round ----------------------------------------------------------------------
    def poll_once(self, block_ms: int | None = None) -> int:
        entries = self._own_pending() or self._claim_stale()
        if not entries:
            # A partial batch last time means we are keeping up: let records gather for a few
            # ms instead of paying a transaction, an XACK and the observers per handful of
            # records (docs/benchmarks.md: a quarter of the consumer's CPU per step).
            gather = GATHER_S - (time.monotonic() - self._last_read)
            if self._last_partial and gather > 0:
                time.sleep(gather)
            self._last_read = time.monotonic()
            resp = self.r.xreadgroup(GROUP, self.name, {self.stream: ">"}, count=self.settings.consumer_batch,
                                     block=self.settings.consumer_block_ms if block_ms is None else block_ms)
            entries = resp[0][1] if resp else []
            self._last_partial = len(entries) < self.settings.consumer_batch
        n = self._ingest(entries) if entries else 0
        now = time.monotonic()
        if now - self._last_trim > 1.0:
            self._last_trim = now
            self.trim()
        if now - self._last_lost_check > LOST_STEPS_CHECK_S:
            self._last_lost_check = now
            self.reopen_lost_completions()
        return n

    def _own_pending(self) -> list:
        """Entries delivered to this consumer name before a restart and never acknowledged
        (also those left pending while the store was unavailable)."""
        if self._own_pending_done:
            return []
        resp = self.r.xreadgroup(GROUP, self.name, {self.stream: "0"}, count=self.settings.consumer_batch)
        entries = [e for e in (resp[0][1] if resp else []) if e[1]]
        if not entries:
            self._own_pending_done = True
        return entries

    def pending(self) -> int:
        """Records delivered to some consumer and not acknowledged yet."""
        try:
            return int(self.r.xpending(self.stream, GROUP)["pending"])
        except redis.ResponseError:
            return 0

    def _claim_stale(self) -> list:
        now = time.monotonic()
        if now - self._last_claim < max(1.0, self.settings.consumer_claim_idle_ms / 4000):
            return []
        self._last_claim = now
        try:
            # Redis 6.2 answers [next, entries], Redis 7 adds the deleted ids.
            entries = self.r.xautoclaim(self.stream, GROUP, self.name, self.settings.consumer_claim_idle_ms,
                                        start_id="0-0", count=self.settings.consumer_batch)[1]
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                self.ensure_group()
                return []
            raise
        entries = [e for e in entries if e[1] is not None]  # ids whose entry was trimmed
        if entries:
            self.stats["claimed"] += len(entries)
            log.warning("claimed %d records left pending by a dead consumer", len(entries))
        return entries

    def _ingest(self, entries: list) -> int:
        records, ids, poison = [], [], []
        for entry_id, fields in entries:
            raw = fields.get(b"r")
            try:
                records.append(unpack(raw))
                ids.append(entry_id.decode() if isinstance(entry_id, bytes) else entry_id)
            except RecordError as exc:
                poison.append((entry_id, raw, f"undecodable: {exc}"))
        fixes: list[tuple[str, str]] = []
        try:
            if records:
                fixes = self._store(records, ids, poison)
        except StoreUnavailable as exc:
            self._wait_for_store(exc)
            return 0  # nothing acknowledged: the same entries come back as our own pending
        self._wait_s = 0.0
        if records:
            # after the commit, before the XACK: a crash in between re-delivers, and announcing is idempotent
            self._announce(records)
        if poison:
            self._park(poison)
        self.r.xack(self.stream, GROUP, *(e[0] for e in entries))
        if fixes:
            self._completed_after_all(fixes)
        for observe in self.observers:
            try:
                observe(records)
            except Exception:
                log.exception("records observer failed (ignored)")
        self.stats["records"] += len(records)
        self.stats["batches"] += 1
        return len(records)

    def _announce(self, records: list) -> None:
        """The feed's announcements of a committed batch. An outage leaves the batch
        unacknowledged (it comes back); any other error is the batch's data, and is contained:
        logged and counted, the batch acknowledged, the rest of the fleet's records go on."""
        try:
            self.feed.after_commit(records)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception:  # noqa: BLE001 - never a crash loop over what a server sent
            self.stats["feed_errors"] += 1
            log.exception("announcing the groups of a batch of %d records failed; the batch is kept", len(records))

    def _store(self, records: list, ids: list[str], poison: list) -> list[tuple[str, str]]:
        """Commit the batch; if the store rejects it, find the record(s) at fault one by one and
        park them, storing the rest. Raises StoreUnavailable when nothing can be stored now.
        Returns the episodes dead-lettered after their completion was stored (see
        :meth:`_completed_after_all`)."""
        try:
            return self.store.write_batch(records, ids).failed_after_completion
        except Exception as exc:  # noqa: BLE001 - classified below
            err = classify(exc)
            if isinstance(err, StoreUnavailable):
                raise err from exc
            log.error("the store rejected a batch of %d records (%s); storing them one by one", len(records), err)
        kept, fixes = [], []
        for rec, entry_id in zip(records, ids):
            try:
                fixes.extend(self.store.write_batch([rec], [entry_id]).failed_after_completion)
                kept.append(rec)
            except Exception as exc:  # noqa: BLE001
                err = classify(exc)
                if isinstance(err, StoreUnavailable):
                    raise err from exc
                poison.append((entry_id, rec.pack(), f"rejected by the store: {err}"))
        # Even when every record of the batch fails alone, each one is parked: a store that
        # cannot take writes at all fails with an error classify() calls unavailable (that
        # batch is retried, never parked), so what is left is data the store refuses; waiting
        # for it would stall the stream for good. An episode whose step was parked is failed as
        # steps_lost once its completion is found short (reopen_lost_completions).
        records[:] = kept
        return fixes

    def _completed_after_all(self, fixes: list[tuple[str, str]]) -> None:
        """Episodes the ledger dead-lettered although the database holds a completion of theirs
        (Redis lost the completing FINISH and a re-run failed): the database's
        completion stands, so the ledger is moved to done and the dead letter withdrawn; a
        re-drive would only run a completed episode again."""
        for job_id, episode_id in fixes:
            if self.ledger.move(job_id, episode_id, LedgerState.DONE, [LedgerState.FAILED]):
                self.dlq.withdraw(job_id, episode_id)
                log.warning("episode %s: completed before Redis lost track of it; its later dead letter withdrawn",
                            episode_id)

    def _park(self, poison: list) -> None:
        pipe = self.r.pipeline(transaction=False)
        for entry_id, raw, why in poison:
            fields = {"id": entry_id, "r": raw or b"", "error": why}
            fields.update(_poison_owner(raw))
            pipe.xadd(self.keys.poison, fields)
            log.error("record %s moved to %s: %s", entry_id, self.keys.poison, why)
        pipe.execute()
        self.stats["poison"] += len(poison)

    def _wait_for_store(self, exc: Exception) -> None:
        self._wait_s = min(_MAX_WAIT_S, max(0.5, self._wait_s * 2))
        self.stats["store_waits"] += 1
        log.error("results store unavailable (%s); records stay pending, retrying in %.1fs", exc, self._wait_s)
        self._own_pending_done = False  # re-read what we hold, in order, once the store is back
        time.sleep(self._wait_s)

    # --- lost steps -----------------------------------------------------------------------
    def reopen_lost_completions(self) -> list[str]:
        """Completions whose missing steps can no longer arrive: every entry before the close
        was committed (none is pending in the group), yet the store lacks steps. Re-run them."""
        try:
            waiting = self.store.completing()
        except Exception as exc:  # noqa: BLE001 - a store hiccup: next round
            log.warning("checking completions for lost steps failed: %s", exc)
            return []
        if not waiting:
            return []
        try:
            oldest = self.r.xpending_range(self.stream, GROUP, min="-", max="+", count=1)
        except redis.ResponseError:
            oldest = []
        floor = _id_tuple(oldest[0]["message_id"]) if oldest else None
        reopened = []
        for episode_id, job_id, attempt_id, entry in waiting:
            if not entry or (floor is not None and floor < _id_tuple(entry)):
                continue  # a record before the close is still pending somewhere: may yet arrive
            status = self.store.reopen_lost_completion(
                episode_id, attempt_id, max_reopens=self.settings.consumer_reopens_max,
                poisoned=self._poisoned(episode_id, attempt_id))
            if not status:
                continue
            if status == StoredStatus.FAILED:
                # The ledger follows, so that the job's count of finished episodes is complete;
                # its failed state is what `interactor dlq redrive --job J --failed` re-drives.
                self.ledger.move(job_id, episode_id, LedgerState.FAILED, [LedgerState.DONE])
                self.feed.after_failure(job_id, episode_id)  # its group may be settled now
                log.error("episode %s: attempt %s completed but some of its steps never reached the database; "
                          "failed as %s (%s)", episode_id, attempt_id, STEPS_LOST,
                          (self.store.episode(episode_id) or {}).get("error"))
                continue
            spec = self.ledger.episode_spec(job_id, episode_id)
            if self.ledger.move(job_id, episode_id, LedgerState.QUEUED, [LedgerState.DONE]):
                push_episodes(self.r, [(job_id, episode_id, self.settings.queue_for(spec))])
            reopened.append(episode_id)
            log.error("episode %s: attempt %s completed but some of its steps were lost in Redis; re-queued",
                      episode_id, attempt_id)
        self.stats["reopened"] += len(reopened)
        return reopened

    def _poisoned(self, episode_id: str, attempt_id: str) -> bool:
        """Whether a record of this attempt of the episode was parked in the poison stream
        (capped at about 10k entries, read in pages; only when a completion is found short)."""
        want_ep, want_attempt = episode_id.encode(), attempt_id.encode()
        start = "-"
        while True:
            page = self.r.xrange(self.keys.poison, min=start, max="+", count=500)
            for entry_id, fields in page:
                ep, aid = fields.get(b"episode"), fields.get(b"attempt_id")
                if ep is None:  # parked before the owner was written beside the record
                    owner = _poison_owner(fields.get(b"r"))
                    ep, aid = owner.get("episode", "").encode(), owner.get("attempt_id", "").encode()
                if ep == want_ep and aid == want_attempt:
                    return True
            if len(page) < 500:
                return False
            last = page[-1][0].decode() if isinstance(page[-1][0], bytes) else page[-1][0]
            start = "(" + last

    # --- stream upkeep ----------------------------------------------------------------------
    def trim(self) -> None:
        """Drop entries every group has acknowledged, never one still pending or unread.

        Another group (a trainer tapping the stream) counts while it is alive; one whose
        consumers have all been idle for ``STALE_GROUP_S`` (or that has none) no longer holds
        the floor: a forgotten tap must not grow the stream until backpressure
        stops every worker."""
        try:
            groups = self.r.xinfo_groups(self.stream)
        except redis.ResponseError:
            return
        floor = None
        for g in groups:
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name != GROUP and self._stale_group(name):
                continue
            candidate = _id_tuple(g["last-delivered-id"])
            pending = self.r.xpending(self.stream, name)
            if pending and pending.get("pending"):
                candidate = min(candidate, _id_tuple(pending["min"]))
            floor = candidate if floor is None else min(floor, candidate)
        if floor and floor > (0, 0):
            self.r.xtrim(self.stream, minid=f"{floor[0]}-{floor[1]}", approximate=False)

    def _stale_group(self, name: str) -> bool:
        try:
            consumers = self.r.xinfo_consumers(self.stream, name)
        except redis.ResponseError:
            return False
        idle_ms = min((int(c.get("idle", 0)) for c in consumers), default=None)
        stale = idle_ms is None or idle_ms > STALE_GROUP_S * 1000
        if stale and name not in self._stale_groups:
            self._stale_groups.add(name)
            log.warning("consumer group %r of %s has been idle for over %.0fs: the stream is trimmed past it",
                        name, self.stream, STALE_GROUP_S)
        elif not stale:
            self._stale_groups.discard(name)
        return stale

    def backlog(self) -> int:
        return int(self.r.xlen(self.stream))

    # --- the process loop ---------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        log.info("consumer %s reading %s into %s", self.name, self.stream, getattr(self.store, "url", "?"))
        if self.sweeper is not None:
            self.sweeper.start()
        delay = 0.0
        try:
            while not stop.is_set():
                try:
                    self.poll_once()
                    delay = 0.0
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
                    delay = min(_MAX_WAIT_S, max(1.0, delay * 2))
                    log.warning("Redis unavailable (%s); retrying in %.0fs", exc, delay)
                    stop.wait(delay)
                except (StoreError, redis.RedisError) as exc:
                    delay = min(_MAX_WAIT_S, max(1.0, delay * 2))
                    log.error("consumer round failed (%s: %s); retrying in %.0fs", type(exc).__name__, exc, delay)
                    stop.wait(delay)
                except Exception:  # noqa: BLE001 - a bug of ours or data we did not foresee: said, never an exit
                    delay = min(_MAX_WAIT_S, max(1.0, delay * 2))
                    self.stats["round_errors"] = self.stats.get("round_errors", 0) + 1
                    log.exception("consumer round failed unexpectedly; retrying in %.0fs", delay)
                    stop.wait(delay)
        finally:
            if self.sweeper is not None:
                self.sweeper.stop()
        log.info("consumer %s stopped: %s", self.name, self.stats)


def _poison_owner(raw) -> dict[str, str]:
    """The episode and attempt_id of a parked record, when it decodes and has them."""
    try:
        rec = unpack(raw) if raw else None
    except RecordError:
        return {}
    if type(rec) is StepRecord:
        return {"episode": rec.env_id, "attempt_id": rec.attempt_id or f"n{rec.attempt}"}
    if type(rec) is AttemptRecord:
        return {"episode": rec.episode_id, "attempt_id": rec.attempt_id or f"n{rec.attempt}"}
    return {}


def _id_tuple(entry_id) -> tuple[int, int]:
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    ms, _, seq = str(entry_id).partition("-")
    return int(ms), int(seq or 0)
