"""A vLLM or SGLang server's own load, read from its Prometheus metrics endpoint
(``--llm-metrics-url``), as a second overload signal for adaptive concurrency (broker/adaptive.py).

:func:`parse_reading` reads the requests waiting in the server's queue and its KV-cache use
(0..1) out of the exposition text, summed over label sets for the queue (several models or
engines behind one endpoint) and the highest for the KV cache (a fraction: one full engine is
an overload, whatever the others hold). :meth:`Reading.overload` says whether the reading is
one, and why ("vLLM: 7 waiting"); a healthy reading adds nothing, growth comes from successes.

The fleet reads one endpoint once per :data:`POLL_MS` at most: the process that wins the turn
(``SET NX PX``, :meth:`ServerMetrics.take_turn`) fetches it (workers/adaptive_caps.py
``MetricsWatch``); the last reading, or the last failure to get one, is kept per cap for
status (``Keys.cap_metrics``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from broker.adaptive import cap_parts
from broker.keys import Keys

MAX_BODY = 1 << 20  # a metrics body is a few kB; more is refused unread beyond this
POLL_MS = 1000  # one read of an endpoint per second, fleet-wide
KV_FULL = 0.9  # KV-cache use at or above this is an overload (the server starts preempting near it)
READING_TTL_S = 3600  # the last reading is kept this long after the last poll, for status

# (engine, requests waiting, KV-cache use): vLLM's newer KV name first; SGLang's token_usage is
# its KV pool's use.
_ENGINES = (("vLLM", ("vllm:num_requests_waiting",), ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
            ("SGLang", ("sglang:num_queue_reqs",), ("sglang:token_usage",)))


class MetricsError(ValueError):
    """A metrics body that gives no reading; the message says why."""


@dataclass(frozen=True)
class Reading:
    """What one scrape said: ``engine`` (vLLM, SGLang), ``waiting`` requests queued, ``kv`` use
    (0..1; None when the server reports none)."""

    engine: str
    waiting: float
    kv: float | None

    def overload(self) -> str:
        """Why this reading is an overload ("" when it is not): anything waiting, or KV >= 0.9."""
        parts = []
        if self.waiting > 0:
            parts.append(f"{self.waiting:g} waiting")
        if self.kv is not None and self.kv >= KV_FULL:
            parts.append(f"KV {self.kv:.2f}")
        return f"{self.engine}: {', '.join(parts)}" if parts else ""


def parse_reading(body: bytes | str) -> Reading:
    """The reading of a Prometheus text body; raises :class:`MetricsError` for a body over
    :data:`MAX_BODY`, one that does not parse, or one without a vLLM or SGLang queue metric."""
    if len(body) > MAX_BODY:
        raise MetricsError(f"a metrics body over {MAX_BODY // (1 << 20)} MB")
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if math.isfinite(sample.value):
                    values.setdefault(sample.name, []).append(float(sample.value))
    except Exception as exc:  # noqa: BLE001 - the parser raises several kinds on bad text
        raise MetricsError(f"not Prometheus text: {type(exc).__name__}: {str(exc)[:120]}") from None
    for engine, waiting_names, kv_names in _ENGINES:
        waiting = next((values[n] for n in waiting_names if n in values), None)
        if waiting is None:
            continue
        kv = next((values[n] for n in kv_names if n in values), None)
        return Reading(engine, sum(waiting), max(kv) if kv else None)
    raise MetricsError("no vLLM or SGLang queue metric (vllm:num_requests_waiting, sglang:num_queue_reqs) in it")


class ServerMetrics:
    """The Redis side: whose turn it is to read an endpoint, and the last reading per cap."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.r, self.k = client, keys

    def _names(self, cap_key: str) -> tuple[str, str]:
        kind, name = cap_parts(self.k, cap_key)
        return self.k.cap_metrics_turn(kind, name), self.k.cap_metrics(kind, name)

    def take_turn(self, cap_key: str, poll_ms: int = POLL_MS) -> bool:
        """True for the one process of the fleet that reads the cap's endpoint now."""
        return bool(self.r.set(self._names(cap_key)[0], "1", nx=True, px=int(poll_ms)))

    def record(self, cap_key: str, reading: Reading | None, error: str = "") -> None:
        """The last reading (or the failure to get one: the last good reading stays beside it)."""
        key = self._names(cap_key)[1]
        now_ms = int(time.time() * 1000)
        if reading is not None:
            fields: dict[str, Any] = {"engine": reading.engine, "waiting": reading.waiting,
                                      "kv": "" if reading.kv is None else reading.kv, "at": now_ms, "error": ""}
        else:
            fields = {"error": error[:200], "error_at": now_ms}
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, READING_TTL_S)
        pipe.execute()

    def last(self, cap_key: str) -> dict[str, Any] | None:
        """{engine, waiting, kv (None if not reported), at (unix s, 0: never), error, error_at}
        of the cap's endpoint; None when nobody read it. Values written by others: a field that
        is not a number reads as none."""
        raw = {k.decode(): v.decode("utf-8", "replace") for k, v in self.r.hgetall(self._names(cap_key)[1]).items()}
        if not raw:
            return None
        return {"engine": raw.get("engine", ""), "waiting": _number(raw.get("waiting")),
                "kv": _number(raw.get("kv")), "at": (_number(raw.get("at")) or 0) / 1000.0,
                "error": raw.get("error", ""), "error_at": (_number(raw.get("error_at")) or 0) / 1000.0}


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text not in (None, "") else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None
