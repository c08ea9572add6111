"""The fleet's Prometheus metrics: one :class:`FleetReader` snapshot (interactor/fleet_reader.py)
per scrape, exposed as metric families by ``interactor metrics`` or the consumer with
``--metrics-port``. Both sources of the snapshot are in Redis, so any process can serve them and
every replica shows the same fleet-wide figures.

Every metric is declared once in :data:`METRICS` (name, type, help); deploy/grafana and
docs/deployment.md use the names (:data:`METRIC_NAMES`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import redis

from broker.states import LedgerState
from consumer.stats import COUNTERS, HISTOGRAMS, RATE_WINDOW_S, Stats
from interactor.fleet_reader import FleetReader

log = logging.getLogger("interactor.metrics")


class MetricSpec(NamedTuple):
    name: str
    type: str  # gauge, counter or histogram
    help: str


METRICS = (
    # live state
    MetricSpec("interactor_redis_up", "gauge", "1 when Redis answered this scrape"),
    MetricSpec("interactor_queue_depth", "gauge", "Episode tasks waiting in a Celery queue, per priority sub-queue"),
    MetricSpec("interactor_queue_inflight", "gauge",
               "Tasks delivered to a worker and not acknowledged (reserved or running)"),
    MetricSpec("interactor_episodes", "gauge", "Episodes per ledger state, over the jobs scanned"),
    MetricSpec("interactor_episodes_running", "gauge", "Episodes running now (ledger state running)"),
    MetricSpec("interactor_episodes_reserved", "gauge", "Episodes received by a worker and not started yet"),
    MetricSpec("interactor_leases_live", "gauge", "Episode leases held by a live worker"),
    MetricSpec("interactor_leases_expired", "gauge",
               "Running episodes whose lease expired (the sweeper re-queues them)"),
    MetricSpec("interactor_retry_scheduled", "gauge", "Episodes waiting for their retry backoff"),
    MetricSpec("interactor_dead_letters", "gauge", "Episodes in the dead-letter queue"),
    MetricSpec("interactor_results_stream_length", "gauge", "Records in the results stream"),
    MetricSpec("interactor_results_pending", "gauge", "Records delivered to a consumer and not committed yet"),
    MetricSpec("interactor_results_lag", "gauge", "Records not delivered to the consumer group yet"),
    MetricSpec("interactor_results_consumers", "gauge", "Consumers in the group"),
    MetricSpec("interactor_results_poison", "gauge", "Undecodable records set aside"),
    MetricSpec("interactor_steps_per_second", "gauge", f"Steps stored per second over the last {RATE_WINDOW_S:.0f}s"),
    MetricSpec("interactor_breaker_open", "gauge",
               "Worker processes holding this server's circuit breaker open (its episodes wait)"),
    MetricSpec("interactor_breaker_open_seconds", "gauge", "How long the server has been down"),
    MetricSpec("interactor_jobs_active", "gauge", "Jobs with episodes not finished"),
    MetricSpec("interactor_job_episodes", "gauge", "Episodes of a job per ledger state"),
    MetricSpec("interactor_job_size", "gauge", "Episodes in a job"),
    MetricSpec("interactor_job_progress_ratio", "gauge", "Finished (done + failed + cancelled) / total"),
    # the online-RL feed of a job (broker/feed.py), live from its counters
    MetricSpec("interactor_feed_groups", "gauge", "Feed groups now: ready (announced, not taken), "
               "taken (not acknowledged), inflight (produced, not settled)"),
    MetricSpec("interactor_feed_groups_settled", "counter", "Feed groups finished with, by outcome "
               "(acked, stale_requeued, stale_dropped, failed, refilled, filtered) and, for filtered, reason"),
    MetricSpec("interactor_feed_groups_delivered", "counter", "Feed groups handed to a trainer: "
               "first time, or again after their ack timeout"),
    MetricSpec("interactor_feed_version", "gauge", "The trainer's published policy version"),
    MetricSpec("interactor_feed_versions_behind_mean", "gauge", "Mean versions behind the current "
               "one of delivered groups' oldest step"),
    MetricSpec("interactor_feed_trainer_wait_seconds", "counter", "Seconds trainers spent waiting "
               "inside take for groups"),
    MetricSpec("interactor_feed_takes", "counter", "Takes that returned groups"),
    # fleet-wide limits (broker/caps.py, broker/ratelimit.py, broker/pause.py)
    MetricSpec("interactor_job_paused", "gauge", "1 while a job is paused: episodes in a row failed with "
               "this reason (interactor resume JOB continues it)"),
    MetricSpec("interactor_fleet_cap_limit", "gauge", "A fleet-wide cap: slots in all"),
    MetricSpec("interactor_fleet_cap_in_use", "gauge", "A fleet-wide cap: slots held now"),
    MetricSpec("interactor_fleet_cap_auto_bound", "gauge", "An adaptive cap's bounds (bound: min, max): its "
               "limit follows the server between them (--concurrency auto, broker/adaptive.py)"),
    MetricSpec("interactor_fleet_cap_changed_seconds", "gauge", "Unix time of a fleet-wide cap's last change of "
               "limit (adaptive rule or interactor job JOB set)"),
    MetricSpec("interactor_rate_limit", "gauge", "A model endpoint's fleet-wide rate limit, per minute"),
    MetricSpec("interactor_rate_bucket", "gauge", "What the endpoint's bucket holds now (may be below 0 "
               "for tokens: answers used more than it had)"),
    MetricSpec("interactor_rate_hold_seconds", "gauge", "How long the fleet still waits before calling the "
               "endpoint (its 429s and x-ratelimit headers)"),
    # folded from committed records (consumer/stats.py COUNTERS and HISTOGRAMS, their labels)
    MetricSpec("interactor_steps", "counter", "Steps stored, per environment"),
    MetricSpec("interactor_episodes_finished", "counter",
               "Episodes finished for good (completed, or failed and dead-lettered)"),
    MetricSpec("interactor_episodes_ended", "counter", "Completed episodes by why they ended (terminated, truncated, "
               "length, context_length, empty_prompt, max_steps)"),
    MetricSpec("interactor_attempt_failures", "counter", "Attempts that did not complete, by reason and outcome "
               "(retrying, failed, abandoned)"),
    MetricSpec("interactor_prompt_tokens", "counter", "Prompt tokens the model server reported (usage), per model"),
    MetricSpec("interactor_completion_tokens", "counter",
               "Completion tokens the model server reported (usage), per model"),
    MetricSpec("interactor_resumes", "counter",
               "Attempts that continued their predecessor's env instance instead of starting afresh"),
    MetricSpec("interactor_resume_steps_saved", "counter",
               "Steps resumed attempts did not run again (their predecessors' recorded steps)"),
    MetricSpec("interactor_resume_fallbacks", "counter", "Attempts with a predecessor that started afresh, by why "
               "(call_in_flight, instance_gone, nothing_kept, outage_since_snapshot, not_resumable)"),
    MetricSpec("interactor_step_latency_seconds", "histogram",
               "Time per step in env calls (get_task_prompt + step) and in the model call"),
    MetricSpec("interactor_episode_duration_seconds", "histogram", "Wall clock of the attempt that finished an episode"),
    MetricSpec("interactor_phase_seconds", "histogram", "Where each attempt's time went: queue_wait (first attempts: "
               "submit to start), reset, prompt, model, env_step, close (totals per attempt)"),
)
METRIC_NAMES = {m.name: m.type for m in METRICS}
_SPECS = {m.name: m for m in METRICS}


def _family(name: str, labels: list[str] | None = None):
    """The metric family of ``name`` as :data:`METRICS` declares it (its type and help)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    spec = _SPECS[name]
    kind = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}[spec.type]
    return kind(name, spec.help, labels=labels)


