"""Circuit breakers: outages wait, failures fail.

Env servers get redeployed and inference servers pause for weight updates. That is weather,
not a verdict on the episodes that were talking to them. One :class:`Breaker` per server (an
env server's base URL, a model endpoint) per worker process:

* A call that fails the way a down server fails (connection refused or reset, timeouts,
  HTTP 429/502/503/504: ``EpisodeError.outage``) asks the server's readiness route whether it
  is down: ``GET {base_url}/envs`` for env servers, ``GET {llm_base_url}/models`` for models
  (a model server answering 429/503 says so itself). If the server answers, the failure is
  the episode's own and takes the usual path (retries, attempts, dead letters): one hung
  instance must not stall every episode on its server. If it does not, the breaker opens.
* While a breaker is open, every episode about to call that server waits, its wall-clock
  budget paused (workers/budget.py); that holds new episodes too (their ``reset`` waits). One
  prober per breaker checks readiness with capped backoff and closes it when the server
  answers; the waiting calls then go on.
* After the outage a call is made again only where that is safe: a model call, ``reset`` and
  ``close``, or a call the server provably never processed (the connection was refused, or it
  answered 429/503). A ``get_task_prompt``/``step`` that may have been applied ends the attempt
  instead, and that attempt is not counted against the episode's ``max_attempts``.
* An outage longer than ``outage_budget_s`` (INTERACTOR_OUTAGE_BUDGET_S, 15 minutes) ends the
  waiting episodes with ``env_outage`` / ``model_outage``: a dead letter whose reason names the
  server, re-drivable once it is back.

Open breakers are written to Redis (``<prefix>:breakers``) for ``interactor status`` and the
metrics; the field expires with its worker (a heartbeat refreshes it while it stays open).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

import redis
import requests

from broker.duty import Duty
from broker.errors import BAD_TASK, ENV_OUTAGE, MODEL_OUTAGE, EpisodeError
from broker.keys import Keys
from broker.records import BreakerState, live_breaker
from broker.settings import redact_url
from broker.urls import url_problem
from workers.allowlist import HostAllowlist
from workers.budget import Budget
from workers.http_transport import proxies_for

log = logging.getLogger("interactor.breakers")

ENV, MODEL = "env", "model"
_OUTAGE_REASON = {ENV: ENV_OUTAGE, MODEL: MODEL_OUTAGE}
_PROBE_MIN_S, _PROBE_MAX_S = 0.5, 10.0
_WAIT_SLICE_S = 0.25
PUBLISH_EVERY_S = 5.0
PRUNE_EVERY_S = 60.0  # how often a process removes the stale entries of the breakers hash
FLAP_WINDOW_S = 30.0
PROBE_TIMEOUT_S = 3.0


class Breaker:
    """One server's health as this process sees it: closed (calls go through) or open."""

    def __init__(self, kind: str, url: str, probe: Callable[[], bool], board: "BreakerBoard | None" = None):
        self.kind = kind
        self.url = url
        self.server = redact_url(url)
        self._probe = probe
        self._board = board
        self._closed = threading.Event()
        self._closed.set()
        self._lock = threading.Lock()
        self.opened_at: float | None = None  # monotonic
        self.opened_wall: float | None = None
        self.last_error = ""
        self.trips = 0
        self._closed_at: float | None = None
        self._outage_start: float | None = None  # wall clock of the outage's first opening
        self._down_s = 0.0  # how long the server has been down in this outage, up to its last recovery

    @property
    def is_open(self) -> bool:
        return not self._closed.is_set()

    def confirm_down(self, exc: EpisodeError | None = None) -> bool:
        """Is the server down, rather than failing this one episode? A model server answering
        429/503 says so itself (it is not serving anyone now). Anything else is checked against
        the readiness route: a server whose readiness answers is up, and the failure is the
        episode's own (a hung instance, a request that times out by itself)."""
        if self.is_open:
            return True
        if self.kind == MODEL and exc is not None and exc.status in (429, 503):
            return True
        return not self._probe()

    def trip(self, error: str) -> None:
        with self._lock:
            self.last_error = error
            if not self._closed.is_set():
                return
            self._closed.clear()
            now = time.monotonic()
            if self._closed_at is not None and now - self._closed_at < FLAP_WINDOW_S and self._outage_start:
                # Down again right after coming back: the same outage goes on (a flapping server
                # must not reset the outage budget each time it answers one probe). Its clock
                # resumes at the time already spent down: the minutes the server answered are no
                # outage, or one short blip soon after another would spend the whole budget at once.
                self.opened_at, self.opened_wall = now - self._down_s, self._outage_start
            else:
                self.opened_at, self.opened_wall = now, time.time()
                self._down_s = 0.0
            self._outage_start = self.opened_wall
            self.trips += 1
        log.error("%s server %s is down (%s): its episodes wait for it", self.kind, self.server, error)
        if self._board is not None:
            self._board.changed(self)
        threading.Thread(target=self._probe_until_up, name=f"probe-{self.kind}", daemon=True).start()

    def _probe_until_up(self) -> None:
        delay = _PROBE_MIN_S
        while True:
            time.sleep(delay)
            if self._probe():
                break
            delay = min(_PROBE_MAX_S, delay * 2)
        with self._lock:
            down_s = time.monotonic() - (self.opened_at or time.monotonic())
            self._down_s = down_s
            self.opened_at = self.opened_wall = None
            self._closed_at = time.monotonic()
            self._closed.set()
        log.warning("%s server %s is back after %.0fs", self.kind, self.server, down_s)
        if self._board is not None:
            self._board.changed(self)

    def wait(self, check: Callable[[], None], budget: Budget, outage_budget_s: float) -> float:
        """Block while open. The time waited pauses ``budget`` as it passes (so ``check``, run
        between slices, never sees the budget run out because of the outage); ``check`` may
        raise (lease lost, shutdown). Past ``outage_budget_s`` of outage: a permanent
        ``env_outage``/``model_outage``. Returns the seconds waited."""
        if self._closed.is_set():
            return 0.0
        t0 = last = time.monotonic()
        while not self._closed.wait(_WAIT_SLICE_S):
            now = time.monotonic()
            budget.pause(now - last)
            last = now
            check()
            opened = self.opened_at
            if opened is not None and now - opened > outage_budget_s:
                raise EpisodeError(_OUTAGE_REASON[self.kind],
                                   f"{self.kind} server {self.server} unreachable for more than "
                                   f"{outage_budget_s:.0f}s (outage budget); last error: {self.last_error}",
                                   transient=False)
        budget.pause(time.monotonic() - last)
        return time.monotonic() - t0

    def state(self) -> dict:
        return {"kind": self.kind, "server": self.server, "open": self.is_open, "since": self.opened_wall,
                "error": self.last_error, "trips": self.trips}


