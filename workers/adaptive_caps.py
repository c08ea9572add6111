"""A worker process's side of adaptive concurrency and of a job's live limits (broker/adaptive.py).

* :class:`LiveLimits`: the limits a job's operator changed while it runs (``interactor job JOB
  set``), read at most once per :data:`LIVE_TTL_S` per job and process, never per call: an
  attempt's ports are built from the job spec's limits with these over them.
* :class:`AdaptiveReporter` (one per process): the outcomes of calls under an adaptive cap.
  Successes are counted and sent once per keeper tick (workers/fleetcaps.py), with whether calls
  of this process waited for the cap in that tick (the demand that lets the limit grow), unless
  the tick also had an overload (then they are no sign that the limit may grow); an
  overload (429, 502/503/504, a read timeout) is sent at once, the others of the same second
  coalesced here (the rule cuts once per cooldown anyway).
* :class:`AdaptivePacer`: the model client's pacer hooks (workers/modelclient.py) that tell the
  reporter; it wraps the rate limits' pacer when the job has one. A client whose pacer is
  adaptive retries overloads until the attempt's budget ends, not ``--llm-retries`` times:
  the cap is cut so that the server recovers, and the episode must not fail meanwhile.
* :class:`MetricsWatch` (one per process, its own duty thread): for a job given
  ``--llm-metrics-url``, the model server's own load (broker/server_metrics.py), read once a
  second by the one process of the fleet whose turn it is, never on a call's path. Requests
  waiting or a full KV cache are an overload, reported as a 429 is; a reading that cannot be
  had is recorded for status, logged once a minute, and changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable, Mapping

import redis
import requests

from broker.adaptive import COOLDOWN_MS, LIVE_AUTO, LIVE_MODEL, LIVE_RPM, LIVE_TPM, AdaptiveCaps
from broker.caps import Limits
from broker.duty import Duty
from broker.keys import Keys
from broker.redact import redact_url
from broker.server_metrics import MAX_BODY, POLL_MS, MetricsError, ServerMetrics, parse_reading
from broker.urls import UrlError, check_url

log = logging.getLogger("interactor.adaptive")

LIVE_TTL_S = 3.0  # a job's live limits are read again this often at most (per job, per process)
OVERLOAD_STATUSES = frozenset({429, 502, 503, 504})
METRICS_TIMEOUT_S = 1.0  # a metrics read takes at most this long, body included
WATCH_IDLE_S = 60.0  # a process stops reading a server's metrics when none of its calls went to it for this long
FAILURE_LOG_S = 60.0  # a metrics endpoint that cannot be read is logged this often at most, per cap


class LiveLimits:
    """A job's live limits (``Keys.job_limits``), cached per job for :data:`LIVE_TTL_S`."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: float = LIVE_TTL_S):
        self.r, self.k, self.ttl_s = client, keys, ttl_s
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, dict[str, str]]] = {}

    def fields(self, job_id: str) -> dict[str, str]:
        now = time.monotonic()
        with self._lock:
            hit = self._seen.get(job_id)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        try:
            raw = {k.decode(): v.decode("utf-8", "replace") for k, v in self.r.hgetall(self.k.job_limits(job_id)).items()}
        except redis.RedisError as exc:  # the spec's limits hold meanwhile; the next read tries again
            log.warning("could not read job %s's live limits: %s", job_id, exc)
            raw = hit[1] if hit is not None else {}
        with self._lock:
            self._seen[job_id] = (now, raw)
        return raw

    def over(self, job_id: str, limits: Limits | None) -> Limits | None:
        """``limits`` (the job spec's) with the live ones over them; None when neither sets any."""
        live = self.fields(job_id)
        if not live:
            return limits
        out = Limits.from_dict(limits.to_dict()) if limits else Limits()
        if _count(live.get(LIVE_MODEL)) is not None:
            out.model, out.model_auto = _count(live[LIVE_MODEL]) or 0, live.get(LIVE_AUTO, "")
        if _count(live.get(LIVE_RPM)) is not None:
            out.model_rpm = _count(live[LIVE_RPM]) or 0
        if _count(live.get(LIVE_TPM)) is not None:
            out.model_tpm = _count(live[LIVE_TPM]) or 0
        return out if out else None

    def rates(self, job_id: str, rpm: int, tpm: int) -> tuple[int, int]:
        """The job's request and token rates now: the live ones, else ``rpm``, ``tpm``."""
        live = self.fields(job_id)
        r, t = _count(live.get(LIVE_RPM)), _count(live.get(LIVE_TPM))
        return (rpm if r is None else r), (tpm if t is None else t)


