"""The results database: one SQLite file (WAL), written by the consumer in batches.

Tables
------
* ``session_steps`` - the original driver's table (same column names) plus ``attempt``,
  ``superseded``, ``finish_reason`` and the two latencies. ``UNIQUE(env_id, attempt, step_id)``:
  a record delivered twice is stored once.
* ``jobs``, ``episodes``, ``attempts``, ``groups`` - derived bookkeeping.

Fencing (how the database keeps exactly one trajectory per episode)
-------------------------------------------------------------------
An episode's *current* attempt is the highest attempt number seen for it, from a step or an
AttemptRecord. Every step of a lower attempt has ``superseded = 1``: steps already stored are
flipped when a higher attempt first shows up, and a stale lower-attempt step that arrives late is
stored superseded straight away. Invariant after every batch:
``superseded = 1  <=>  attempt < episodes.attempt``. So "the trajectory" of an episode is simply
its rows with ``superseded = 0`` (which are exactly the rows of ``episodes.attempt``).

The episode's status follows the current attempt's AttemptRecord (completed / failed /
retrying; ``abandoned`` shows as ``retrying``: another attempt takes over), or ``running`` when
that attempt has not closed yet. Episode and group aggregates are recomputed once per batch for
each episode and group the batch touched, so redelivery (same records again) is a no-op and the
order in which records of different attempts arrive does not matter.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
from typing import Any

from broker.records import (
    ABANDONED,
    ATTEMPT_FAILED,
    ATTEMPT_RETRYING,
    COMPLETED,
    AttemptRecord,
    EpisodeSpec,
    JobSpec,
    RecordError,
    StepRecord,
    _KINDS,
)

STORE_SCHEMA_VERSION = 1

# Episode statuses (episodes.status).
EP_RUNNING, EP_COMPLETED, EP_RETRYING, EP_FAILED = "running", "completed", "retrying", "failed"
_EPISODE_STATUS = {
    COMPLETED: EP_COMPLETED,
    ATTEMPT_FAILED: EP_FAILED,
    ATTEMPT_RETRYING: EP_RETRYING,
    ABANDONED: EP_RETRYING,
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS session_steps (
    id INTEGER PRIMARY KEY,
    job_id TEXT NOT NULL,
    env_id TEXT NOT NULL,
    step_id INTEGER NOT NULL,
    env_name TEXT,
    llm_model TEXT,
    group_id TEXT,
    messages TEXT,
    response TEXT,
    step_reward REAL,
    cumulative_reward REAL,
    env_state TEXT,
    weight_version TEXT,
    terminated INTEGER,
    truncated INTEGER,
    episode_finished INTEGER,
    is_trainable INTEGER,
    created_at REAL,
    attempt INTEGER NOT NULL DEFAULT 1,
    superseded INTEGER NOT NULL DEFAULT 0,
    finish_reason TEXT,
    env_latency_s REAL,
    model_latency_s REAL,
    UNIQUE (env_id, attempt, step_id)
);
CREATE INDEX IF NOT EXISTS session_steps_job_trainable ON session_steps (job_id, is_trainable);

-- Internal: stored step count and reward sum per (episode, attempt), kept by a trigger that fires
-- only for rows actually inserted (INSERT OR IGNORE skips duplicates), so it is exact under
-- redelivery and lets a batch recompute an episode without reading its steps back.
CREATE TABLE IF NOT EXISTS attempt_steps (
    env_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    steps INTEGER NOT NULL,
    reward REAL NOT NULL,
    PRIMARY KEY (env_id, attempt)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS session_steps_count AFTER INSERT ON session_steps BEGIN
    INSERT INTO attempt_steps (env_id, attempt, steps, reward) VALUES (NEW.env_id, NEW.attempt, 1, COALESCE(NEW.step_reward, 0.0))
    ON CONFLICT (env_id, attempt) DO UPDATE SET steps = steps + 1, reward = reward + excluded.reward;
END;

CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    created_at REAL,
    episodes INTEGER,
    groups INTEGER,
    model TEXT,
    llm_base_url TEXT,
    sources TEXT,
    spec TEXT
);

CREATE TABLE IF NOT EXISTS episodes (
    episode_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    group_id TEXT,
    env_name TEXT,
    llm_model TEXT,
    status TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    total_reward REAL,
    steps INTEGER,
    reason TEXT,
    error_class TEXT,
    error TEXT,
    started_at REAL,
    finished_at REAL,
    duration_s REAL,
    updated_at REAL
);
CREATE INDEX IF NOT EXISTS episodes_job ON episodes (job_id);
CREATE INDEX IF NOT EXISTS episodes_group ON episodes (group_id);

CREATE TABLE IF NOT EXISTS attempts (
    episode_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    job_id TEXT,
    status TEXT NOT NULL,
    reason TEXT,
    error_class TEXT,
    error TEXT,
    total_reward REAL,
    steps INTEGER,
    started_at REAL,
    finished_at REAL,
    worker TEXT,
    PRIMARY KEY (episode_id, attempt)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT PRIMARY KEY,
    job_id TEXT,
    env_name TEXT,
    size INTEGER,
    completed INTEGER,
    failed INTEGER,
    reward_mean REAL,
    reward_std REAL,
    complete INTEGER NOT NULL DEFAULT 0,
    incomplete_reason TEXT
);
"""

