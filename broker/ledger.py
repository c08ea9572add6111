"""The job ledger: which episodes exist, in which state, and who runs them.

Every state change is one Lua script, so that it is atomic with the fencing check beside it:

* ``start``   - queued/retrying/running-without-lease -> running, takes the lease, counts the
  attempt (running-without-lease not while reclaims are held after an outage, see below). A second delivery of a running or finished episode gets ``busy``/``finished`` and
  is dropped: the lease holder (or the sweeper, if the holder dies) owns the episode's future.
  The same START sent again (same worker and attempt_id: its reply was lost) gets its own
  attempt back, with its predecessor, and counts nothing.
* ``renew``   - extends the attempt's lease.
* ``publish`` - XADD a record only while the attempt holds its episode, so an abandoned attempt
  can never write into the results stream after another attempt took over.
* ``finish``  - XADD the attempt record, move the state (done / failed / retrying / queued),
  park a dead letter, schedule a retry, drop the lease: all or nothing.
* ``reclaim`` - for the sweeper: running with no live lease -> queued or failed.
* ``move``    - guarded transitions for re-drive and reconcile.

**Who holds an episode** (renew, publish and finish alike, ``_HOLDS_FN``): the attempt whose
token the lease key carries; or, when the key is gone, the attempt the episode is still
``running`` under (its ``"<attempt>:<attempt_id>"`` is the latest START's), which takes the
lease back. A lease that lapsed is not lost: nobody else took the episode (a reclaim moves it
out of ``running``, a new START changes the attempt id). An attempt loses its episode only when
another token holds the lease or the episode moved on.

**When the sweeper reclaims**: a running episode whose lease expired more than a third of the
TTL ago - unless the sweep clock shows an outage. Every sweep, in every process, stamps the
clock with Redis' time; a gap of more than half the TTL (at least two sweep intervals) means
nobody reached Redis, so every lease may have lapsed under a live holder that could not renew.
(A lease lapses under a live holder only after about two thirds of the TTL without Redis, so
this sees every such outage as long as ``sweep_interval_s`` is under a third of the TTL, as
by default: 5 s and 30 s.) Reclaims are then held for two TTLs, time for the holders to take
their leases back, and the check runs inside the reclaim script too, so a sweep that stalled
across the outage cannot reclaim on the far side of it. Holders take a lease back on their next renewal (every third of
the TTL), step record or FINISH. So Redis being away - frozen, restarted, unreachable from
everyone - never costs an attempt. What it cannot tell apart from a dead worker: a worker cut
off from Redis while the sweepers still reach it (its attempts fence themselves by their own
clock and are re-run, counted), and a worker whose renewer does not get to run for the whole
hold after an outage.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import orjson
import redis

from broker.keys import Keys, member
from broker.records import (
    AttemptRecord,
    DeadLetter,
    EpisodeSpec,
    EpisodesEnqueued,
    JobSpec,
    RecordError,
    new_attempt_id,
    unpack,
)
from broker.settings import Settings
from broker.states import LedgerState, lua

ANNOUNCE_CHUNK = 1000  # episodes per EpisodesEnqueued record
SUBMIT_MARKER_TTL_S = 600.0  # a submit writing one chunk longer than this is taken for dead

# Time in the scripts is Redis' own clock (TIME), never a worker's: a worker whose clock runs
# behind cannot make a live lease look expired to the sweeper, or a dead one look alive
# (workers' clocks drift apart). Effects replication keeps TIME usable before writes on Redis 6.
_NOW = """
redis.replicate_commands()
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
"""

_COUNTS_FN = """
local function move(counts, old, new)
  if old == new then return end
  if old then redis.call('HINCRBY', counts, old, -1) end
  if new then redis.call('HINCRBY', counts, new, 1) end
