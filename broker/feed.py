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

* the consumer (consumer/announce.py) announces a group once all its members are settled
  (:func:`announce`: an HSETNX marker and the XADD in one script, so a batch re-processed after
  a crash announces nothing twice);
* workers (workers/versions.py) read :func:`current_version` before each model call;
* the feed server (interactor/feed_service.py) takes, settles, and publishes versions;
* the continuous producer (producer/continuous.py) counts what it produces, so that at most
  ``max_ahead`` groups are produced and not yet settled, and reports its state
  (:func:`note_producer`), which ``/stats`` and ``interactor status`` show.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields

import redis

from broker.keys import Keys
from broker.lua_scripts import lua_file, lua_script
from broker.replicas import ReplicaWait
from broker.settings import FEED, Settings
from broker.settings_checks import FEED_FAILED_POLICIES, FEED_STALE_POLICIES
from broker.states import LedgerState, ProducerState

TRAINERS = "trainers"  # the consumer group of a feed's stream; trainers are its consumers

# What becomes of a stale group (FeedConfig.stale_policy) and of a failed one (failed_policy).
STALE_REQUEUE, STALE_DROP = FEED_STALE_POLICIES
FAILED_REPORT, FAILED_REFILL = FEED_FAILED_POLICIES

# A feed's knobs: FeedConfig.<knob> is the setting feed_<knob>, described (with its default and
# flag) in broker/settings.py.
KNOBS = tuple(f.name.removeprefix("feed_") for f in fields(Settings) if FEED in f.metadata["read_by"])

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
C_VERSION_RESETS = "version_resets"  # times an operator reset the version (interactor feed version --reset)
C_ANNOUNCE_ERRORS = "announce_errors"  # groups whose announcement failed on their data (reported failed instead)
C_REDO_DROPPED = "redo_dropped"  # groups to run again that could not be (their episode specs gone), dropped

# The producer's report of itself (Keys.feed_producer, a hash): what it is doing, how many rounds
# failed, the last failure and when, and when it last wrote (every PRODUCER_BEAT_S while it runs).
P_STATE, P_ERRORS, P_SEEN_AT = "state", "errors", "seen_at"
P_LAST_ERROR, P_LAST_ERROR_AT = "last_error", "last_error_at"
PRODUCER_BEAT_S = 5.0
PRODUCER_SILENT_S = 60.0  # not heard from for this long: reported silent (its process is gone or stuck)

FAILURES_KEPT = 1000  # the failures list (what the trainer reads of failed groups) is capped


class FeedError(ValueError):
    """A request the feed refuses; ``status`` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 400, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.extra = extra or {}  # more of the answer (what an ack did settle beside what it refused)


@dataclass
class FeedConfig:
    """A job's feed, as stored in ``Keys.feed_config`` (strings in Redis, typed here): its knobs
    (:data:`KNOBS`, each the setting of that name, which says what it does; a hash written
    before a knob existed reads as its default) and the job's own fields after them."""

    max_ahead: int = Settings.feed_max_ahead
    max_staleness: int = Settings.feed_max_staleness
    stale_policy: str = Settings.feed_stale_policy
    failed_policy: str = Settings.feed_failed_policy
    refill_max: int = Settings.feed_refill_max
    ack_timeout_s: float = Settings.feed_ack_timeout_s
    drop_uniform: bool = Settings.feed_drop_uniform
    filter: str = Settings.feed_filter  # module:function
    continuous: bool = False  # a producer draws groups from the templates (producer/continuous.py)
    epochs: int = 0  # continuous: 0 = without end
    seed: int = 0  # continuous: shuffles each epoch
    created_at: float = 0.0

    @classmethod
    def from_settings(cls, settings, **kw) -> "FeedConfig":
        return cls(**{knob: getattr(settings, "feed_" + knob) for knob in KNOBS}, **kw)

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
# The largest version the feed accepts: the set-version script compares versions as Lua numbers
# (doubles, exact up to 2^53), and records carry them as msgpack integers. A value beyond it, a
# negative one or digits other than ASCII's would compare wrongly or fail to pack.
MAX_VERSION = 2**53 - 1
_MAX_DIGITS = len(str(MAX_VERSION))

_SET_VERSION = lua_script(lua_file("feed_set_version"))  # its Lua: broker/lua/feed_set_version.lua


