"""Adaptive concurrency: a job's fleet-wide cap on calls to its model that follows the server
(``--concurrency auto[:MIN-MAX]``), and the limits a job's operator changes while it runs.

The rule is AIMD, as Inspect AI's: the cap's limit grows by one per window of ``limit``
successful answers, but only while the fleet's demand reaches the limit (calls waited for a
slot) and not within :data:`COOLDOWN_MS` of a cut, so a job of 5 episodes does not drift to MAX
and fast answers do not outgrow a server's metrics, read once a second; it shrinks x0.8 on an
overload (HTTP 429, 502, 503, 504, a read timeout, the server's own queue or KV-cache use), at
most once per :data:`COOLDOWN_MS` so that the 429s of one burst cut once. The rule is one script (lua/caps_adapt.lua) over the cap's state in Redis
(``Keys.cap_adapt``: bounds, successes since the last change, the last cut and its reason) and
writes the limit in force where takes and renewals read it (``Keys.caps``, broker/caps.py).
Workers report outcomes (workers/adaptive_caps.py): successes batched per process per keeper tick,
overloads at once. Each change is kept in a bounded log (``Keys.cap_adapt_log``) for status, the
browser and the plot.

A job's limits changed live (``interactor job JOB set``, interactor/job_set.py) are a hash per
job (``Keys.job_limits``): workers read it every few seconds (workers/adaptive_caps.py
``LiveLimits``) for the attempts they start, and the model cap's limit in force is written at
once for the calls running now.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import redis

from broker.keys import Keys
from broker.lua_scripts import lua_file

# Bare ``auto``: Inspect's start of 20 connections per model, between 1 (a server that takes one
# call at a time still makes progress) and 256 (more than one vLLM replica's useful batch: a
# limit beyond it would only ever be cut back).
AUTO_MIN, AUTO_MAX, AUTO_START = 1, 256, 20
COOLDOWN_MS = 1000  # one cut per second at most: one burst of 429s is one overload
LOG_MAX = 500  # changes kept per cap
SHRINK = 0.8  # the cut's factor, as lua/caps_adapt.lua applies it

# Fields of a job's live limits (Keys.job_limits)
LIVE_MODEL, LIVE_AUTO, LIVE_RPM, LIVE_TPM = "model", "auto", "model_rpm", "model_tpm"

_AUTO_RE = re.compile(r"auto(?::(\d+)-(\d+))?")
_ADAPT = lua_file("now") + lua_file("caps_adapt")


@dataclass(frozen=True)
class Concurrency:
    """A fleet-wide model concurrency as given: ``fixed`` N (0: no cap), or adaptive between
    ``low`` and ``high``."""

    fixed: int = 0
    low: int = 0
    high: int = 0

    @property
    def auto(self) -> bool:
        return self.high > 0

    @property
    def start(self) -> int:
        """The limit an adaptive cap starts at: 20 (Inspect's), within the bounds."""
        return max(self.low, min(self.high, AUTO_START))

    @property
    def bounds(self) -> str:
        return f"{self.low}-{self.high}" if self.auto else ""

    def __str__(self) -> str:
        return f"auto:{self.bounds}" if self.auto else str(self.fixed)


def parse_concurrency(text: Any) -> Concurrency:
    """``N``, ``auto`` or ``auto:MIN-MAX`` (what ``--concurrency`` of a job and
    ``--llm-fleet-max-concurrency`` take); raises ValueError naming what is wrong."""
    value = str(text).strip().lower()
    if value.isdigit():
        return Concurrency(fixed=int(value))
    m = _AUTO_RE.fullmatch(value)
    if not m:
        raise ValueError(f"a fleet-wide model concurrency must be a number, auto or auto:MIN-MAX (e.g. auto:4-64), "
                         f"not {str(text)!r}")
    if m[1] is None:
        return Concurrency(low=AUTO_MIN, high=AUTO_MAX)
    low, high = int(m[1]), int(m[2])
    if low < 1 or high < low:
        raise ValueError(f"concurrency {str(text)!r}: auto:MIN-MAX needs 1 <= MIN <= MAX, got MIN={low}, MAX={high}")
    return Concurrency(low=low, high=high)


def bounds_of(text: str) -> tuple[int, int] | None:
    """``"MIN-MAX"`` as stored (Limits.model_auto, the live limits) read back; None if not that."""
    lo, sep, hi = str(text or "").partition("-")
    if not sep or not lo.isdigit() or not hi.isdigit():
        return None
    return int(lo), int(hi)


def cap_parts(keys: Keys, cap_key: str) -> tuple[str, str]:
    """(kind, name) of a cap from its key (``<prefix>:cap:<kind>:<name>``)."""
    head = f"{keys.prefix}:cap:"
    if not cap_key.startswith(head):
        return "?", cap_key
    kind, _, name = cap_key[len(head):].partition(":")
    return kind, name


class AdaptiveCaps:
    """The Redis side of adaptive caps: configure one, report outcomes, read its state."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.r = client
        self.k = keys
        self._adapt = client.register_script(_ADAPT)

    def _state_keys(self, cap_key: str) -> tuple[str, str]:
        kind, name = cap_parts(self.k, cap_key)
        return self.k.cap_adapt(kind, name), self.k.cap_adapt_log(kind, name)

    def configure(self, cap_key: str, low: int, high: int, start: int, reason: str, *,
                  keep_limit: bool = False) -> int:
        """Make ``cap_key`` adaptive between ``low`` and ``high``; its limit becomes ``start`` (or,
        with ``keep_limit``, the limit in force brought within the bounds). Returns the limit."""
        state, log_key = self._state_keys(cap_key)
        now_ms = int(time.time() * 1000)
        if keep_limit:
            current = self.r.hget(self.k.caps, cap_key)
            start = int(current) if current and current.isdigit() else start
        limit = max(low, min(high, int(start)))
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(state, mapping={"min": low, "max": high, "successes": 0, "cut_at": 0, "at": now_ms, "reason": reason})
        pipe.hset(self.k.caps, cap_key, limit)
        pipe.rpush(log_key, f"{now_ms} {limit} {reason}")
        pipe.ltrim(log_key, -LOG_MAX, -1)
        pipe.execute()
        return limit

    def fix(self, cap_key: str, limit: int, reason: str) -> None:
        """A fixed limit for ``cap_key``: adaptation stops (its state goes), the change is logged."""
        state, log_key = self._state_keys(cap_key)
        now_ms = int(time.time() * 1000)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(state)
        pipe.hset(self.k.caps, cap_key, int(limit))
        pipe.rpush(log_key, f"{now_ms} {int(limit)} {reason}")
        pipe.ltrim(log_key, -LOG_MAX, -1)
        pipe.execute()

    def report(self, cap_key: str, start: int, successes: int = 0, overload: str = "", demand: bool = False,
               cooldown_ms: int = COOLDOWN_MS) -> tuple[int, bool]:
        """One report of outcomes (lua/caps_adapt.lua): (limit in force, whether it changed);
        limit -1 when the cap is not adaptive."""
        state, log_key = self._state_keys(cap_key)
        limit, changed = self._adapt(keys=[self.k.caps, state, log_key],
                                     args=[cap_key, int(successes), overload[:80], int(bool(demand)),
                                           int(cooldown_ms), LOG_MAX, int(start)])
        return int(limit), bool(changed)

    def state(self, cap_key: str) -> dict[str, Any] | None:
        """{low, high, reason, at (unix s)} of an adaptive cap; None when it is not one."""
        state, _ = self._state_keys(cap_key)
        raw = {k.decode(): v.decode() for k, v in self.r.hgetall(state).items()}
        try:
            return {"low": int(raw["min"]), "high": int(raw["max"]), "reason": raw.get("reason", ""),
                    "at": int(raw.get("at") or 0) / 1000.0}
        except (KeyError, ValueError):
            return None

    def history(self, cap_key: str, limit: int = LOG_MAX) -> list[dict[str, Any]]:
        """The cap's changes, oldest first: [{at (unix s), limit, reason}] (a malformed entry skipped)."""
        _, log_key = self._state_keys(cap_key)
        out = []
        for raw in self.r.lrange(log_key, -max(1, int(limit)), -1):
            at, _, rest = raw.decode("utf-8", "replace").partition(" ")
            n, _, reason = rest.partition(" ")
            if at.isdigit() and n.isdigit():
                out.append({"at": int(at) / 1000.0, "limit": int(n), "reason": reason})
        return out

    def last_change(self, cap_key: str) -> dict[str, Any] | None:
        """The cap's last logged change, also of a fixed cap (a `job set`); None if none."""
        changes = self.history(cap_key, 1)
        return changes[-1] if changes else None
