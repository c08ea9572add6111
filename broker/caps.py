"""Fleet-wide caps: at most N calls in flight to a server, across every worker process.

Per-process limits (``llm_max_concurrency``) multiply with the fleet: 20 workers at 64 slots
put 1,280 requests on a model endpoint that serves 200. A cap here holds whatever the number
of workers, because its slots are counted in Redis. Per cap (``<kind>``, ``<name>``):

* ``<prefix>:cap-held:<kind>:<name>``: hash holder -> how many slots it holds;
* ``<prefix>:cap:<kind>:<name>``: zset holder -> its lease's expiry (ms, Redis' clock);
* ``<prefix>:cap-wanted:<kind>:<name>``: zset holder -> until when (ms) it waits for slots
  the cap did not have.

A holder is one worker process's pool for one set of caps (workers/fleetcaps.py). It takes
slots in *blocks* and lends them to its own calls without asking Redis again, so that a call
costs no round trip while the process keeps enough slots; it gives back what it has not
needed for a while, and its share when another holder waits. It renews its lease; a
SIGKILLed or frozen process's slots lapse within the lease TTL and are swept by the next
take of anyone. The sum of every live holder's count never exceeds the cap.

Kinds of cap (what a job's ``limits`` name, resolved at submit into :class:`Limits`):

* ``model``: calls to the job's model endpoint (its ``llm_base_url``);
* ``env``: calls to one env server (``base_url``: reset, prompt, step, close);
* ``env_name``: calls to env instances of one ``env_name`` (any server);
* ``env_instances``: live env instances on one env server, held from reset to close, so that
  a sandbox-backed server is never asked for more than it holds.

A call may need several caps at once (an env call: its server's and its env_name's); a take
gets the same number of slots of each or none, so waiting for one never holds another.
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

# Every script takes a cap's keys as a triple: lease zset, held hash, wanted zset.
# Lapsed holders of cap i swept (lease expired: count and lease gone), then its slots in use.
_SWEEP = """
local function sweep(z, h)
  local lapsed = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  for _, m in ipairs(lapsed) do redis.call('HDEL', h, m) end
  if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', z, '-inf', now) end
  local used = 0
  for _, v in ipairs(redis.call('HVALS', h)) do used = used + tonumber(v) end
  return used
end
"""

# KEYS: triples per cap   ARGV: holder, ttl_ms, want, wanted_ttl_ms, limit per cap
# Grants up to ``want`` slots of every cap (the same number of each: what the fullest has
# room for), extends the holder's lease, and notes it as waiting when it got fewer than it
# wanted. Returns {granted, held before} (held before: the holder's count of the first cap
# as Redis had it, so that a holder learns its slots lapsed).
_TAKE = _NOW + _SWEEP + """
local holder, ttl, want = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n = #KEYS / 3
local grant = want
for i = 1, n do
  local room = tonumber(ARGV[4 + i]) - sweep(KEYS[3 * i - 2], KEYS[3 * i - 1])
  if room < grant then grant = room end
end
if grant < 0 then grant = 0 end
local before = tonumber(redis.call('HGET', KEYS[2], holder) or '0')
for i = 1, n do
  local z, h, w = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if grant > 0 then
    redis.call('HINCRBY', h, holder, grant)
    redis.call('ZADD', z, now + ttl, holder)
  end
  if grant < want then
    redis.call('ZADD', w, now + tonumber(ARGV[4]), holder)
  else
    redis.call('ZREM', w, holder)
  end
end
return {grant, before}
"""

# KEYS: triples per cap   ARGV: holder, count   Gives ``count`` slots back (all: the holder is gone).
_GIVE = """
for i = 1, #KEYS / 3 do
  local z, h = KEYS[3 * i - 2], KEYS[3 * i - 1]
  if redis.call('HINCRBY', h, ARGV[1], -tonumber(ARGV[2])) <= 0 then
    redis.call('HDEL', h, ARGV[1])
    redis.call('ZREM', z, ARGV[1])
  end