class BreakerBoard:
    """The breakers of one worker process, and their publication in Redis."""

    def __init__(self, client: redis.Redis | None, keys: Keys | None, worker: str | None = None, *,
                 env_hosts: HostAllowlist | None = None):
        self.r = client
        self.keys = keys
        self.worker = worker or f"{socket.gethostname()}-{os.getpid()}"
        self._lock = threading.Lock()
        self._breakers: dict[tuple[str, str], Breaker] = {}
        self._last_publish = 0.0
        self._last_prune = 0.0
        # Probes go to URLs a job named: no ~/.netrc credentials, no redirects followed (either
        # would take the probe past the checks below), proxies as for the calls themselves.
        self._session = requests.Session()
        self._session.trust_env = False
        self.env_hosts = env_hosts or HostAllowlist("")

    def for_env(self, base_url: str, readiness: str = "/envs") -> Breaker:
        """The breaker of an env server; readiness: ``GET {base_url}/envs`` answers 2xx
        (``readiness``: the route of servers of another protocol, ``/health`` for OpenEnv and
        ORS). The URL must pass the checks the env calls pass (broker/urls.py, the env host
        allow-list)."""
        if not self.env_hosts.allows(base_url):
            raise EpisodeError(BAD_TASK, f"env server {redact_url(base_url)!r}: "
                               f"{url_problem(base_url) or 'not on INTERACTOR_ENV_HOSTS'}", transient=False)
        url = base_url.rstrip("/")
        return self.get(ENV, url, lambda: self._answers(url + readiness, strict=True))

    def for_model(self, llm_base_url: str) -> Breaker:
        """The breaker of a model endpoint; readiness: ``GET {llm_base_url}/models`` answers at
        all, short of 429/5xx (a 401 or 404 still means a server is there). Probes never carry
        the API key, and go only to a URL broker/urls.py accepts."""
        problem = url_problem(llm_base_url)
        if problem:
            raise EpisodeError(BAD_TASK, f"model endpoint {redact_url(llm_base_url)!r}: {problem}", transient=False)
        url = llm_base_url.rstrip("/")
        return self.get(MODEL, url, lambda: self._answers(url + "/models", strict=False))

    def _answers(self, url: str, *, strict: bool) -> bool:
        try:
            with self._session.get(url, timeout=(PROBE_TIMEOUT_S, PROBE_TIMEOUT_S), stream=True,
                                   allow_redirects=False, proxies=proxies_for(url)) as resp:
                status = resp.status_code
        except Exception:  # noqa: BLE001 - any failure to answer is "not up"
            return False
        return 200 <= status < 300 if strict else status < 500 and status != 429

    def get(self, kind: str, url: str, probe: Callable[[], bool]) -> Breaker:
        key = (kind, url.rstrip("/"))
        with self._lock:
            b = self._breakers.get(key)
            if b is None:
                b = self._breakers[key] = Breaker(kind, key[1], probe, self)
            return b

    def open_breakers(self) -> list[Breaker]:
        with self._lock:
            return [b for b in self._breakers.values() if b.is_open]

    def changed(self, breaker: Breaker) -> None:
        self.publish()

    def publish(self) -> None:
        """Write this process's open breakers (and clear closed ones); best effort: Redis may be
        the thing that is down."""
        if self.r is None or self.keys is None:
            return
        self._last_publish = time.monotonic()
        try:
            pipe = self.r.pipeline(transaction=False)
            with self._lock:
                breakers = list(self._breakers.values())
            for b in breakers:
                state = BreakerState(kind=b.kind, server=b.server, worker=self.worker, since=b.opened_wall or 0.0,
                                     error=b.last_error[:500], trips=b.trips)
                if b.is_open:
                    pipe.hset(self.keys.breakers, state.hash_field(), state.pack())
                else:
                    pipe.hdel(self.keys.breakers, state.hash_field())
            pipe.execute()
        except redis.RedisError as exc:
            log.debug("could not publish breakers: %s", exc)

    def heartbeat(self) -> None:
        """Refresh published open breakers now and then (readers skip stale ones), and now and
        then remove the stale entries of every process (those of a worker that died stay
        otherwise): the workers are the one writer of the breakers hash."""
        now = time.monotonic()
        if self.open_breakers() and now - self._last_publish >= PUBLISH_EVERY_S:
            self.publish()
        if now - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = now
            self.prune_stale()

    def prune_stale(self) -> int:
        """Remove the entries not refreshed for ``BREAKER_STALE_S`` (or unreadable); best effort."""
        if self.r is None or self.keys is None:
            return 0
        try:
            stale = [field for field, raw in self.r.hgetall(self.keys.breakers).items() if live_breaker(raw) is None]
            if stale:
                self.r.hdel(self.keys.breakers, *stale)
            return len(stale)
        except redis.RedisError as exc:
            log.debug("could not prune stale breakers: %s", exc)
            return 0


class BreakerHeartbeat(Duty):
    """Keeps this process's open breakers fresh in Redis while they stay open."""

    name = "breaker-heartbeat"

    def __init__(self, board: BreakerBoard, interval_s: float = PUBLISH_EVERY_S):
        super().__init__(interval_s)
        self.board = board

    def tick(self) -> None:
        self.board.heartbeat()