end
"""

# KEYS: state, attempts, counts, lease, running, reserved, episodes, attempt_ids, attempt_previous,
#       reclaim_hold
# ARGV: episode, token_prefix, ttl_ms, member, attempt_id
# Returns {'ok', attempt, token, episode spec, previous attempt} so that starting costs one
# round trip. "<attempt>:<attempt_id>" is kept per episode: the renewer checks it before
# resuming a lease that lapsed during a Redis outage, the sweeper names the attempt it
# reclaims, and the next attempt closes the previous one's env instance (kept in
# attempt_previous too, so that a repeated START can still name it).
#
# A START is idempotent per attempt_id: sent again with the same attempt_id (its reply was lost,
# and redis-py or the runtime sent it again), it finds its own attempt - under its own lease, or
# running with the lease lapsed and nobody else holding it - and returns that attempt again
# instead of finding it "busy" and counting another one.
_START = lua(_NOW + _COUNTS_FN + """
redis.call('ZREM', KEYS[6], ARGV[4])
local st = redis.call('HGET', KEYS[1], ARGV[1])
if not st then return {'unknown', ''} end
if st == $DONE or st == $FAILED then return {'finished', st} end
local holder = redis.call('GET', KEYS[4])
local latest = redis.call('HGET', KEYS[8], ARGV[1]) or ''
local mine_attempt, mine_id = string.match(latest, '^(%d+):(.*)$')
if st == $RUNNING and mine_id == ARGV[5] then
  local token = ARGV[2] .. ':' .. mine_attempt
  if holder and holder ~= token then return {'busy', holder} end
  redis.call('SET', KEYS[4], token, 'PX', ARGV[3])  -- a full TTL from this call, which the worker counts from
  redis.call('ZADD', KEYS[5], now + tonumber(ARGV[3]), ARGV[4])
  return {'ok', mine_attempt, token, redis.call('HGET', KEYS[7], ARGV[1]) or '',
          redis.call('HGET', KEYS[9], ARGV[1]) or ''}
end
if holder then return {'busy', holder} end
-- Running with its lease lapsed right after an outage: its attempt is alive and about to take
-- the lease back; another delivery takes over only as the sweeper would, once the hold is over.
if st == $RUNNING and redis.call('EXISTS', KEYS[10]) == 1 then return {'busy', 'lease lapsed in an outage'} end
local attempt = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
local token = ARGV[2] .. ':' .. attempt
redis.call('SET', KEYS[4], token, 'PX', ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], $RUNNING)
move(KEYS[3], st, $RUNNING)
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[3]), ARGV[4])
if latest ~= '' then redis.call('HSET', KEYS[9], ARGV[1], latest) else redis.call('HDEL', KEYS[9], ARGV[1]) end
redis.call('HSET', KEYS[8], ARGV[1], attempt .. ':' .. ARGV[5])
return {'ok', tostring(attempt), token, redis.call('HGET', KEYS[7], ARGV[1]) or '', latest}
""")

# The one rule by which an attempt holds its episode, shared by renew, publish and finish:
# the lease key carries its token; or the key is gone (it lapsed: a Redis outage longer than
# the TTL, a stalled worker the sweeper has not reached yet) while the episode is still
# ``running`` under this very attempt ("<attempt>:<attempt_id>" matches), and then the lease is
# taken back. Nobody else took the episode in that case: the sweeper's reclaim moves it out of
# ``running`` and a new START changes the attempt id. So a lease is lost only when another
# token holds it, or the episode moved on. Returns 'held' | 'resumed' | false.
_HOLDS_FN = lua("""
local function holds(lease, running, state, attempt_ids, token, ttl_ms, mem, episode, value)
  local holder = redis.call('GET', lease)
  if holder == token then return 'held' end
  if holder then return false end
  if redis.call('HGET', state, episode) ~= $RUNNING then return false end
  if redis.call('HGET', attempt_ids, episode) ~= value then return false end
  redis.call('SET', lease, token, 'PX', ttl_ms)
  redis.call('ZADD', running, now + tonumber(ttl_ms), mem)
  return 'resumed'
end
""")

# KEYS: lease, running, state, attempt_ids   ARGV: token, ttl_ms, member, episode, "<attempt>:<attempt_id>"
# Extends a lease this attempt holds (or takes back one that lapsed, by the rule above).
# 1: held, 0: lost (another attempt, or the sweeper, has the episode).
_RENEW = _NOW + _HOLDS_FN + """
local h = holds(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
if not h then return 0 end
if h == 'held' then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return 1
"""

# KEYS: jobs, job spec, submitting   ARGV: job_id, created_at, marker_ttl_ms.
# 1: the id is ours now; 0: it exists. The submitting marker (with a TTL, refreshed while the
# submit writes) tells housekeeping that an indexed job without a spec yet is being written,
# not gone; a submit that died leaves it to expire, and then housekeeping forgets the job.
_CLAIM = """
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
if redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[1]) == 0 then return 0 end
redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
return 1
"""

# KEYS: running   ARGV: grace_ms, limit. Members whose lease expiry passed grace_ms ago.
_EXPIRED = _NOW + """
return redis.call('ZRANGEBYSCORE', KEYS[1], 0, now - tonumber(ARGV[1]), 'LIMIT', 0, tonumber(ARGV[2]))
"""

# KEYS: reserved   ARGV: ttl_ms, xx, member...  (xx = '1': only extend those still there)
_RESERVE = _NOW + """
local gone = {}
for i = 3, #ARGV do
  if ARGV[2] == '1' then
    if redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[1]), ARGV[i]) == 0
       and not redis.call('ZSCORE', KEYS[1], ARGV[i]) then
      table.insert(gone, ARGV[i])
    end
  else
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
  end