end
return 0
"""

# KEYS: triples, per holder its caps' in turn   ARGV: ttl_ms, then per holder: name, number of
# caps, limit per cap.
# Per holder: when its lease lapsed in any of its caps, whatever is left of it is removed and
# {-1, 0, 0} returned (its slots are gone); else its lease is extended and {held, contended,
# share} returned: contended 1 when another holder waits for one of its caps, share the
# fewest slots a cap's limit gives each of those taking part in it (holders and waiters).
_RENEW = _NOW + """
local ttl = tonumber(ARGV[1])
local out = {}
local k, a = 0, 2
while a <= #ARGV do
  local holder, n = ARGV[a], tonumber(ARGV[a + 1])
  local gone = false
  for i = 1, n do
    local s = redis.call('ZSCORE', KEYS[3 * (k + i) - 2], holder)
    if not s or tonumber(s) <= now or not redis.call('HGET', KEYS[3 * (k + i) - 1], holder) then gone = true end
  end
  if gone then
    for i = 1, n do
      redis.call('ZREM', KEYS[3 * (k + i) - 2], holder)
      redis.call('HDEL', KEYS[3 * (k + i) - 1], holder)
    end
    table.insert(out, {-1, 0, 0})
  else
    local contended, share = 0, nil
    for i = 1, n do
      local z, h, w = KEYS[3 * (k + i) - 2], KEYS[3 * (k + i) - 1], KEYS[3 * (k + i)]
      redis.call('ZADD', z, now + ttl, holder)
      local parts = redis.call('ZCOUNT', z, now, '+inf')
      for _, m in ipairs(redis.call('ZRANGEBYSCORE', w, now, '+inf')) do
        if m ~= holder then contended = 1 end
        local ms = redis.call('ZSCORE', z, m)
        if not ms or tonumber(ms) <= now then parts = parts + 1 end
      end
      local sh = math.floor(tonumber(ARGV[a + 1 + i]) / math.max(1, parts))
      if share == nil or sh < share then share = sh end
    end
    table.insert(out, {tonumber(redis.call('HGET', KEYS[2 + 3 * k], holder)), contended, math.max(1, share)})
  end
  k = k + n
  a = a + 2 + n
end
return out
"""

# KEYS: triples per cap   Lapsed holders swept, then the slots held of each (status, metrics).
_USE = _NOW + _SWEEP + """
local out = {}
for i = 1, #KEYS / 3 do
  out[i] = sweep(KEYS[3 * i - 2], KEYS[3 * i - 1])
end
return out
"""


def server_name(url: str) -> str:
    """How a server is named in its cap's key: its base URL without a trailing slash."""
    return url.rstrip("/")


@dataclass(frozen=True)
class Cap:
    """One cap a call needs: its keys (module docstring) and how many slots there are."""

    key: str  # the holders' leases; also the cap's name in ``<prefix>:caps``
    held: str
    wanted: str
    limit: int

    @classmethod
    def of(cls, keys: Keys, kind: str, name: str, limit: int) -> "Cap":
        return cls(keys.cap(kind, name), keys.cap_held(kind, name), keys.cap_wanted(kind, name), int(limit))

    @property
    def triple(self) -> list[str]:
        return [self.key, self.held, self.wanted]


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
        return [Cap.of(keys, CAP_MODEL, server_name(llm_base_url), self.model)] if self.model > 0 else []

    def env_call_caps(self, keys: Keys, base_url: str, env_name: str) -> list[Cap]:
        out = []
        n = self.env_servers.get(server_name(base_url), {}).get(MAX_CONCURRENCY, 0)
        if n > 0:
            out.append(Cap.of(keys, CAP_ENV, server_name(base_url), n))
        n = self.env_names.get(env_name, 0)
        if n > 0:
            out.append(Cap.of(keys, CAP_ENV_NAME, env_name, n))
        return out

    def env_instance_caps(self, keys: Keys, base_url: str) -> list[Cap]:
        n = self.env_servers.get(server_name(base_url), {}).get(MAX_INSTANCES, 0)
        return [Cap.of(keys, CAP_ENV_INSTANCES, server_name(base_url), n)] if n > 0 else []

    def all_caps(self, keys: Keys, llm_base_url: str) -> list[Cap]:
        out = self.model_caps(keys, llm_base_url)
        for url, v in self.env_servers.items():
            if v.get(MAX_CONCURRENCY, 0) > 0:
                out.append(Cap.of(keys, CAP_ENV, url, v[MAX_CONCURRENCY]))
            if v.get(MAX_INSTANCES, 0) > 0:
                out.append(Cap.of(keys, CAP_ENV_INSTANCES, url, v[MAX_INSTANCES]))
        out += [Cap.of(keys, CAP_ENV_NAME, n, v) for n, v in self.env_names.items() if v > 0]
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


