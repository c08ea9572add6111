"""Reading the results stream into the store: batch, commit, then acknowledge.

* A consumer group gives each record to one consumer; XACK happens only after the SQLite
  commit, so a consumer killed mid-batch leaves its records pending, and another consumer (or
  the same one restarted under a new name) claims them with XAUTOCLAIM once they idle.
* The store ignores a record it already has, so a claimed batch that was in fact committed
  is stored once.
* The stream is trimmed only below the oldest entry not yet acknowledged by every group
  (XTRIM MINID): trimming by length would delete records nobody has read.
* A record that cannot be decoded is moved to ``<prefix>:results:poison`` with its error
  and acknowledged, so one bad record never blocks the stream and nothing is silently lost.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import redis

from broker.keys import Keys
from broker.records import RecordError, unpack
from broker.recovery import Sweeper
from broker.settings import Settings

log = logging.getLogger("interactor.consumer")

GROUP = "consumers"
# While the consumer keeps up, it reads at most every GATHER_S: batches of tens of records
# instead of ones and twos, for at most this much more record latency.
GATHER_S = 0.05


class Ingestor:
    def __init__(self, client: redis.Redis, settings: Settings, store, *, name: str | None = None,
                 observers: list | None = None):
        self.r = client
        self.settings = settings
        self.store = store
        self.keys = Keys(settings.key_prefix)
        self.stream = self.keys.results
        # Stable per host: a restarted consumer re-reads its own pending entries at once instead
        # of waiting for them to idle long enough for XAUTOCLAIM.
        self.name = name or f"consumer@{socket.gethostname()}"
        self._own_pending_done = False
        self.sweeper = Sweeper(client, settings)
        # Called with each committed batch of records (metrics); their errors never stop ingest.
        self.observers = list(observers or [])
        self.stats = {"records": 0, "batches": 0, "poison": 0, "claimed": 0}
        self._last_claim = 0.0
        self._last_read = 0.0
        self._last_partial = False
        self._last_sweep = 0.0
        self._last_trim = 0.0
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
        if now - self._last_sweep > self.settings.sweep_interval_s:
            self._last_sweep = now
            try:
                self.sweeper.tick()
            except redis.RedisError as exc:
                log.warning("sweep failed: %s", exc)
        return n

    def _own_pending(self) -> list:
        """Entries delivered to this consumer name before a restart and never acknowledged."""
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
            ids.append(entry_id)
            raw = fields.get(b"r")
            try:
                records.append(unpack(raw))
            except RecordError as exc:
                poison.append((entry_id, raw, str(exc)))
        if poison:
            pipe = self.r.pipeline(transaction=False)
            for entry_id, raw, why in poison:
                pipe.xadd(f"{self.stream}:poison", {"id": entry_id, "r": raw or b"", "error": why})
                log.error("undecodable record %s moved to %s:poison: %s", entry_id, self.stream, why)
            pipe.execute()
            self.stats["poison"] += len(poison)
        if records:
            self.store.write_batch(records)  # commits before we acknowledge
        self.r.xack(self.stream, GROUP, *ids)
        for observe in self.observers:
            try:
                observe(records)
            except Exception:
                log.exception("records observer failed (ignored)")
        self.stats["records"] += len(records)
        self.stats["batches"] += 1
        return len(records)

    def trim(self) -> None:
        """Drop entries every group has acknowledged, never one still pending or unread."""
        try:
            groups = self.r.xinfo_groups(self.stream)
        except redis.ResponseError:
            return
        floor = None
        for g in groups:
            name = g["name"]
            candidate = _id_tuple(g["last-delivered-id"])
            pending = self.r.xpending(self.stream, name)
            if pending and pending.get("pending"):
                candidate = min(candidate, _id_tuple(pending["min"]))
            floor = candidate if floor is None else min(floor, candidate)
        if floor and floor > (0, 0):
            self.r.xtrim(self.stream, minid=f"{floor[0]}-{floor[1]}", approximate=False)

    def backlog(self) -> int:
        return int(self.r.xlen(self.stream))

    # --- the process loop ---------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        log.info("consumer %s reading %s into %s", self.name, self.stream, getattr(self.store, "path", "?"))
        while not stop.is_set():
            try:
                self.poll_once()
            except redis.ConnectionError as exc:
                log.warning("Redis unavailable (%s); retrying", exc)
                stop.wait(1.0)
        log.info("consumer %s stopped: %s", self.name, self.stats)


def _id_tuple(entry_id) -> tuple[int, int]:
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    ms, _, seq = str(entry_id).partition("-")
    return int(ms), int(seq or 0)