end
return gone
"""

# KEYS: lease, stream, running, state, attempt_ids
# ARGV: token, record, ttl_ms, member, episode, "<attempt>:<attempt_id>"
# XADD only while the attempt holds its episode (``holds``: a lapsed lease is taken back).
_PUBLISH = _NOW + _HOLDS_FN + """
if not holds(KEYS[1], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[3], ARGV[4], ARGV[5], ARGV[6]) then return -1 end
redis.call('XADD', KEYS[2], '*', 'r', ARGV[2])
return redis.call('XLEN', KEYS[2])
"""

# KEYS: stream, running, then per record: lease, state, attempt_ids
# ARGV: ttl_ms, then per record: token, record, member, episode, "<attempt>:<attempt_id>"
# Each record is added only while its own attempt holds its episode: one round trip for the
# records of many episodes, fenced exactly as one PUBLISH each would be. Returns {ok_1 .. ok_n, xlen}.
_PUBLISH_MANY = _NOW + _HOLDS_FN + """
local n = (#KEYS - 2) / 3
local out = {}
for i = 1, n do
  local k, a = 2 + (i - 1) * 3, 1 + (i - 1) * 5
  if holds(KEYS[k + 1], KEYS[2], KEYS[k + 2], KEYS[k + 3], ARGV[a + 1], ARGV[1], ARGV[a + 3], ARGV[a + 4],
           ARGV[a + 5]) then
    redis.call('XADD', KEYS[1], '*', 'r', ARGV[a + 2])
    out[i] = 1
  else
    out[i] = 0
  end
end
out[n + 1] = redis.call('XLEN', KEYS[1])
return out
"""

# KEYS: lease, state, counts, running, stream, retry, dlq, dlq_index, attempt_ids
# ARGV: token, episode, new_state, member, record, retry_at_ms, dead_letter, now_s, ttl_ms,
#       "<attempt>:<attempt_id>"
# Only while the attempt holds its episode (``holds``: a lapsed lease counts as held).
_FINISH = _NOW + _COUNTS_FN + _HOLDS_FN + """
if not holds(KEYS[1], KEYS[4], KEYS[2], KEYS[9], ARGV[1], ARGV[9], ARGV[4], ARGV[2], ARGV[10]) then return 0 end
redis.call('XADD', KEYS[5], '*', 'r', ARGV[5])
local old = redis.call('HGET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
move(KEYS[3], old, ARGV[3])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[4], ARGV[4])
if ARGV[6] ~= '' then redis.call('ZADD', KEYS[6], ARGV[6], ARGV[4]) end
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[7], ARGV[4], ARGV[7])
  redis.call('ZADD', KEYS[8], ARGV[8], ARGV[4])
end
return 1
"""

# Outage detection, for the sweeper. Every sweep (in every worker and the consumer) stamps the
# sweep clock with Redis' time. A gap longer than gap_ms since the last stamp means no sweeper
# reached Redis meanwhile: Redis was away (stopped, restarting, frozen: its own clock jumps
# too), so every lease may have lapsed with its holder alive and unable to renew. Reclaims are
# then held for hold_ms, time for the renewers (and publishes, finishes) to take their leases
# back. A gap can also mean no sweeper ran at all; then reclaims come hold_ms later, no harm.
# Returns 1 while reclaims are held.
_OUTAGE_FN = """
local function reclaim_held(clock, hold, gap_ms, hold_ms)
  local last = tonumber(redis.call('GET', clock) or '')
  redis.call('SET', clock, now)
  if last and now - last > tonumber(gap_ms) then
    redis.call('SET', hold, '1', 'PX', hold_ms)
    return 1
  end
  return redis.call('EXISTS', hold)