_STEP_COLS = (
    "job_id, env_id, step_id, env_name, llm_model, group_id, messages, response, step_reward, "
    "cumulative_reward, env_state, weight_version, terminated, truncated, episode_finished, "
    "is_trainable, created_at, attempt, superseded, finish_reason, env_latency_s, model_latency_s"
)
_INSERT_STEP = f"INSERT OR IGNORE INTO session_steps ({_STEP_COLS}) VALUES ({', '.join('?' * 22)})"

_INSERT_ATTEMPT = (
    "INSERT OR IGNORE INTO attempts (episode_id, attempt, job_id, status, reason, error_class, error, "
    "total_reward, steps, started_at, finished_at, worker) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
)
# A 'completed' close wins over any other close of the same attempt (e.g. a sweeper's 'abandoned'
# racing the worker's own 'completed'); otherwise the first close stored is kept.
_UPGRADE_ATTEMPT = (
    "UPDATE attempts SET job_id=?, status=?, reason=?, error_class=?, error=?, total_reward=?, steps=?, "
    "started_at=?, finished_at=?, worker=? WHERE episode_id=? AND attempt=? AND status != 'completed'"
)

_UPSERT_EPISODE = """
INSERT INTO episodes (episode_id, job_id, group_id, env_name, llm_model, status, attempt, attempts,
    total_reward, steps, reason, error_class, error, started_at, finished_at, duration_s, updated_at)
VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)
ON CONFLICT (episode_id) DO UPDATE SET
    status=excluded.status, attempt=excluded.attempt, attempts=excluded.attempts,
    total_reward=excluded.total_reward, steps=excluded.steps, reason=excluded.reason,
    error_class=excluded.error_class, error=excluded.error, started_at=excluded.started_at,
    finished_at=excluded.finished_at, duration_s=excluded.duration_s, updated_at=excluded.updated_at
"""

_UPSERT_GROUP = """
INSERT INTO groups (group_id, job_id, env_name, size, completed, failed, reward_mean, reward_std,
    complete, incomplete_reason)
VALUES (?,?,?,?,?,?,?,?,?,?)
ON CONFLICT (group_id) DO UPDATE SET
    size=excluded.size, completed=excluded.completed, failed=excluded.failed,
    reward_mean=excluded.reward_mean, reward_std=excluded.reward_std, complete=excluded.complete,
    incomplete_reason=excluded.incomplete_reason
"""

# Facts to recompute the touched episodes; ?1 = JSON [[episode_id, current attempt], ...].
_EPISODE_FACTS = """
WITH t(eid, att) AS (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?1))
SELECT t.eid, st.steps, st.reward, a.status, a.total_reward, a.reason, a.error_class, a.error, a.finished_at
FROM t
LEFT JOIN attempt_steps st ON st.env_id = t.eid AND st.attempt = t.att
LEFT JOIN attempts a ON a.episode_id = t.eid AND a.attempt = t.att
"""

