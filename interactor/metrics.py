"""The fleet's numbers: one snapshot read from Redis, shown by Prometheus and `interactor status`.

Two sources, both in Redis so that any process can serve them (``interactor metrics``, the
consumer with ``--metrics-port``) and every replica shows the same fleet-wide figures:

* **Live state**, read at scrape time: queue depth per queue and per priority sub-queue, messages
  in flight (kombu's layout is known in broker/queueing.py), the ledger (episodes per state, per job),
  leases, retries, dead letters, the results stream and its consumer group.
* **Counters and histograms of what happened**, folded from the records the consumer commits
  (consumer/stats.py's ``StatsRecorder``, its ``observers`` hook) into the ``<prefix>:stats``
  hash: steps, per-step env and model latency, episode duration, finished episodes, failures by
  reason, tokens.

Metric names are listed in :data:`METRIC_NAMES`; deploy/grafana and docs/deployment.md use them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Iterable

import redis

from broker.caps import FleetSlots
from broker.keys import Keys
from broker.pause import JobPause
from broker.ratelimit import RateLimits
from broker.queueing import PRIORITY_SEP, declared_queues, inflight_per_queue, sub_queues
from broker.settings import Settings, redact_url
from broker.states import LEDGER_WAITING, LedgerState
from consumer.stats import (
    COUNTERS,
    HISTOGRAMS,
    RATE_WINDOW_S,
    SAMPLES_KEEP_S,
    Stats,
    read_stats,
    steps_rate,
)

log = logging.getLogger("interactor.metrics")

MAX_JOBS_SCANNED = 1000  # the most recent jobs looked at per snapshot
RECENT_FINISHED_JOBS = 5  # finished jobs still shown per snapshot (besides every active one)

METRIC_NAMES = {
    # live state
    "interactor_redis_up": "gauge",
    "interactor_queue_depth": "gauge",
    "interactor_queue_inflight": "gauge",
    "interactor_episodes": "gauge",
    "interactor_episodes_running": "gauge",
    "interactor_episodes_reserved": "gauge",
    "interactor_leases_live": "gauge",
    "interactor_leases_expired": "gauge",
    "interactor_retry_scheduled": "gauge",
    "interactor_dead_letters": "gauge",
    "interactor_results_stream_length": "gauge",
    "interactor_results_pending": "gauge",
    "interactor_results_lag": "gauge",
    "interactor_results_consumers": "gauge",
    "interactor_results_poison": "gauge",
    "interactor_steps_per_second": "gauge",
    "interactor_breaker_open": "gauge",
    "interactor_breaker_open_seconds": "gauge",
    "interactor_jobs_active": "gauge",
    "interactor_job_episodes": "gauge",
    "interactor_job_size": "gauge",
    "interactor_job_progress_ratio": "gauge",
    # the online-RL feed of a job (broker/feed.py), live from its counters
    "interactor_feed_groups": "gauge",
    "interactor_feed_groups_settled": "counter",
    "interactor_feed_groups_delivered": "counter",
    "interactor_feed_version": "gauge",
    "interactor_feed_versions_behind_mean": "gauge",
    "interactor_feed_trainer_wait_seconds": "counter",
    "interactor_feed_takes": "counter",
    # fleet-wide limits (broker/caps.py, broker/ratelimit.py, broker/pause.py)
    "interactor_job_paused": "gauge",
    "interactor_fleet_cap_limit": "gauge",
    "interactor_fleet_cap_in_use": "gauge",
    "interactor_rate_limit": "gauge",
    "interactor_rate_bucket": "gauge",
    "interactor_rate_hold_seconds": "gauge",
    # folded from committed records
    "interactor_steps": "counter",
    "interactor_episodes_finished": "counter",
    "interactor_episodes_ended": "counter",
    "interactor_attempt_failures": "counter",
    "interactor_prompt_tokens": "counter",
    "interactor_completion_tokens": "counter",
    "interactor_step_latency_seconds": "histogram",
    "interactor_episode_duration_seconds": "histogram",
    "interactor_phase_seconds": "histogram",
}


def _s(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


# --- the reading side: one snapshot of the fleet ---------------------------------------------
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
        """Messages delivered to a worker and not acknowledged yet (reserved or running), per
        queue; only those whose episode holds a live lease or reservation (a killed worker's
        deliveries linger in kombu's hash after the sweeper re-ran their episodes)."""
        return inflight_per_queue(self.r, self.keys)

    # jobs --------------------------------------------------------------------------------
    def job_counts(self, job_ids: list[str]) -> dict[str, dict[str, int]]:
        pipe = self.r.pipeline(transaction=False)
        for j in job_ids:
            pipe.hgetall(self.keys.job_counts(j))
        out = {}
        for j, raw in zip(job_ids, pipe.execute()):
            out[j] = {s: int(raw.get(s.encode(), 0)) for s in LedgerState}
        return out

    # stream ------------------------------------------------------------------------------
    def stream(self) -> dict[str, Any]:
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(k.results)
        pipe.xlen(f"{k.results}:poison")
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
        breaker closed while Redis was away) are dropped and removed."""
        from broker.records import BREAKER_STALE_S, BreakerState, RecordError

        now = time.time()
        merged: dict[tuple[str, str], dict[str, Any]] = {}
        stale = []
        for key, raw in self.r.hgetall(self.keys.breakers).items():
            try:
                b = BreakerState.unpack(raw)
            except RecordError:
                stale.append(key)
                continue
            if now - b.seen > BREAKER_STALE_S:
                stale.append(key)
                continue
            m = merged.setdefault((b.kind, b.server), {"kind": b.kind, "server": b.server, "since": b.since,
                                                      "workers": 0, "error": b.error})
            m["workers"] += 1
            if b.since and (not m["since"] or b.since < m["since"]):
                m["since"] = b.since
        if stale:
            self.r.hdel(self.keys.breakers, *stale)
        return sorted(merged.values(), key=lambda m: (m["kind"], m["server"]))

    # everything ----------------------------------------------------------------------------
    def snapshot(self, job_id: str | None = None) -> dict[str, Any]:
        k = self.keys
        now = time.time()
        now_ms = int(now * 1000)
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
        stats = read_stats(raw_stats)
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
        jobs = []
        for j in shown:
            c = counts.get(j) or {s: 0 for s in LedgerState}
            spec = specs.get(j)
            total = spec.episodes if spec is not None else sum(c.values())
            jobs.append({"job_id": j, "counts": c, "total": total,
                         "created_at": spec.created_at if spec is not None else None,
                         "progress": (c[LedgerState.DONE] + c[LedgerState.FAILED]) / total if total else 1.0,
                         "active": j in active,
                         "paused": dataclasses.asdict(paused[j]) if j in paused else None})
        if jobs:  # jobs with an online-RL feed show it (broker/feed.py)
            from broker import feed

            with_feed = {m.decode() if isinstance(m, bytes) else m for m in self.r.smembers(k.feeds)}
            for entry in jobs:
                if entry["job_id"] in with_feed:
                    entry["feed"] = feed.summary(self.r, k, entry["job_id"])
        return {
            "time": now,
            "redis": redact_url(self.settings.redis_url),
            "key_prefix": self.settings.key_prefix,
            "queues": {q: {"depth": sum(depths[q].values()), "by_priority": depths[q],
                           "inflight": inflight.get(q, 0)} for q in queues},
            "episodes": totals,
            LedgerState.RUNNING: totals[LedgerState.RUNNING],
            "reserved": reserved,
            "leases_live": int(live),
            "leases_expired": int(expired),
            "retry_scheduled": int(retry),
            "dead_letters": int(dead),
            "stream": self.stream(),
            "steps_total": stats.steps_total,
            "steps_per_s": steps_rate(samples, now),
            "stats": stats,
            "jobs_active": len(active),
            "jobs": jobs,
            "breakers": self.breakers(),
            "caps": FleetSlots(self.r, k, 0).use(),
            "rates": self.rates(),
        }

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


# --- Prometheus ------------------------------------------------------------------------------
class FleetCollector:
    """A Prometheus collector that reads one :class:`FleetReader` snapshot per scrape."""

    def __init__(self, reader: FleetReader):
        self.reader = reader

    def describe(self):
        return []  # unchecked collector: families are produced at scrape time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        up = GaugeMetricFamily("interactor_redis_up", "1 when Redis answered this scrape")
        try:
            snap = self.reader.snapshot()
        except redis.RedisError as exc:
            log.warning("metrics: Redis unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up

        g = GaugeMetricFamily("interactor_queue_depth",
                              "Episode tasks waiting in a Celery queue, per priority sub-queue",
                              labels=["queue", "priority"])
        inf = GaugeMetricFamily("interactor_queue_inflight",
                                "Tasks delivered to a worker and not acknowledged (reserved or running)",
                                labels=["queue"])
        for q, d in snap["queues"].items():
            for p, n in d["by_priority"].items():
                g.add_metric([q, str(p)], n)
            inf.add_metric([q], d["inflight"])
        yield g
        yield inf

        eps = GaugeMetricFamily("interactor_episodes", "Episodes per ledger state, over the jobs scanned",
                                labels=["state"])
        for s, n in snap["episodes"].items():
            eps.add_metric([s], n)
        yield eps
        for name, doc, value in (
            ("interactor_episodes_running", "Episodes running now (ledger state running)",
             snap["episodes"][LedgerState.RUNNING]),
            ("interactor_episodes_reserved", "Episodes received by a worker and not started yet", snap["reserved"]),
            ("interactor_leases_live", "Episode leases held by a live worker", snap["leases_live"]),
            ("interactor_leases_expired", "Running episodes whose lease expired (the sweeper re-queues them)",
             snap["leases_expired"]),
            ("interactor_retry_scheduled", "Episodes waiting for their retry backoff", snap["retry_scheduled"]),
            ("interactor_dead_letters", "Episodes in the dead-letter queue", snap["dead_letters"]),
            ("interactor_results_stream_length", "Records in the results stream", snap["stream"]["length"]),
            ("interactor_results_poison", "Undecodable records set aside", snap["stream"]["poison"]),
            ("interactor_steps_per_second", f"Steps stored per second over the last {RATE_WINDOW_S:.0f}s",
             snap["steps_per_s"]),
            ("interactor_jobs_active", "Jobs with episodes not finished", snap["jobs_active"]),
        ):
            m = GaugeMetricFamily(name, doc)
            m.add_metric([], value)
            yield m

        bo = GaugeMetricFamily("interactor_breaker_open",
                               "Worker processes holding this server's circuit breaker open (its episodes wait)",
                               labels=["kind", "server"])
        bs = GaugeMetricFamily("interactor_breaker_open_seconds", "How long the server has been down",
                               labels=["kind", "server"])
        for b in snap["breakers"]:
            bo.add_metric([b["kind"], b["server"]], b["workers"])
            bs.add_metric([b["kind"], b["server"]], max(0.0, snap["time"] - b["since"]) if b["since"] else 0.0)
        yield bo
        yield bs

        pending = GaugeMetricFamily("interactor_results_pending",
                                    "Records delivered to a consumer and not committed yet", labels=["group"])
        lag = GaugeMetricFamily("interactor_results_lag", "Records not delivered to the consumer group yet",
                                labels=["group"])
        consumers = GaugeMetricFamily("interactor_results_consumers", "Consumers in the group", labels=["group"])
        for grp in snap["stream"]["groups"]:
            pending.add_metric([grp["group"]], grp["pending"])
            lag.add_metric([grp["group"]], grp["lag"])
            consumers.add_metric([grp["group"]], grp["consumers"])
        yield pending
        yield lag
        yield consumers

        je = GaugeMetricFamily("interactor_job_episodes", "Episodes of a job per ledger state",
                               labels=["job_id", "state"])
        jt = GaugeMetricFamily("interactor_job_size", "Episodes in a job", labels=["job_id"])
        jp = GaugeMetricFamily("interactor_job_progress_ratio", "Finished (done + failed) / total",
                               labels=["job_id"])
        for job in snap["jobs"]:
            for s, n in job["counts"].items():
                je.add_metric([job["job_id"], s], n)
            jt.add_metric([job["job_id"]], job["total"])
            jp.add_metric([job["job_id"]], job["progress"])
        yield je
        yield jt
        yield jp
        yield from self._feeds([j for j in snap["jobs"] if j.get("feed")])
        jpa = GaugeMetricFamily("interactor_job_paused", "1 while a job is paused: episodes in a row failed with "
                                "this reason (interactor resume JOB continues it)", labels=["job_id", "reason"])
        for job in snap["jobs"]:
            if job.get("paused"):
                jpa.add_metric([job["job_id"], job["paused"]["reason"]], 1)
        yield jpa
        cl = GaugeMetricFamily("interactor_fleet_cap_limit", "A fleet-wide cap: slots in all",
                               labels=["kind", "name"])
        cu = GaugeMetricFamily("interactor_fleet_cap_in_use", "A fleet-wide cap: slots held now",
                               labels=["kind", "name"])
        for cap in snap.get("caps", []):
            cl.add_metric([cap["kind"], cap["name"]], cap["limit"])
            cu.add_metric([cap["kind"], cap["name"]], cap["in_use"])
        yield cl
        yield cu
        rl = GaugeMetricFamily("interactor_rate_limit", "A model endpoint's fleet-wide rate limit, per minute",
                               labels=["server", "unit"])
        rb = GaugeMetricFamily("interactor_rate_bucket", "What the endpoint's bucket holds now (may be below 0 "
                               "for tokens: answers used more than it had)", labels=["server", "unit"])
        rh = GaugeMetricFamily("interactor_rate_hold_seconds", "How long the fleet still waits before calling the "
                               "endpoint (its 429s and x-ratelimit headers)", labels=["server"])
        for rate in snap.get("rates", []):
            for unit, limit, left in (("requests", rate["rpm"], rate["requests_left"]),
                                      ("tokens", rate["tpm"], rate["tokens_left"])):
                if limit:
                    rl.add_metric([rate["server"], unit], limit)
                    rb.add_metric([rate["server"], unit], left)
            rh.add_metric([rate["server"]], rate["hold_s"])
        yield rl
        yield rb
        yield rh

        stats: Stats = snap["stats"]
        docs = {
            "steps": "Steps stored, per environment",
            "episodes_finished": "Episodes finished for good (completed, or failed and dead-lettered)",
            "episodes_ended": "Completed episodes by why they ended (terminated, truncated, length, "
                              "context_length, empty_prompt, max_steps)",
            "attempt_failures": "Attempts that did not complete, by reason and outcome "
                                "(retrying, failed, abandoned)",
            "prompt_tokens": "Prompt tokens the model server reported (usage), per model",
            "completion_tokens": "Completion tokens the model server reported (usage), per model",
            "step_latency_seconds": "Time per step in env calls (get_task_prompt + step) and in the model call",
            "episode_duration_seconds": "Wall clock of the attempt that finished an episode",
            "phase_seconds": "Where each attempt's time went: queue_wait (first attempts: submit to start), reset, "
                             "prompt, model, env_step, close (totals per attempt)",
        }
        for name, labels in COUNTERS.items():
            c = CounterMetricFamily(f"interactor_{name}", docs[name], labels=list(labels))
            for lv, v in sorted(stats.counters.get(name, {}).items()):
                if len(lv) == len(labels):
                    c.add_metric(list(lv), v)
            yield c
        for name, (labels, _) in HISTOGRAMS.items():
            h = HistogramMetricFamily(f"interactor_{name}", docs[name], labels=list(labels))
            for lv, hist in sorted(stats.histograms.get(name, {}).items()):
                if len(lv) == len(labels):
                    h.add_metric(list(lv), hist.cumulative(), hist.sum)
            yield h


    @staticmethod
    def _feeds(jobs: list[dict]):
        """Jobs with an online-RL feed: its groups by state and by outcome, the version, and
        the trainers' wait (a trainer that waits is a trainer the rollouts do not keep busy)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        groups = GaugeMetricFamily("interactor_feed_groups", "Feed groups now: ready (announced, not taken), "
                                   "taken (not acknowledged), inflight (produced, not settled)",
                                   labels=["job_id", "state"])
        settled = CounterMetricFamily("interactor_feed_groups_settled", "Feed groups finished with, by outcome "
                                      "(acked, stale_requeued, stale_dropped, failed, refilled, filtered) and, "
                                      "for filtered, reason", labels=["job_id", "outcome", "reason"])
        delivered = CounterMetricFamily("interactor_feed_groups_delivered", "Feed groups handed to a trainer: "
                                        "first time, or again after their ack timeout", labels=["job_id", "kind"])
        version = GaugeMetricFamily("interactor_feed_version", "The trainer's published policy version",
                                    labels=["job_id"])
        behind = GaugeMetricFamily("interactor_feed_versions_behind_mean", "Mean versions behind the current "
                                   "one of delivered groups' oldest step", labels=["job_id"])
        wait = CounterMetricFamily("interactor_feed_trainer_wait_seconds", "Seconds trainers spent waiting "
                                   "inside take for groups", labels=["job_id"])
        takes = CounterMetricFamily("interactor_feed_takes", "Takes that returned groups", labels=["job_id"])
        for job in jobs:
            j, f = job["job_id"], job["feed"]
            for state in ("ready", "taken", "inflight"):
                groups.add_metric([j, state], f[state])
            for outcome, n in (("acked", f["acked"]), ("stale_requeued", f["requeued"]),
                               ("stale_dropped", f["dropped"]), ("failed", f["failed_reported"]),
                               ("refilled", f["refilled"])):
                settled.add_metric([j, outcome, ""], n)
            for reason, n in sorted(f["filtered_by"].items()):
                settled.add_metric([j, "filtered", reason], n)
            delivered.add_metric([j, "first"], f["delivered"])
            delivered.add_metric([j, "redelivered"], f["redelivered"])
            if f["version"] is not None:
                version.add_metric([j], f["version"])
            if f["versions_behind_mean"] is not None:
                behind.add_metric([j], f["versions_behind_mean"])
            wait.add_metric([j], f["trainer_wait_s"])
            takes.add_metric([j], f["takes"])
        yield from (groups, settled, delivered, version, behind, wait, takes)


def registry(reader: FleetReader):
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(reader))
    return reg


def exposition(reader: FleetReader) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry(reader)).decode()


def serve(reg, host: str = "127.0.0.1", port: int = 9400):
    """Serve ``/metrics`` from a daemon thread; returns ``(server, thread)``."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=host, registry=reg)
