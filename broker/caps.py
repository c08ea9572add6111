"""Fleet-wide caps: at most N calls in flight to a server, across every worker process.

Per-process limits (``llm_max_concurrency``) multiply with the fleet: 20 workers at 64 slots
put 1,280 requests on a model endpoint that serves 200. A cap here holds whatever the number
of workers, because its slots are counted in Redis. Per cap (``<kind>``, ``<name>``):

* ``<prefix>:cap-held:<kind>:<name>``: hash holder -> how many slots it holds;
* ``<prefix>:cap:<kind>:<name>``: zset holder -> its lease's expiry (ms, Redis' clock);
* ``<prefix>:cap-wanted:<kind>:<name>``: zset holder -> until when (ms) it waits for slots
  the cap did not have;
* ``<prefix>:cap-queue:<kind>:<name>``: zset holder -> since when (ms) it waits holding
  none of the cap: the order in which such waiters are served.

And for every cap, ``<prefix>:caps-clock`` (Redis' time of the last take or renewal),
``<prefix>:caps-hold`` (set for a while after an outage, see below) and ``<prefix>:caps`` (cap
key -> its limit in force).

**A cap's limit lives in Redis.** ``<prefix>:caps`` holds the limit in force of every cap a job
set: written at submit, changed by ``interactor job JOB set`` and by adaptive concurrency
(broker/adaptive.py); takes and renewals read it (the job spec's number, passed as ARGV, only
when it is absent). A cap is its server's, so the limit is too: the jobs that share an endpoint
share its cap and its limit, the last word (submit or set) winning. Lowering it below what the
holders hold makes the next renewal tell each holder it is contended, with its share of the new
limit: a pool keeps that many and gives the rest back as its calls end, so the fleet is within
the new limit about one keeper tick after the change plus its calls' end
(workers/fleetcaps.py).

A holder is one worker process's pool for one set of caps (workers/fleetcaps.py). It takes
slots in *blocks* and lends them to its own calls without asking Redis again, so that a call
costs no round trip while the process keeps enough slots; it gives back what it has not
needed for a while, and its share when another holder waits. It renews its lease; a
SIGKILLed or frozen process's slots lapse within the lease TTL and are swept by the next
take of anyone. The sum of the holders' counts never exceeds the cap.

**Every waiter is served, whatever the cap.** A holder that waits holding none of a cap is
queued, and a take gets only the room left after one slot for each of those queued ahead of
it (for each of them, when the taker holds some): the longest waiter is served first. A
renewal tells a holder that another waits and its fair share (the cap over the holders and
waiters taking part); a holder keeps no more than that, and when more take part than the
cap has slots (share 0) it keeps one slot for a turn, then gives it back and queues again
(workers/fleetcaps.py). So a process that waits is served once those ahead of it had their
turn: within about one renewal (for the holders to learn that it waits) and ``processes /
cap`` turns of a second each. A slot comes back only when its call ends (an env instance's,
when the instance is closed), so a turn lasts at least one call.

**A Redis outage frees no slot that is still in use.** When Redis is away (frozen,
restarting, unreachable from everyone) for longer than the lease TTL, every lease lapses
by Redis' clock while the holders' calls carry on. The ledger's rule applies
(broker/ledger.py ``OUTAGE_FN``, lua/ledger_outage_fn.lua), on the caps' own clock: every take and renewal stamps it,
and a gap of more than half the TTL (a live holder renews every third of it, so its lease
lapses only after two thirds without Redis) holds the sweeps for two TTLs. Meanwhile lapsed
slots still count against the cap, and a holder's renewal extends its lapsed lease (nobody
took its slots). A gap can also mean nobody used the caps at all; then a dead holder's slots
come back two TTLs later, no harm. What the rule cannot tell from a dead holder: a process
frozen past the TTL, or cut off from Redis while the others reach it. Its slots are swept
and taken by others while its calls in flight finish, so those calls may exceed the cap until
they end.

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

from broker.adaptive import AdaptiveCaps
from broker.keys import Keys
from broker.ledger import OUTAGE_FN
from broker.lua_scripts import lua_file
from broker.server_metrics import ServerMetrics

CAP_MODEL = "model"
CAP_ENV = "env"
CAP_ENV_NAME = "env_name"
CAP_ENV_INSTANCES = "env_instances"

# The task file's spelling (top-level ``limits:``), docs/protocol.md#task-files.
LIMIT_MODEL, LIMIT_ENV_SERVERS, LIMIT_ENV_NAMES = "model", "env_servers", "env_names"
MAX_CONCURRENCY, MAX_INSTANCES = "max_concurrency", "max_instances"
# the model endpoint's rate limits (broker/ratelimit.py)
REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE = "requests_per_minute", "tokens_per_minute"
# the model cap's adaptive bounds "MIN-MAX" (broker/adaptive.py): set by --concurrency auto, not in task files
AUTO_BOUNDS = "auto"
# the model server's Prometheus metrics, read under an adaptive cap (broker/server_metrics.py): not in task files
METRICS_URL = "metrics_url"
_ALLOWED = {LIMIT_MODEL: (MAX_CONCURRENCY, REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE), LIMIT_ENV_SERVERS: (MAX_CONCURRENCY, MAX_INSTANCES),
            LIMIT_ENV_NAMES: (MAX_CONCURRENCY,)}

# Its scripts' Lua: broker/lua/caps_*.lua (broker/lua_scripts.py), with the ledger's now.lua and
# ledger_outage_fn.lua (the caps' clock and hold after an outage).
_NOW = lua_file("now")
_CAP = lua_file("caps_cap_fn")
_TAKE = _NOW + OUTAGE_FN + _CAP + lua_file("caps_sweep_fn") + lua_file("caps_ahead_fn") + lua_file("caps_take")
_GIVE = _CAP + lua_file("caps_give")
_RENEW = _NOW + OUTAGE_FN + _CAP + lua_file("caps_renew")
_USE = _NOW + _CAP + lua_file("caps_use")


def server_name(url: str) -> str:
    """How a server is named in its cap's key: its base URL without a trailing slash."""
    return url.rstrip("/")


