"""The job ledger: which episodes exist, in which state, and who runs them.

Every state change is one Lua script, so that it is atomic with the fencing check beside it:

* ``start``   - queued/retrying/running-without-lease -> running, takes the lease, counts the
  attempt. A second delivery of a running or finished episode gets ``busy``/``finished`` and
  is dropped: the lease holder (or the sweeper, if the holder dies) owns the episode's future.
* ``renew``   - extends leases whose token still matches.
* ``publish`` - XADD a record only while the lease token matches, so an abandoned attempt can
  never write into the results stream after another attempt took over.
* ``finish``  - XADD the attempt record, move the state (done / failed / retrying / queued),
  park a dead letter, schedule a retry, drop the lease: all or nothing.
* ``reclaim`` - for the sweeper: running with no live lease -> queued or failed.
* ``move``    - guarded transitions for re-drive and reconcile.
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
    DONE,
    FAILED,
    LEDGER_STATES,
    QUEUED,
    RETRYING,
    RUNNING,
    AttemptRecord,
    DeadLetter,
    EpisodeSpec,
    EpisodesEnqueued,
    JobSpec,
    RecordError,
    new_attempt_id,
    unpack,
)

ANNOUNCE_CHUNK = 1000  # episodes per EpisodesEnqueued record

_COUNTS_FN = """
local function move(counts, old, new)
  if old == new then return end
  if old then redis.call('HINCRBY', counts, old, -1) end
  if new then redis.call('HINCRBY', counts, new, 1) end
end
"""

# KEYS: state, attempts, counts, lease, running, reserved, episodes, attempt_ids
# ARGV: episode, token_prefix, ttl_ms, now_ms, member, attempt_id
# Returns {'ok', attempt, token, episode spec} so that starting costs one round trip. The
# attempt_id is kept so that the sweeper can name the attempt it reclaims.
_START = _COUNTS_FN + """
redis.call('ZREM', KEYS[6], ARGV[5])
local st = redis.call('HGET', KEYS[1], ARGV[1])
if not st then return {'unknown', ''} end
if st == 'done' or st == 'failed' then return {'finished', st} end
local holder = redis.call('GET', KEYS[4])
if holder then return {'busy', holder} end
local attempt = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
local token = ARGV[2] .. ':' .. attempt
redis.call('SET', KEYS[4], token, 'PX', ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], 'running')
move(KEYS[3], st, 'running')
redis.call('ZADD', KEYS[5], tonumber(ARGV[4]) + tonumber(ARGV[3]), ARGV[5])
redis.call('HSET', KEYS[8], ARGV[1], ARGV[6])
return {'ok', tostring(attempt), token, redis.call('HGET', KEYS[7], ARGV[1]) or ''}
"""

# KEYS: lease, running   ARGV: token, ttl_ms, now_ms, member
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]) + tonumber(ARGV[2]), ARGV[4])
return 1
"""

# KEYS: lease, stream   ARGV: token, record
_PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('XADD', KEYS[2], '*', 'r', ARGV[2])
return redis.call('XLEN', KEYS[2])
"""

# KEYS: stream, lease_1 .. lease_n   ARGV: token_1 .. token_n, record_1 .. record_n
# Each record is added only while its own lease token matches: one round trip for the records
# of many episodes, fenced exactly as one PUBLISH each would be. Returns {ok_1 .. ok_n, xlen}.
_PUBLISH_MANY = """
local n = #KEYS - 1
local out = {}
for i = 1, n do
  if redis.call('GET', KEYS[i + 1]) == ARGV[i] then
    redis.call('XADD', KEYS[1], '*', 'r', ARGV[n + i])
    out[i] = 1
  else
    out[i] = 0
  end
end
out[n + 1] = redis.call('XLEN', KEYS[1])
return out
"""

# KEYS: lease, state, counts, running, stream, retry, dlq, dlq_index
# ARGV: token, episode, new_state, member, record, retry_at_ms, dead_letter, now_s
_FINISH = _COUNTS_FN + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
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

# KEYS: state, counts, lease, running, stream, dlq, dlq_index
# ARGV: episode, member, new_state, record, dead_letter, now_s
_RECLAIM = _COUNTS_FN + """
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local st = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[2])
if st ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
move(KEYS[2], st, ARGV[3])
if ARGV[4] ~= '' then redis.call('XADD', KEYS[5], '*', 'r', ARGV[4]) end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[6], ARGV[2], ARGV[5])
  redis.call('ZADD', KEYS[7], ARGV[6], ARGV[2])