end
"""

# KEYS: clock, hold   ARGV: gap_ms, hold_ms
_SWEEP_CLOCK = _NOW + _OUTAGE_FN + """
return reclaim_held(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
"""

# KEYS: state, counts, lease, running, stream, dlq, dlq_index, clock, hold
# ARGV: episode, member, new_state, record, dead_letter, now_s, gap_ms, hold_ms
# With gap_ms '' the outage check is skipped (a caller that is no sweeper). -1: held.
_RECLAIM = lua(_NOW + _COUNTS_FN + _OUTAGE_FN + """
if ARGV[7] ~= '' and reclaim_held(KEYS[8], KEYS[9], ARGV[7], ARGV[8]) == 1 then return -1 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local st = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[2])
if st ~= $RUNNING then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
move(KEYS[2], st, ARGV[3])
if ARGV[4] ~= '' then redis.call('XADD', KEYS[5], '*', 'r', ARGV[4]) end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[6], ARGV[2], ARGV[5])
  redis.call('ZADD', KEYS[7], ARGV[6], ARGV[2])
end
return 1
""")

# KEYS: reserved, state   ARGV: member, episode
_RECLAIM_RESERVED = lua(_NOW + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > now then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[2], ARGV[2]) ~= $QUEUED then return 0 end
return 1
""")

# KEYS: state, counts   ARGV: episode, new_state, allowed_old...
_MOVE = _COUNTS_FN + """
local st = redis.call('HGET', KEYS[1], ARGV[1])
if not st then return 0 end
for i = 3, #ARGV do
  if st == ARGV[i] then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    move(KEYS[2], st, ARGV[2])
    return 1
  end
end
return 0
"""


