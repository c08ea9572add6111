"""The results store: a small base class, one module per backend (``sqlite``, ``postgres``).

Shaped like dramatiq's result backends: :class:`ResultStore` implements what callers use, in
terms of a few primitives each backend provides (a transaction, queries, its DDL). The same
SQL runs on both backends: written with ``?`` placeholders (PostgreSQL's module swaps them),
the original tables' flags written as Python booleans (BOOLEAN on PostgreSQL, 0/1 in SQLite;
``WHERE is_session_completed`` and the original documentation's ``= 1`` work on both, and our
own queries test them bare), timestamps written by the database from epoch seconds.

Text: a NUL character (which PostgreSQL's text type cannot hold) is stored as U+FFFD on both
backends, so that they store the same and a model answer or an env error holding one is not
refused as bad data (:func:`_nul_free`).

Writer: :meth:`ResultStore.write_batch` (the consumer, one transaction per batch; the
rules are in :mod:`consumer.storage.plan`). Reader: every other public method (``interactor
results``, ``export``, ``status``, the results browser). No caller outside this package
touches a connection or writes SQL.

Tables (docs/protocol.md, "What is stored"):

* ``job_environments``, ``session_steps``: the original system's, column for column (plus
  extra columns of ours on ``session_steps``: attempt, attempt_id, weight_version, finish_reason,
  ended_by, latencies, token counts, created_ts).
* ``superseded_steps``: step rows that are not an episode's trajectory, with the reason.
* ``episodes``, ``attempts``, ``groups``, ``jobs``: our bookkeeping.
* ``step_tokens``, ``attempt_phases``: additive tables of ours (consumer/storage/tokens.py,
  phases.py), created by a writer that opens a store lacking them; no schema version.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import orjson

from broker.records import PHASES, AttemptRecord, EpisodesEnqueued, JobSpec, StepRecord
from broker.settings import redact_url
from consumer.storage import phases as attempt_phases_table
from consumer.storage import tokens as step_tokens_table
from consumer.storage.group_stats import reward_mean_std
from consumer.storage.plan import (
    EP_COMPLETED,
    EP_COMPLETING,
    EP_FAILED,
    EP_RETRYING,
    EP_RUNNING,
    STEPS_LOST,
    Batch,
    EpisodeState,
    Plan,
    lost_completion,
    plan_batch,
    settle,
)

log = logging.getLogger("interactor.store")

SCHEMA_VERSION = 3

STEP_COLUMNS = (
    "session_id", "step_id", "env_name", "llm_model", "group_id", "job_id", "messages", "response",
    "step_reward", "reward", "env_state", "is_terminal", "is_truncated", "is_session_completed",
    "is_trainable", "created_at", "attempt", "attempt_id", "weight_version", "finish_reason", "ended_by",
    "env_latency_s", "model_latency_s", "prompt_tokens", "completion_tokens", "created_ts",
)
_STEP_COLS = ", ".join(STEP_COLUMNS)

# Indexes the results browser pages through (ResultStore.page_episodes): a page of a job's
# episodes in episode_id or reward order is one range read at any depth. Part of each
# backend's schema; a writer opening a store made before them creates them (no schema version:
# older code reads and writes the same tables). Only two, because the consumer rewrites an
# episode row on every batch that touches it and SQLite updates every index of the row: with
# one-step episodes (every record a new or closing episode) these two cost about 4% of
# write_batch throughput, six (steps, attempts, duration, started too) cost 29%; with 20-step
# episodes neither is measurable.
BROWSE_INDEXES = (
    ("episodes_job_episode", "CREATE INDEX IF NOT EXISTS episodes_job_episode ON episodes (job_id, episode_id)"),
    ("episodes_job_reward",
     "CREATE INDEX IF NOT EXISTS episodes_job_reward ON episodes (job_id, total_reward, episode_id)"),
)

EPISODE_COLUMNS = EpisodeState.COLUMNS + ("duration_s", "updated_at")
ATTEMPT_COLUMNS = ("episode_id", "attempt_id", "attempt", "job_id", "status", "reason", "error_class", "error",
                   "total_reward", "steps", "ended_by", "prompt_tokens", "completion_tokens", "started_at",
                   "finished_at", "worker")


class StoreError(RuntimeError):
    """The store cannot be opened or used (bad URL, newer schema, missing driver)."""


@dataclass
class WriteResult:
    records: int = 0
    session_steps: int = 0  # rows offered to session_steps (duplicates are ignored by the database)
    superseded_steps: int = 0
    completing: list[tuple[str, str, str]] = field(default_factory=list)  # (episode, attempt_id, close entry)
    # (job, episode): dead-lettered by the ledger after another attempt's completion was stored
    # (a Redis rollback re-ran a completed episode); the ledger is told it is done.
    failed_after_completion: list[tuple[str, str]] = field(default_factory=list)


class ResultStore:
    """Base class of the backends. Subclasses provide the primitives marked below."""

    #: SQL expression turning an epoch-seconds parameter into the backend's timestamp type.
    TS: str = "?"
    url: str = ""

    # --- primitives (each backend) -------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[None]:  # pragma: no cover - backend
        raise NotImplementedError
        yield

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:  # pragma: no cover - backend
        """Run one statement; returns the rows it changed."""
        raise NotImplementedError

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:  # pragma: no cover
        raise NotImplementedError

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:  # pragma: no cover - backend
        raise NotImplementedError

    def query_dicts(self, sql: str, args: Sequence[Any] = ()) -> list[dict]:  # pragma: no cover
        raise NotImplementedError

    def has_table(self, table: str) -> bool:  # pragma: no cover - backend
        """Whether the store has an additive table (step_tokens, attempt_phases): a store made
        before one, and not yet opened by a writer of this code, has not."""
        raise NotImplementedError

    def lock_episodes(self, episode_ids: Sequence[str]) -> None:
        """Hold the episodes' rows until the transaction ends (several writers at once).
        SQLite has one writer at a time, so its version does nothing."""

    def lock_groups(self, group_ids: Sequence[str]) -> None:
        """As :meth:`lock_episodes`, for group rows."""

    def close(self) -> None:  # pragma: no cover - backend
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ writing
    def write_batch(self, records: Iterable[Any], entry_ids: Sequence[str] | None = None) -> WriteResult:
        """Store a batch in one transaction (plan: :mod:`consumer.storage.plan`). Storing the
        same batch again changes nothing. ``entry_ids``: the records' stream ids, kept with a
        completion so that lost steps can be told from late ones."""
        records = list(records)
        batch = Batch.collect(records, entry_ids)
        result = WriteResult(records=len(records))
        with self.transaction():
            if batch.jobs:
                self._write_jobs(batch.jobs)
            if batch.announced:
                self._write_announced(batch.announced)
            if batch.events:
                plan = self._write_episodes(batch)
                result.session_steps = len(plan.session_steps)
                result.superseded_steps = len(plan.superseded_steps)
                result.completing = [(st.episode_id, st.completed_attempt_id, st.close_entry)
                                     for st in plan.states.values() if st.status == EP_COMPLETING]
                result.failed_after_completion = list(plan.failed_after_completion)
        return result

    def _write_jobs(self, jobs: list[JobSpec]) -> None:
        # A job id the store already holds under another creation time: Redis forgot the first
        # run (its keys expired after the retention) and the id was submitted again. The first
        # run's rows stay; the new run's episodes share their ids, so their completions are
        # filed completed_by_other (README, limits). Said loudly, once per submission.
        ids = [j.job_id for j in jobs]
        held = dict(self.query(f"SELECT job_id, created_at FROM jobs WHERE job_id IN ({_marks(ids)})", ids))
        for j in jobs:
            if j.job_id in held and held[j.job_id] is not None and j.created_at is not None \
                    and abs(float(held[j.job_id]) - float(j.created_at)) > 1e-6:
                log.warning("job %s was submitted again after the store recorded it (created %s, now %s): the "
                            "store keeps the first run, the new run's episodes are stored as completed_by_other; "
                            "use a new job id", j.job_id, held[j.job_id], j.created_at)
        self.executemany(
            "INSERT INTO jobs (job_id, created_at, episodes, groups, model, llm_base_url, sources, spec) "
            "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (job_id) DO NOTHING",
            # URLs with their passwords starred: the database is read by more people than Redis.
            [_clean((j.job_id, j.created_at, j.episodes, j.groups, j.model, redact_url(j.llm_base_url),
                     _json(j.sources), _json(j.to_dict() | {"llm_base_url": redact_url(j.llm_base_url)})))
             for j in jobs],
        )

    def _write_announced(self, announced: list[EpisodesEnqueued]) -> None:
        rows = []
        for a in announced:
            for env_id, env_name, group_id, params in a.episodes:
                text = params.decode() if isinstance(params, (bytes, bytearray)) else _json(params)
                rows.append(_clean((a.job_id, env_id, env_name, text, group_id, a.created_at)))
        self.executemany(
            "INSERT INTO job_environments (job_id, env_id, env_name, env_params, image, group_id, finished, "
            f"is_deleted, created_at) VALUES (?, ?, ?, ?, NULL, ?, FALSE, FALSE, {self.TS}) "
            "ON CONFLICT (env_id) DO NOTHING",
            rows,
        )

    def _write_episodes(self, batch: Batch) -> Plan:
        ids = batch.episode_ids
        self.lock_episodes(ids)
        plan = plan_batch(batch, self._load_states(ids))
        now = time.time()
        for episode_id, attempt_id, reason in plan.moves:
            self._move_steps(episode_id, attempt_id, reason, now)
        for episode_id, attempt_id in plan.restores:
            self._restore_steps(episode_id, attempt_id)
        if plan.session_steps:
            self.executemany(
                f"INSERT INTO session_steps ({_STEP_COLS}) VALUES ({self._step_values()}) "
                "ON CONFLICT (session_id, step_id) DO NOTHING",
                [_step_row(s) for s in plan.session_steps],
            )
        if plan.superseded_steps:
            self.executemany(
                f"INSERT INTO superseded_steps ({_STEP_COLS}, superseded_reason, superseded_at) "
                f"VALUES ({self._step_values()}, ?, ?) ON CONFLICT (session_id, attempt_id, step_id) DO NOTHING",
                [_step_row(s) + (_nul_free(reason), now) for s, reason in plan.superseded_steps],
            )
        # Token rows of every step that asked, trajectory or set aside: keyed by attempt, they
        # never move (consumer/storage/tokens.py).
        token_rows = step_tokens_table.rows(
            [*plan.session_steps, *(s for s, _ in plan.superseded_steps)])
        if token_rows:
            self.executemany(step_tokens_table.INSERT, token_rows)
        if plan.closes:
            self._write_closes(plan.closes)
        stored = self._stored_steps(plan.episodes_to_count())
        for st in plan.states.values():
            settle(st, stored.get(st.episode_id))
        self._save_states(plan, now)
        return plan

    def _step_values(self) -> str:
        return ", ".join(self.TS if c == "created_at" else "?" for c in STEP_COLUMNS)

    def _move_steps(self, episode_id: str, attempt_id: str, reason: str, now: float) -> None:
        self.execute(
            f"INSERT INTO superseded_steps ({_STEP_COLS}, superseded_reason, superseded_at) "
            f"SELECT {_STEP_COLS}, CAST(? AS TEXT), CAST(? AS DOUBLE PRECISION) FROM session_steps "
            "WHERE session_id = ? AND attempt_id = ? "
            "ON CONFLICT (session_id, attempt_id, step_id) DO NOTHING",
            (reason, now, episode_id, attempt_id),
        )
        self.execute("DELETE FROM session_steps WHERE session_id = ? AND attempt_id = ?", (episode_id, attempt_id))

    def _restore_steps(self, episode_id: str, attempt_id: str) -> None:
        """An attempt's rows back from superseded_steps (its completion was taken after they
        had been set aside); rows set aside because the steps were lost stay there."""
        where = "WHERE session_id = ? AND attempt_id = ? AND superseded_reason <> ?"
        args = (episode_id, attempt_id, STEPS_LOST)
        self.execute(f"INSERT INTO session_steps ({_STEP_COLS}) SELECT {_STEP_COLS} FROM superseded_steps {where} "
                     "ON CONFLICT (session_id, step_id) DO NOTHING", args)
        self.execute(f"DELETE FROM superseded_steps {where}", args)

    def _write_closes(self, closes: list[AttemptRecord]) -> None:
        cols = ", ".join(ATTEMPT_COLUMNS)
        marks = ", ".join("?" for _ in ATTEMPT_COLUMNS)
        # A 'completed' close wins over any other close of the same attempt; otherwise the
        # first one stored is kept.
        updates = ", ".join(f"{c} = excluded.{c}" for c in ATTEMPT_COLUMNS[2:])
        self.executemany(
            f"INSERT INTO attempts ({cols}) VALUES ({marks}) ON CONFLICT (episode_id, attempt_id) DO UPDATE SET "
            f"{updates} WHERE excluded.status = 'completed' AND attempts.status <> 'completed'",
            [_clean((c.episode_id, c.attempt_id, c.attempt, c.job_id, c.status, c.reason, c.error_class, c.error,
                     float(c.total_reward or 0.0), c.steps, c.ended_by or None, c.prompt_tokens, c.completion_tokens,
                     c.started_at, c.finished_at, c.worker)) for c in closes],
        )
        # where each attempt's time went (records v5), kept by the same rule (consumer/storage/phases.py)
        phase_rows = attempt_phases_table.rows(closes)
        if phase_rows:
            self.executemany(attempt_phases_table.INSERT, phase_rows)

    def _load_states(self, ids: Sequence[str]) -> dict[str, EpisodeState]:
        out: dict[str, EpisodeState] = {}
        cols = ", ".join(EpisodeState.COLUMNS)
        for chunk in _chunks(ids, 500):
            for row in self.query(f"SELECT {cols} FROM episodes WHERE episode_id IN ({_marks(chunk)})", chunk):
                out[row[0]] = EpisodeState.from_row(row)
        return out

    def _stored_steps(self, ids: Sequence[str]) -> dict[str, tuple]:
        out = {}
        for chunk in _chunks(ids, 500):
            for eid, n, r, p, c in self.query(
                "SELECT session_id, COUNT(*), COALESCE(SUM(step_reward), 0), COALESCE(SUM(prompt_tokens), 0), "
                f"COALESCE(SUM(completion_tokens), 0) FROM session_steps WHERE session_id IN ({_marks(chunk)}) "
                "GROUP BY session_id", chunk,
            ):
                out[eid] = (int(n), float(r), int(p), int(c))
        return out

    def _save_states(self, plan: Plan, now: float) -> None:
        cols = ", ".join(EPISODE_COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in EPISODE_COLUMNS[1:])
        self.executemany(
            f"INSERT INTO episodes ({cols}) VALUES ({_marks(EPISODE_COLUMNS)}) "
            f"ON CONFLICT (episode_id) DO UPDATE SET {updates}",
            [_clean(st.row(now)) for st in plan.states.values()],
        )
        flips = [(st.status == EP_COMPLETED, st.episode_id) for st in plan.states.values()
                 if (st.status == EP_COMPLETED) != (st.loaded_status == EP_COMPLETED)]
        if flips:
            self.executemany("UPDATE job_environments SET finished = ? WHERE env_id = ?", flips)
        groups = {}
        for st in plan.states.values():
            if (st.new or st.status != st.loaded_status or st.group_size
                    or (st.status == EP_COMPLETED and st.total_reward != st.loaded_reward)):
                g = groups.setdefault(st.group_id, [st.job_id, st.env_name, 0])
                g[2] = max(g[2], st.group_size)
        groups.pop(None, None)
        if groups:
            self._refresh_groups(groups)

    def _refresh_groups(self, groups: dict[str, list]) -> None:
        """Recompute each touched group from its members, once per batch."""
        ids = sorted(groups)
        self.lock_groups(ids)
        for chunk in _chunks(ids, 500):
            # A group's size: what its closes said, or how many episodes were enqueued in it.
            for gid, size in self.query(f"SELECT group_id, size FROM groups WHERE group_id IN ({_marks(chunk)})", chunk):
                if size and size > groups[gid][2]:
                    groups[gid][2] = size
            for gid, n in self.query(f"SELECT group_id, COUNT(*) FROM job_environments WHERE group_id IN "
                                     f"({_marks(chunk)}) GROUP BY group_id", chunk):
                if n > groups[gid][2]:
                    groups[gid][2] = int(n)
        members: dict[str, list] = {gid: [[], []] for gid in ids}  # completed rewards, failed (id, reason)
        for chunk in _chunks(ids, 500):
            for gid, ep_id, st, tr, reason in self.query(
                "SELECT group_id, episode_id, status, total_reward, reason FROM episodes "
                f"WHERE group_id IN ({_marks(chunk)}) ORDER BY group_id, episode_id", chunk,
            ):
                if st == EP_COMPLETED:
                    members[gid][0].append(float(tr or 0.0))
                elif st == EP_FAILED:
                    members[gid][1].append((ep_id, reason))
        rows = []
        for gid in ids:
            job_id, env_name, size = groups[gid]
            done, failed = members[gid]
            nc = len(done)
            mean, std = reward_mean_std(done)
            complete = 1 if size > 0 and nc >= size and not failed else 0
            why = None
            if failed:
                why = f"episode {failed[0][0]} failed: {failed[0][1] or 'unknown'}"
                if len(failed) > 1:
                    why += f" (+{len(failed) - 1} more failed)"
            rows.append((gid, job_id, env_name, size, nc, len(failed), mean, std, complete, why))
        self.executemany(
            "INSERT INTO groups (group_id, job_id, env_name, size, completed, failed, reward_mean, reward_std, "
            "complete, incomplete_reason) VALUES (?,?,?,?,?,?,?,?,?,?) ON CONFLICT (group_id) DO UPDATE SET "
            "job_id = excluded.job_id, env_name = excluded.env_name, size = excluded.size, "
            "completed = excluded.completed, failed = excluded.failed, reward_mean = excluded.reward_mean, "
            "reward_std = excluded.reward_std, complete = excluded.complete, "
            "incomplete_reason = excluded.incomplete_reason",
            rows,
        )

    def reopen_lost_completion(self, episode_id: str, attempt_id: str, *, max_reopens: int | None = None,
                               poisoned: bool = False) -> str:
        """A completion whose steps never all arrived: set its rows aside and put the episode
        back to ``retrying`` (the consumer re-queues it), or to ``failed`` (reason
        ``steps_lost``) when a missing step is in the poison stream (``poisoned``) or the
        episode was already reopened ``max_reopens`` times (:func:`plan.lost_completion`).
        Returns the new status; "" when the episode is no longer completing under that
        attempt."""
        with self.transaction():
            self.lock_episodes([episode_id])
            st = self._load_states([episode_id]).get(episode_id)
            if st is None or st.status != EP_COMPLETING or st.completed_attempt_id != attempt_id:
                return ""
            now = time.time()
            self._move_steps(episode_id, attempt_id, STEPS_LOST, now)
            status = lost_completion(st, max_reopens=max_reopens, poisoned=poisoned)
            if status == EP_FAILED:
                st.finished_at = now
            self._save_states(Plan(states={episode_id: st}), now)
        return status

    # ------------------------------------------------------------------ reading
    def job_ids(self) -> list[str]:
        """Every job known to the store, oldest first."""
        rows = self.query(
            "SELECT job_id, MIN(t) FROM (SELECT job_id, created_at AS t FROM jobs "
            "UNION ALL SELECT job_id, started_at AS t FROM episodes) u GROUP BY job_id ORDER BY MIN(t), job_id"
        )
        return [r[0] for r in rows]

    def job(self, job_id: str) -> dict | None:
        rows = self.query("SELECT spec FROM jobs WHERE job_id = ?", (job_id,))
        return orjson.loads(rows[0][0]) if rows and rows[0][0] else None

    def jobs(self, limit: int = 100) -> list[dict]:
        """The most recent jobs with their counts: the results browser's first page."""
        out = []
        for job_id in self.job_ids()[-limit:][::-1]:
            res = self.results(job_id)
            out.append(res["job"] | {"groups": res["groups"]})
        return out

    def results(self, job_id: str) -> dict:
        """One job's summary: episodes per status, steps, rewards per env_name, groups."""
        spec = self.job(job_id) or {}
        counts = dict(self.query("SELECT status, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY status", (job_id,)))
        (n_steps, n_attempts, p_tok, c_tok, first, last) = self.query(
            "SELECT COALESCE(SUM(steps), 0), COALESCE(SUM(attempts), 0), COALESCE(SUM(prompt_tokens), 0), "
            "COALESCE(SUM(completion_tokens), 0), MIN(started_at), MAX(finished_at) FROM episodes WHERE job_id = ?",
            (job_id,))[0]
        (mean_reward,) = self.query(
            "SELECT AVG(total_reward) FROM episodes WHERE job_id = ? AND status = 'completed'", (job_id,))[0]
        (announced,) = self.query("SELECT COUNT(*) FROM job_environments WHERE job_id = ?", (job_id,))[0]
        # Why the completed episodes ended (broker.records.ENDED_BY): a prompt outgrowing the
        # model's context shows here as context_length.
        ended_by = {why or "unknown": int(n) for why, n in self.query(
            "SELECT ended_by, COUNT(*) FROM episodes WHERE job_id = ? AND status = 'completed' GROUP BY ended_by "
            "ORDER BY COUNT(*) DESC, ended_by", (job_id,))}
        by_env = {}
        for env, n, comp, fail, mean, lo, hi, pt, ct in self.query(
            "SELECT env_name, COUNT(*), SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN status = 'failed' THEN 1 ELSE 0 END), "
            "AVG(CASE WHEN status = 'completed' THEN total_reward END), "
            "MIN(CASE WHEN status = 'completed' THEN total_reward END), "
            "MAX(CASE WHEN status = 'completed' THEN total_reward END), "
            "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) "
            "FROM episodes WHERE job_id = ? GROUP BY env_name ORDER BY env_name",
            (job_id,),
        ):
            by_env[env] = {"episodes": n, "completed": int(comp or 0), "failed": int(fail or 0), "mean": mean,
                           "min": lo, "max": hi, "prompt_tokens": int(pt), "completion_tokens": int(ct)}
        total, complete, with_failure, mean_std, zero_std = self.query(
            "SELECT COUNT(*), COALESCE(SUM(complete), 0), "
            "SUM(CASE WHEN incomplete_reason IS NOT NULL THEN 1 ELSE 0 END), "
            "AVG(CASE WHEN complete = 1 THEN reward_std END), "
            "SUM(CASE WHEN complete = 1 AND reward_std = 0 THEN 1 ELSE 0 END) FROM groups WHERE job_id = ?",
            (job_id,),
        )[0]
        started = sum(counts.values())
        expected = spec.get("episodes")
        tokens = int(p_tok) + int(c_tok)
        span = (last - first) if first is not None and last is not None and last > first else None
        return {
            "job": {
                "job_id": job_id,
                "model": spec.get("model"),
                "created_at": spec.get("created_at"),
                "episodes_expected": expected,
                "groups_expected": spec.get("groups"),
                "episodes": started,
                "announced": int(announced),
                "queued": max(0, (expected or announced or 0) - started),
                "completed": counts.get(EP_COMPLETED, 0),
                "failed": counts.get(EP_FAILED, 0),
                "running": counts.get(EP_RUNNING, 0),
                "retrying": counts.get(EP_RETRYING, 0),
                "completing": counts.get(EP_COMPLETING, 0),
                "attempts": int(n_attempts),
                "steps": int(n_steps),
                "short_trajectories": counts.get(EP_COMPLETING, 0),
                "mean_reward": mean_reward,
                "prompt_tokens": int(p_tok),
                "completion_tokens": int(c_tok),
                "tokens_per_episode": tokens / started if started else None,
                "tokens_per_s": tokens / span if span else None,
                "ended_by": ended_by,
            },
            "by_env": by_env,
            # token-exact trajectories (jobs run with tokens): None when no step asked
            "token_ids": self.token_summary(job_id),
            # where the attempts' time went (attempt_phases): None when no attempt was timed
            "phases": self.phase_summary(job_id),
            "groups": {
                "total": int(total),
                "complete": int(complete),
                "incomplete": int(total) - int(complete),
                "failed": int(with_failure or 0),
                "mean_std": mean_std,
                "zero_std": int(zero_std or 0),
            },
        }

    def episode(self, episode_id: str) -> dict | None:
        rows = self.query_dicts("SELECT * FROM episodes WHERE episode_id = ?", (episode_id,))
        return rows[0] if rows else None

    def group(self, group_id: str) -> dict | None:
        rows = self.query_dicts("SELECT * FROM groups WHERE group_id = ?", (group_id,))
        return rows[0] if rows else None

    def groups(self, job_id: str) -> list[dict]:
        """Every group of a job: size, completed, failed, reward mean and std, complete or why not."""
        return self.query_dicts("SELECT * FROM groups WHERE job_id = ? ORDER BY group_id", (job_id,))

    def group_members(self, group_id: str) -> list[dict]:
        return self.query_dicts("SELECT * FROM episodes WHERE group_id = ? ORDER BY episode_id", (group_id,))

    def attempts(self, episode_id: str) -> list[dict]:
        """The episode's closed attempts, each with its phases' seconds (``<phase>_s``, None where
        not timed: records before v5, or a store no writer of this code has opened yet)."""
        if not self.has_table(attempt_phases_table.TABLE):
            return [d | dict.fromkeys(attempt_phases_table.PHASE_COLUMNS) for d in self.query_dicts(
                "SELECT * FROM attempts WHERE episode_id = ? ORDER BY attempt, started_at", (episode_id,))]
        cols = ", ".join(f"p.{c}" for c in attempt_phases_table.PHASE_COLUMNS)
        return self.query_dicts(
            f"SELECT a.*, {cols} FROM attempts a LEFT JOIN attempt_phases p ON p.episode_id = a.episode_id "
            "AND p.attempt_id = a.attempt_id WHERE a.episode_id = ? ORDER BY a.attempt, a.started_at", (episode_id,))

    def phase_summary(self, job_id: str) -> dict | None:
        """Where the job's attempts' time went (records v5, broker/records.py PHASES): per phase,
        the mean seconds per attempt over the attempts that timed it, how many did, and the
        total. None when no attempt of the job was timed (older records or store)."""
        if not self.has_table(attempt_phases_table.TABLE):
            return None
        cols = attempt_phases_table.PHASE_COLUMNS
        row = self.query(
            "SELECT COUNT(*), " + ", ".join(f"AVG({c}), COUNT({c}), SUM({c})" for c in cols)
            + " FROM attempt_phases WHERE job_id = ?", (job_id,))[0]
        if not row[0]:
            return None
        out: dict[str, Any] = {"attempts": int(row[0]), "mean_s": {}, "timed": {}, "total_s": {}}
        for i, phase in enumerate(PHASES):
            mean, n, total = row[1 + 3 * i: 4 + 3 * i]
            out["mean_s"][phase] = None if mean is None else float(mean)
            out["timed"][phase] = int(n)
            out["total_s"][phase] = float(total or 0.0)
        return out

    def episode_trajectory(self, episode_id: str) -> list[dict]:
        """The episode's trajectory (its session_steps rows) in step order, JSON decoded."""
        return [_decode_step(d) for d in self.query_dicts(
            "SELECT * FROM session_steps WHERE session_id = ? ORDER BY step_id", (episode_id,))]

    def superseded_steps(self, episode_id: str) -> list[dict]:
        """Rows of the episode's other attempts, with why they are not its trajectory."""
        return [_decode_step(d) for d in self.query_dicts(
            "SELECT * FROM superseded_steps WHERE session_id = ? ORDER BY attempt, attempt_id, step_id",
            (episode_id,))]

    def job_environments(self, job_id: str) -> list[dict]:
        return self.query_dicts("SELECT * FROM job_environments WHERE job_id = ? ORDER BY id", (job_id,))

    def completing(self, limit: int = 1000) -> list[tuple[str, str, str, str]]:
        """Completions still waiting for steps: (episode, job, attempt_id, close entry id)."""
        return [tuple(r) for r in self.query(
            "SELECT episode_id, job_id, completed_attempt_id, close_entry FROM episodes WHERE status = 'completing' "
            "ORDER BY updated_at LIMIT ?", (limit,))]

    # episodes, filtered, sorted and paged (results browser, exports)
    EPISODE_SORTS = {"episode_id": "episode_id", "reward": "total_reward", "steps": "steps", "status": "status",
                     "attempts": "attempts", "started": "started_at", "duration": "duration_s",
                     "env_name": "env_name", "group": "group_id"}

    def _episode_filter(self, job_id: str, env_names=None, statuses=None, reward_min=None, reward_max=None,
                        reason=None, attempts_min=None, group_id=None) -> tuple[str, list]:
        where, args = ["job_id = ?"], [job_id]
        if env_names:
            where.append(f"env_name IN ({_marks(env_names)})")
            args.extend(env_names)
        if statuses:
            where.append(f"status IN ({_marks(statuses)})")
            args.extend(statuses)
        if reward_min is not None:
            where.append("total_reward >= ?")
            args.append(float(reward_min))
        if reward_max is not None:
            where.append("total_reward <= ?")
            args.append(float(reward_max))
        if reason:
            where.append("(reason = ? OR ended_by = ?)")
            args.extend([reason, reason])
        if attempts_min is not None:
            where.append("attempts >= ?")
            args.append(int(attempts_min))
        if group_id:
            where.append("group_id = ?")
            args.append(group_id)
        return " AND ".join(where), args

    #: How each sort key compares in Python: a cursor value from a URL is turned back into it.
    EPISODE_SORT_TYPES = {"episode_id": str, "reward": float, "steps": int, "status": str, "attempts": int,
                          "started": float, "duration": float, "env_name": str, "group": str}
    #: Sorts backed by an index on (job_id, column, episode_id) (BROWSE_INDEXES): a page is one
    #: index seek at any depth. The others sort the job's matching rows (bounded top-N); more
    #: indexes on ``episodes`` would slow the consumer's upserts, measured in the docstring of
    #: BROWSE_INDEXES.
    INDEXED_EPISODE_SORTS = ("episode_id", "reward")

    def page_episodes(self, job_id: str, *, sort: str = "episode_id", descending: bool = False, limit: int = 50,
                      after: tuple[Any, str] | None = None, **filters: Any) -> list[dict]:
        """One page of a job's episodes by keyset: the ``limit`` rows that follow ``after`` (the
        ``(sort value, episode_id)`` of the previous page's last row; None: from the start).

        The order is total: the sort column, then episode_id; NULLs come first ascending and last
        descending (SQLite's own order, spelled out so that PostgreSQL pages the same way). Unlike
        OFFSET, a page deep in 100,000 episodes costs what the first one does. Going backwards is
        the same call with ``descending`` flipped and the page reversed.
        """
        col = self.EPISODE_SORTS.get(sort)
        if col is None:
            raise ValueError(f"unknown sort {sort!r}; one of {sorted(self.EPISODE_SORTS)}")
        where, args = self._episode_filter(job_id, **filters)
        return self._keyset_page("episodes", where, args, col, "episode_id", descending, after, limit)

    GROUP_SORTS = {"group_id": "group_id", "mean": "reward_mean", "std": "reward_std", "completed": "completed",
                   "failed": "failed", "env_name": "env_name"}
    GROUP_SORT_TYPES = {"group_id": str, "mean": float, "std": float, "completed": int, "failed": int,
                        "env_name": str}

    def _group_filter(self, job_id: str, env_names=None, complete=None, zero_std=None) -> tuple[str, list]:
        where, args = ["job_id = ?"], [job_id]
        if env_names:
            where.append(f"env_name IN ({_marks(env_names)})")
            args.extend(env_names)
        if complete is not None:
            where.append("complete = ?")
            args.append(1 if complete else 0)
        if zero_std:
            where.append("complete = 1 AND reward_std = 0")
        return " AND ".join(where), args

    def page_groups(self, job_id: str, *, sort: str = "group_id", descending: bool = False, limit: int = 50,
                    after: tuple[Any, str] | None = None, **filters: Any) -> list[dict]:
        """One page of a job's groups, by keyset as :meth:`page_episodes`. Filters: env_names,
        complete (True/False), zero_std (complete groups whose rewards are all equal)."""
        col = self.GROUP_SORTS.get(sort)
        if col is None:
            raise ValueError(f"unknown sort {sort!r}; one of {sorted(self.GROUP_SORTS)}")
        where, args = self._group_filter(job_id, **filters)
        return self._keyset_page("groups", where, args, col, "group_id", descending, after, limit)

    def count_groups(self, job_id: str, **filters: Any) -> int:
        where, args = self._group_filter(job_id, **filters)
        return int(self.query(f"SELECT COUNT(*) FROM groups WHERE {where}", args)[0][0])

    def _keyset_page(self, table: str, where: str, args: list, col: str, id_col: str, descending: bool,
                     after: tuple[Any, str] | None, limit: int) -> list[dict]:
        """Rows of ``table`` matching ``where`` that follow ``after`` in the order (col, id_col).

        The rows fall into two runs, the NULLs of ``col`` and its values, each read by one range
        query on an index of (job_id, col, id) (ascending: NULLs first; descending: values
        first), so a row-value comparison ``(col, id) > (?, ?)`` never meets a NULL.
        """
        limit = max(0, int(limit))
        if limit == 0:
            return []
        d = "DESC" if descending else "ASC"
        gt = "<" if descending else ">"
        runs: list[tuple[str, list, str]] = []  # (condition, args, order)
        if col == id_col:
            runs.append((f"{id_col} {gt} ?" if after is not None else "", [after[1]] if after is not None else [],
                         f"{id_col} {d}"))
        else:
            nulls = (f"{col} IS NULL", [], f"{id_col} {d}")
            values = (f"{col} IS NOT NULL", [], f"{col} {d}, {id_col} {d}")
            if after is None:
                runs = [values, nulls] if descending else [nulls, values]
            elif after[0] is None:
                runs = [(f"{col} IS NULL AND {id_col} {gt} ?", [after[1]], f"{id_col} {d}")]
                if not descending:
                    runs.append(values)
            else:
                runs = [(f"({col}, {id_col}) {gt} (?, ?)", [after[0], after[1]], f"{col} {d}, {id_col} {d}")]
                if descending:
                    runs.append(nulls)
        out: list[dict] = []
        for cond, extra, order in runs:
            sql = f"SELECT * FROM {table} WHERE {where}" + (f" AND {cond}" if cond else "")
            out += self.query_dicts(f"{sql} ORDER BY {order} LIMIT ?", (*args, *extra, limit - len(out)))
            if len(out) >= limit:
                break
        return out

    def job_progress(self, job_id: str) -> dict:
        """What the jobs page polls: episodes per status, steps, mean reward and the time span,
        in one pass over the job's rows (:meth:`results` makes five)."""
        out = {"job_id": job_id, "statuses": {}, "steps": 0, "reward_sum": 0.0, "first_started": None,
               "last_finished": None}
        for status, n, steps, reward, first, last in self.query(
            "SELECT status, COUNT(*), COALESCE(SUM(steps), 0), COALESCE(SUM(total_reward), 0), MIN(started_at), "
            "MAX(finished_at) FROM episodes WHERE job_id = ? GROUP BY status", (job_id,),
        ):
            out["statuses"][status] = int(n)
            out["steps"] += int(steps)
            if status == EP_COMPLETED:
                out["reward_sum"] = float(reward)
            if first is not None and (out["first_started"] is None or first < out["first_started"]):
                out["first_started"] = first
            if last is not None and (out["last_finished"] is None or last > out["last_finished"]):
                out["last_finished"] = last
        done = out["statuses"].get(EP_COMPLETED, 0)
        out["mean_reward"] = out["reward_sum"] / done if done else None
        rows = self.query("SELECT episodes, groups, model, created_at FROM jobs WHERE job_id = ?", (job_id,))
        out["episodes_expected"], out["groups_expected"], out["model"], out["created_at"] = (
            rows[0] if rows else (None, None, None, None))
        return out

    def episode_facets(self, job_id: str) -> dict[str, dict[str, int]]:
        """How many of a job's episodes have each env_name, status, ended_by and reason: the
        episode filters' choices, with counts (``None`` keys: not set)."""
        out = {}
        for col in ("env_name", "status", "ended_by", "reason"):
            out[col] = {k: int(n) for k, n in self.query(
                f"SELECT {col}, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY {col} ORDER BY {col}", (job_id,))}
        return out

    def group_members_many(self, group_ids: Sequence[str]) -> dict[str, list[dict]]:
        """The members (episode_id, status, total_reward) of several groups: a page of the
        groups table with each sample's advantage, in one query per 500 groups."""
        out: dict[str, list[dict]] = {g: [] for g in group_ids}
        for chunk in _chunks(list(group_ids), 500):
            for d in self.query_dicts(
                "SELECT group_id, episode_id, status, total_reward FROM episodes "
                f"WHERE group_id IN ({_marks(chunk)}) ORDER BY group_id, episode_id", chunk,
            ):
                out.setdefault(d["group_id"], []).append(d)
        return out

    def job_environment(self, env_id: str) -> dict | None:
        """The episode as it was announced: its env_params (the task), group and env_name."""
        rows = self.query_dicts("SELECT * FROM job_environments WHERE env_id = ?", (env_id,))
        return rows[0] if rows else None

    def list_episodes(self, job_id: str, *, sort: str = "episode_id", descending: bool = False, limit: int = 50,
                      offset: int = 0, **filters: Any) -> list[dict]:
        where, args = self._episode_filter(job_id, **filters)
        col = self.EPISODE_SORTS.get(sort)
        if col is None:
            raise ValueError(f"unknown sort {sort!r}; one of {sorted(self.EPISODE_SORTS)}")
        order = f"{col} {'DESC' if descending else 'ASC'}, episode_id"
        return self.query_dicts(f"SELECT * FROM episodes WHERE {where} ORDER BY {order} LIMIT ? OFFSET ?",
                                (*args, int(limit), int(offset)))

    def count_episodes(self, job_id: str, **filters: Any) -> int:
        where, args = self._episode_filter(job_id, **filters)
        return int(self.query(f"SELECT COUNT(*) FROM episodes WHERE {where}", args)[0][0])

    def env_names(self, job_id: str) -> list[str]:
        return [r[0] for r in self.query("SELECT DISTINCT env_name FROM episodes WHERE job_id = ? ORDER BY env_name",
                                         (job_id,))]

    def reward_points(self, job_id: str) -> list[tuple[str, float, float | None]]:
        """(env_name, total reward, finished at) of every completed episode: distributions, trends."""
        return [(e, float(r or 0.0), f) for e, r, f in self.query(
            "SELECT env_name, total_reward, finished_at FROM episodes WHERE job_id = ? AND status = 'completed' "
            "ORDER BY finished_at", (job_id,))]

    def export_episodes(self, job_id: str, *, statuses: Sequence[str] | None, env_names: Sequence[str] | None,
                        complete_groups_only: bool) -> list[tuple]:
        """(episode, attempt_id, status, total reward, group complete, group id, group size) in
        group order: what an export walks."""
        where, args = ["e.job_id = ?"], [job_id]
        if statuses is not None:
            where.append(f"e.status IN ({_marks(statuses)})")
            args.extend(statuses)
        if env_names:
            where.append(f"e.env_name IN ({_marks(env_names)})")
            args.extend(env_names)
        if complete_groups_only:
            where.append("g.complete = 1")
        return self.query(
            "SELECT e.episode_id, e.attempt_id, e.status, e.total_reward, COALESCE(g.complete, 0), e.group_id, "
            "COALESCE(g.size, 0) FROM episodes e LEFT JOIN groups g ON g.group_id = e.group_id "
            f"WHERE {' AND '.join(where)} ORDER BY e.group_id, e.episode_id", args)

    def export_steps(self, episode_id: str, *, trainable_only: bool) -> list[tuple]:
        """The episode's trajectory rows as an export needs them, in step order. (The flag is
        cast: a reader may meet a PostgreSQL store no writer has migrated yet, flags SMALLINT.)"""
        return self.query(
            "SELECT job_id, session_id, group_id, env_name, step_id, attempt, messages, response, step_reward, "
            "weight_version, is_trainable, is_terminal, is_truncated, prompt_tokens, completion_tokens, ended_by "
            "FROM session_steps WHERE session_id = ?"
            + (" AND CAST(is_trainable AS INTEGER) = 1" if trainable_only else "")
            + " ORDER BY step_id", (episode_id,))

    def weight_versions(self, job_id: str) -> list[tuple[str, Any]]:
        """(episode, weight_version) pairs of the job's trajectories (staleness filters)."""
        return self.query(
            "SELECT session_id, weight_version FROM session_steps WHERE job_id = ? AND weight_version IS NOT NULL "
            "GROUP BY session_id, weight_version", (job_id,))

    def feed_groups(self, group_ids: Sequence[str]) -> dict[str, dict]:
        """What the feed announces of each group (consumer/feed.py): its row of ``groups``, its
        members (episode_id, status, total_reward, reason) and the weight versions of its
        trajectories' steps."""
        out: dict[str, dict] = {}
        for chunk in _chunks(list(group_ids), 500):
            for d in self.query_dicts(
                    "SELECT group_id, job_id, size, completed, failed, complete, incomplete_reason FROM groups "
                    f"WHERE group_id IN ({_marks(chunk)})", chunk):
                out[d["group_id"]] = d | {"members": [], "versions": []}
            for gid, ep, st, tr, reason in self.query(
                    "SELECT group_id, episode_id, status, total_reward, reason FROM episodes "
                    f"WHERE group_id IN ({_marks(chunk)}) ORDER BY group_id, episode_id", chunk):
                if gid in out:
                    out[gid]["members"].append((ep, st, float(tr or 0.0), reason))
            for gid, wv in self.query(
                    "SELECT DISTINCT group_id, weight_version FROM session_steps "
                    f"WHERE group_id IN ({_marks(chunk)}) AND weight_version IS NOT NULL", chunk):
                if gid in out:
                    out[gid]["versions"].append(wv)
        return out

    def feed_steps(self, episode_id: str) -> list[tuple]:
        """The episode's trajectory rows as the feed hands them to a trainer, in step order."""
        return self.query(
            "SELECT job_id, session_id, group_id, env_name, step_id, attempt, messages, response, step_reward, "
            "weight_version, CAST(is_trainable AS INTEGER), CAST(is_terminal AS INTEGER), "
            "CAST(is_truncated AS INTEGER), prompt_tokens, completion_tokens, ended_by, finish_reason, created_ts "
            "FROM session_steps WHERE session_id = ? ORDER BY step_id", (episode_id,))

    def settled_group_ids(self, job_id: str) -> list[str]:
        """Groups of a job with no member left to run (every one completed or failed): what a
        feed attached late, or a consumer that crashed between commit and announce, catches up on."""
        return [r[0] for r in self.query(
            "SELECT group_id FROM groups WHERE job_id = ? AND size > 0 AND completed + failed >= size", (job_id,))]

    # ------------------------------------------------------------------ tokens (step_tokens)
    def has_step_tokens(self) -> bool:
        """Whether the store has the step_tokens table (a store made before it has not)."""
        return self.has_table(step_tokens_table.TABLE)

    def episode_tokens(self, episode_id: str, step_id: int | None = None) -> list[dict]:
        """The token rows of the episode's trajectory (the attempt its session_steps rows are
        of), in step order, ids and logprobs decoded (consumer/storage/tokens.py)."""
        if not self.has_step_tokens():
            return []
        sql = ("SELECT t.* FROM step_tokens t JOIN session_steps s ON s.session_id = t.session_id "
               "AND s.step_id = t.step_id AND s.attempt_id = t.attempt_id WHERE s.session_id = ?")
        args: list[Any] = [episode_id]
        if step_id is not None:
            sql += " AND s.step_id = ?"
            args.append(int(step_id))
        return [step_tokens_table.decode_row(d) for d in self.query_dicts(sql + " ORDER BY t.step_id", args)]

    def episode_token_index(self, episode_id: str) -> dict[int, dict]:
        """step_id -> status, source, error, drift and lengths of the trajectory's token rows,
        without the ids (the results browser's episode page)."""
        if not self.has_step_tokens():
            return {}
        return {d["step_id"]: d for d in self.query_dicts(
            "SELECT t.step_id, t.token_status, t.token_source, t.token_error, t.token_drift, t.prompt_len, "
            "t.completion_len FROM step_tokens t JOIN session_steps s ON s.session_id = t.session_id "
            "AND s.step_id = t.step_id AND s.attempt_id = t.attempt_id WHERE s.session_id = ? ORDER BY t.step_id",
            (episode_id,))}

    def token_summary(self, job_id: str) -> dict | None:
        """Per status, the trajectory steps that asked for tokens; steps and episodes whose
        prompt did not extend the previous turn (token_drift); ids and bytes stored. None when
        no step of the job asked."""
        if not self.has_step_tokens():
            return None
        rows = self.query(
            "SELECT t.token_status, COUNT(*), SUM(CASE WHEN t.token_drift IS NOT NULL THEN 1 ELSE 0 END), "
            "COUNT(DISTINCT CASE WHEN t.token_drift IS NOT NULL THEN t.session_id END), "
            "COALESCE(SUM(t.prompt_len), 0), COALESCE(SUM(t.completion_len), 0), "
            "COALESCE(SUM(LENGTH(t.prompt_ids)), 0) + COALESCE(SUM(LENGTH(t.completion_ids)), 0) "
            "+ COALESCE(SUM(LENGTH(t.completion_logprobs)), 0), COALESCE(SUM(LENGTH(t.completion_token_texts)), 0) "
            "FROM step_tokens t JOIN session_steps s ON s.session_id = t.session_id AND s.step_id = t.step_id "
            "AND s.attempt_id = t.attempt_id WHERE s.job_id = ? GROUP BY t.token_status", (job_id,))
        if not rows:
            return None
        out = {"steps": 0, "by_status": {}, "drift_steps": 0, "drift_episodes": 0, "prompt_ids": 0,
               "completion_ids": 0, "bytes": 0, "text_bytes": 0}
        for status, n, drift, drift_eps, p, c, nbytes, text_bytes in rows:
            out["steps"] += int(n)
            out["by_status"][status] = int(n)
            out["drift_steps"] += int(drift or 0)
            out["drift_episodes"] += int(drift_eps or 0)
            out["prompt_ids"] += int(p)
            out["completion_ids"] += int(c)
            out["bytes"] += int(nbytes)  # packed ids and logprobs
            out["text_bytes"] += int(text_bytes)  # the token strings (JSON), for readers
        return out

    def sql(self, text: str, args: Sequence[Any] = ()) -> list[tuple]:
        """A read-only query for tests and tools that check the original tables' contract."""
        return self.query(text, args)