@dataclass(frozen=True)
class Cap:
    """One cap a call needs: its keys (module docstring) and how many slots there are."""

    key: str  # the holders' leases; also the cap's name in ``<prefix>:caps``
    held: str
    wanted: str
    queue: str
    limit: int

    @classmethod
    def of(cls, keys: Keys, kind: str, name: str, limit: int) -> "Cap":
        return cls(keys.cap(kind, name), keys.cap_held(kind, name), keys.cap_wanted(kind, name),
                   keys.cap_queue(kind, name), int(limit))

    @property
    def quadruple(self) -> list[str]:
        return [self.key, self.held, self.wanted, self.queue]


@dataclass
class Limits:
    """A job's caps, as its JobSpec carries them (``to_dict``); 0 / absent = no cap."""

    model: int = 0
    model_rpm: int = 0  # requests per minute to the model endpoint, fleet-wide (broker/ratelimit.py)
    model_tpm: int = 0  # tokens per minute (the answers' usage), fleet-wide
    model_auto: str = ""  # "MIN-MAX": the model cap adapts to the server between them (broker/adaptive.py)
    model_metrics: str = ""  # the model server's metrics URL, a second overload signal of an adaptive cap
    env_servers: dict[str, dict[str, int]] = field(default_factory=dict)  # base URL -> {max_concurrency, max_instances}
    env_names: dict[str, int] = field(default_factory=dict)  # env_name -> max_concurrency

    def __bool__(self) -> bool:
        return bool(self.model or self.model_rpm or self.model_tpm or self.env_servers or self.env_names)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        model = {k: n for k, n in ((MAX_CONCURRENCY, self.model), (REQUESTS_PER_MINUTE, self.model_rpm),
                                   (TOKENS_PER_MINUTE, self.model_tpm), (AUTO_BOUNDS, self.model_auto),
                                   (METRICS_URL, self.model_metrics)) if n}
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
                   model_tpm=int(model.get(TOKENS_PER_MINUTE, 0)), model_auto=str(model.get(AUTO_BOUNDS) or ""),
                   model_metrics=str(model.get(METRICS_URL) or ""),
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
    they were swept), whether another holder waits for one of its caps, and its fair share
    (0: more take part than the cap has slots, so holders take turns)."""

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
        # The outage rule (module docstring): a live holder renews every third of the TTL at
        # least, so its lease lapses only after two thirds of it without Redis; a gap of half
        # the TTL in the caps' clock is an outage, and sweeps wait two TTLs after one.
        self.outage_ms = (max(1, self.ttl_ms // 2), max(1, 2 * self.ttl_ms))
        self._take = client.register_script(_TAKE)
        self._give = client.register_script(_GIVE)
        self._renew = client.register_script(_RENEW)
        self._use = client.register_script(_USE)

    def _keys(self, caps: Sequence[Cap]) -> list[str]:
        return [self.k.caps_clock, self.k.caps_hold, self.k.caps, *(k for c in caps for k in c.quadruple)]

    def take(self, caps: Sequence[Cap], holder: str, want: int = 1) -> tuple[int, int]:
        """Up to ``want`` slots of every cap in ``caps`` (the same number of each) for
        ``holder``: (granted, what Redis counted for the holder before)."""
        granted, before = self._take(keys=self._keys(caps),
                                     args=[holder, self.ttl_ms, int(want), self.wanted_ttl_ms, *self.outage_ms,
                                           *(c.limit for c in caps)])
        return int(granted), int(before)

    def give(self, caps: Sequence[Cap], holder: str, count: int) -> None:
        if count > 0:
            self._give(keys=self._keys(caps), args=[holder, int(count)])

    def renew(self, holders: Sequence[tuple[str, Sequence[Cap]]]) -> list[Renewal]:
        """Extend each holder's lease on its caps; what each is told (:class:`Renewal`)."""
        if not holders:
            return []
        keys: list[str] = self._keys([])
        args: list[Any] = [self.ttl_ms, *self.outage_ms]
        for holder, caps in holders:
            keys += [k for c in caps for k in c.quadruple]
            args += [holder, len(caps), *(c.limit for c in caps)]
        return [Renewal(int(h), bool(c), int(s)) for h, c, s in self._renew(keys=keys, args=args)]

    def register(self, caps: Iterable[Cap]) -> None:
        """Note the caps a job set (``<prefix>:caps``), for status and metrics."""
        mapping = {c.key: c.limit for c in caps}
        if mapping:
            self.r.hset(self.k.caps, mapping=mapping)

    def use(self) -> list[dict[str, Any]]:
        """Every registered cap with the slots held of it now: [{kind, name, limit (in force),
        in_use}], a model cap's also with auto ("MIN-MAX" when it adapts, else ""), changed
        (its limit's last change: {at, limit, reason}, or None) and server (the model server's last
        metrics reading, broker/server_metrics.py ServerMetrics.last, or None).
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
        out = []
        adaptive, metrics = AdaptiveCaps(self.r, self.k), ServerMetrics(self.r, self.k)
        for (kind, name, cap), n in zip(caps, counts):
            use = {"kind": kind, "name": name, "limit": cap.limit, "in_use": int(n)}
            if kind == CAP_MODEL:  # adaptive bounds ("" if fixed), its limit's last change (broker/adaptive.py)
                state = adaptive.state(cap.key)
                use.update(auto=f"{state['low']}-{state['high']}" if state else "", changed=adaptive.last_change(cap.key),
                           server=metrics.last(cap.key))
            out.append(use)
        return out
