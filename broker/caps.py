"""Fleet-wide caps: at most N calls in flight to a server, across every worker process.

Per-process limits (``llm_max_concurrency``) multiply with the fleet: 20 workers at 64 slots
put 1,280 requests on a model endpoint that serves 200. A cap here holds whatever the number
of workers, because its slots live in Redis: one sorted set per cap
(``<prefix>:cap:<kind>:<name>``), a member per slot holder, scored by its lease's expiry (ms,
Redis' clock). Holders renew their slots (workers/fleetcaps.py); a SIGKILLed or frozen
worker's slots lapse within the lease TTL and are swept by the next acquire of anyone.

Kinds of cap (what a job's ``limits`` name, resolved at submit into :class:`Limits`):

* ``model``: calls to the job's model endpoint (its ``llm_base_url``);
* ``env``: calls to one env server (``base_url``: reset, prompt, step, close);
* ``env_name``: calls to env instances of one ``env_name`` (any server);
* ``env_instances``: live env instances on one env server, held from reset to close, so that
  a sandbox-backed server is never asked for more than it holds.

A call may need several caps at once (an env call: its server's and its env_name's); the
acquire script takes them all or none, so waiting for one never holds another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import redis

from broker.keys import Keys

CAP_MODEL = "model"
CAP_ENV = "env"
CAP_ENV_NAME = "env_name"
CAP_ENV_INSTANCES = "env_instances"

# The task file's spelling (top-level ``limits:``), docs/protocol.md#task-files.
LIMIT_MODEL, LIMIT_ENV_SERVERS, LIMIT_ENV_NAMES = "model", "env_servers", "env_names"
MAX_CONCURRENCY, MAX_INSTANCES = "max_concurrency", "max_instances"
# the model endpoint's rate limits (broker/ratelimit.py)
REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE = "requests_per_minute", "tokens_per_minute"
_ALLOWED = {LIMIT_MODEL: (MAX_CONCURRENCY, REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE), LIMIT_ENV_SERVERS: (MAX_CONCURRENCY, MAX_INSTANCES),
            LIMIT_ENV_NAMES: (MAX_CONCURRENCY,)}

_NOW = """
redis.replicate_commands()
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
"""

# KEYS: cap zsets   ARGV: holder, ttl_ms, limit per key
# All or none: sweeps lapsed holders, then takes a slot in every cap if each has room.
# Returns 0 (taken), or the 1-based index of the first cap that is full.
_ACQUIRE = _NOW + """
for i = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  if redis.call('ZCARD', KEYS[i]) >= tonumber(ARGV[2 + i]) then return i end
end
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], now + tonumber(ARGV[2]), ARGV[1])
end
return 0
"""

# KEYS: cap zsets, one per holder   ARGV: ttl_ms, holder per key
# Extends the slots still held; returns the 1-based indexes of those gone (they lapsed).
_RENEW = _NOW + """
local gone = {}
for i = 1, #KEYS do
  if redis.call('ZADD', KEYS[i], 'XX', 'CH', now + tonumber(ARGV[1]), ARGV[1 + i]) == 0
     and not redis.call('ZSCORE', KEYS[i], ARGV[1 + i]) then
    table.insert(gone, i)
  end
end
return gone
"""

# KEYS: cap zsets   Lapsed holders swept, then the live count of each (for status and metrics).
_USE = _NOW + """
local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('ZCOUNT', KEYS[i], now, '+inf')
end
return out
"""


def server_name(url: str) -> str:
    """How a server is named in its cap's key: its base URL without a trailing slash."""
    return url.rstrip("/")


@dataclass(frozen=True)
class Cap:
    """One cap a call needs: the key of its slots and how many there are."""

    key: str
    limit: int