def _json(obj: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS, default=str).decode()


def _marks(items: Sequence[Any]) -> str:
    return ", ".join("?" for _ in items)


def _chunks(items: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


_ENV_STATE: dict[Any, str] = {}


def _env_state(wv: Any) -> str | None:
    """``{"weight_version": ...}`` as the original system writes it, or None."""
    if wv is None:
        return None
    text = _ENV_STATE.get(wv) if isinstance(wv, (str, int)) else None
    if text is None:
        text = orjson.dumps({"weight_version": wv}).decode()
        if isinstance(wv, (str, int)) and len(_ENV_STATE) < 10_000:
            _ENV_STATE[wv] = text
    return text


def _nul_free(v: Any) -> Any:
    """``v`` with every NUL character replaced by U+FFFD (the replacement character), on both
    backends: PostgreSQL's text type cannot hold NUL (the row would be refused and the record
    parked as poison), and SQLite stores what PostgreSQL does. JSON columns never hold one (the
    encoder escapes it as ``\\u0000``)."""
    if type(v) is str and "\x00" in v:
        return v.replace("\x00", "\ufffd")
    return v


def _clean(row: tuple) -> tuple:
    return tuple(_nul_free(v) for v in row)


def _step_row(s: StepRecord) -> tuple:
    # the model server's version when it sent one, else the feed's (broker/records.py v4)
    wv = s.weight_version if s.weight_version is not None else s.policy_version
    mj = s.messages_json
    return _clean((
        s.env_id, s.step_id, s.env_name, s.llm_model, s.group_id, s.job_id,
        mj.decode() if isinstance(mj, (bytes, bytearray)) else mj, s.response,
        float(s.step_reward or 0.0), float(s.cumulative_reward or 0.0), _env_state(wv),
        bool(s.terminated), bool(s.truncated), bool(s.episode_finished), bool(s.is_trainable), s.created_at,
        s.attempt, s.attempt_id or f"n{s.attempt}", None if wv is None else str(wv), s.finish_reason,
        s.ended_by or None, s.env_latency_s, s.model_latency_s, s.prompt_tokens, s.completion_tokens,
        s.created_at,
    ))


def _decode_step(d: dict) -> dict:
    if d.get("messages") is not None:
        d["messages"] = orjson.loads(d["messages"])
    if d.get("env_state") is not None:
        d["env_state"] = orjson.loads(d["env_state"])
    for k in ("is_terminal", "is_truncated", "is_session_completed", "is_trainable"):
        if k in d and d[k] is not None:
            d[k] = bool(d[k])
    return d
