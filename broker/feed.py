"""The online-RL feed's shared contract: names, its per-job configuration, and the few Redis
operations that must be atomic (announce once, settle once, versions never go backwards).

Why it lives in Redis and not in a server's memory: the original system's buffer server kept
its cursor in memory, so a restart re-served or skipped groups. Here the feed of a job is a
Redis stream of complete groups (``Keys.feed_stream``) read by one consumer group
(:data:`TRAINERS`) whose consumers are the trainers: XREADGROUP hands a group to one trainer,
XACK (by :func:`settle`) ends it, XCLAIM gives a group taken and not acknowledged within
the timeout to the next taker, whoever it is (the trainer that took it, restarted, too). Whoever restarts (feed server, consumer, worker, trainer), the
cursor and the pending entries are where Redis keeps them.

Who writes what:

* the consumer (consumer/feed.py) announces a group once all its members are settled
  (:func:`announce`: an HSETNX marker and the XADD in one script, so a batch re-processed after
  a crash announces nothing twice);
* workers (workers/versions.py) read :func:`current_version` before each model call;
* the feed server (interactor/feed.py) takes, settles, and publishes versions;
* the continuous producer (producer/continuous.py) counts what it produces, so that at most
  ``max_ahead`` groups are produced and not yet settled.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields

import redis

from broker.keys import Keys
from broker.states import LedgerState

TRAINERS = "trainers"  # the consumer group of a feed's stream; trainers are its consumers

# What becomes of a stale group (FeedConfig.stale_policy) and of a failed one (failed_policy).
STALE_REQUEUE, STALE_DROP = "requeue", "drop"
FAILED_REPORT, FAILED_REFILL = "report", "refill"

# Why a group was filtered (counted as ``filtered:<reason>``).
FILTER_UNIFORM = "uniform"  # drop_uniform: every reward equal, no learning signal
FILTER_USER = "user_filter"  # the configured module:function said no

# Counters in Keys.feed_stats (a hash). inflight = produced - settled (backpressure).
C_PRODUCED = "produced"  # groups the continuous producer enqueued (re-runs included)
C_SETTLED = "settled"  # groups finished with: acknowledged, filtered, failed, stale (either policy)
C_ANNOUNCED = "announced"  # groups the consumer put on the feed
C_READ = "read"  # groups read from the feed for the first time (delivered, filtered or set aside)
C_DELIVERED = "delivered"  # groups handed to a trainer (first time)
C_REDELIVERED = "redelivered"  # groups handed out again after their ack timeout (to any taker)
C_ACKED = "acked"
C_FAILED = "failed"  # groups with a dead-lettered member, reported
C_REFILLED = "refilled"  # ... or run again as fresh episodes (failed_policy refill)
C_STALE_REQUEUED = "stale_requeued"
C_STALE_DROPPED = "stale_dropped"
C_FILTERED = "filtered"  # prefix: filtered:<reason>
C_TAKES = "takes"  # take calls that returned at least one group
C_WAIT_S = "wait_s"  # seconds trainers spent waiting inside take (sum)
C_BEHIND = "versions_behind"  # sum over delivered groups of (current - oldest version)
C_BEHIND_N = "versions_behind_n"  # delivered groups that had a version
C_LAST_TAKE = "last_take_at"  # when a trainer last asked for groups (unix time): retention's clock

FAILURES_KEPT = 1000  # the failures list (what the trainer reads of failed groups) is capped


class FeedError(ValueError):
    """A request the feed refuses; ``status`` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class FeedConfig:
    """A job's feed, as stored in ``Keys.feed_config`` (strings in Redis, typed here)."""

    max_ahead: int = 64
    max_staleness: int = -1  # -1: no bound
    stale_policy: str = STALE_REQUEUE
    failed_policy: str = FAILED_REPORT
    refill_max: int = 2  # failed_policy refill: re-runs of one group's tasks before it is reported
    ack_timeout_s: float = 300.0
    drop_uniform: bool = False
    filter: str = ""  # module:function
    continuous: bool = False  # a producer draws groups from the templates (producer/continuous.py)
    epochs: int = 0  # continuous: 0 = without end
    seed: int = 0  # continuous: shuffles each epoch
    created_at: float = 0.0

    @classmethod
    def from_settings(cls, settings, **kw) -> "FeedConfig":
        return cls(max_ahead=settings.feed_max_ahead, max_staleness=settings.feed_max_staleness,
                   stale_policy=settings.feed_stale_policy, failed_policy=settings.feed_failed_policy,
                   refill_max=settings.feed_refill_max,
                   ack_timeout_s=settings.feed_ack_timeout_s, drop_uniform=settings.feed_drop_uniform,
                   filter=settings.feed_filter, **kw)

    def to_hash(self) -> dict[str, str]:
        return {k: str(int(v) if isinstance(v, bool) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, h: dict) -> "FeedConfig":
        out = cls()
        h = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in (h or {}).items()}
        for f in fields(cls):
            raw = h.get(f.name)
            if raw is None:
                continue
            typ = type(getattr(out, f.name))
            setattr(out, f.name, bool(int(raw)) if typ is bool else typ(raw))
        return out