@dataclass
class Limits:
    """A job's caps, as its JobSpec carries them (``to_dict``); 0 / absent = no cap."""

    model: int = 0
    model_rpm: int = 0  # requests per minute to the model endpoint, fleet-wide (broker/ratelimit.py)
    model_tpm: int = 0  # tokens per minute (the answers' usage), fleet-wide
    env_servers: dict[str, dict[str, int]] = field(default_factory=dict)  # base URL -> {max_concurrency, max_instances}
    env_names: dict[str, int] = field(default_factory=dict)  # env_name -> max_concurrency

    def __bool__(self) -> bool:
        return bool(self.model or self.model_rpm or self.model_tpm or self.env_servers or self.env_names)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        model = {k: n for k, n in ((MAX_CONCURRENCY, self.model), (REQUESTS_PER_MINUTE, self.model_rpm),
                                   (TOKENS_PER_MINUTE, self.model_tpm)) if n}
        if model:
            out[LIMIT_MODEL] = model
        if self.env_servers:
            out[LIMIT_ENV_SERVERS] = {u: dict(v) for u, v in self.env_servers.items()}
        if self.env_names:
            out[LIMIT_ENV_NAMES] = {n: {MAX_CONCURRENCY: v} for n, v in self.env_names.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "Limits":
        d = d or {}
        model = d.get(LIMIT_MODEL) or {}
        return cls(model=int(model.get(MAX_CONCURRENCY, 0)), model_rpm=int(model.get(REQUESTS_PER_MINUTE, 0)),
                   model_tpm=int(model.get(TOKENS_PER_MINUTE, 0)),
                   env_servers={server_name(u): {k: int(n) for k, n in v.items()}
                                for u, v in (d.get(LIMIT_ENV_SERVERS) or {}).items()},
                   env_names={n: int(v.get(MAX_CONCURRENCY, 0)) for n, v in (d.get(LIMIT_ENV_NAMES) or {}).items()})

    # --- the caps one call needs (empty: none, and no Redis round trip) ---------------
    def model_caps(self, keys: Keys, llm_base_url: str) -> list[Cap]:
        return [Cap(keys.cap(CAP_MODEL, server_name(llm_base_url)), self.model)] if self.model > 0 else []

    def env_call_caps(self, keys: Keys, base_url: str, env_name: str) -> list[Cap]:
        out = []
        n = self.env_servers.get(server_name(base_url), {}).get(MAX_CONCURRENCY, 0)
        if n > 0:
            out.append(Cap(keys.cap(CAP_ENV, server_name(base_url)), n))
        n = self.env_names.get(env_name, 0)
        if n > 0:
            out.append(Cap(keys.cap(CAP_ENV_NAME, env_name), n))
        return out

    def env_instance_caps(self, keys: Keys, base_url: str) -> list[Cap]:
        n = self.env_servers.get(server_name(base_url), {}).get(MAX_INSTANCES, 0)
        return [Cap(keys.cap(CAP_ENV_INSTANCES, server_name(base_url)), n)] if n > 0 else []

    def all_caps(self, keys: Keys, llm_base_url: str) -> list[Cap]:
        out = self.model_caps(keys, llm_base_url)
        for url, v in self.env_servers.items():
            if v.get(MAX_CONCURRENCY, 0) > 0:
                out.append(Cap(keys.cap(CAP_ENV, url), v[MAX_CONCURRENCY]))
            if v.get(MAX_INSTANCES, 0) > 0:
                out.append(Cap(keys.cap(CAP_ENV_INSTANCES, url), v[MAX_INSTANCES]))
        out += [Cap(keys.cap(CAP_ENV_NAME, n), v) for n, v in self.env_names.items() if v > 0]
        return out


def check_limits(raw: Any) -> str:
    """Why a task file's ``limits`` mapping is wrong ("" = it is right): known keys only, every
    cap an integer >= 1 (a cap of 0 or less would stop the job: it is refused, not ignored)."""
    if not isinstance(raw, dict):
        return f"must be a mapping with keys {', '.join(_ALLOWED)}, got {type(raw).__name__}"
    for section, value in raw.items():
        if section not in _ALLOWED:
            return f"unknown key {section!r} (allowed: {', '.join(_ALLOWED)})"
        entries = {None: value} if section == LIMIT_MODEL else value
        if not isinstance(entries, dict) or (section != LIMIT_MODEL and not entries):
            return f"{section}: must be a non-empty mapping, got {value!r}"
        for name, caps in entries.items():
            at = section if name is None else f"{section} {name!r}"
            if name is not None and (not isinstance(name, str) or not name):
                return f"{section}: names must be non-empty strings, got {name!r}"
            if not isinstance(caps, dict) or not caps:
                return f"{at}: must be a mapping of {', '.join(_ALLOWED[section])}, got {caps!r}"
            for k, n in caps.items():
                if k not in _ALLOWED[section]:
                    return f"{at}: unknown key {k!r} (allowed: {', '.join(_ALLOWED[section])})"
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    return f"{at}: {k} must be an integer >= 1, got {n!r}"
    return ""


class FleetSlots:
    """The Redis side of the caps: acquire, release, renew, and the use of each (status)."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_ms: int):
        self.r = client
        self.k = keys
        self.ttl_ms = int(ttl_ms)
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._use = client.register_script(_USE)

    def try_acquire(self, caps: Sequence[Cap], holder: str) -> int:
        """One round trip: 0 when a slot of every cap was taken, else the index (1-based) of
        the first cap that is full."""
        return int(self._acquire(keys=[c.key for c in caps], args=[holder, self.ttl_ms, *(c.limit for c in caps)]))

    def release(self, caps: Sequence[Cap], holder: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        for c in caps:
            pipe.zrem(c.key, holder)
        pipe.execute()

    def renew(self, held: Sequence[tuple[str, str]]) -> list[int]:
        """Extend ``(key, holder)`` slots; returns the indexes (0-based) of those that lapsed."""
        if not held:
            return []
        gone = self._renew(keys=[k for k, _ in held], args=[self.ttl_ms, *(h for _, h in held)])
        return [int(i) - 1 for i in gone]

    def register(self, caps: Iterable[Cap]) -> None:
        """Note the caps a job set (``<prefix>:caps``), for status and metrics."""
        mapping = {c.key: c.limit for c in caps}
        if mapping:
            self.r.hset(self.k.caps, mapping=mapping)

    def use(self) -> list[dict[str, Any]]:
        """Every registered cap with its live holders: [{kind, name, limit, in_use}]."""
        raw = self.r.hgetall(self.k.caps)
        if not raw:
            return []
        keys = sorted(k.decode() for k in raw)
        counts = self._use(keys=keys)
        head = f"{self.k.prefix}:cap:"
        out = []
        for key, n in zip(keys, counts):
            kind, _, name = key[len(head):].partition(":") if key.startswith(head) else ("?", "", key)
            out.append({"kind": kind, "name": name, "limit": int(raw[key.encode()]), "in_use": int(n)})
        return out
