"""One snapshot of the fleet, read from Redis in a few round trips: what ``interactor metrics``
exposes (interactor/metrics.py) and ``interactor status`` shows.

Two sources, both in Redis so that any process can read them and every reader sees the same
fleet-wide figures:

* **Live state**, read at each snapshot: queue depth per queue and per priority sub-queue,
  messages in flight (kombu's layout is known in broker/queueing.py), the ledger (episodes per
  state, per job), leases, retries, dead letters, the results stream and its consumer group,
  breakers, caps, rate limits, paused and cancelled jobs, feeds.
* **Counters and histograms of what happened**, folded from the records the consumer commits
  (consumer/stats.py's ``StatsRecorder``) into the ``<prefix>:stats`` hash.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Iterable

import redis

from broker.cancel import JobCancel
from broker.caps import FleetSlots
from broker.job_budgets import JobBudget, read_usages, usage_text
from broker.keys import Keys
from broker.ledger import Ledger
from broker.audit import JobAudit
from broker.pause import JobPause
from broker.queueing import PRIORITY_SEP, declared_queues, inflight_per_queue, sub_queues
from broker.ratelimit import RateLimits
from broker.settings import Settings, redact_url
from broker.states import LEDGER_FINAL, LEDGER_WAITING, LedgerState
from consumer.stats import SAMPLES_KEEP_S, read_stats, steps_rate

log = logging.getLogger("interactor.metrics")

MAX_JOBS_SCANNED = 1000  # the most recent jobs looked at per snapshot
RECENT_FINISHED_JOBS = 5  # finished jobs still shown per snapshot (besides every active one)
AUDIT_SHOWN = 5  # `status JOB`: its newest audit entries shown


def _s(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


class FleetReader:
    """Reads everything the metrics and `interactor status` show, in a few Redis round trips.

    Queues seen: the settings' queue and ``queues``, ``extra_queues``, every queue a Celery
    worker declared (kombu's binding sets), every queue with tasks in flight, and every Redis
    list holding episode tasks (a SCAN by type, at most every ``rescan_s``; a list counts when
    its oldest message is one of our tasks). A queue seen once keeps being reported (at 0 once
    drained), so a queue nobody serves yet shows its depth too.
    """

    def __init__(self, client: redis.Redis, settings: Settings, extra_queues: Iterable[str] = (),
                 rescan_s: float = 30.0):
        self.r = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.extra_queues = [q for q in extra_queues if q]
        self.rescan_s = rescan_s
        self._seen: set[str] = set()
        self._not_queues: set[str] = set()
        self._last_scan = -math.inf

    # queues ----------------------------------------------------------------------------
    def _scan_task_lists(self) -> set[str]:
        from broker.queueing import decode_task_args

        found = set()
        for key in self.r.scan_iter(count=1000, _type="list"):
            name = _s(key)
            base = name.split(PRIORITY_SEP, 1)[0]
            if base in self._seen or base in found or name in self._not_queues:
                continue
            raw = self.r.lindex(key, -1)  # the oldest: kombu LPUSHes and BRPOPs
            if raw is not None and decode_task_args(raw) is not None:
                found.add(base)
            else:
                if len(self._not_queues) > 10_000:
                    self._not_queues.clear()
                self._not_queues.add(name)
        return found

    def queues(self, inflight: dict[str, int] | None = None) -> list[str]:
        qs = set(self.settings.served_queues) | {self.settings.queue} | set(self.extra_queues) | self._seen
        qs |= set(inflight or ())
        now = time.monotonic()
        if now - self._last_scan >= self.rescan_s:
            self._last_scan = now
            try:
                qs |= declared_queues(self.r) | self._scan_task_lists()
            except redis.ResponseError as exc:  # e.g. SCAN TYPE on a Redis older than 6
                log.debug("queue discovery: %s", exc)
        if len(qs) < 10_000:
            self._seen = qs
        return sorted(qs)

    def queue_depths(self, queues: list[str]) -> dict[str, dict[int, int]]:
        pipe = self.r.pipeline(transaction=False)
        for q in queues:
            for _, name in sub_queues(q):
                pipe.llen(name)
        out = pipe.execute()
        depths, i = {}, 0
        for q in queues:
            depths[q] = {}
            for p, _ in sub_queues(q):
                depths[q][p] = int(out[i])
                i += 1
        return depths

    def inflight(self) -> dict[str, int]:
        """Episodes delivered to a worker and not finished (a live reservation or lease), per queue."""
        return inflight_per_queue(self.r, self.keys, self._queues_of)

    def _queues_of(self, job_id: str, episode_ids: list[str]) -> list[str]:
        """Each episode's queue: the job's one queue when it has one, else its spec's."""
        ledger = Ledger.for_settings(self.r, self.settings)
        queues = ledger.job_queues(job_id)
        if len(queues) == 1:
            return [next(iter(queues))] * len(episode_ids)
        specs = ledger.episode_specs(job_id, episode_ids)
        return [self.settings.queue_for(specs.get(e)) for e in episode_ids]

    # jobs --------------------------------------------------------------------------------
    def job_counts(self, job_ids: list[str]) -> dict[str, dict[str, int]]:
        return dict(zip(job_ids, Ledger(self.r, self.keys).counts_many(job_ids)))

    # stream ------------------------------------------------------------------------------
    def stream(self) -> dict[str, Any]:
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(k.results)
        pipe.xlen(k.poison)
        length, poison = pipe.execute()
        groups = []
        try:
            infos = self.r.xinfo_groups(k.results)
        except redis.ResponseError:
            infos = []
        last_generated = None
        for g in infos:
            name = _s(g["name"])
            pending_n = int(g.get("pending") or 0)
            lag = g.get("lag")
            if lag is None:
                # Redis < 7 has no lag. Nothing undelivered when the group has seen the last id;
                # otherwise the stream holds (after the consumer's MINID trim) what is pending,
                # what is undelivered and a few acknowledged records: an upper bound.
                if last_generated is None:
                    try:
                        last_generated = _s(self.r.xinfo_stream(k.results).get("last-generated-id"))
                    except redis.ResponseError:
                        last_generated = ""
                lag = 0 if _s(g["last-delivered-id"]) == last_generated else max(0, int(length) - pending_n)
            groups.append({"group": name, "pending": pending_n, "lag": int(lag or 0),
                           "consumers": int(g.get("consumers") or 0)})
        return {"length": int(length), "poison": int(poison), "groups": groups}

    # breakers ------------------------------------------------------------------------------
    def breakers(self) -> list[dict[str, Any]]:
        """Open circuit breakers, one entry per server: which, since when, on how many worker
        processes, the last error. Entries not refreshed lately (their worker died, or the
        breaker closed while Redis was away) are skipped; the workers remove them
        (workers/breakers.py), the one writer of the hash."""
        from broker.records import live_breaker

        now = time.time()
        merged: dict[tuple[str, str], dict[str, Any]] = {}
        for raw in self.r.hgetall(self.keys.breakers).values():
            b = live_breaker(raw, now)
            if b is None:
                continue
            m = merged.setdefault((b.kind, b.server), {"kind": b.kind, "server": b.server, "since": b.since,
                                                      "workers": 0, "error": b.error})
            m["workers"] += 1
            if b.since and (not m["since"] or b.since < m["since"]):
                m["since"] = b.since
        return sorted(merged.values(), key=lambda m: (m["kind"], m["server"]))

    # everything ----------------------------------------------------------------------------
    def snapshot(self, job_id: str | None = None) -> dict[str, Any]:
        k = self.keys
        now = time.time()
        job_ids = [j.decode() for j in self.r.zrange(k.jobs, -MAX_JOBS_SCANNED, -1)]
        if job_id and job_id not in job_ids and self.r.zscore(k.jobs, job_id) is not None:
            job_ids.append(job_id)
        counts = self.job_counts(job_ids)
        active = [j for j in job_ids if any(counts[j][s] for s in (*LEDGER_WAITING, LedgerState.RUNNING))]
        finished = [j for j in job_ids if j not in set(active)]
        shown = [job_id] if job_id else active + finished[-RECENT_FINISHED_JOBS:]
        # `status JOB` counts that job's episodes; the fleet-wide figures (queues, leases,
        # stream) stay fleet-wide
        counted = [job_id] if job_id else job_ids
        totals = {s: sum(counts[j][s] for j in counted if j in counts) for s in LedgerState}
        inflight = self.inflight()
        queues = self.queues(inflight)
        depths = self.queue_depths(queues)
        fleet = self._fleet_counts(now)
        jobs = self._jobs_shown(shown, counts, active)
        if job_id and jobs:  # `status JOB`: the job's last changes, who and when (broker/audit.py)
            jobs[0]["audit"] = JobAudit(self.r, k).entries(job_id, AUDIT_SHOWN)
        return {
            "time": now,
            "redis": redact_url(self.settings.redis_url),
            "key_prefix": self.settings.key_prefix,
            "queues": {q: {"depth": sum(depths[q].values()), "by_priority": depths[q],
                           "inflight": inflight.get(q, 0)} for q in queues},
            "episodes": totals,
            LedgerState.RUNNING: totals[LedgerState.RUNNING],
            "reserved": fleet["reserved"],
            "leases_live": fleet["leases_live"],
            "leases_expired": fleet["leases_expired"],
            "retry_scheduled": fleet["retry_scheduled"],
            "dead_letters": fleet["dead_letters"],
            "stream": self.stream(),
            "steps_total": fleet["stats"].steps_total,
            "steps_per_s": steps_rate(fleet["samples"], now),
            "stats": fleet["stats"],
            "jobs_active": len(active),
            "jobs": jobs,
            "breakers": self.breakers(),
            "caps": FleetSlots(self.r, k, 0).use(),
            "rates": self.rates(),
        }

    def _fleet_counts(self, now: float) -> dict[str, Any]:
        """Leases live and expired, retries, dead letters, reservations, and the folded counters
        with the steps' rate samples, in one round trip."""
        k = self.keys
        now_ms = int(now * 1000)
        pipe = self.r.pipeline(transaction=False)
        pipe.zcount(k.running, now_ms, "+inf")
        pipe.zcount(k.running, "-inf", f"({now_ms}")
        pipe.zcard(k.retry)
        pipe.hlen(k.dlq)
        pipe.hgetall(k.stats)
        pipe.zrangebyscore(k.stats_samples, now - SAMPLES_KEEP_S, "+inf")
        reserved_key = getattr(k, "reserved", None)
        if reserved_key:
            pipe.zcard(reserved_key)
        res = pipe.execute()
        live, expired, retry, dead, raw_stats, raw_samples = res[:6]
        reserved = int(res[6]) if reserved_key else 0
        samples = []
        for m in raw_samples:
            ts, _, n = (m.decode() if isinstance(m, bytes) else m).partition(":")
            try:
                samples.append((float(ts), int(n)))
            except ValueError:
                pass
        return {"leases_live": int(live), "leases_expired": int(expired), "retry_scheduled": int(retry),
                "dead_letters": int(dead), "reserved": reserved, "stats": read_stats(raw_stats), "samples": samples}

    def _jobs_shown(self, shown: list[str], counts: dict[str, dict[str, int]], active: list[str]) -> list[dict]:
        """One entry per job shown: its counts, size, progress, whether it is active, paused or
        cancelled, and its feed when it has one."""
        k = self.keys
        specs = {}
        if shown:
            pipe = self.r.pipeline(transaction=False)
            for j in shown:
                pipe.get(k.job_spec(j))
            from broker.records import unpack

            for j, raw in zip(shown, pipe.execute()):
                try:
                    specs[j] = unpack(raw) if raw else None
                except Exception:
                    specs[j] = None
        paused = JobPause(self.r, k).states(shown)
        cancelled = JobCancel(self.r, self.settings).cancelled(shown)
        jobs = []
        for j in shown:
            c = counts.get(j) or {s: 0 for s in LedgerState}
            spec = specs.get(j)
            total = spec.episodes if spec is not None else sum(c.values())
            jobs.append({"job_id": j, "counts": c, "total": total,
                         "created_at": spec.created_at if spec is not None else None,
                         "progress": sum(c[s] for s in LEDGER_FINAL) / total if total else 1.0,
                         "active": j in active,
                         "paused": dataclasses.asdict(paused[j]) if j in paused else None,
                         "cancelled": j in cancelled})
            if spec is not None and getattr(spec, "cache", ""):  # run with --cache: its look-ups (broker/cache.py)
                raw = self.r.hgetall(k.job_cache(j))
                looked = {_s(f): int(v) for f, v in raw.items()}
                jobs[-1]["cache"] = {"mode": spec.cache, "hits": looked.get("hits", 0),
                                     "misses": looked.get("misses", 0)}
        usages = read_usages(self.r, k, shown) if shown else {}
        for entry in jobs:  # tokens and cost as the consumer counted them, with the budgets (broker/job_budgets.py)
            u, spec = usages[entry["job_id"]], specs.get(entry["job_id"])
            b = JobBudget.of(spec) if spec is not None else JobBudget()
            if u.tokens or u.unknown_steps or u.cached_steps or b.any:
                entry["usage"] = u.to_dict() | {"max_tokens_total": b.max_tokens_total, "budget_usd": b.budget_usd,
                                                "priced": b.price is not None, "text": usage_text(u, b)}
        if jobs:  # jobs with an online-RL feed show it (broker/feed.py)
            from broker import feed

            with_feed = {m.decode() if isinstance(m, bytes) else m for m in self.r.smembers(k.feeds)}
            for entry in jobs:
                if entry["job_id"] in with_feed:
                    entry["feed"] = feed.summary(self.r, k, entry["job_id"])
                    cfg = feed.config(self.r, k, entry["job_id"])
                    # Its groups are produced as trainers take them: no total to be a fraction of.
                    entry["continuous"] = bool(cfg is not None and cfg.continuous)
        return jobs

    def rates(self) -> list[dict[str, Any]]:
        """Each model endpoint's fleet-wide rate limits, with what its buckets hold now."""
        out = []
        limits = RateLimits(self.r, self.keys)
        for server, raw in sorted(self.r.hgetall(self.keys.rates).items()):
            try:
                rpm, tpm = (int(x) for x in raw.decode().split())
            except ValueError:
                continue
            left_r, left_t, hold = limits.levels(server.decode(), rpm, tpm)
            out.append({"server": server.decode(), "rpm": rpm, "tpm": tpm, "requests_left": left_r,
                        "tokens_left": left_t, "hold_s": hold})
        return out
