"""What the pages read: the results store, through its reader methods, and Redis for what
only Redis knows while a job runs (the ledger's queued / running / retrying counts, the fleet,
the dead-letter queue).

Redis is optional: ``interactor ui --store runs/demo/results.sqlite`` after a run whose
embedded Redis has stopped shows everything stored, and says that live state is off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, TypeVar

import redis

from broker.settings import Settings, redact_url
from broker.states import LedgerState, StoredStatus

log = logging.getLogger("interactor.ui")
T = TypeVar("T")

RATE_WINDOW_S = 10.0  # steps/s of a running job: over the samples of the last this many seconds
DOWN_RETRY_S = 5.0  # after a failed Redis call, pages do not try again for this long
JOB_IDS_TTL_S = 3.0  # the store's job list is re-read at most this often (it scans every job)
FINISHED_TTL_S = 10.0  # a finished job's stored progress is re-read at most this often
AUDIT_SHOWN = 200  # a job page's newest audit entries
AGGREGATE_TTL_S = {True: 3.0, False: 30.0}  # job-wide aggregates, by "is the job active"
MAX_JOBS = 100
# A server runs for weeks; what it remembers per job must not grow with every job it has seen.
MAX_REMEMBERED_JOBS = 4 * MAX_JOBS


class LiveState:
    """The Redis side, every call guarded: an unreachable Redis costs one failed call, then
    pages skip it for :data:`DOWN_RETRY_S` and say why instead of waiting on timeouts."""

    def __init__(self, settings: Settings, client: redis.Redis | None = None):
        from broker.dlq import DeadLetterQueue
        from broker.keys import Keys
        from broker.ledger import Ledger
        from broker.pause import JobPause
        from broker.redisconn import connect
        from interactor.fleet_reader import FleetReader

        self.settings = settings
        self.url_shown = redact_url(settings.redis_url)
        self.client = client or connect(settings, retries=1, max_connections=16)
        self.ledger = Ledger(self.client, Keys(settings.key_prefix), settings.lease_ttl_s)
        self.dlq = DeadLetterQueue(self.client, settings)
        self.fleet = FleetReader(self.client, settings)
        self.pauses = JobPause(self.client, Keys(settings.key_prefix))
        self.error = ""
        self._down_until = 0.0

    def call(self, fn: Callable[[], Any], default: Any = None) -> Any:
        if time.monotonic() < self._down_until:
            return default
        try:
            out = fn()
        except (redis.RedisError, OSError) as exc:
            self.error = self._redacted(f"{type(exc).__name__}: {exc}")
            self._down_until = time.monotonic() + DOWN_RETRY_S
            log.warning("Redis at %s: %s", self.url_shown, self.error)
            return default
        self.error = ""
        return out

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _redacted(self, text: str) -> str:
        from broker.redisurl import redis_password

        for secret in (redis_password(self.settings.redis_url), self.settings.redis_sentinel_password.reveal()):
            text = text.replace(secret, "***") if secret else text
        return text


class RateMeter:
    """Steps/s of running jobs, from the step totals the pages read as they poll."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._samples: dict[str, deque] = {}
        self._lock = threading.Lock()

    def sample(self, job_id: str, steps: int, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if job_id not in self._samples and len(self._samples) >= MAX_REMEMBERED_JOBS:
                # forget the job sampled least recently (a finished job is sampled no more)
                del self._samples[min(self._samples, key=lambda j: self._samples[j][-1][0])]
            q = self._samples.setdefault(job_id, deque())
            if not q or now - q[-1][0] >= 0.5:
                q.append((now, steps))
            while len(q) > 2 and now - q[1][0] >= self.window_s:
                q.popleft()
            t0, s0 = q[0]
            if now - t0 < 1.0:
                return None
            return max(0.0, (steps - s0) / (now - t0))


class Source:
    """The results store (one lock around it: the PostgreSQL backend holds one connection)
    and, optionally, :class:`LiveState`."""

    def __init__(self, store, *, store_shown: str, live: LiveState | None = None):
        self.store = store
        self.store_shown = store_shown
        self.live = live
        self.rates = RateMeter()
        self._lock = threading.RLock()
        self._job_ids: tuple[float, list[str]] = (-1e9, [])
        self._finished: dict[str, tuple[float, dict]] = {}
        self._cache: dict[tuple, tuple[float, Any]] = {}

    def _read(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """One of the store's reader methods, called under the lock."""
        with self._lock:
            return fn(*args, **kw)

    def _cached(self, ttl_s: float, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`_read`, remembered for ``ttl_s``: the aggregates over a whole job (facets,
        plots' points, summaries), which cost a scan of its episodes (~0.1 s at 100,000) and
        change slowly or, once the job is finished, not at all."""
        key = (fn.__name__, args)
        hit = self._cache.get(key)
        now = time.monotonic()
        if hit is not None and now - hit[0] < ttl_s:
            return hit[1]
        value = self._read(fn, *args)
        if len(self._cache) > 256:
            self._cache.clear()
        self._cache[key] = (now, value)
        return value

    # --- jobs ---------------------------------------------------------------------------
    def job_ids(self) -> list[str]:
        """Jobs in the store and in Redis, newest first."""
        t, ids = self._job_ids
        if time.monotonic() - t > JOB_IDS_TTL_S:
            ids = self._read(self.store.job_ids)
            self._job_ids = (time.monotonic(), ids)
        out = list(ids)
        if self.live is not None:
            known = set(out)
            out += [j for j in self.live.call(self.live.ledger.job_ids, []) if j not in known]
        return out[::-1][:MAX_JOBS]

    def progress(self, job_ids: list[str]) -> list[dict]:
        counts, paused = {}, {}
        if self.live is not None and job_ids:
            got = self.live.call(lambda: self.live.ledger.counts_many(job_ids), None)
            if got:
                counts = {j: c for j, c in zip(job_ids, got) if sum(c.values())}
            # jobs that paused themselves (broker/pause.py): the page says why
            paused = self.live.call(lambda: self.live.pauses.states(job_ids), None) or {}
        out = [self._progress(j, counts.get(j)) for j in job_ids]
        for p in out:
            state = paused.get(p["job_id"])
            p["paused"] = state.describe() if state is not None else ""
        return out

    def _progress(self, job_id: str, ledger: dict | None) -> dict:
        cached = self._finished.get(job_id)
        if cached and time.monotonic() - cached[0] < FINISHED_TTL_S:
            p = cached[1]
        else:
            p = self._read(self.store.job_progress, job_id)
        st = p["statuses"]
        stored = sum(st.values())
        total = p["episodes_expected"] or (sum(ledger.values()) if ledger else stored)
        if ledger:
            done, failed = ledger[LedgerState.DONE], ledger[LedgerState.FAILED]
            cancelled = ledger.get(LedgerState.CANCELLED, 0)
            running, queued = ledger[LedgerState.RUNNING], ledger[LedgerState.QUEUED]
            retrying = ledger[LedgerState.RETRYING]
            source = "redis"
        else:
            done, failed = st.get(StoredStatus.COMPLETED, 0), st.get(StoredStatus.FAILED, 0)
            cancelled = st.get(StoredStatus.CANCELLED, 0)
            running = st.get(StoredStatus.RUNNING, 0) + st.get(StoredStatus.COMPLETING, 0)
            retrying = st.get(StoredStatus.RETRYING, 0)
            queued = max(0, total - stored)
            source = "store"
        ended = done + failed + cancelled  # a cancelled job (broker/cancel.py) is finished too
        active = running + queued + retrying > 0 or (source == "store" and ended < total)
        if active:
            self._finished.pop(job_id, None)
            rate = self.rates.sample(job_id, p["steps"])
        else:
            if job_id not in self._finished and len(self._finished) >= MAX_REMEMBERED_JOBS:
                del self._finished[min(self._finished, key=lambda j: self._finished[j][0])]
            self._finished[job_id] = (time.monotonic(), p)
            span = (p["last_finished"] - p["first_started"]) if p["first_started"] and p["last_finished"] else None
            rate = p["steps"] / span if span and span > 0 else None
        return {
            "job_id": job_id, "model": p["model"], "created_at": p["created_at"], "total": total,
            LedgerState.DONE: done, LedgerState.FAILED: failed, LedgerState.RUNNING: running,
            LedgerState.QUEUED: queued, LedgerState.RETRYING: retrying, LedgerState.CANCELLED: cancelled,
            "progress": ended / total if total else 1.0, "steps": p["steps"], "steps_per_s": rate,
            "mean_reward": p["mean_reward"], "active": active, "counts_from": source,
        }

    # --- what the pages read from the store (consumer/storage/reads.py, browse.py) ----------
    def job(self, job_id: str) -> dict | None:
        return self._read(self.store.job, job_id)

    def audit(self, job_id: str, limit: int = AUDIT_SHOWN) -> list[dict]:
        """Who changed the job and when, newest first: the store's copy (consumer/storage/job_audit.py),
        with the entries Redis holds that the consumer has not stored yet."""
        from broker.audit import JobAudit
        from broker.keys import Keys
        from consumer.storage import job_audit

        out = self._read(job_audit.entries, self.store, job_id, limit)
        if self.live is not None:
            live = self.live
            out += live.call(lambda: JobAudit(live.client, Keys(live.settings.key_prefix)).entries(job_id, limit), [])
        seen, merged = set(), []
        for e in sorted(out, key=lambda e: -float(e.get("at") or 0)):
            key = (round(float(e.get("at") or 0), 3), e.get("who"), e.get("action"))
            if key not in seen:
                seen.add(key)
                merged.append(e)
        return merged[:limit]

    def results(self, job_id: str, *, ttl_s: float) -> dict:
        return self._cached(ttl_s, self.store.results, job_id)

    def scores(self, job_id: str, *, ttl_s: float) -> dict:
        """How sure the job's scores are, and its tasks solved always, sometimes, never."""
        from consumer.storage.score_stats import score_summary, task_rows

        def read(job_id: str) -> dict:
            samples = self.store.score_samples(job_id)  # one read of the job's episodes for both
            rows = task_rows(samples)
            return score_summary(samples) | {"solved_by": {k: sum(1 for r in rows if r["solved_by"] == k)
                                                           for k in ("always", "sometimes", "never")}}
        return self._cached(ttl_s, read, job_id)

    def compare(self, job_a: str, job_b: str, threshold: float | None, *, ttl_s: float) -> dict:
        """Two jobs side by side (consumer/storage/compare.py)."""
        return self._cached(ttl_s, self.store.compare_jobs, job_a, job_b, threshold)

    def reward_points(self, job_id: str, *, ttl_s: float) -> list[tuple[str, float, float | None]]:
        return self._cached(ttl_s, self.store.reward_points, job_id)

    def episode_facets(self, job_id: str, *, ttl_s: float) -> dict[str, dict[str, int]]:
        return self._cached(ttl_s, self.store.episode_facets, job_id)

    def page_episodes(self, job_id: str, *, sort: str, descending: bool, limit: int, after: tuple[Any, str] | None,
                      **filters: Any) -> list[dict]:
        return self._read(self.store.page_episodes, job_id, sort=sort, descending=descending, limit=limit,
                          after=after, **filters)

    def count_episodes(self, job_id: str, **filters: Any) -> int:
        return self._read(self.store.count_episodes, job_id, **filters)

    def page_groups(self, job_id: str, *, sort: str, descending: bool, limit: int, after: tuple[Any, str] | None,
                    **filters: Any) -> list[dict]:
        return self._read(self.store.page_groups, job_id, sort=sort, descending=descending, limit=limit,
                          after=after, **filters)

    def count_groups(self, job_id: str, **filters: Any) -> int:
        return self._read(self.store.count_groups, job_id, **filters)

    def group_members_many(self, group_ids: list[str]) -> dict[str, list[dict]]:
        return self._read(self.store.group_members_many, group_ids)

    def env_names(self, job_id: str) -> list[str]:
        return self._read(self.store.env_names, job_id)

    def group(self, group_id: str) -> dict | None:
        return self._read(self.store.group, group_id)

    def group_members(self, group_id: str) -> list[dict]:
        return self._read(self.store.group_members, group_id)

    def episode(self, episode_id: str) -> dict | None:
        return self._read(self.store.episode, episode_id)

    def episode_trajectory(self, episode_id: str) -> list[dict]:
        return self._read(self.store.episode_trajectory, episode_id)

    def superseded_steps(self, episode_id: str) -> list[dict]:
        return self._read(self.store.superseded_steps, episode_id)

    def job_environment(self, env_id: str) -> dict | None:
        return self._read(self.store.job_environment, env_id)

    def attempts(self, episode_id: str) -> list[dict]:
        return self._read(self.store.attempts, episode_id)

    def episode_tokens(self, episode_id: str) -> list[dict]:
        return self._read(self.store.episode_tokens, episode_id)

    def episode_token_index(self, episode_id: str) -> dict[int, dict]:
        return self._read(self.store.episode_token_index, episode_id)

    # --- Redis ----------------------------------------------------------------------------
    def fleet(self) -> dict | None:
        if self.live is None:
            return None
        snap = self.live.call(self.live.fleet.snapshot, None)
        if snap is None:
            return None
        return {LedgerState.QUEUED: sum(q["depth"] for q in snap["queues"].values()),
                LedgerState.RUNNING: snap["episodes"][LedgerState.RUNNING],
                "dead_letters": snap["dead_letters"], "steps_per_s": snap["steps_per_s"],
                "breakers": snap.get("breakers", []), "redis": snap["redis"]}

    def model_caps(self, job_id: str) -> list[dict]:
        """The fleet-wide cap on the job's model endpoint, as status shows it (the limit in force,
        in use, adaptive bounds, its last change: broker/caps.py ``use``) with its recent changes
        (broker/adaptive.py ``history``); [] without Redis, or when the endpoint has no cap."""
        if self.live is None:
            return []
        live = self.live

        def read() -> list[dict]:
            from broker.adaptive import AdaptiveCaps
            from broker.caps import CAP_MODEL, FleetSlots, server_name
            from broker.keys import Keys
            from broker.ledger import Ledger

            job = Ledger.for_settings(live.client, live.settings).job_spec(job_id)
            if job is None:
                return []
            keys, name = Keys(live.settings.key_prefix), server_name(job.llm_base_url)
            caps = [c for c in FleetSlots(live.client, keys, 0).use() if c["kind"] == CAP_MODEL and c["name"] == name]
            for c in caps:
                c["history"] = AdaptiveCaps(live.client, keys).history(keys.cap(CAP_MODEL, name), 12)[::-1]
            return caps

        return live.call(read, [])

    def feed(self, job_id: str) -> dict | None:
        """The job's online-RL feed (broker/feed.py ``summary``), or None: no Redis, or no feed.
        Only Redis knows it (its counters and stream), so a store-only browser shows none."""
        if self.live is None:
            return None
        from broker import feed
        from broker.keys import Keys

        keys = Keys(self.live.settings.key_prefix)

        def read():
            if not feed.has_feed(self.live.client, keys, job_id):
                return None
            out = feed.summary(self.live.client, keys, job_id)
            cfg = feed.config(self.live.client, keys, job_id)
            out["config"] = cfg
            return out

        return self.live.call(read, None)

    # --- dead letters -------------------------------------------------------------------
    def dead_letters(self, job_id: str | None = None, reason: str | None = None,
                     limit: int = 1000) -> tuple[list, int, bool] | None:
        """The newest ``limit`` letters (see ``DeadLetterQueue.newest``), or None without Redis."""
        if self.live is None:
            return None
        return self.live.call(lambda: self.live.dlq.newest(job_id=job_id or None, reason=reason or None,
                                                           limit=limit), None)

    def dead_letter(self, episode_id: str, job_id: str | None = None):
        if self.live is None:
            return None
        return self.live.call(lambda: self.live.dlq.get(episode_id, job_id), None)

    def redrive(self, episode_ids: list[str], who: str | None = None) -> list[str]:
        """Re-drive these dead letters (as ``interactor dlq redrive IDS``), the jobs' audit logs
        signed ``who``; raises if Redis fails."""
        assert self.live is not None
        letters = [d for d in (self.live.dlq.get(e) for e in dict.fromkeys(episode_ids)) if d is not None]
        return self.live.dlq.redrive(letters, who=who)