@dataclass
class Lease:
    """The right to run one attempt of one episode; lost when its token stops matching.

    ``attempt_id`` is the attempt's own random token (broker/records.py): the lease token
    carries it, and so does every record of the attempt."""

    job_id: str
    episode_id: str
    attempt: int
    token: str
    attempt_id: str = ""
    lost: threading.Event = field(default_factory=threading.Event)
    ttl_s: float = 30.0
    # Until when (time.monotonic()) the lease certainly still holds, by this process's own
    # clock: its last successful renewal's send time plus the TTL, less a margin. An attempt
    # past it stops calling anything until a renewal lands (fence by local time: a stalled or
    # partitioned worker cannot act on a lease that may have passed to another attempt).
    valid_until: float = 0.0

    def __post_init__(self) -> None:
        if not self.valid_until:
            self.renewed(time.monotonic())

    @property
    def member(self) -> str:
        return member(self.job_id, self.episode_id)

    @property
    def attempt_value(self) -> str:
        """What the ledger keeps for this attempt: ``"<attempt>:<attempt_id>"``."""
        return f"{self.attempt}:{self.attempt_id}"

    def renewed(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` (monotonic) succeeded."""
        margin = min(2.0, self.ttl_s / 4)
        self.valid_until = max(self.valid_until, sent_at + self.ttl_s - margin)

    def valid(self) -> bool:
        return not self.lost.is_set() and time.monotonic() < self.valid_until


class JobExists(ValueError):
    """A job with this id was submitted before."""

    def __init__(self, job_id: str):
        super().__init__(f"job id {job_id!r} exists already: submitting it again would re-run its finished "
                         f"episodes. Finish it with `interactor run --resume {job_id}`, re-drive its failures with "
                         f"`interactor dlq redrive --job {job_id}`, or submit under a new id")
        self.job_id = job_id


@dataclass
class StartResult:
    status: str  # ok | busy | finished | unknown
    lease: Lease | None = None
    detail: str = ""
    spec: EpisodeSpec | None = None  # with ok: the episode's spec (None if the ledger has none)
    previous: tuple[int, str] | None = None  # with ok: the attempt before this one (number, attempt_id)


class Ledger:
    def __init__(self, client: redis.Redis, keys: Keys, lease_ttl_s: float = 30.0):
        self.r = client
        self.k = keys
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self._start = client.register_script(_START)
        self._renew = client.register_script(_RENEW)
        self._publish = client.register_script(_PUBLISH)
        self._publish_many = client.register_script(_PUBLISH_MANY)
        self._finish = client.register_script(_FINISH)
        self._reclaim = client.register_script(_RECLAIM)
        self._move = client.register_script(_MOVE)
        self._reclaim_reserved = client.register_script(_RECLAIM_RESERVED)
        self._expired = client.register_script(_EXPIRED)
        self._claim = client.register_script(_CLAIM)
        self._reserve = client.register_script(_RESERVE)
        self._sweep_clock = client.register_script(_SWEEP_CLOCK)

    # --- jobs ------------------------------------------------------------------------
    def create_job(self, job: JobSpec, episodes: Sequence[EpisodeSpec], chunk: int = 5000,
                   marker_ttl_s: float = SUBMIT_MARKER_TTL_S) -> None:
        """Record the job and every episode as queued, before any task is sent.

        Everything is encoded before the first write, so a value that cannot travel (an
        integer past 64 bits, a lone surrogate) fails the call with nothing written.

        Between the claim and the spec (written last) the job is indexed without a spec; a
        submitting marker with a TTL, refreshed before every chunk, tells housekeeping that
        it is being written (broker/recovery.py forgets indexed jobs with neither). A submit
        that outlived its marker stops with an error rather than finish a job that was
        forgotten meanwhile."""
        k = self.k
        specs = [(e.episode_id, e.pack()) for e in episodes]
        announcements = [
            EpisodesEnqueued(job.job_id, [[e.episode_id, e.env_name, e.group_id, orjson.dumps(e.env_params)]
                                          for e in episodes[i : i + ANNOUNCE_CHUNK]],
                             created_at=job.created_at).pack()
            for i in range(0, len(episodes), ANNOUNCE_CHUNK)
        ]
        job_packed = job.pack()
        # The id is claimed before anything else is written: a second submit of the same id
        # (the natural retry after a producer crash) must not reset finished episodes and run
        # them again. Resuming a job is its own command.
        marker, marker_ms = k.job_submitting(job.job_id), int(marker_ttl_s * 1000)
        if not self._claim(keys=[k.jobs, k.job_spec(job.job_id), marker], args=[job.job_id, job.created_at, marker_ms]):
            raise JobExists(job.job_id)

        def still_ours() -> None:
            if not self.r.set(marker, "1", px=marker_ms, xx=True):
                raise RuntimeError(f"submitting job {job.job_id!r} took longer than its marker's "
                                   f"{marker_ttl_s:.0f}s: housekeeping may have forgotten it; submit it again")

        for i in range(0, len(specs), chunk):
            part = specs[i : i + chunk]
            still_ours()
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(k.job_episodes(job.job_id), mapping=dict(part))
            pipe.hset(k.job_state(job.job_id), mapping={episode_id: LedgerState.QUEUED for episode_id, _ in part})
            pipe.execute()
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(k.job_counts(job.job_id), mapping={s: 0 for s in LedgerState})
        pipe.hset(k.job_counts(job.job_id), LedgerState.QUEUED, len(episodes))
        pipe.set(k.job_spec(job.job_id), job_packed)
        queues = {e.queue for e in episodes if e.queue}
        if queues:
            pipe.sadd(k.job_queues(job.job_id), *queues)
        # The job and its episodes are announced in the results stream too, so the database
        # knows what to expect (and lists every episode before it runs: job_environments).
        pipe.xadd(k.results, {"r": job_packed})
        for raw in announcements:
            pipe.xadd(k.results, {"r": raw})
        pipe.delete(marker)
        still_ours()
        pipe.execute()

    @classmethod
    def for_settings(cls, client: redis.Redis, settings: Settings) -> "Ledger":
        """The ledger as every role uses it: the settings' key prefix and lease TTL."""
        return cls(client, Keys(settings.key_prefix), settings.lease_ttl_s)

    def job_ids(self) -> list[str]:
        return [j.decode() for j in self.r.zrange(self.k.jobs, 0, -1)]

    def job_spec(self, job_id: str) -> JobSpec | None:
        raw = self.r.get(self.k.job_spec(job_id))
        return unpack(raw) if raw else None

    def episode_spec(self, job_id: str, episode_id: str) -> EpisodeSpec | None:
        raw = self.r.hget(self.k.job_episodes(job_id), episode_id)
        return unpack(raw) if raw else None

    def job_queues(self, job_id: str) -> set[str]:
        return {q.decode() for q in self.r.smembers(self.k.job_queues(job_id))}

    def counts(self, job_id: str) -> dict[str, int]:
        raw = self.r.hgetall(self.k.job_counts(job_id))
        return {s: int(raw.get(s.encode(), 0)) for s in LedgerState}

    def counts_many(self, job_ids: Sequence[str]) -> list[dict[str, int]]:
        """:meth:`counts` of several jobs in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.k.job_counts(job_id))
        return [{s: int(raw.get(s.encode(), 0)) for s in LedgerState} for raw in pipe.execute()]

    def states(self, job_id: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.k.job_state(job_id)).items()}

    def state(self, job_id: str, episode_id: str) -> str | None:
        v = self.r.hget(self.k.job_state(job_id), episode_id)
        return v.decode() if v else None

    def attempts(self, job_id: str, episode_id: str) -> int:
        return int(self.r.hget(self.k.job_attempts(job_id), episode_id) or 0)

    def attempt_id(self, job_id: str, episode_id: str) -> str:
        """The attempt_id of the episode's latest start ("" if it never started)."""
        return self.latest_attempt(job_id, episode_id)[1]

    def latest_attempt(self, job_id: str, episode_id: str) -> tuple[int, str]:
        """(number, attempt_id) of the episode's latest start; (0, "") if it never started."""
        return _parse_attempt_value(self.r.hget(self.k.job_attempt_ids(job_id), episode_id))

    def attempt_limit(self, job_id: str, episode_id: str, default: int) -> int:
        """The last attempt number allowed; re-drives and hand-backs raise it."""
        v = self.r.hget(self.k.job_attempt_limit(job_id), episode_id)
        return int(v) if v is not None else default

    def grant_extra_attempt(self, job_id: str, episode_id: str, default: int, n: int = 1) -> int:
        key = self.k.job_attempt_limit(job_id)
        self.r.hsetnx(key, episode_id, default)
        return int(self.r.hincrby(key, episode_id, n))

    # --- attempts --------------------------------------------------------------------
    def start(self, job_id: str, episode_id: str, worker: str, attempt_id: str | None = None) -> StartResult:
        """Start an attempt. ``attempt_id`` (new if not given) makes the call repeatable: a
        START whose reply was lost, sent again with the same worker and attempt_id, returns
        the attempt it started (with its predecessor) instead of starting another."""
        k = self.k
        attempt_id = attempt_id or new_attempt_id()
        prefix = f"{worker}:{attempt_id}"
        sent = time.monotonic()
        keys = [k.job_state(job_id), k.job_attempts(job_id), k.job_counts(job_id), k.lease(episode_id), k.running,
                k.reserved, k.job_episodes(job_id), k.job_attempt_ids(job_id), k.job_attempt_previous(job_id),
                k.reclaim_hold]
        out = self._start(keys=keys, args=[episode_id, prefix, self.lease_ttl_ms, member(job_id, episode_id),
                                           attempt_id])
        status = out[0].decode()
        previous = None
        if status != "ok":
            return StartResult(status, detail=out[1].decode() if len(out) > 1 else "")
        raw_spec = out[3] if len(out) > 3 else b""
        spec = None
        if raw_spec:
            try:
                spec = unpack(raw_spec)
            except RecordError:
                spec = None  # the runner dead-letters the episode as bad_task
        if len(out) > 4 and out[4]:
            previous = _parse_attempt_value(out[4])
        lease = Lease(job_id, episode_id, int(out[1]), out[2].decode(), attempt_id, ttl_s=self.lease_ttl_ms / 1000)
        # Counted from when START was sent, not from its reply: a process stopped with the reply
        # in flight must not take the lease for fresh (it may have expired and passed on since).
        # Lease() counts from now when given no time, so the count is set here, not passed in.
        lease.valid_until = 0.0
        lease.renewed(sent)
        return StartResult("ok", lease, spec=spec, previous=previous)

    def renew(self, leases: Iterable[Lease]) -> None:
        """Extend every lease (or take back one that lapsed with nobody else taking over: the
        rule in ``_HOLDS_FN``); a lease another attempt holds now is flagged lost."""
        leases = list(leases)
        if not leases:
            return
        sent = time.monotonic()
        pipe = self.r.pipeline(transaction=False)
        for lease in leases:
            self._renew(
                keys=[self.k.lease(lease.episode_id), self.k.running, self.k.job_state(lease.job_id),
                      self.k.job_attempt_ids(lease.job_id)],
                args=[lease.token, self.lease_ttl_ms, lease.member, lease.episode_id, lease.attempt_value],
                client=pipe,
            )
        for lease, ok in zip(leases, pipe.execute()):
            if ok:
                lease.renewed(sent)
            else:
                lease.lost.set()

    # --- reservations: received by a worker, not started yet ----------------------------
    # A worker that dies between receiving a task and starting it leaves no lease behind, and
    # its message comes back only after the broker's visibility timeout (hours). A renewed
    # reservation lets the sweeper send such episodes again within the lease TTL.
    def reserve(self, members: Sequence[str]) -> None:
        if members:
            self._reserve(keys=[self.k.reserved], args=[self.lease_ttl_ms, "0", *members])

    def renew_reservations(self, members: Sequence[str]) -> set[str]:
        """Extend reservations still open; returns those gone (started, or reclaimed)."""
        if not members:
            return set()
        gone = self._reserve(keys=[self.k.reserved], args=[self.lease_ttl_ms, "1", *members])
        return {m.decode() if isinstance(m, bytes) else m for m in gone}

    def expired_reservations(self, limit: int = 1000) -> list[str]:
        return [m.decode() for m in self._expired(keys=[self.k.reserved], args=[0, limit])]

    def reclaim_reservation(self, m: str) -> bool:
        """True once (atomically) for an expired reservation whose episode never started."""
        job_id, _, episode_id = m.partition(" ")
        return bool(self._reclaim_reserved(keys=[self.k.reserved, self.k.job_state(job_id)], args=[m, episode_id]))

    def publish(self, lease: Lease, payload: bytes) -> int:
        """XADD under the lease (a lapsed one is taken back, as by :meth:`renew`). Returns the
        stream length, or -1 if the episode is no longer this attempt's (the lease is flagged lost)."""
        k = self.k
        n = self._publish(keys=[k.lease(lease.episode_id), k.results, k.running, k.job_state(lease.job_id),
                                k.job_attempt_ids(lease.job_id)],
                          args=[lease.token, payload, self.lease_ttl_ms, lease.member, lease.episode_id,
                                lease.attempt_value])
        if n < 0:
            lease.lost.set()
        return int(n)

    def publish_many(self, items: Sequence[tuple[Lease, bytes]]) -> tuple[list[bool], int]:
        """XADD several records, each under its own lease (fenced as by :meth:`publish`), in
        one round trip. Returns which were added (a refused one's lease is flagged lost) and
        the stream length after."""
        if not items:
            return [], 0
        k = self.k
        keys = [k.results, k.running]
        args: list = [self.lease_ttl_ms]
        for lease, payload in items:
            keys += [k.lease(lease.episode_id), k.job_state(lease.job_id), k.job_attempt_ids(lease.job_id)]
            args += [lease.token, payload, lease.member, lease.episode_id, lease.attempt_value]
        out = self._publish_many(keys=keys, args=args)
        added = [bool(x) for x in out[:-1]]
        for (lease, _), ok in zip(items, added):
            if not ok:
                lease.lost.set()
        return added, int(out[-1])

    def finish(
        self,
        lease: Lease,
        record: AttemptRecord,
        new_state: str,
        *,
        retry_at: float | None = None,
        dead_letter: DeadLetter | None = None,
    ) -> bool:
        k = self.k
        """Close the attempt: record, state, dead letter, retry, all or nothing, while the
        attempt holds its episode (a lapsed lease counts, by the rule of :meth:`renew`). False
        (and the lease flagged lost) when it does not: another attempt has it, or the episode
        moved on - possibly by this very FINISH, sent before and its reply lost
        (:meth:`finished_as` tells)."""
        k = self.k
        ok = self._finish(
            keys=[k.lease(lease.episode_id), k.job_state(lease.job_id), k.job_counts(lease.job_id), k.running,
                  k.results, k.retry, k.dlq, k.dlq_index, k.job_attempt_ids(lease.job_id)],
            args=[lease.token, lease.episode_id, new_state, lease.member, record.pack(),
                  int(retry_at * 1000) if retry_at else "", dead_letter.pack() if dead_letter else "", time.time(),
                  self.lease_ttl_ms, lease.attempt_value],
        )
        if not ok:
            lease.lost.set()
        return bool(ok)

    def finished_as(self, lease: Lease, new_state: str) -> bool:
        """Whether the episode ended in ``new_state`` by this attempt's own FINISH: for a FINISH
        that was refused when sent again after its reply was lost. The episode is in
        ``new_state`` and its latest START is still this attempt (a later attempt would have
        changed it; the sweeper's reclaim only moves a running episode to queued or failed, so
        ``done`` or ``retrying`` under this attempt can only be this FINISH's doing)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(self.k.job_state(lease.job_id), lease.episode_id)
        pipe.hget(self.k.job_attempt_ids(lease.job_id), lease.episode_id)
        state, latest = pipe.execute()
        return (state is not None and state.decode() == new_state
                and latest is not None and latest.decode() == lease.attempt_value)

    # --- recovery --------------------------------------------------------------------
    def expired_running(self, grace_ms: int = 0, limit: int = 1000) -> list[str]:
        """Members of the running set whose lease expiry passed (grace_ms ago, by Redis' clock)."""
        return [m.decode() for m in self._expired(keys=[self.k.running], args=[int(grace_ms), limit])]

    def reclaim(self, job_id: str, episode_id: str, new_state: str, record: AttemptRecord | None,
                dead_letter: DeadLetter | None = None, *, outage: tuple[float, float] | None = None) -> bool:
        """Running with no live lease -> ``new_state``. ``outage`` = (gap_s, hold_s): the
        sweeper's outage rule (:meth:`sweep_clock`), checked in the same script, so that a
        sweep that stalled across a Redis outage cannot reclaim on the far side of it."""
        k = self.k
        gap, hold = (int(outage[0] * 1000), int(outage[1] * 1000)) if outage else ("", "")
        return self._reclaim(
            keys=[k.job_state(job_id), k.job_counts(job_id), k.lease(episode_id), k.running, k.results,
                  k.dlq, k.dlq_index, k.sweep_clock, k.reclaim_hold],
            args=[episode_id, member(job_id, episode_id), new_state, record.pack() if record else "",
                  dead_letter.pack() if dead_letter else "", time.time(), gap, hold],
        ) == 1

    def sweep_clock(self, gap_s: float, hold_s: float) -> bool:
        """Stamp the sweep clock; True while reclaims are held after an outage: no sweeper
        reached Redis for more than ``gap_s``, so leases may have lapsed under live attempts,
        which get ``hold_s`` to take them back (``_OUTAGE_FN``)."""
        return self._sweep_clock(keys=[self.k.sweep_clock, self.k.reclaim_hold],
                                 args=[int(gap_s * 1000), int(hold_s * 1000)]) == 1

    def move(self, job_id: str, episode_id: str, new_state: str, allowed_from: Sequence[str]) -> bool:
        return bool(self._move(keys=[self.k.job_state(job_id), self.k.job_counts(job_id)],
                               args=[episode_id, new_state, *allowed_from]))

    def move_many(self, job_id: str, moves: Sequence[tuple[str, str]], new_state: str,
                  chunk: int = 1000) -> list[bool]:
        """:meth:`move` for many ``(episode_id, from_state)`` pairs, pipelined: each move is
        still its own guarded script, ``chunk`` of them per round trip."""
        out: list[bool] = []
        keys = [self.k.job_state(job_id), self.k.job_counts(job_id)]
        for i in range(0, len(moves), chunk):
            pipe = self.r.pipeline(transaction=False)
            for episode_id, old in moves[i : i + chunk]:
                self._move(keys=keys, args=[episode_id, new_state, old], client=pipe)
            out.extend(bool(x) for x in pipe.execute())
        return out

    def episode_specs(self, job_id: str, episode_ids: Sequence[str]) -> dict[str, EpisodeSpec]:
        """Several episodes' specs in one round trip (those the ledger has)."""
        if not episode_ids:
            return {}
        raws = self.r.hmget(self.k.job_episodes(job_id), list(episode_ids))
        out = {}
        for episode_id, raw in zip(episode_ids, raws):
            if raw:
                try:
                    out[episode_id] = unpack(raw)
                except RecordError:
                    pass
        return out

    def due_retries(self, limit: int = 1000) -> list[str]:
        return [m.decode() for m in self.r.zrangebyscore(self.k.retry, 0, _now_ms(), start=0, num=limit)]

    def take_retry(self, m: str) -> bool:
        """Claim a due retry; only one sweeper gets 1 for a given member."""
        return bool(self.r.zrem(self.k.retry, m))


def _parse_attempt_value(raw: bytes | str | None) -> tuple[int, str]:
    """``"<attempt>:<attempt_id>"`` -> (attempt, attempt_id). A bare attempt_id (written by an
    older version) gives number 0."""
    if not raw:
        return 0, ""
    value = raw.decode() if isinstance(raw, bytes) else raw
    number, sep, attempt_id = value.partition(":")
    if sep and number.isdigit():
        return int(number), attempt_id
    return 0, value


def _now_ms() -> int:
    return int(time.time() * 1000)


__all__ = ["Ledger", "Lease", "StartResult"]
