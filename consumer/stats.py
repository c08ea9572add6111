"""The fleet's counters of what happened, folded from the records the consumer commits.

:class:`StatsRecorder` is the consumer's ``observers`` hook: each committed batch becomes one
pipeline of HINCRBY/HINCRBYFLOAT on the ``<prefix>:stats`` hash (steps, per-step env and model
latency, episode duration, finished and ended episodes, failures by reason, tokens per model),
plus a sample of the step total for the steps/s rate. :func:`read_stats` reads the hash back;
the layout of its fields is defined here once, for the writer and every reader
(``interactor metrics``, ``interactor status``, the results browser).
A batch claimed again after a consumer crash is counted again (rare; the database is exact).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import redis

from broker.keys import Keys
from broker.records import AttemptRecord, StepRecord
from broker.settings import Settings
from broker.states import AttemptStatus

log = logging.getLogger("interactor.consumer.stats")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DURATION_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0)
RATE_WINDOW_S = 15.0  # steps/s is measured over this window
SAMPLES_KEEP_S = 300.0

# Counters: name -> label names. Histograms: name -> (label names, buckets).
COUNTERS = {
    "steps": ("env_name",),
    "episodes_finished": ("env_name", "status"),
    "episodes_ended": ("env_name", "ended_by"),
    "attempt_failures": ("reason", "outcome"),
    "prompt_tokens": ("model",),
    "completion_tokens": ("model",),
    # attempts that continued their predecessor's env instance, and the steps that saved; and
    # those that had a predecessor and started afresh, by why (broker/resume.py)
    "resumes": ("env_name",),
    "resume_steps_saved": ("env_name",),
    "resume_fallbacks": ("env_name", "reason"),
}
HISTOGRAMS = {
    "step_latency_seconds": (("part", "env_name"), LATENCY_BUCKETS),
    "episode_duration_seconds": (("env_name", "status"), DURATION_BUCKETS),
    # per attempt, where its time went (records v5: broker/states.py ``Phase``)
    "phase_seconds": (("phase", "env_name"), LATENCY_BUCKETS + (600.0, 1800.0, 3600.0)),
}
_STEPS_FIELD = "n|steps"  # all steps, the value the rate samples follow


def _fmt_le(x: float) -> str:
    return repr(float(x))


def _labels_field(values: Iterable[Any]) -> str:
    return json.dumps([str(v) for v in values], separators=(",", ":"))


# --- the consumer side: records -> Redis counters -------------------------------------------
class StatsRecorder:
    """An ``Ingestor`` observer: folds each committed batch into ``<prefix>:stats``.

    One pipeline per batch (HINCRBY/HINCRBYFLOAT on a few dozen fields), so it costs the
    consumer next to nothing however large the batch.
    """

    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.keys = Keys(settings.key_prefix)
        self._last_sample = 0.0

    def __call__(self, records: list) -> None:
        # Tallied per label set first, then one field name per distinct label set: a batch of
        # hundreds of steps costs a few dict updates each (field names are built once).
        steps = 0
        per_env: dict[str, int] = {}
        hist: dict[tuple, list] = {}  # (name, labels) -> [bucket counts..., sum]
        counts: dict[tuple, int] = {}  # (name, labels) -> n
        tokens: dict[tuple, int] = {}  # (name, model) -> n

        def observe(name: str, labels: tuple, value: float) -> None:
            h = hist.get((name, labels))
            if h is None:
                h = hist[(name, labels)] = [0] * (len(HISTOGRAMS[name][1]) + 1) + [0.0]
            h[bisect.bisect_left(HISTOGRAMS[name][1], value)] += 1  # index len(buckets) is +Inf
            h[-1] += value

        for rec in records:
            t = type(rec)
            if t is StepRecord:
                steps += 1
                env = rec.env_name or ""
                per_env[env] = per_env.get(env, 0) + 1
                observe("step_latency_seconds", ("env", env), max(0.0, float(rec.env_latency_s or 0.0)))
                observe("step_latency_seconds", ("model", env), max(0.0, float(rec.model_latency_s or 0.0)))
                if rec.prompt_tokens:
                    key = ("prompt_tokens", rec.llm_model or "")
                    tokens[key] = tokens.get(key, 0) + int(rec.prompt_tokens)
                if rec.completion_tokens:
                    key = ("completion_tokens", rec.llm_model or "")
                    tokens[key] = tokens.get(key, 0) + int(rec.completion_tokens)
            elif t is AttemptRecord:
                env = rec.env_name or ""
                if rec.status in (AttemptStatus.COMPLETED, AttemptStatus.FAILED):
                    key = ("episodes_finished", (env, rec.status))
                    counts[key] = counts.get(key, 0) + 1
                if rec.status == AttemptStatus.COMPLETED:
                    key = ("episodes_ended", (env, rec.ended_by or "unknown"))
                    counts[key] = counts.get(key, 0) + 1
                    if rec.started_at > 0 and rec.finished_at >= rec.started_at:
                        observe("episode_duration_seconds", (env, rec.status), rec.finished_at - rec.started_at)
                for phase, seconds in rec.phases().items():
                    observe("phase_seconds", (phase, env), max(0.0, float(seconds)))
                if rec.status not in (AttemptStatus.COMPLETED, AttemptStatus.CANCELLED):  # a cancel is no failure
                    key = ("attempt_failures", (rec.reason or "unknown", rec.status))
                    counts[key] = counts.get(key, 0) + 1
                if rec.resumed_at:
                    counts[("resumes", (env,))] = counts.get(("resumes", (env,)), 0) + 1
                    key = ("resume_steps_saved", (env,))
                    counts[key] = counts.get(key, 0) + rec.resumed_at - 1
                elif rec.resume_note:
                    key = ("resume_fallbacks", (env, rec.resume_note))
                    counts[key] = counts.get(key, 0) + 1
        for env, n in per_env.items():
            counts[("steps", (env,))] = n
        for (name, model), n in tokens.items():
            counts[(name, (model,))] = n
        if not counts and not hist:
            return
        pipe = self.r.pipeline(transaction=False)
        for (name, labels), n in counts.items():
            pipe.hincrby(self.keys.stats, f"c|{name}|{_labels_field(labels)}", n)
        for (name, labels), h in hist.items():
            base = f"h|{name}|{_labels_field(labels)}|"
            for i, n in enumerate(h[:-1]):
                if n:
                    pipe.hincrby(self.keys.stats, base + str(i), n)
            pipe.hincrbyfloat(self.keys.stats, base + "sum", h[-1])
        pipe.hincrby(self.keys.stats, _STEPS_FIELD, steps)
        total = int(pipe.execute()[-1])
        self._sample(total, steps)

    def _sample(self, total: int, added: int) -> None:
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        if now - self._last_sample > RATE_WINDOW_S:
            # Idle for a while: mark where this burst started, so its first batch counts.
            pipe.zadd(self.keys.stats_samples, {f"{now - 0.001:.3f}:{total - added}": now - 0.001})
        pipe.zadd(self.keys.stats_samples, {f"{now:.3f}:{total}": now})
        pipe.zremrangebyscore(self.keys.stats_samples, "-inf", now - SAMPLES_KEEP_S)
        pipe.execute()
        self._last_sample = now


def steps_rate(samples: list[tuple[float, int]], now: float, window: float = RATE_WINDOW_S) -> float:
    """Steps per second over the last ``window`` from ``(ts, total)`` samples (any order)."""
    if not samples:
        return 0.0
    samples = sorted(samples)
    latest = samples[-1][1]
    start = now - window
    base = None
    for ts, n in samples:
        if ts <= start:
            base = (ts, n)
        else:
            break
    if base is None:
        base = samples[0]
        if len(samples) == 1:
            return 0.0
    dt = now - base[0]
    return max(0.0, (latest - base[1]) / dt) if dt > 0 else 0.0


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int]  # per bucket (not cumulative); the last is +Inf
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for i, c in enumerate(self.counts):
            acc += c
            le = "+Inf" if i == len(self.buckets) else _fmt_le(self.buckets[i])
            out.append((le, acc))
        return out

    def quantile(self, q: float) -> float | None:
        """Bucket upper bound at quantile ``q`` (as coarse as the buckets); None when empty."""
        total = self.count
        if not total:
            return None
        rank, acc = q * total, 0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= rank:
                return self.buckets[i] if i < len(self.buckets) else math.inf
        return math.inf


@dataclass
class Stats:
    steps_total: int = 0
    counters: dict[str, dict[tuple, float]] = field(default_factory=dict)
    histograms: dict[str, dict[tuple, Histogram]] = field(default_factory=dict)


def read_stats(raw: dict) -> Stats:
    st = Stats(counters={n: {} for n in COUNTERS}, histograms={n: {} for n in HISTOGRAMS})
    for k, v in raw.items():
        k = k.decode() if isinstance(k, bytes) else k
        v = v.decode() if isinstance(v, bytes) else v
        if k == _STEPS_FIELD:
            st.steps_total = int(float(v))
            continue
        parts = k.split("|")
        try:
            if parts[0] == "c" and len(parts) == 3 and parts[1] in COUNTERS:
                st.counters[parts[1]][tuple(json.loads(parts[2]))] = float(v)
            elif parts[0] == "h" and len(parts) == 4 and parts[1] in HISTOGRAMS:
                buckets = HISTOGRAMS[parts[1]][1]
                h = st.histograms[parts[1]].setdefault(tuple(json.loads(parts[2])),
                                                       Histogram(buckets, [0] * (len(buckets) + 1)))
                if parts[3] == "sum":
                    h.sum = float(v)
                else:
                    i = int(parts[3])
                    if 0 <= i <= len(buckets):
                        h.counts[i] += int(float(v))
        except (ValueError, TypeError):
            log.debug("ignoring malformed stats field %r", k)
    return st