# Distinct attempt numbers seen for an episode (steps or closes); only asked when a batch brings
# an attempt number other than the episode's current one.
_ATTEMPTS_SEEN = """
SELECT (SELECT COUNT(*) FROM attempt_steps WHERE env_id = ?1)
     + (SELECT COUNT(*) FROM attempts a WHERE a.episode_id = ?1 AND NOT EXISTS
           (SELECT 1 FROM attempt_steps s WHERE s.env_id = a.episode_id AND s.attempt = a.attempt))
"""

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _messages_json(messages: Any, cache: dict) -> str:
    """``_dumps(messages)``, with each plain two-field message (role/content strings) encoded
    once per batch: consecutive prompts of an episode repeat its system message and recent
    turns, and this halves the JSON cost of a realistic batch. Same text as ``_dumps``."""
    if type(messages) is not list:
        return _dumps(messages)
    parts = []
    for m in messages:
        if type(m) is dict and len(m) == 2:
            (k0, v0), (k1, v1) = m.items()
            if type(v0) is str and type(v1) is str:
                key = (k0, v0, k1, v1)
                j = cache.get(key)
                if j is None:
                    j = cache[key] = _dumps(m)
                parts.append(j)
                continue
        parts.append(_dumps(m))
    return "[" + ",".join(parts) + "]"


def _coerce(rec: Any):
    """Accept record objects, or decoded maps carrying ``kind`` (as on the stream)."""
    if isinstance(rec, (StepRecord, AttemptRecord, JobSpec, EpisodeSpec)):
        return rec
    if isinstance(rec, dict):
        cls = _KINDS.get(rec.get("kind"))
        if cls is None:
            raise RecordError(f"unknown record kind {rec.get('kind')!r}")
        return cls.from_dict(rec)
    raise TypeError(f"Store.write_batch: unsupported record type {type(rec).__name__}")


class _EpisodeMeta:
    __slots__ = ("job_id", "group_id", "env_name", "llm_model", "batch_max", "attempts", "started_min", "group_size")

    def __init__(self, job_id, group_id, env_name, llm_model):
        self.job_id, self.group_id, self.env_name, self.llm_model = job_id, group_id, env_name, llm_model
        self.batch_max = 0
        self.attempts: set[int] = set()  # attempt numbers in this batch
        self.started_min: float | None = None
        self.group_size = 0