def enable(r: redis.Redis, keys: Keys, job_id: str, cfg: FeedConfig) -> None:
    """Give a job a feed (idempotent: the stream's consumer group is created once; the config is
    rewritten, so a restarted server can change max_ahead or the staleness bound)."""
    if not cfg.created_at:
        cfg.created_at = time.time()
    try:
        r.xgroup_create(keys.feed_stream(job_id), TRAINERS, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.feed_config(job_id), mapping=cfg.to_hash())
    pipe.sadd(keys.feeds, job_id)
    pipe.execute()


def config(r: redis.Redis, keys: Keys, job_id: str) -> FeedConfig | None:
    h = r.hgetall(keys.feed_config(job_id))
    return FeedConfig.from_hash(h) if h else None


def has_feed(r: redis.Redis, keys: Keys, job_id: str) -> bool:
    return bool(r.sismember(keys.feeds, job_id))


# --- versions -------------------------------------------------------------------------------
_SET_VERSION = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
local new = tonumber(ARGV[1])
if new < cur then return {0, cur} end
redis.call('SET', KEYS[1], ARGV[1])
return {1, cur}
"""


def current_version(r: redis.Redis, keys: Keys, job_id: str) -> int | None:
    raw = r.get(keys.feed_version(job_id))
    return int(raw) if raw is not None else None


def set_version(r: redis.Redis, keys: Keys, job_id: str, version) -> int:
    """Publish the trainer's version. The same version again is fine (a retried call); a lower
    one is refused (409): versions order the staleness bound, so they may not go back."""
    if isinstance(version, bool) or not isinstance(version, int):
        if isinstance(version, str) and version.strip().lstrip("-").isdigit():
            version = int(version)
        else:
            raise FeedError(f"version must be an integer, got {version!r}")
    if version < 0:
        raise FeedError(f"version must be >= 0, got {version}")
    ok, cur = r.eval(_SET_VERSION, 1, keys.feed_version(job_id), version)
    if not ok:
        raise FeedError(f"version {version} is behind the current version {cur}: versions only go forward", 409)
    return version


def parse_version(v) -> int | None:
    """A step's version as an integer: ``7``, ``"7"`` or ``"v7"``; None when it is none of them
    (a model server's own naming we cannot order: such a step is never called stale)."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    s = str(v).strip()
    if s[:1] in ("v", "V"):
        s = s[1:]
    return int(s) if s.isdigit() else None


# --- announce and settle --------------------------------------------------------------------
_ANNOUNCE = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return false end
local id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], id)
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
return id
"""

# KEYS: stream, stats, redo, failures. ARGV: group, entry id, counter, redo payload, failure payload.
_SETTLE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('HINCRBY', KEYS[2], 'settled', 1)
if ARGV[4] ~= '' then redis.call('RPUSH', KEYS[3], ARGV[4]) end
if ARGV[5] ~= '' then
  redis.call('LPUSH', KEYS[4], ARGV[5])
  redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[6]) - 1)
end
return 1
"""


def announce(r: redis.Redis, keys: Keys, packed_group: bytes, job_id: str, group_id: str) -> str | None:
    """Put a settled group on its job's feed, once: returns the entry id, or None when the group
    was announced before."""
    out = r.eval(_ANNOUNCE, 3, keys.feed_stream(job_id), keys.feed_seen(job_id), keys.feed_stats(job_id),
                 group_id, packed_group, C_ANNOUNCED)
    return out.decode() if isinstance(out, bytes) else out


def settle(r: redis.Redis, keys: Keys, job_id: str, entry_id: str, counter: str, *,
           redo: bytes = b"", failure: bytes = b"") -> bool:
    """Finish with a feed entry: acknowledge it and count why, in one script, so that a group is
    counted (and re-run, ``redo``) once even if two servers settle it. False: settled before."""
    return bool(r.eval(_SETTLE, 4, keys.feed_stream(job_id), keys.feed_stats(job_id), keys.feed_redo(job_id),
                       keys.feed_failures(job_id), TRAINERS, entry_id, counter, redo, failure, FAILURES_KEPT))