@dataclass(frozen=True)
class Renewal:
    """What a renewal tells a holder: the slots Redis counts for it (-1: its lease lapsed and
    they are gone), whether another holder waits for one of its caps, and its fair share."""

    held: int
    contended: bool = False
    share: int = 0


class FleetSlots:
    """The Redis side of the caps: take and give back slots in blocks, renew the holders'
    leases, and the use of each cap (status). One round trip each."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_ms: int, wanted_ttl_ms: int = 2000):
        self.r = client
        self.k = keys
        self.ttl_ms = int(ttl_ms)
        self.wanted_ttl_ms = int(wanted_ttl_ms)  # a waiter that stopped asking is forgotten this soon
        self._take = client.register_script(_TAKE)
        self._give = client.register_script(_GIVE)
        self._renew = client.register_script(_RENEW)
        self._use = client.register_script(_USE)

    @staticmethod
    def _keys(caps: Sequence[Cap]) -> list[str]:
        return [k for c in caps for k in c.triple]

    def take(self, caps: Sequence[Cap], holder: str, want: int = 1) -> tuple[int, int]:
        """Up to ``want`` slots of every cap in ``caps`` (the same number of each) for
        ``holder``: (granted, what Redis counted for the holder before)."""
        granted, before = self._take(keys=self._keys(caps),
                                     args=[holder, self.ttl_ms, int(want), self.wanted_ttl_ms, *(c.limit for c in caps)])
        return int(granted), int(before)

    def give(self, caps: Sequence[Cap], holder: str, count: int) -> None:
        if count > 0:
            self._give(keys=self._keys(caps), args=[holder, int(count)])

    def renew(self, holders: Sequence[tuple[str, Sequence[Cap]]]) -> list[Renewal]:
        """Extend each holder's lease on its caps; what each is told (:class:`Renewal`)."""
        if not holders:
            return []
        keys: list[str] = []
        args: list[Any] = [self.ttl_ms]
        for holder, caps in holders:
            keys += self._keys(caps)
            args += [holder, len(caps), *(c.limit for c in caps)]
        return [Renewal(int(h), bool(c), int(s)) for h, c, s in self._renew(keys=keys, args=args)]

    def register(self, caps: Iterable[Cap]) -> None:
        """Note the caps a job set (``<prefix>:caps``), for status and metrics."""
        mapping = {c.key: c.limit for c in caps}
        if mapping:
            self.r.hset(self.k.caps, mapping=mapping)

    def use(self) -> list[dict[str, Any]]:
        """Every registered cap with the slots held of it now: [{kind, name, limit, in_use}].
        Held counts what workers took, lent to a call or kept for the next one a moment."""
        raw = self.r.hgetall(self.k.caps)
        if not raw:
            return []
        head = f"{self.k.prefix}:cap:"
        caps = []
        for key in sorted(k.decode() for k in raw):
            kind, _, name = key[len(head):].partition(":") if key.startswith(head) else ("?", "", key)
            caps.append((kind, name, Cap.of(self.k, kind, name, int(raw[key.encode()]))))
        counts = self._use(keys=self._keys([c for _, _, c in caps]))
        return [{"kind": kind, "name": name, "limit": cap.limit, "in_use": int(n)}
                for (kind, name, cap), n in zip(caps, counts)]