def _min_opt(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a <= b else b


class Store:
    """The results database. One writer (the consumer); readers may be other processes."""

    def __init__(self, path: str):
        self.path = str(path)
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        c = self._conn
        # page_size only takes effect before the first table is created: 8 KiB pages hold a
        # few-KB step row without overflow pages.
        c.execute("PRAGMA page_size = 8192")
        c.execute("PRAGMA journal_mode = WAL")
        c.execute("PRAGMA synchronous = NORMAL")
        c.execute("PRAGMA busy_timeout = 30000")
        c.execute("PRAGMA cache_size = -65536")  # 64 MiB
        c.execute("PRAGMA temp_store = MEMORY")
        c.execute("PRAGMA wal_autocheckpoint = 8192")  # pages: ~64 MiB of WAL between checkpoints
        c.execute("PRAGMA journal_size_limit = 67108864")
        with self._lock:
            (uv,) = c.execute("PRAGMA user_version").fetchone()
            if uv > STORE_SCHEMA_VERSION:
                c.close()
                raise RuntimeError(f"{self.path}: store schema v{uv} is newer than this code (v{STORE_SCHEMA_VERSION})")
            if uv < STORE_SCHEMA_VERSION:  # new file (readers of an existing one take no write lock)
                c.executescript(f"BEGIN IMMEDIATE;\n{_SCHEMA}\nPRAGMA user_version = {STORE_SCHEMA_VERSION};\nCOMMIT;")

    # ------------------------------------------------------------------ writing

    def write_batch(self, records: list) -> int:
        """Store a batch in one transaction; returns the number of new rows (steps, attempt
        closes and jobs). Redelivering the same batch stores nothing and returns 0."""
        jobs: list[JobSpec] = []
        steps: list[StepRecord] = []
        closes: list[AttemptRecord] = []
        for r in records:
            r = _coerce(r)
            if isinstance(r, StepRecord):
                steps.append(r)
            elif isinstance(r, AttemptRecord):
                closes.append(r)
            elif isinstance(r, JobSpec):
                jobs.append(r)
            # EpisodeSpec: nothing to store (the ledger owns it)
        if not (jobs or steps or closes):
            return 0

        # Per-episode facts carried by this batch.
        meta: dict[str, _EpisodeMeta] = {}
        for s in steps:
            m = meta.get(s.env_id)
            if m is None:
                m = meta[s.env_id] = _EpisodeMeta(s.job_id, s.group_id, s.env_name, s.llm_model)
            if s.attempt > m.batch_max:
                m.batch_max = s.attempt
            m.attempts.add(s.attempt)
            m.started_min = _min_opt(m.started_min, s.created_at)
        for a in closes:
            m = meta.get(a.episode_id)
            if m is None:
                m = meta[a.episode_id] = _EpisodeMeta(a.job_id, a.group_id, a.env_name, a.llm_model)
            if a.attempt > m.batch_max:
                m.batch_max = a.attempt
            m.attempts.add(a.attempt)
            if a.started_at and a.started_at > 0:
                m.started_min = _min_opt(m.started_min, a.started_at)
            if a.group_size and a.group_size > m.group_size:
                m.group_size = a.group_size

        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                inserted = self._write(c, jobs, steps, closes, meta)
                c.execute("COMMIT")
            except BaseException:
                if c.in_transaction:
                    c.execute("ROLLBACK")
                raise
        return inserted

    def _write(self, c, jobs, steps, closes, meta: dict[str, _EpisodeMeta]) -> int:
        inserted = 0
        if jobs:
            inserted += c.executemany(
                "INSERT OR IGNORE INTO jobs (job_id, created_at, episodes, groups, model, llm_base_url, "
                "sources, spec) VALUES (?,?,?,?,?,?,?,?)",
                [
                    (j.job_id, j.created_at, j.episodes, j.groups, j.model, j.llm_base_url, _dumps(j.sources), _dumps(j.to_dict()))
                    for j in jobs
                ],
            ).rowcount

        # Existing episode rows: current attempt, start, identity and what groups depend on.
        existing: dict[str, tuple] = {}
        for (eid, *rest) in c.execute(
            "SELECT episode_id, attempt, started_at, job_id, group_id, env_name, llm_model, status, total_reward, attempts "
            "FROM episodes WHERE episode_id IN (SELECT value FROM json_each(?))",
            (_dumps(list(meta)),),
        ):
            existing[eid] = rest
        cur: dict[str, int] = {}
        raised: list[tuple[str, int]] = []  # episodes whose current attempt went up
        for eid, m in meta.items():
            old = existing.get(eid)
            if old is None:
                cur[eid] = m.batch_max
            elif m.batch_max > old[0]:
                cur[eid] = m.batch_max
                raised.append((eid, m.batch_max))
            else:
                cur[eid] = old[0]

        if steps:
            env_state: dict[Any, str] = {}  # weight_version -> its env_state JSON, per batch
            msg_json: dict = {}  # message -> its JSON, per batch
            rows = []
            append = rows.append
            for s in steps:
                wv = s.weight_version
                if wv is None:
                    es = None
                elif type(wv) is str or type(wv) is int:
                    es = env_state.get(wv)
                    if es is None:
                        es = env_state[wv] = _dumps({"weight_version": wv})
                else:  # not per the schema; keep it readable rather than fail the batch
                    es = _dumps({"weight_version": wv})
                    wv = wv if isinstance(wv, (int, float)) else _dumps(wv)
                append(
                    (
                        s.job_id, s.env_id, s.step_id, s.env_name, s.llm_model, s.group_id,
                        s.messages_json.decode(), s.response, float(s.step_reward or 0.0),
                        float(s.cumulative_reward or 0.0), es, wv, 1 if s.terminated else 0,
                        1 if s.truncated else 0, 1 if s.episode_finished else 0,
                        1 if s.is_trainable else 0, s.created_at, s.attempt,
                        1 if s.attempt < cur[s.env_id] else 0, s.finish_reason,
                        s.env_latency_s, s.model_latency_s,
                    )
                )
            inserted += c.executemany(_INSERT_STEP, rows).rowcount

        if raised:
            c.executemany(
                "UPDATE session_steps SET superseded = 1 WHERE env_id = ? AND attempt < ? AND superseded = 0",
                raised,
            )

        if closes:
            inserted += c.executemany(
                _INSERT_ATTEMPT,
                [
                    (a.episode_id, a.attempt, a.job_id, a.status, a.reason, a.error_class, a.error,
                     float(a.total_reward or 0.0), a.steps, a.started_at, a.finished_at, a.worker)
                    for a in closes
                ],
            ).rowcount
            done = [a for a in closes if a.status == COMPLETED]
            if done:
                c.executemany(
                    _UPGRADE_ATTEMPT,
                    [
                        (a.job_id, a.status, a.reason, a.error_class, a.error, float(a.total_reward or 0.0),
                         a.steps, a.started_at, a.finished_at, a.worker, a.episode_id, a.attempt)
                        for a in done
                    ],
                )

        # ---- episodes: recompute each touched one, once, from one query.
        now = time.time()
        ep_rows = []
        # Groups to recompute: those where a member appeared, changed status or (completed)
        # changed reward, or learned its size. group_id -> [job_id, env_name, size seen in batch]
        groups: dict[str, list] = {}
        for (eid, n, rsum, c_status, c_total, reason, error_class, error, c_finished) in c.execute(
            _EPISODE_FACTS, (_dumps([[eid, att] for eid, att in cur.items()]),)
        ):
            m = meta[eid]
            old = existing.get(eid)
            if old is None:
                job_id, group_id, env_name, llm_model, started = m.job_id, m.group_id, m.env_name, m.llm_model, m.started_min
            else:
                job_id, group_id, env_name, llm_model = old[2], old[3], old[4], old[5]
                started = old[1] if m.started_min is None or (old[1] is not None and old[1] <= m.started_min) else m.started_min
            if c_status is None:
                status, total, finished = EP_RUNNING, rsum or 0.0, None
                reason = error_class = error = None
            else:
                status = _EPISODE_STATUS.get(c_status, EP_RETRYING)
                total = c_total if c_total is not None else (rsum or 0.0)
                finished = c_finished if (status == EP_COMPLETED or status == EP_FAILED) else None
                reason, error_class, error = reason or None, error_class or None, error or None
            if old is None:
                n_attempts = len(m.attempts)  # the episode's first records are all in this batch
            elif len(m.attempts) == 1 and old[0] in m.attempts:
                n_attempts = old[8]  # nothing but the current attempt again
            else:
                (n_attempts,) = c.execute(_ATTEMPTS_SEEN, (eid,)).fetchone()
            duration = max(0.0, finished - started) if (finished is not None and started is not None) else None
            ep_rows.append(
                (eid, job_id, group_id, env_name, llm_model, status, cur[eid], n_attempts or 1, total, n or 0,
                 reason, error_class, error, started, finished, duration, now)
            )
            if (
                old is None
                or m.group_size
                or status != old[6]
                or (status == EP_COMPLETED and total != old[7])
            ):
                g = groups.get(group_id)
                if g is None:
                    groups[group_id] = [job_id, env_name, m.group_size]
                elif m.group_size > g[2]:
                    g[2] = m.group_size
        c.executemany(_UPSERT_EPISODE, ep_rows)

        # ---- groups: recompute each touched one, once.
        groups.pop(None, None)
        if groups:
            gkeys = _dumps(list(groups))
            for gid, size in c.execute(
                "SELECT group_id, size FROM groups WHERE group_id IN (SELECT value FROM json_each(?))", (gkeys,)
            ):
                if size and size > groups[gid][2]:
                    groups[gid][2] = size
            members: dict[str, list] = {gid: [[], []] for gid in groups}  # completed rewards, failed (id, reason)
            for gid, ep_id, st, tr, reason in c.execute(
                "SELECT group_id, episode_id, status, total_reward, reason FROM episodes "
                "WHERE group_id IN (SELECT value FROM json_each(?)) ORDER BY group_id, episode_id",
                (gkeys,),
            ):
                if st == EP_COMPLETED:
                    members[gid][0].append(float(tr or 0.0))
                elif st == EP_FAILED:
                    members[gid][1].append((ep_id, reason))
            g_rows = []
            for gid, (job_id, env_name, size) in groups.items():
                done_rewards, failed = members[gid]
                nc = len(done_rewards)
                if nc:
                    mean = sum(done_rewards) / nc
                    std = math.sqrt(sum((x - mean) ** 2 for x in done_rewards) / nc)
                else:
                    mean = std = None
                complete = 1 if size > 0 and nc >= size and not failed else 0
                if failed:
                    ep_id, reason = failed[0]
                    why = f"episode {ep_id} failed: {reason or 'unknown'}"
                    if len(failed) > 1:
                        why += f" (+{len(failed) - 1} more failed)"
                else:
                    why = None
                g_rows.append((gid, job_id, env_name, size, nc, len(failed), mean, std, complete, why))
            c.executemany(_UPSERT_GROUP, g_rows)
        return inserted

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ reading

    def _q(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def job_ids(self) -> list[str]:
        """Every job with a JobSpec or at least one episode, oldest first."""
        rows = self._q(
            "SELECT job_id, MIN(t) FROM (SELECT job_id, created_at AS t FROM jobs "
            "UNION ALL SELECT job_id, started_at AS t FROM episodes) GROUP BY job_id ORDER BY MIN(t), job_id"
        )
        return [r[0] for r in rows]

    def job(self, job_id: str) -> dict | None:
        rows = self._q("SELECT spec FROM jobs WHERE job_id = ?", (job_id,))
        return json.loads(rows[0][0]) if rows else None

    def results(self, job_id: str) -> dict:
        """Summary counts of one job (see the module docstring for what counts)."""
        spec = self.job(job_id) or {}
        counts = dict(
            self._q("SELECT status, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY status", (job_id,))
        )
        # episodes.steps counts the stored steps of the current attempt, i.e. the job's
        # non-superseded session_steps rows (without reading those multi-KB rows).
        (n_steps,) = self._q("SELECT COALESCE(SUM(steps), 0) FROM episodes WHERE job_id = ?", (job_id,))[0]
        (mean_reward,) = self._q(
            "SELECT AVG(total_reward) FROM episodes WHERE job_id = ? AND status = 'completed'", (job_id,)
        )[0]
        (n_attempts,) = self._q("SELECT COALESCE(SUM(attempts), 0) FROM episodes WHERE job_id = ?", (job_id,))[0]
        # Completed episodes whose stored steps are fewer than their AttemptRecord reports (steps
        # still in flight, e.g. redelivered after the close): transient; nonzero for long = lost.
        (short,) = self._q(
            "SELECT COUNT(*) FROM episodes e JOIN attempts a ON a.episode_id = e.episode_id AND a.attempt = e.attempt "
            "WHERE e.job_id = ? AND e.status = 'completed' AND e.steps < a.steps",
            (job_id,),
        )[0]
        by_env = {}
        for env, n, comp, fail, mean, lo, hi in self._q(
            "SELECT env_name, COUNT(*), SUM(status = 'completed'), SUM(status = 'failed'), "
            "AVG(CASE WHEN status = 'completed' THEN total_reward END), "
            "MIN(CASE WHEN status = 'completed' THEN total_reward END), "
            "MAX(CASE WHEN status = 'completed' THEN total_reward END) "
            "FROM episodes WHERE job_id = ? GROUP BY env_name ORDER BY env_name",
            (job_id,),
        ):
            by_env[env] = {"episodes": n, "completed": comp or 0, "failed": fail or 0, "mean": mean, "min": lo, "max": hi}
        total, complete, with_failure, mean_std, zero_std = self._q(
            "SELECT COUNT(*), COALESCE(SUM(complete), 0), SUM(incomplete_reason IS NOT NULL), "
            "AVG(CASE WHEN complete = 1 THEN reward_std END), "
            "SUM(complete = 1 AND reward_std = 0) FROM groups WHERE job_id = ?",
            (job_id,),
        )[0]
        return {
            "job": {
                "job_id": job_id,
                "model": spec.get("model"),
                "created_at": spec.get("created_at"),
                "episodes_expected": spec.get("episodes"),
                "groups_expected": spec.get("groups"),
                "episodes": sum(counts.values()),
                "completed": counts.get(EP_COMPLETED, 0),
                "failed": counts.get(EP_FAILED, 0),
                "running": counts.get(EP_RUNNING, 0),
                "retrying": counts.get(EP_RETRYING, 0),
                "attempts": n_attempts,
                "steps": n_steps,
                "short_trajectories": short,
                "mean_reward": mean_reward,
            },
            "by_env": by_env,
            "groups": {
                "total": total,
                "complete": complete,
                "incomplete": total - complete,
                "failed": with_failure or 0,  # incomplete for good: a member was dead-lettered
                "mean_std": mean_std,  # over complete groups
                "zero_std": zero_std or 0,  # complete groups with no reward spread (no GRPO signal)
            },
        }

    def episode(self, episode_id: str) -> dict | None:
        with self._lock:
            cur = self._conn.execute("SELECT * FROM episodes WHERE episode_id = ?", (episode_id,))
            row = cur.fetchone()
            names = [d[0] for d in cur.description]
        return dict(zip(names, row)) if row else None

    def group(self, group_id: str) -> dict | None:
        with self._lock:
            cur = self._conn.execute("SELECT * FROM groups WHERE group_id = ?", (group_id,))
            row = cur.fetchone()
            names = [d[0] for d in cur.description]
        return dict(zip(names, row)) if row else None

    def groups(self, job_id: str) -> list[dict]:
        """Every group of a job: size, completed, failed, reward mean and std, complete or why not."""
        with self._lock:
            cur = self._conn.execute("SELECT * FROM groups WHERE job_id = ? ORDER BY group_id", (job_id,))
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def attempts(self, episode_id: str) -> list[dict]:
        with self._lock:
            cur = self._conn.execute("SELECT * FROM attempts WHERE episode_id = ? ORDER BY attempt", (episode_id,))
            rows = cur.fetchall()
            names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in rows]

    def episode_trajectory(self, episode_id: str) -> list[dict]:
        """The episode's non-superseded steps in step order (messages and env_state decoded)."""
        with self._lock:
            cur = self._conn.execute(
                "SELECT * FROM session_steps WHERE env_id = ? AND superseded = 0 ORDER BY attempt, step_id",
                (episode_id,),
            )
            rows = cur.fetchall()
            names = [d[0] for d in cur.description]
        out = []
        for r in rows:
            d = dict(zip(names, r))
            d["messages"] = json.loads(d["messages"]) if d["messages"] is not None else None
            d["env_state"] = json.loads(d["env_state"]) if d["env_state"] is not None else None
            for k in ("terminated", "truncated", "episode_finished", "is_trainable", "superseded"):
                d[k] = bool(d[k])
            out.append(d)
        return out

    def connection(self) -> sqlite3.Connection:
        """The underlying connection, for readers (export). Hold ``store.lock`` while using it
        from several threads."""
        return self._conn

    @property
    def lock(self):
        return self._lock