end
return 1
"""

# KEYS: reserved, state   ARGV: member, episode, now_ms
_RECLAIM_RESERVED = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[3]) then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[2], ARGV[2]) ~= 'queued' then return 0 end
return 1
"""

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

    @property
    def member(self) -> str:
        return member(self.job_id, self.episode_id)


@dataclass
class StartResult:
    status: str  # ok | busy | finished | unknown
    lease: Lease | None = None
    detail: str = ""
    spec: EpisodeSpec | None = None  # with ok: the episode's spec (None if the ledger has none)


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

    # --- jobs ------------------------------------------------------------------------
    def create_job(self, job: JobSpec, episodes: Sequence[EpisodeSpec], chunk: int = 5000) -> None:
        """Record the job and every episode as queued, before any task is sent.

        Everything is encoded before the first write, so a value that cannot travel (an
        integer past 64 bits, a lone surrogate) fails the call with nothing written."""
        k = self.k
        specs = [(e.episode_id, e.pack()) for e in episodes]
        announcements = [
            EpisodesEnqueued(job.job_id, [[e.episode_id, e.env_name, e.group_id, orjson.dumps(e.env_params)]
                                          for e in episodes[i : i + ANNOUNCE_CHUNK]],
                             created_at=job.created_at).pack()
            for i in range(0, len(episodes), ANNOUNCE_CHUNK)
        ]
        job_packed = job.pack()
        for i in range(0, len(specs), chunk):
            part = specs[i : i + chunk]
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(k.job_episodes(job.job_id), mapping=dict(part))
            pipe.hset(k.job_state(job.job_id), mapping={episode_id: QUEUED for episode_id, _ in part})
            pipe.execute()
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(k.job_counts(job.job_id), mapping={s: 0 for s in LEDGER_STATES})
        pipe.hset(k.job_counts(job.job_id), QUEUED, len(episodes))
        pipe.set(k.job_spec(job.job_id), job_packed)
        queues = {e.queue for e in episodes if e.queue}
        if queues:
            pipe.sadd(k.job_queues(job.job_id), *queues)
        pipe.zadd(k.jobs, {job.job_id: job.created_at})
        # The job and its episodes are announced in the results stream too, so the database
        # knows what to expect (and lists every episode before it runs: job_environments).
        pipe.xadd(k.results, {"r": job_packed})
        for raw in announcements:
            pipe.xadd(k.results, {"r": raw})
        pipe.execute()

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
        return {s: int(raw.get(s.encode(), 0)) for s in LEDGER_STATES}

    def states(self, job_id: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.k.job_state(job_id)).items()}

    def state(self, job_id: str, episode_id: str) -> str | None:
        v = self.r.hget(self.k.job_state(job_id), episode_id)
        return v.decode() if v else None

    def attempts(self, job_id: str, episode_id: str) -> int:
        return int(self.r.hget(self.k.job_attempts(job_id), episode_id) or 0)

    def attempt_id(self, job_id: str, episode_id: str) -> str:
        """The attempt_id of the episode's latest start ("" if it never started)."""
        v = self.r.hget(self.k.job_attempt_ids(job_id), episode_id)
        return v.decode() if v else ""

    def attempt_limit(self, job_id: str, episode_id: str, default: int) -> int:
        """The last attempt number allowed; re-drives and hand-backs raise it."""
        v = self.r.hget(self.k.job_attempt_limit(job_id), episode_id)
        return int(v) if v is not None else default

    def grant_extra_attempt(self, job_id: str, episode_id: str, default: int, n: int = 1) -> int:
        key = self.k.job_attempt_limit(job_id)
        self.r.hsetnx(key, episode_id, default)
        return int(self.r.hincrby(key, episode_id, n))

    # --- attempts --------------------------------------------------------------------
    def start(self, job_id: str, episode_id: str, worker: str) -> StartResult:
        k = self.k
        attempt_id = new_attempt_id()
        out = self._start(
            keys=[k.job_state(job_id), k.job_attempts(job_id), k.job_counts(job_id), k.lease(episode_id), k.running,
                  k.reserved, k.job_episodes(job_id), k.job_attempt_ids(job_id)],
            args=[episode_id, f"{worker}:{attempt_id}", self.lease_ttl_ms, _now_ms(), member(job_id, episode_id),
                  attempt_id],
        )
        status = out[0].decode()
        if status != "ok":
            return StartResult(status, detail=out[1].decode() if len(out) > 1 else "")
        raw_spec = out[3] if len(out) > 3 else b""
        spec = None
        if raw_spec:
            try:
                spec = unpack(raw_spec)
            except RecordError:
                spec = None  # the runner dead-letters the episode as bad_task
        return StartResult("ok", Lease(job_id, episode_id, int(out[1]), out[2].decode(), attempt_id), spec=spec)

    def renew(self, leases: Iterable[Lease]) -> None:
        """Extend every lease; a lease whose token no longer matches is flagged lost."""
        leases = list(leases)
        if not leases:
            return
        now = _now_ms()
        pipe = self.r.pipeline(transaction=False)
        for lease in leases:
            self._renew(
                keys=[self.k.lease(lease.episode_id), self.k.running],
                args=[lease.token, self.lease_ttl_ms, now, lease.member],
                client=pipe,
            )
        for lease, ok in zip(leases, pipe.execute()):
            if not ok:
                lease.lost.set()

    # --- reservations: received by a worker, not started yet ----------------------------
    # A worker that dies between receiving a task and starting it leaves no lease behind, and
    # its message comes back only after the broker's visibility timeout (hours). A renewed
    # reservation lets the sweeper send such episodes again within the lease TTL.
    def reserve(self, members: Sequence[str]) -> None:
        if members:
            expiry = _now_ms() + self.lease_ttl_ms
            self.r.zadd(self.k.reserved, {m: expiry for m in members})

    def renew_reservations(self, members: Sequence[str]) -> set[str]:
        """Extend reservations still open; returns those gone (started, or reclaimed)."""
        if not members:
            return set()
        expiry = _now_ms() + self.lease_ttl_ms
        pipe = self.r.pipeline(transaction=False)
        for m in members:
            pipe.zscore(self.k.reserved, m)
            pipe.zadd(self.k.reserved, {m: expiry}, xx=True)  # XX: never re-adds a started one
        scores = pipe.execute()[0::2]
        return {m for m, score in zip(members, scores) if score is None}

    def expired_reservations(self, limit: int = 1000) -> list[str]:
        return [m.decode() for m in self.r.zrangebyscore(self.k.reserved, 0, _now_ms(), start=0, num=limit)]

    def reclaim_reservation(self, m: str) -> bool:
        """True once (atomically) for an expired reservation whose episode never started."""
        job_id, _, episode_id = m.partition(" ")
        return bool(self._reclaim_reserved(keys=[self.k.reserved, self.k.job_state(job_id)],
                                           args=[m, episode_id, _now_ms()]))

    def publish(self, lease: Lease, payload: bytes) -> int:
        """XADD under the lease. Returns the stream length, or -1 if the lease is gone."""
        n = self._publish(keys=[self.k.lease(lease.episode_id), self.k.results], args=[lease.token, payload])
        if n < 0:
            lease.lost.set()
        return int(n)

    def publish_many(self, items: Sequence[tuple[Lease, bytes]]) -> tuple[list[bool], int]:
        """XADD several records, each under its own lease, in one round trip. Returns which
        were added (a refused one's lease is flagged lost) and the stream length after."""
        if not items:
            return [], 0
        keys = [self.k.results] + [self.k.lease(lease.episode_id) for lease, _ in items]
        args = [lease.token for lease, _ in items] + [payload for _, payload in items]
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
        ok = self._finish(
            keys=[k.lease(lease.episode_id), k.job_state(lease.job_id), k.job_counts(lease.job_id), k.running,
                  k.results, k.retry, k.dlq, k.dlq_index],
            args=[lease.token, lease.episode_id, new_state, lease.member, record.pack(),
                  int(retry_at * 1000) if retry_at else "", dead_letter.pack() if dead_letter else "", time.time()],
        )
        if not ok:
            lease.lost.set()
        return bool(ok)

    # --- recovery --------------------------------------------------------------------
    def expired_running(self, grace_ms: int = 0, limit: int = 1000) -> list[str]:
        """Members of the running set whose lease expiry passed (grace_ms ago)."""
        return [m.decode() for m in self.r.zrangebyscore(self.k.running, 0, _now_ms() - grace_ms, start=0, num=limit)]

    def reclaim(self, job_id: str, episode_id: str, new_state: str, record: AttemptRecord | None,
                dead_letter: DeadLetter | None = None) -> bool:
        k = self.k
        return bool(self._reclaim(
            keys=[k.job_state(job_id), k.job_counts(job_id), k.lease(episode_id), k.running, k.results,
                  k.dlq, k.dlq_index],
            args=[episode_id, member(job_id, episode_id), new_state, record.pack() if record else "",
                  dead_letter.pack() if dead_letter else "", time.time()],
        ))

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


def _now_ms() -> int:
    return int(time.time() * 1000)


__all__ = ["Ledger", "Lease", "StartResult", "QUEUED", "RUNNING", "RETRYING", "DONE", "FAILED"]