class FleetCollector:
    """A Prometheus collector that reads one :class:`FleetReader` snapshot per scrape."""

    def __init__(self, reader: FleetReader):
        self.reader = reader

    def describe(self):
        return []  # unchecked collector: families are produced at scrape time

    def collect(self):
        up = _family("interactor_redis_up")
        try:
            snap = self.reader.snapshot()
        except redis.RedisError as exc:
            log.warning("metrics: Redis unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _queues(snap)
        yield from _fleet_gauges(snap)
        yield from _breakers(snap)
        yield from _results_groups(snap)
        yield from _jobs(snap)
        yield from _feeds([j for j in snap["jobs"] if j.get("feed")])
        yield from _limits(snap)
        yield from _folded(snap["stats"])


def _queues(snap: dict):
    g = _family("interactor_queue_depth", ["queue", "priority"])
    inf = _family("interactor_queue_inflight", ["queue"])
    for q, d in snap["queues"].items():
        for p, n in d["by_priority"].items():
            g.add_metric([q, str(p)], n)
        inf.add_metric([q], d["inflight"])
    yield g
    yield inf


def _fleet_gauges(snap: dict):
    """Episodes per state, then the fleet's single figures."""
    eps = _family("interactor_episodes", ["state"])
    for s, n in snap["episodes"].items():
        eps.add_metric([s], n)
    yield eps
    for name, value in (
        ("interactor_episodes_running", snap["episodes"][LedgerState.RUNNING]),
        ("interactor_episodes_reserved", snap["reserved"]),
        ("interactor_leases_live", snap["leases_live"]),
        ("interactor_leases_expired", snap["leases_expired"]),
        ("interactor_retry_scheduled", snap["retry_scheduled"]),
        ("interactor_dead_letters", snap["dead_letters"]),
        ("interactor_results_stream_length", snap["stream"]["length"]),
        ("interactor_results_poison", snap["stream"]["poison"]),
        ("interactor_steps_per_second", snap["steps_per_s"]),
        ("interactor_jobs_active", snap["jobs_active"]),
    ):
        m = _family(name)
        m.add_metric([], value)
        yield m


def _breakers(snap: dict):
    bo = _family("interactor_breaker_open", ["kind", "server"])
    bs = _family("interactor_breaker_open_seconds", ["kind", "server"])
    for b in snap["breakers"]:
        bo.add_metric([b["kind"], b["server"]], b["workers"])
        bs.add_metric([b["kind"], b["server"]], max(0.0, snap["time"] - b["since"]) if b["since"] else 0.0)
    yield bo
    yield bs


def _results_groups(snap: dict):
    """The results stream's consumer groups."""
    pending = _family("interactor_results_pending", ["group"])
    lag = _family("interactor_results_lag", ["group"])
    consumers = _family("interactor_results_consumers", ["group"])
    for grp in snap["stream"]["groups"]:
        pending.add_metric([grp["group"]], grp["pending"])
        lag.add_metric([grp["group"]], grp["lag"])
        consumers.add_metric([grp["group"]], grp["consumers"])
    yield pending
    yield lag
    yield consumers


def _jobs(snap: dict):
    je = _family("interactor_job_episodes", ["job_id", "state"])
    jt = _family("interactor_job_size", ["job_id"])
    jp = _family("interactor_job_progress_ratio", ["job_id"])
    for job in snap["jobs"]:
        for s, n in job["counts"].items():
            je.add_metric([job["job_id"], s], n)
        jt.add_metric([job["job_id"]], job["total"])
        jp.add_metric([job["job_id"]], job["progress"])
    yield je
    yield jt
    yield jp


def _feeds(jobs: list[dict]):
    """Jobs with an online-RL feed: its groups by state and by outcome, the version, and
    the trainers' wait (a trainer that waits is a trainer the rollouts do not keep busy)."""
    groups = _family("interactor_feed_groups", ["job_id", "state"])
    settled = _family("interactor_feed_groups_settled", ["job_id", "outcome", "reason"])
    delivered = _family("interactor_feed_groups_delivered", ["job_id", "kind"])
    version = _family("interactor_feed_version", ["job_id"])
    behind = _family("interactor_feed_versions_behind_mean", ["job_id"])
    wait = _family("interactor_feed_trainer_wait_seconds", ["job_id"])
    takes = _family("interactor_feed_takes", ["job_id"])
    for job in jobs:
        j, f = job["job_id"], job["feed"]
        for state in ("ready", "taken", "inflight"):
            groups.add_metric([j, state], f[state])
        for outcome in ("acked", "stale_requeued", "stale_dropped", "failed", "refilled"):
            settled.add_metric([j, outcome, ""], f[outcome])
        for reason, n in sorted(f["filtered"].items()):
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


def _limits(snap: dict):
    """Paused jobs, fleet-wide caps and rate limits."""
    jpa = _family("interactor_job_paused", ["job_id", "reason"])
    for job in snap["jobs"]:
        if job.get("paused"):
            jpa.add_metric([job["job_id"], job["paused"]["reason"]], 1)
    yield jpa
    cl = _family("interactor_fleet_cap_limit", ["kind", "name"])
    cu = _family("interactor_fleet_cap_in_use", ["kind", "name"])
    for cap in snap.get("caps", []):
        cl.add_metric([cap["kind"], cap["name"]], cap["limit"])
        cu.add_metric([cap["kind"], cap["name"]], cap["in_use"])
    ab = _family("interactor_fleet_cap_auto_bound", ["kind", "name", "bound"])
    ch = _family("interactor_fleet_cap_changed_seconds", ["kind", "name"])
    for cap in snap.get("caps", []):
        low, _, high = (cap.get("auto") or "").partition("-")
        if high:
            ab.add_metric([cap["kind"], cap["name"], "min"], int(low))
            ab.add_metric([cap["kind"], cap["name"], "max"], int(high))
        if cap.get("changed"):
            ch.add_metric([cap["kind"], cap["name"]], cap["changed"]["at"])
    yield cl
    yield cu
    yield ab
    yield ch
    rl = _family("interactor_rate_limit", ["server", "unit"])
    rb = _family("interactor_rate_bucket", ["server", "unit"])
    rh = _family("interactor_rate_hold_seconds", ["server"])
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


def _folded(stats: Stats):
    """The counters and histograms folded from committed records (consumer/stats.py)."""
    for name, labels in COUNTERS.items():
        c = _family(f"interactor_{name}", list(labels))
        for lv, v in sorted(stats.counters.get(name, {}).items()):
            if len(lv) == len(labels):
                c.add_metric(list(lv), v)
        yield c
    for name, (labels, _) in HISTOGRAMS.items():
        h = _family(f"interactor_{name}", list(labels))
        for lv, hist in sorted(stats.histograms.get(name, {}).items()):
            if len(lv) == len(labels):
                h.add_metric(list(lv), hist.cumulative(), hist.sum)
        yield h


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