def _count(value: Any) -> int | None:
    """A live limit's number (written by others: anything else is no limit set)."""
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


class AdaptiveReporter:
    """This process's reports of outcomes under adaptive caps (module docstring)."""

    def __init__(self, client: redis.Redis, keys: Keys, cooldown_ms: int = COOLDOWN_MS):
        self.caps = AdaptiveCaps(client, keys)
        self.cooldown_s = cooldown_ms / 1000.0
        self._lock = threading.Lock()
        self._ok: dict[str, int] = {}
        self._start: dict[str, int] = {}
        self._cut_sent: dict[str, float] = {}
        self._troubled: set[str] = set()  # caps that had an overload since the last flush
        self.overloads_seen = 0
        self.overloads_sent = 0

    def track(self, cap_key: str, start: int) -> None:
        with self._lock:
            self._start.setdefault(cap_key, start)

    def success(self, cap_key: str) -> None:
        with self._lock:
            self._ok[cap_key] = self._ok.get(cap_key, 0) + 1

    def overload(self, cap_key: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.overloads_seen += 1
            self._troubled.add(cap_key)
            if now - self._cut_sent.get(cap_key, -1e9) < self.cooldown_s:
                return
            self._cut_sent[cap_key] = now
            start = self._start.get(cap_key, 1)
            self.overloads_sent += 1
        try:
            limit, changed = self.caps.report(cap_key, start, overload=reason)
            if changed:
                log.info("adaptive cap %s: %s, limit now %d", cap_key, reason, limit)
        except redis.RedisError as exc:  # the call retries all the same; the next overload tells
            log.warning("could not report an overload of %s: %s", cap_key, exc)

    def flush(self, demand: Iterable[str]) -> None:
        """The keeper's tick: each cap's successes since the last, with whether calls waited."""
        waited = set(demand)
        with self._lock:
            counts, self._ok = self._ok, {}
            troubled, self._troubled = self._troubled, set()
            starts = dict(self._start)
        for cap_key, n in counts.items():
            if cap_key in troubled:  # successes beside an overload are no sign the limit may grow
                continue
            try:
                self.caps.report(cap_key, starts.get(cap_key, 1), successes=n, demand=cap_key in waited)
            except redis.RedisError as exc:  # lost successes only slow the growth a little
                log.warning("could not report %d successes of %s: %s", n, cap_key, exc)


class AdaptivePacer:
    """The model client's pacer hooks for a call under an adaptive cap: outcomes to the reporter,
    the rest to the rate limits' pacer ``inner`` (None: the job has no rate limit)."""

    adaptive = True  # workers/modelclient.py: overloads are retried within the attempt's budget

    def __init__(self, inner: Any, reporter: AdaptiveReporter, cap_key: str,
                 metrics: tuple["MetricsWatch", str] | None = None):
        self.inner, self.reporter, self.cap_key = inner, reporter, cap_key
        self.metrics = metrics  # (this process's watch, the server's metrics URL) when the job gave one

    def before_try(self) -> None:
        if self.metrics is not None:
            self.metrics[0].watch(self.cap_key, self.metrics[1])
        if self.inner is not None:
            self.inner.before_try()

    def after_reply(self, status: int, headers: Mapping[str, str] | None) -> None:
        if self.inner is not None:
            self.inner.after_reply(status, headers)
        if status in OVERLOAD_STATUSES:
            self.reporter.overload(self.cap_key, f"HTTP {status}")
        elif 200 <= status < 300:
            self.reporter.success(self.cap_key)

    def after_failure(self, what: str) -> None:
        """A try that got no answer: ``what`` (a read timeout) is an overload."""
        self.reporter.overload(self.cap_key, what)

    def charge(self, tokens: int | None) -> None:
        if self.inner is not None:
            self.inner.charge(tokens)


def fetch_metrics(session: requests.Session, url: str, timeout_s: float = METRICS_TIMEOUT_S) -> bytes:
    """The body of a metrics endpoint, read within ``timeout_s`` and :data:`MAX_BODY` bytes;
    raises MetricsError, UrlError or a requests error naming what went wrong."""
    check_url(url)  # written into the job by its submitter: checked again before anything is sent
    deadline = time.monotonic() + timeout_s
    with session.get(url, timeout=timeout_s, stream=True, allow_redirects=False,
                     headers={"Accept": "text/plain", "Accept-Encoding": "identity"}) as resp:
        if resp.status_code != 200:
            raise MetricsError(f"HTTP {resp.status_code}")
        body = bytearray()
        for chunk in resp.iter_content(64 * 1024):
            body += chunk
            if len(body) > MAX_BODY:
                raise MetricsError(f"a metrics body over {MAX_BODY // (1 << 20)} MB")
            if time.monotonic() > deadline:
                raise MetricsError(f"the body took over {timeout_s:g} s")
        return bytes(body)


class MetricsWatch(Duty):
    """This process's reads of the model servers' metrics (module docstring): each cap a call of
    this process used within :data:`WATCH_IDLE_S`, when it wins the fleet's turn for it."""

    name = "server-metrics-watch"

    def __init__(self, client: redis.Redis, keys: Keys, reporter: AdaptiveReporter, interval_s: float = POLL_MS / 1000):
        super().__init__(interval_s)
        self.metrics = ServerMetrics(client, keys)
        self.caps = AdaptiveCaps(client, keys)
        self.reporter = reporter
        self._lock = threading.Lock()
        self._watched: dict[str, tuple[str, float]] = {}  # cap key -> (metrics URL, last call seen)
        self._logged: dict[str, float] = {}  # cap key -> when its last failure was logged
        self.session = requests.Session()
        self.session.trust_env = False  # no proxies or .netrc from the environment for an internal endpoint
        self.reads = 0

    def watch(self, cap_key: str, url: str) -> None:
        with self._lock:
            self._watched[cap_key] = (url, time.monotonic())

    def tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            for cap_key in [k for k, (_, seen) in self._watched.items() if now - seen > WATCH_IDLE_S]:
                del self._watched[cap_key]
            watched = list(self._watched.items())
        for cap_key, (url, _) in watched:
            if self.metrics.take_turn(cap_key) and self.caps.state(cap_key) is not None:  # still adaptive
                self.read(cap_key, url)

    def read(self, cap_key: str, url: str) -> str:
        """One read of ``url`` for ``cap_key``: the overload it reported ("" if none or no reading)."""
        self.reads += 1
        try:
            reading = parse_reading(fetch_metrics(self.session, url))
        except (requests.RequestException, MetricsError, UrlError) as exc:
            self._failed(cap_key, url, f"{type(exc).__name__}: {exc}" if not isinstance(exc, MetricsError) else str(exc))
            return ""
        self.metrics.record(cap_key, reading)
        why = reading.overload()
        if why:
            self.reporter.overload(cap_key, why)
        return why

    def _failed(self, cap_key: str, url: str, error: str) -> None:
        error = error.replace(url, redact_url(url))[:200]
        self.metrics.record(cap_key, None, error)
        now = time.monotonic()
        if now - self._logged.get(cap_key, -1e9) >= FAILURE_LOG_S:
            self._logged[cap_key] = now
            log.warning("model server metrics %s could not be read (%s); the cap of %s goes on by its calls' "
                        "answers alone (logged once a minute)", redact_url(url), error, cap_key)