def parse_version(v) -> int | None:
    """A version as an integer: ``7``, ``"7"`` or ``"v7"``, in ``[0, MAX_VERSION]``, written in
    ASCII digits; None for anything else (a model server's own naming, or a value we cannot
    order exactly: such a step is unversioned, never called stale)."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if 0 <= v <= MAX_VERSION else None
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if not isinstance(v, str) or len(v) > _MAX_DIGITS + 8:
        return None
    s = v.strip()
    if s[:1] in ("v", "V"):
        s = s[1:]
    if not s or len(s) > _MAX_DIGITS or not (s.isascii() and s.isdigit()):
        return None
    n = int(s)
    return n if n <= MAX_VERSION else None


def current_version(r: redis.Redis, keys: Keys, job_id: str) -> int | None:
    """The trainer's published version; None before the first one (or when what Redis holds is
    not a version: only an edit outside the feed can put one there, and
    ``interactor feed version JOB --reset N`` repairs it)."""
    return parse_version(r.get(keys.feed_version(job_id)))


def checked_version(version) -> int:
    """A version a trainer publishes: an integer (or its ASCII digits) in ``[0, MAX_VERSION]``,
    else a FeedError naming what was sent."""
    plain = (isinstance(version, int) and not isinstance(version, bool)) or (
        isinstance(version, str) and version.strip()[:1] not in ("v", "V"))
    n = parse_version(version) if plain else None
    if n is None:
        shown = repr(version)
        raise FeedError(f"version must be an integer from 0 to {MAX_VERSION} (2^53 - 1), got "
                        f"{shown if len(shown) <= 40 else shown[:40] + '...'}")
    return n


def set_version(r: redis.Redis, keys: Keys, job_id: str, version) -> int:
    """Publish the trainer's version. The same version again is fine (a retried call); a lower
    one is refused (409): versions order the staleness bound, so they may not go back (an
    operator can: :func:`reset_version`)."""
    version = checked_version(version)
    ok, cur = _SET_VERSION(keys=[keys.feed_version(job_id)], args=[version], client=r)
    if not ok:
        cur = cur.decode("utf-8", "replace") if isinstance(cur, bytes) else cur
        raise FeedError(f"version {version} is behind the current version {cur}: versions only go forward "
                        f"(an operator can reset it: interactor feed version {job_id} --reset N)", 409)
    return version


def reset_version(r: redis.Redis, keys: Keys, job_id: str, version) -> str | None:
    """Set a job's version to ``version`` whatever it was (an operator's repair after a wrong
    jump), counted in the feed's stats; returns what it was before."""
    version = checked_version(version)
    pipe = r.pipeline(transaction=True)
    pipe.getset(keys.feed_version(job_id), version)
    pipe.hincrby(keys.feed_stats(job_id), C_VERSION_RESETS, 1)
    before = pipe.execute()[0]
    return before.decode("utf-8", "replace") if isinstance(before, bytes) else before


# --- announce and settle --------------------------------------------------------------------
# Their Lua: broker/lua/feed_announce.lua, feed_settle.lua (broker/lua_scripts.py).
_ANNOUNCE = lua_script(lua_file("feed_announce"))
_SETTLE = lua_script(lua_file("feed_settle"))


def announce(r: redis.Redis, keys: Keys, packed_group: bytes, job_id: str, group_id: str) -> str | None:
    """Put a settled group on its job's feed, once: returns the entry id, or None when the group
    was announced before."""
    out = _ANNOUNCE(keys=[keys.feed_stream(job_id), keys.feed_seen(job_id), keys.feed_stats(job_id)],
                    args=[group_id, packed_group, C_ANNOUNCED], client=r)
    return out.decode() if isinstance(out, bytes) else out


def settle(r: redis.Redis, keys: Keys, job_id: str, entry_id: str, counter: str, *,
           redo: bytes = b"", failure: bytes = b"", replicas: ReplicaWait | None = None) -> bool:
    """Finish with a feed entry: acknowledge it and count why, in one script, so that a group is
    counted (and re-run, ``redo``) once even if two servers settle it. False: settled before.
    ``replicas``: returns once a replica has it, when its waits are on (a trainer's ack)."""
    script_keys = [keys.feed_stream(job_id), keys.feed_stats(job_id), keys.feed_redo(job_id),
                   keys.feed_failures(job_id)]
    args = [TRAINERS, entry_id, counter, redo, failure, FAILURES_KEPT]
    if replicas is None or not replicas.due():
        return bool(_SETTLE(keys=script_keys, args=args, client=r))
    return bool(replicas.run(r, lambda pipe: pipe.evalsha(_SETTLE.sha, len(script_keys), *script_keys, *args),
                             scripts=(_SETTLE,))[0])


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


