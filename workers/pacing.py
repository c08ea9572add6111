"""A worker process's side of the model endpoints' rate limits (broker/ratelimit.py).

:class:`Pacing` (one per process) hands out a :class:`Pacer` per model request: the model
client calls ``before_try`` before each try, ``after_reply`` with each answer's status and
headers, and ``charge`` with the tokens a successful answer used. Waiting is in line per
endpoint, as for the caps (workers/fleetcaps.py): one waiter of the process asks Redis, the
others wait for their turn without calling anything; waits pause the attempt's budget and run
its ``check``.

Only a job that sets ``requests_per_minute`` or ``tokens_per_minute`` for its endpoint is
paced; others cost nothing and back off per call as before.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable, Mapping

import redis

from broker.ratelimit import RateLimits, parse_reset
from workers.budget import Budget
from workers.http_errors import retry_after_s

log = logging.getLogger("interactor.pacing")

_SLICE_S = 0.25
_DEFAULT_429_WAIT_S = 1.0  # a 429 without Retry-After still holds the fleet this long
_MAX_HOLD_S = 300.0
_RESET_HEADERS = (("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"),
                  ("x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"))


class Pacing:
    def __init__(self, rates: RateLimits):
        self.rates = rates
        self._lock = threading.Lock()
        self._lines: dict[str, threading.Lock] = {}
        self.holds_set = 0  # how often a server's answer made the fleet wait

    def line(self, server: str) -> threading.Lock:
        with self._lock:
            lock = self._lines.get(server)
            if lock is None:
                lock = self._lines[server] = threading.Lock()
            return lock

    def pacer(self, server: str, rpm: int, tpm: int, check: Callable[[], None], budget: Budget,
              live: Callable[[int, int], tuple[int, int]] | None = None) -> "Pacer":
        return Pacer(self, server, rpm, tpm, check, budget, live)


class Pacer:
    """One attempt's pacing of its requests to one endpoint."""

    def __init__(self, pacing: Pacing, server: str, rpm: int, tpm: int, check: Callable[[], None], budget: Budget,
                 live: Callable[[int, int], tuple[int, int]] | None = None):
        self.pacing, self.server, self.rpm, self.tpm = pacing, server, rpm, tpm
        self.check, self.budget = check, budget
        # the job's rates changed while it runs (workers/adaptive_caps.py LiveLimits: cached, no round trip a try)
        self.live = live

    def before_try(self) -> None:
        rates, line = self.pacing.rates, self.pacing.line(self.server)
        last = time.monotonic()

        def waited() -> None:
            nonlocal last
            now = time.monotonic()
            self.budget.pause(now - last)
            last = now

        if self.live is not None:
            self.rpm, self.tpm = self.live(self.rpm, self.tpm)
        while not line.acquire(timeout=_SLICE_S):
            self.check()
            waited()
        try:
            while True:
                self.check()
                wait = rates.take(self.server, self.rpm, self.tpm)
                if wait <= 0:
                    return
                end = time.monotonic() + wait * random.uniform(1.0, 1.1)
                while True:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    time.sleep(min(_SLICE_S, left))
                    waited()
                    self.check()
        finally:
            waited()
            line.release()

    def after_reply(self, status: int, headers: Mapping[str, str] | None) -> None:
        """The server's word on waiting, shared with the fleet: a 429's Retry-After, or a limit
        reported as exhausted (``x-ratelimit-remaining-*`` 0) until its reset."""
        if headers is None:
            return
        hold = 0.0
        if status == 429:
            hold = retry_after_s(headers, _MAX_HOLD_S) or _DEFAULT_429_WAIT_S
        for remaining, reset in _RESET_HEADERS:
            left = headers.get(remaining)
            if left is not None and left.strip() in ("0", "0.0"):
                hold = max(hold, min(_MAX_HOLD_S, parse_reset(headers.get(reset)) or 0.0))
        if hold > 0:
            self.pacing.holds_set += 1
            try:
                self.pacing.rates.hold(self.server, hold)
            except redis.RedisError as exc:  # this call backs off on its own all the same
                log.warning("could not tell the fleet to wait for %s: %s", self.server, exc)

    def charge(self, tokens: int | None) -> None:
        """Best effort: an answer already received is never lost to Redis being away."""
        if tokens:
            try:
                self.pacing.rates.charge(self.server, self.tpm, tokens)
            except redis.RedisError as exc:
                log.warning("could not charge %d tokens to %s: %s", tokens, self.server, exc)
