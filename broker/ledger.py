"""The job ledger: which episodes exist, in which state, and who runs them.

Every change of an episode's state, and every write fenced by its lease, is one Lua script (its
text in ``broker/lua/``), so that it is atomic with the fencing check beside it:

* ``start``   - queued/retrying/running-without-lease -> running, takes the lease, counts the
  attempt (running-without-lease not while reclaims are held after an outage, see below). A
  second delivery of a running or finished episode gets ``busy``/``finished`` and is dropped:
  the lease holder (or the sweeper, if the holder dies) owns the episode's future. The same
  START sent again (same worker and attempt_id: its reply was lost) gets its own attempt back,
  with its predecessor, and counts nothing.
* ``renew``   - extends the attempt's lease, and tells the attempt when its job was cancelled.
* ``publish_many`` - XADDs records (and writes progress snapshots) only while their attempts
  hold their episodes: an abandoned attempt never writes after another took over; ``mark``
  one snapshot that is waited for (``stepping``), fenced the same way.
* ``finish``  - XADD the attempt record, move the state, park a dead letter, schedule a retry,
  drop the lease: all or nothing. ``reclaim`` - for the sweeper: running with no live lease ->
  queued or failed. ``move`` - guarded transitions for re-drive and reconcile.

A cancelled job (broker/cancel.py) starts nothing: ``start`` refuses its episodes.

**Who holds an episode** (renew, publish and finish alike, ``lua/ledger_holds_fn.lua``): the
attempt whose token the lease key carries; or, when the key is gone, the attempt the episode is still
``running`` under (its ``"<attempt>:<attempt_id>"`` is the latest START's), which takes the
lease back. A lease that lapsed is not lost: nobody else took the episode (a reclaim moves it
out of ``running``, a new START changes the attempt id). An attempt loses its episode only when
another token holds the lease or the episode moved on.

**When the sweeper reclaims** a lease that ran out, and when not (an outage): broker/recovery.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import orjson
import redis

from broker.keys import Keys, member, split_member
from broker.lease import Lease
from broker.lua_scripts import lua_file
from broker.records import (
    AttemptRecord,
    DeadLetter,
    EpisodeSpec,
    EpisodesEnqueued,
    JobSpec,
    Progress,
    RecordError,
    new_attempt_id,
    unpack,
)
from broker.replicas import ReplicaWait
from broker.settings import Settings
from broker.states import LedgerState, ProgressPhase, StartStatus

ANNOUNCE_CHUNK = 1000  # episodes per EpisodesEnqueued record
OUTAGES_KEPT = 64  # outage windows remembered (Keys.outages): a lease lapsed in an older one counts
SUBMIT_MARKER_TTL_S = 600.0  # a submit writing one chunk longer than this is taken for dead

# Each script's Lua is in broker/lua/ledger_*.lua (broker/lua_scripts.py), put together here once, at import.
_NOW = lua_file("now")
COUNTS_FN = lua_file("ledger_counts_fn")  # also broker/cancel.py's
_HOLDS_FN = lua_file("ledger_holds_fn")
_PROGRESS_FN = lua_file("ledger_progress_fn")
OUTAGE_FN = lua_file("ledger_outage_fn", OUTAGES_KEPT=OUTAGES_KEPT)  # also broker/caps.py's

_START = _NOW + COUNTS_FN + lua_file("ledger_start")
_RENEW = _NOW + _HOLDS_FN + lua_file("ledger_renew")
_CLAIM = lua_file("ledger_claim")
_EXPIRED = _NOW + lua_file("ledger_expired")
_RESERVE = _NOW + lua_file("ledger_reserve")
_PUBLISH_MANY = _NOW + _HOLDS_FN + _PROGRESS_FN + lua_file("ledger_publish_many")
# ``now`` declared, not read: MARK asks Redis' time only on the rare path that needs it
_MARK = "local now = 0\n" + _HOLDS_FN + lua_file("ledger_mark")
_FINISH = _NOW + COUNTS_FN + _HOLDS_FN + lua_file("ledger_finish")
_SWEEP_CLOCK = _NOW + OUTAGE_FN + lua_file("ledger_sweep_clock")
_RECLAIM = _NOW + COUNTS_FN + OUTAGE_FN + lua_file("ledger_reclaim")
_RECLAIM_RESERVED = _NOW + lua_file("ledger_reclaim_reserved")
_MOVE = COUNTS_FN + lua_file("ledger_move")


class JobExists(ValueError):
    """A job with this id was submitted before."""

    def __init__(self, job_id: str):
        super().__init__(f"job id {job_id!r} exists already: submitting it again would re-run its finished "
                         f"episodes. Finish it with `interactor run --resume {job_id}`, re-drive its failures with "
                         f"`interactor dlq redrive --job {job_id}`, or submit under a new id")
        self.job_id = job_id


@dataclass
class StartResult:
    status: StartStatus
    lease: Lease | None = None
    detail: str = ""
    spec: EpisodeSpec | None = None  # with ok: the episode's spec (None if the ledger has none)
    #: with ok: the earlier attempts whose env instance may still be open, oldest first, ``previous``
    #: last (lua/ledger_start.lua keeps the list)
    earlier: tuple[tuple[int, str], ...] = ()
    progress: Progress | None = None  # with ok: where the episode's trajectory stands (broker/resume.py)
    #: with ok: the sweep clock recorded an outage or a failover after ``progress`` was written
    outage_since_progress: bool = False

    @property
    def previous(self) -> tuple[int, str] | None:
        """The attempt before this one (number, attempt_id), if any."""
        return self.earlier[-1] if self.earlier else None


class Ledger:
    def __init__(self, client: redis.Redis, keys: Keys, lease_ttl_s: float = 30.0,
                 replicas: ReplicaWait | None = None):
        """``replicas``: whether START and FINISH wait until a replica has them (broker/replicas.py);
        ``for_settings`` takes it from the settings, a ledger made otherwise does not wait."""
        self.r = client
        self.k = keys
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.replicas = replicas or ReplicaWait.off()
        self._start = client.register_script(_START)
        self._renew = client.register_script(_RENEW)
        self._publish_many = client.register_script(_PUBLISH_MANY)
        self._mark = client.register_script(_MARK)
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
                   marker_ttl_s: float = SUBMIT_MARKER_TTL_S, queues: Sequence[str] = ()) -> None:
        """Record the job and every episode as queued, before any task is sent. ``queues``: the
        queues its episodes will use besides those of ``episodes`` (a continuous job's, whose
        episodes come later).

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
                             created_at=job.created_at,
                             images={e.episode_id: e.image for e in episodes[i : i + ANNOUNCE_CHUNK] if e.image}).pack()
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
            still_ours()
            pipe = self.r.pipeline(transaction=False)
            self.add_episodes(pipe, job.job_id, episodes[i : i + chunk], packed=specs[i : i + chunk], count=False)
            pipe.execute()
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(k.job_counts(job.job_id), mapping={s: 0 for s in LedgerState})
        pipe.hset(k.job_counts(job.job_id), LedgerState.QUEUED, len(episodes))
        pipe.set(k.job_spec(job.job_id), job_packed)
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

    def add_episodes(self, pipe, job_id: str, episodes: Sequence[EpisodeSpec], *,
                     packed: Sequence[tuple[str, bytes]] | None = None, count: bool = True) -> None:
        """Queue, on ``pipe``, the ledger's writes that make ``episodes`` queued episodes of a
        job: their specs, their state, the job's count (unless the caller sets the counts, as
        a job's creation does) and the queues they use (what reconcile scans besides the
        served ones). A job's creation and the continuous producer both add episodes here."""
        k = self.k
        packed = packed if packed is not None else [(e.episode_id, e.pack()) for e in episodes]
        pipe.hset(k.job_episodes(job_id), mapping=dict(packed))
        pipe.hset(k.job_state(job_id), mapping={episode_id: LedgerState.QUEUED for episode_id, _ in packed})
        if count:
            pipe.hincrby(k.job_counts(job_id), LedgerState.QUEUED, len(packed))
        queues = {e.queue for e in episodes if e.queue}
        if queues:
            pipe.sadd(k.job_queues(job_id), *queues)

    @classmethod
    def for_settings(cls, client: redis.Redis, settings: Settings) -> "Ledger":
        """The ledger as every role uses it: the settings' key prefix, lease TTL and replica waits."""
        return cls(client, Keys(settings.key_prefix), settings.lease_ttl_s, ReplicaWait.for_settings(settings))

    def _commit(self, script, keys: list, args: list):
        """A commit point's script (START, FINISH, a ``stepping`` snapshot): with replica waits on, followed by a WAIT on
        the same connection, so that it returns once a replica has it (broker/replicas.py)."""
        if not self.replicas.due():
            return script(keys=keys, args=args)
        (out,) = self.replicas.run(self.r, lambda pipe: pipe.evalsha(script.sha, len(keys), *keys, *args),
                                   scripts=(script,))
        return out

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

    def latest_attempt(self, job_id: str, episode_id: str) -> tuple[int, str]:
        """(number, attempt_id) of the episode's latest start; (0, "") if it never started."""
        return _parse_attempt_value(self.r.hget(self.k.job_attempt_ids(job_id), episode_id))

    def latest_attempts(self, job_id: str, episode_ids: Sequence[str]) -> list[tuple[int, str]]:
        """:meth:`latest_attempt` of several episodes, in one round trip."""
        if not episode_ids:
            return []
        return [_parse_attempt_value(v) for v in self.r.hmget(self.k.job_attempt_ids(job_id), list(episode_ids))]

    def attempt_limit(self, job_id: str, episode_id: str, default: int) -> int:
        """The last attempt number allowed; re-drives and hand-backs raise it."""
        v = self.r.hget(self.k.job_attempt_limit(job_id), episode_id)
        return int(v) if v is not None else default

    def grant_fresh_attempts(self, job_id: str, episode_id: str, max_attempts: int) -> int:
        """A re-drive's fresh budget: ``max_attempts`` more on top of the attempts already used;
        returns the new limit."""
        limit = self.attempts(job_id, episode_id) + max_attempts
        self.r.hset(self.k.job_attempt_limit(job_id), episode_id, limit)
        return limit

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
                k.reclaim_hold, k.job_cancel(job_id), k.job_progress(job_id), k.job_progress_seq(job_id), k.outages, k.primary]
        out = self._commit(self._start, keys, [episode_id, prefix, self.lease_ttl_ms, member(job_id, episode_id),
                                               attempt_id, Progress.PHASE_ORDER.index(ProgressPhase.PROMPTED)])
        status = StartStatus(out[0].decode())
        earlier = ()
        if status != StartStatus.OK:
            return StartResult(status, detail=out[1].decode() if len(out) > 1 else "")
        raw_spec = out[3] if len(out) > 3 else b""
        spec = None
        if raw_spec:
            try:
                spec = unpack(raw_spec)
            except RecordError:
                spec = None  # the attempt dead-letters the episode as bad_task
        if len(out) > 4 and out[4]:
            earlier = tuple(_parse_attempt_value(v) for v in out[4].split(b",") if v)
        progress = _progress(out[5]) if len(out) > 5 and out[5] else None
        outage_since = len(out) > 6 and out[6] == b"1"
        lease = Lease(job_id, episode_id, int(out[1]), out[2].decode(), attempt_id, ttl_s=self.lease_ttl_ms / 1000)
        # Counted from when START was sent, not from its reply: a process stopped with the reply
        # in flight must not take the lease for fresh (it may have expired and passed on since).
        # Lease() counts from now when given no time, so the count is set here, not passed in.
        lease.valid_until = 0.0
        lease.renewed(sent)
        return StartResult(StartStatus.OK, lease, spec=spec, earlier=earlier, progress=progress,
                           outage_since_progress=outage_since)

    def renew(self, leases: Iterable[Lease]) -> None:
        """Extend every lease (or take back one that lapsed with nobody else taking over: the
        rule in ``lua/ledger_holds_fn.lua``); a lease another attempt holds now is flagged lost, one whose job
        was cancelled is flagged cancelled (and extended: its attempt closes under it)."""
        leases = list(leases)
        if not leases:
            return
        sent = time.monotonic()
        pipe = self.r.pipeline(transaction=False)
        for lease in leases:
            self._renew(
                keys=[self.k.lease(lease.episode_id), self.k.running, self.k.job_state(lease.job_id),
                      self.k.job_attempt_ids(lease.job_id), self.k.job_cancel(lease.job_id)],
                args=[lease.token, self.lease_ttl_ms, lease.member, lease.episode_id, lease.attempt_value],
                client=pipe,
            )
        for lease, ok in zip(leases, pipe.execute()):
            if ok:
                lease.renewed(sent)
                if ok == 2:
                    lease.cancelled.set()
            else:
                lease.lost.set()

    # --- reservations: received by a worker, not started yet ----------------------------
    # A worker that dies between receiving a task and starting it leaves no lease behind, and
    # its message is gone with it (the transport keeps no copy of a delivered message). A renewed
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

    def results_length(self) -> int:
        """Records in the results stream not yet trimmed (the consumer's backlog, as the
        publishers' backpressure reads it)."""
        return int(self.r.xlen(self.k.results))

    def publish_many(self, items: Sequence[tuple[Lease, bytes] | tuple[Lease, bytes, Progress | None]]
                     ) -> tuple[list[bool], int]:
        """XADD several records and write progress snapshots, each under its own lease, in one
        round trip (fenced: a lapsed lease is taken back, as by :meth:`renew`): an item is (lease,
        record or b"") or (lease, record or b"", snapshot or None). Returns which were written (a
        refused one's lease is flagged lost) and the stream length after (-1 when no record was
        added: snapshots alone do not read it)."""
        if not items:
            return [], 0
        k = self.k
        keys = [k.results, k.running]
        args: list = [self.lease_ttl_ms]
        for item in items:
            lease, payload = item[0], item[1]
            snapshot = item[2] if len(item) > 2 else None
            keys += [k.lease(lease.episode_id), k.job_state(lease.job_id), k.job_attempt_ids(lease.job_id),
                     k.job_progress(lease.job_id), k.job_progress_seq(lease.job_id)]
            args += [lease.token, payload, lease.member, lease.episode_id, lease.attempt_value,
                     *((snapshot.pack(), f"{snapshot.trajectory} {snapshot.seq}") if snapshot is not None else ("", ""))]
        out = self._publish_many(keys=keys, args=args)
        added = [bool(x) for x in out[:-1]]
        for item, ok in zip(items, added):
            if not ok:
                item[0].lost.set()
        return added, int(out[-1])

    def mark(self, lease: Lease, snapshot: Progress) -> bool:
        """One snapshot written now, fenced by ``lease`` (lua/ledger_mark.lua), a commit point; False
        (the lease flagged lost): the attempt no longer holds its episode."""
        k = self.k
        ok = self._commit(self._mark, [k.lease(lease.episode_id), k.running, k.job_state(lease.job_id),
                                       k.job_attempt_ids(lease.job_id), k.job_progress(lease.job_id)],
                          [lease.token, self.lease_ttl_ms, lease.member, lease.episode_id, lease.attempt_value,
                           snapshot.pack()])
        if not ok:
            lease.lost.set()
        return bool(ok)

    def progress(self, job_id: str, episode_id: str) -> Progress | None:
        """The episode's progress snapshot (None: none kept, or unreadable)."""
        return _progress(self.r.hget(self.k.job_progress(job_id), episode_id))

    def progresses(self, job_id: str, episode_ids: Sequence[str]) -> list[Progress | None]:
        """:meth:`progress` of several episodes, in one round trip."""
        if not episode_ids:
            return []
        return [_progress(raw) for raw in self.r.hmget(self.k.job_progress(job_id), list(episode_ids))]

    def finish(
        self,
        lease: Lease,
        record: AttemptRecord,
        new_state: str,
        *,
        retry_at: float | None = None,
        dead_letter: DeadLetter | None = None,
        keep_progress: bool = False,
        progress: Progress | None = None,
    ) -> bool:
        """Close the attempt: record, state, dead letter, retry, all or nothing, while the
        attempt holds its episode (a lapsed lease counts, by the rule of :meth:`renew`). False
        (and the lease flagged lost) when it does not: another attempt has it, or the episode
        moved on - possibly by this very FINISH, sent before and its reply lost
        (:meth:`finished_as` tells). ``keep_progress``: the episode's progress snapshot stays
        for the next attempt to continue from (an attempt handed back with its env instance
        kept), replaced by ``progress`` if given (where it stopped, between env calls); otherwise
        it goes with the attempt."""
        k = self.k
        ok = self._commit(
            self._finish,
            [k.lease(lease.episode_id), k.job_state(lease.job_id), k.job_counts(lease.job_id), k.running,
             k.results, k.retry, k.dlq, k.dlq_index, k.job_attempt_ids(lease.job_id),
             k.job_progress(lease.job_id), k.job_progress_seq(lease.job_id)],
            [lease.token, lease.episode_id, new_state, lease.member, record.pack(),
             int(retry_at * 1000) if retry_at else "", dead_letter.pack() if dead_letter else "", time.time(),
             self.lease_ttl_ms, lease.attempt_value, "1" if keep_progress else "",
             *((progress.pack(), f"{progress.trajectory} {progress.seq}") if progress is not None else ("", ""))],
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

    def live_lease_tokens(self) -> list[str]:
        """The tokens of the leases live now, ``<worker>:<attempt_id>:<attempt>``: which process
        runs how many episodes (the autoscaler counts them per worker process)."""
        members = self.r.zrangebyscore(self.k.running, _now_ms(), "+inf")
        if not members:
            return []
        tokens = self.r.mget([self.k.lease(split_member(m.decode())[1]) for m in members])
        return [t.decode(errors="replace") for t in tokens if t]

    # --- recovery --------------------------------------------------------------------
    def expired_running(self, grace_ms: int = 0, limit: int = 1000) -> list[str]:
        """Members of the running set whose lease expiry passed (grace_ms ago, by Redis' clock)."""
        return [m.decode() for m in self._expired(keys=[self.k.running], args=[int(grace_ms), limit])]

    def forget_running(self, m: str) -> None:
        """Drop a member of the running set whose job or episode the ledger no longer has."""
        self.r.zrem(self.k.running, m)

    def reclaim(self, job_id: str, episode_id: str, new_state: str, record: AttemptRecord | None,
                dead_letter: DeadLetter | None = None, *, outage: tuple[float, float] | None = None,
                uncounted_default: int | None = None) -> bool:
        """Running with no live lease -> ``new_state``. ``outage`` = (gap_s, hold_s): the
        sweeper's outage rule (:meth:`sweep_clock`), checked in the same script, so that a
        sweep that stalled across a Redis outage cannot reclaim on the far side of it.
        ``uncounted_default``: the attempt is not counted, in the same script (the episode's
        attempt limit, this if it has none, goes up by one)."""
        k = self.k
        gap, hold = (int(outage[0] * 1000), int(outage[1] * 1000)) if outage else ("", "")
        return self._reclaim(
            keys=[k.job_state(job_id), k.job_counts(job_id), k.lease(episode_id), k.running, k.results,
                  k.dlq, k.dlq_index, k.sweep_clock, k.reclaim_hold, k.outages, k.job_attempt_limit(job_id),
                  k.job_progress(job_id), k.job_progress_seq(job_id), k.primary],
            args=[episode_id, member(job_id, episode_id), new_state, record.pack() if record else "",
                  dead_letter.pack() if dead_letter else "", time.time(), gap, hold,
                  "" if uncounted_default is None else int(uncounted_default)],
        ) == 1

    def sweep_clock(self, gap_s: float, hold_s: float) -> bool:
        """Stamp the sweep clock; True while reclaims are held after an outage: no sweeper
        reached Redis for more than ``gap_s``, so leases may have lapsed under live attempts,
        which get ``hold_s`` to take them back (``lua/ledger_outage_fn.lua``)."""
        return self._sweep_clock(keys=[self.k.sweep_clock, self.k.reclaim_hold, self.k.outages, self.k.primary],
                                 args=[int(gap_s * 1000), int(hold_s * 1000)]) == 1

    def lapsed_in_outage(self, m: str) -> bool:
        """Whether running member ``m``'s lease lapsed while no sweeper reached Redis (a gap the
        sweep clock recorded, ``lua/ledger_outage_fn.lua``), its holder never renewing it after: it was live
        at the gap's first moment (the last stamp before it), and it expires no later than the
        gap's end or four thirds of a TTL after that stamp (a renewal between the stamp and
        Redis going away: sweeps come every third of a TTL at most). A renewal after the gap
        would expire a TTL after its end, later than both, the gap being over half a TTL."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zscore(self.k.running, m)
        pipe.zrange(self.k.outages, 0, -1)
        expiry, windows = pipe.execute()
        if expiry is None:
            return False
        for w in windows:
            start, end = (int(x) for x in w.decode().split(":"))
            if start <= expiry <= max(end, start + self.lease_ttl_ms * 4 // 3):
                return True
        return False

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


def _progress(raw) -> Progress | None:
    """A progress snapshot as stored, or None (an unreadable one is no snapshot: the successor
    starts afresh)."""
    if not raw:
        return None
    try:
        p = unpack(raw)
    except RecordError:
        return None
    return p if isinstance(p, Progress) else None


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