# --- the continuous producer's report (producer/continuous.py writes, status and /stats read) ------
def note_producer(r: redis.Redis, keys: Keys, job_id: str, state: str, ttl_s: float, error: str = "") -> None:
    """The producer says what it is doing; ``error``: a round failed (counted, kept as the last)."""
    key = keys.feed_producer(job_id)
    now = f"{time.time():.3f}"
    pipe = r.pipeline(transaction=True)
    pipe.hset(key, mapping={P_STATE: str(state), P_SEEN_AT: now})
    if error:
        pipe.hincrby(key, P_ERRORS, 1)
        pipe.hset(key, mapping={P_LAST_ERROR: error[:2000], P_LAST_ERROR_AT: now})
    pipe.expire(key, max(1, int(ttl_s)))
    pipe.execute()


def producer_status(r: redis.Redis, keys: Keys, job_id: str, now: float | None = None) -> dict | None:
    """The producer as it last reported itself, None before it ever did (no producer ran):
    ``state`` (broker.states.ProducerState; ``silent`` when a running one has not written for
    PRODUCER_SILENT_S), failed rounds, the last failure, and redo entries it had to drop."""
    raw = {k.decode(): v.decode() for k, v in r.hgetall(keys.feed_producer(job_id)).items()}
    if not raw:
        return None
    now = time.time() if now is None else now
    seen = now - float(raw.get(P_SEEN_AT) or 0.0)
    state = raw.get(P_STATE, "")
    if state != ProducerState.STOPPED and seen > PRODUCER_SILENT_S:
        state = ProducerState.SILENT
    error_at = raw.get(P_LAST_ERROR_AT)
    return {"state": state, "errors": int(raw.get(P_ERRORS) or 0), "last_error": raw.get(P_LAST_ERROR, ""),
            "last_error_s_ago": round(now - float(error_at), 1) if error_at else None, "seen_s_ago": round(seen, 1),
            "redo_dropped": int(r.hget(keys.feed_stats(job_id), C_REDO_DROPPED) or 0)}


# --- retention (broker/recovery.py's housekeeping) -----------------------------------------------
def holds(r: redis.Redis, keys: Keys, job_id: str, idle_s: float, now: float | None = None) -> bool:
    """Whether a feed keeps its job alive though none of the job's episodes runs: a group is
    ready or taken, or the producer has more to produce (a continuous job not through its
    epochs, groups to run again, groups produced and not settled; never a cancelled job). A continuous job without end
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
    if not cfg.continuous or r.exists(keys.job_cancel(job_id)):
        return False  # nothing more to produce: a batch job's groups are all in, a cancelled job's producer stopped
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
    """The feed of a job at a glance, one view for every reader (``GET /stats`` adds its recent
    failures and config to it; ``interactor status``, the metrics and the results browser read
    it as it is). Each counter under one name with one meaning: ``failed`` the groups reported
    failed (a dead-lettered member, :data:`C_FAILED`), ``refilled`` those re-run instead,
    ``stale_requeued`` / ``stale_dropped`` those past the staleness bound, ``filtered`` the
    groups a filter dropped, by reason; ``ready``, ``taken`` and ``inflight`` are now; the mean
    of how far behind delivered groups were, how long trainers waited inside take, and the
    continuous producer's report of itself (``producer_status``)."""
    c = counters(r, keys, job_id)
    try:
        taken = int(r.xpending(keys.feed_stream(job_id), TRAINERS)["pending"])
    except redis.ResponseError:
        taken = 0
    n_behind = int(c.get(C_BEHIND_N, 0))
    return {"version": current_version(r, keys, job_id),
            "ready": int(c.get(C_ANNOUNCED, 0)) - int(c.get(C_READ, 0)), "taken": taken,
            "inflight": int(c.get(C_PRODUCED, 0)) - int(c.get(C_SETTLED, 0)),
            "produced": int(c.get(C_PRODUCED, 0)), "announced": int(c.get(C_ANNOUNCED, 0)),
            "delivered": int(c.get(C_DELIVERED, 0)), "redelivered": int(c.get(C_REDELIVERED, 0)),
            "acked": int(c.get(C_ACKED, 0)), "failed": int(c.get(C_FAILED, 0)), "refilled": int(c.get(C_REFILLED, 0)),
            "stale_requeued": int(c.get(C_STALE_REQUEUED, 0)), "stale_dropped": int(c.get(C_STALE_DROPPED, 0)),
            "filtered": {k.split(":", 1)[1]: int(v) for k, v in c.items() if k.startswith(C_FILTERED + ":")},
            "versions_behind_mean": int(c.get(C_BEHIND, 0)) / n_behind if n_behind else None,
            "trainer_wait_s": float(c.get(C_WAIT_S, 0.0)), "takes": int(c.get(C_TAKES, 0)),
            "producer": producer_status(r, keys, job_id)}
