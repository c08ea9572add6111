"""Fleet-wide rate limits on a model endpoint: requests per minute and tokens per minute.

Hosted APIs publish both limits and answer 429 past them; one benchmark lost a tenth of its
trials that way, each worker backing off alone. Here the fleet shares one pair of token
buckets per endpoint in Redis (``<prefix>:rate:<server>``) and one "wait until" mark
(``<prefix>:rate-hold:<server>``):

* before each request (each try), :meth:`RateLimits.take` checks the mark, then takes one
  request from the RPM bucket and requires the TPM bucket to be above zero; one round trip.
  It answers how long to wait when it cannot (the caller waits, then asks again);
* after an answer, the tokens it used (the answer's ``usage``) are charged to the TPM
  bucket, which may go below zero: the next requests wait until it refilled;
* a 429's ``Retry-After``, or ``x-ratelimit-remaining-requests``/``-tokens`` at 0 with their
  ``x-ratelimit-reset-*``, set the mark: every worker waits, not only the one told.

The RPM bucket holds one request, and the fleet paces at ``RPM_PACE`` (97%) of the limit. A
server's own bucket, fed at exactly the rate the fleet sends, stays near empty, and a request
that arrives a few milliseconds early (scheduling, a busy machine) is refused: seen as a 429
now and then after the first, with the fleet at 100% of the limit and a half-second burst.
The headroom lets the server's bucket fill between requests instead. Time is Redis' clock.
Buckets expire when unused for two minutes.
"""

from __future__ import annotations

import re

import redis

from broker.keys import Keys
from broker.lua_scripts import lua_file

RPM_BURST_S = 0.0  # the bucket's depth in seconds of requests beyond one: none
RPM_PACE = 0.97  # the share of a requests-per-minute limit the fleet sends at

# Its scripts' Lua: broker/lua/ratelimit_*.lua (broker/lua_scripts.py), after the ledger's
# now.lua (Redis' clock).
_NOW = lua_file("now")
_REFILL_FN = lua_file("ratelimit_refill_fn")
_TAKE = _NOW + _REFILL_FN + lua_file("ratelimit_take")
_CHARGE = _NOW + _REFILL_FN + lua_file("ratelimit_charge")
_HOLD = _NOW + lua_file("ratelimit_hold")
_LEVELS = _NOW + _REFILL_FN + lua_file("ratelimit_levels")

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


def parse_reset(value: str | None) -> float | None:
    """An ``x-ratelimit-reset-*`` value in seconds: ``"1s"``, ``"6m0s"``, ``"20ms"``,
    ``"0.5s"`` (OpenAI's form) or a bare number of seconds; None when unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    parts = _DURATION_RE.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        return None
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


class RateLimits:
    """The Redis side of the rate limits of model endpoints."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.r = client
        self.k = keys
        self._take = client.register_script(_TAKE)
        self._charge = client.register_script(_CHARGE)
        self._hold = client.register_script(_HOLD)
        self._levels = client.register_script(_LEVELS)

    def take(self, server: str, rpm: int, tpm: int) -> float:
        """0.0: go; else seconds to wait before asking again."""
        ms = self._take(keys=[self.k.rate(server), self.k.rate_hold(server)], args=[rpm * RPM_PACE, tpm, RPM_BURST_S])
        return int(ms) / 1000.0

    def charge(self, server: str, tpm: int, tokens: int) -> None:
        if tpm > 0 and tokens > 0:
            self._charge(keys=[self.k.rate(server)], args=[tpm, int(tokens)])

    def hold(self, server: str, seconds: float) -> None:
        """Every worker waits ``seconds`` before its next request to ``server``."""
        if seconds > 0:
            self._hold(keys=[self.k.rate_hold(server)], args=[int(seconds * 1000) + 1])

    def levels(self, server: str, rpm: int, tpm: int) -> tuple[float, float, float]:
        """(requests left, tokens left, seconds still held); -1 for a limit that is off."""
        r, t, hold = self._levels(keys=[self.k.rate(server), self.k.rate_hold(server)],
                                  args=[rpm * RPM_PACE, tpm, RPM_BURST_S])
        return float(r), float(t), int(hold) / 1000.0