def counters(r: redis.Redis, keys: Keys, job_id: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in r.hgetall(keys.feed_stats(job_id)).items():
        k = k.decode() if isinstance(k, bytes) else k
        v = v.decode() if isinstance(v, bytes) else v
        out[k] = float(v) if "." in v else int(v)
    return out


def inflight(r: redis.Redis, keys: Keys, job_id: str) -> int:
    """Groups produced and not settled yet: queued, running, ready or taken-unacknowledged."""
    produced, settled = r.hmget(keys.feed_stats(job_id), C_PRODUCED, C_SETTLED)
    return int(produced or 0) - int(settled or 0)


# --- retention (broker/recovery.py's housekeeping) -----------------------------------------------
def holds(r: redis.Redis, keys: Keys, job_id: str, idle_s: float, now: float | None = None) -> bool:
    """Whether a feed keeps its job alive though none of the job's episodes runs: a group is
    ready or taken, or the producer has more to produce (a continuous job not through its
    epochs, groups to run again, groups produced and not settled). A continuous job without end
    would never finish: one no trainer asked anything of for ``idle_s`` (the job retention) is
    let go like a finished one, its position and counters expiring with its keys."""
    cfg = config(r, keys, job_id)
    if cfg is None:
        return False
    now = time.time() if now is None else now
    c = counters(r, keys, job_id)
    if now - max(float(c.get(C_LAST_TAKE, 0.0)), cfg.created_at) > idle_s:
        return False
    if int(c.get(C_ANNOUNCED, 0)) > int(c.get(C_READ, 0)):
        return True  # ready
    try:
        if int(r.xpending(keys.feed_stream(job_id), TRAINERS)["pending"]):
            return True  # taken
    except redis.ResponseError:
        pass
    if not cfg.continuous:
        return False
    if r.llen(keys.feed_redo(job_id)) or int(c.get(C_PRODUCED, 0)) > int(c.get(C_SETTLED, 0)):
        return True
    epoch = int(r.hget(keys.feed_position(job_id), "epoch") or 0)
    return not cfg.epochs or epoch < cfg.epochs


def finished(r: redis.Redis, keys: Keys, job_id: str, counts: dict[str, int], idle_s: float,
             now: float | None = None) -> bool:
    """A feed job is finished when none of its episodes is queued, running or retrying (its
    ledger ``counts``) and its feed holds nothing more (:func:`holds`): the sweeper then lets its
    keys expire (broker/recovery.py), and a feed server refuses to serve it."""
    if counts.get(LedgerState.QUEUED) or counts.get(LedgerState.RUNNING) or counts.get(LedgerState.RETRYING):
        return False
    return not holds(r, keys, job_id, idle_s, now)


def trim(r: redis.Redis, keys: Keys, job_id: str, older_than_s: float, now: float | None = None) -> int:
    """Drop settled groups announced more than ``older_than_s`` ago from the feed's stream (a
    continuous job's stream would grow by one entry per group for as long as it runs). Never
    one that is ready (not read yet) or taken (pending). The announce-once markers stay: a
    group announced again would be delivered twice. Returns how many entries went."""
    stream = keys.feed_stream(job_id)
    now = time.time() if now is None else now
    bound = f"{max(0, int((now - older_than_s) * 1000))}-0"
    try:
        info = r.xinfo_groups(stream)
        pending = r.xpending(stream, TRAINERS)
    except redis.ResponseError:  # no stream, or no group
        return 0
    ids = [bound]
    for g in info:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        if name == TRAINERS:
            last = g["last-delivered-id"]
            ids.append(last.decode() if isinstance(last, bytes) else last)
    if pending.get("pending") and pending.get("min"):
        low = pending["min"]
        ids.append(low.decode() if isinstance(low, bytes) else low)
    minid = min(ids, key=lambda x: tuple(int(p) for p in x.split("-")))
    return int(r.xtrim(stream, minid=minid, approximate=False) or 0)


def summary(r: redis.Redis, keys: Keys, job_id: str) -> dict:
    """The feed of a job at a glance (``interactor status``, the metrics, the results browser):
    groups ready, taken, acknowledged, re-queued or dropped for staleness, filtered (in all and
    by reason), failed (reported, or re-filled), the current version, how far behind delivered
    groups were on average, and how long trainers waited inside take."""
    c = counters(r, keys, job_id)
    try:
        taken = int(r.xpending(keys.feed_stream(job_id), TRAINERS)["pending"])
    except redis.ResponseError:
        taken = 0
    n_behind = int(c.get(C_BEHIND_N, 0))
    return {"version": current_version(r, keys, job_id),
            "delivered": int(c.get(C_DELIVERED, 0)), "redelivered": int(c.get(C_REDELIVERED, 0)),
            "failed_reported": int(c.get(C_FAILED, 0)), "refilled": int(c.get(C_REFILLED, 0)),
            "filtered_by": {k.split(":", 1)[1]: int(v) for k, v in c.items() if k.startswith(C_FILTERED + ":")},
            "versions_behind_mean": int(c.get(C_BEHIND, 0)) / n_behind if n_behind else None,
            "trainer_wait_s": float(c.get(C_WAIT_S, 0.0)), "takes": int(c.get(C_TAKES, 0)),
            "ready": int(c.get(C_ANNOUNCED, 0)) - int(c.get(C_READ, 0)), "taken": taken,
            "acked": int(c.get(C_ACKED, 0)), "requeued": int(c.get(C_STALE_REQUEUED, 0)),
            "dropped": int(c.get(C_STALE_DROPPED, 0)),
            "filtered": sum(int(v) for k, v in c.items() if k.startswith(C_FILTERED + ":")),
            "failed": int(c.get(C_FAILED, 0)) + int(c.get(C_REFILLED, 0)),
            "inflight": int(c.get(C_PRODUCED, 0)) - int(c.get(C_SETTLED, 0))}
