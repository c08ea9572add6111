"""The results store's base class and its write path: :class:`ResultStore`, the primitives
each backend provides (a transaction, statements, queries), and :meth:`ResultStore.write_batch`,
which applies a batch of records in one transaction.

Shaped like dramatiq's result backends: :class:`ResultStore` implements what callers use, in
terms of a few primitives each backend provides (``sqlite.py``, ``postgres.py``). The same
SQL runs on both backends: written with ``?`` placeholders (PostgreSQL's module swaps them),
the original tables' flags written as Python booleans (BOOLEAN on PostgreSQL, 0/1 in SQLite;
``WHERE is_session_completed`` and the original documentation's ``= 1`` work on both, and our
own queries test them bare), timestamps written by the database from epoch seconds.

Text: a NUL character (which PostgreSQL's text type cannot hold) is stored as U+FFFD on both
backends, so that they store the same and a model answer or an env error holding one is not
refused as bad data (:func:`_nul_free`).

Who does what in this package:

* here, the writer: :meth:`ResultStore.write_batch` (the consumer, one transaction per batch;
  the rules are in :mod:`consumer.storage.plan`) and :meth:`ResultStore.reopen_lost_completion`;
* ``reads.py``: the job, episode and group readers (``interactor results``, ``status``,
  exports, the feed) and ``browse.py``: the results browser's filtered, sorted, paged lists;
  both are mixins of :class:`ResultStore`, so every reader is a method of the store;
* ``schema.py``: the tables, declared once, from which both backends' DDL and the inserts'
  column lists below are made; ``group_stats.py``: a group's reward mean, std and advantages.

No caller outside this package touches a connection or writes SQL (``sql()``, for tests and
tools checking the original tables' contract, aside).

Tables (docs/protocol.md, "What is stored"; columns in schema.py):

* ``job_environments``, ``session_steps``: the original system's, column for column (plus
  extra columns of ours on ``session_steps``: attempt, attempt_id, weight_version, finish_reason,
  ended_by, latencies, token counts, created_ts).
* ``superseded_steps``: step rows that are not an episode's trajectory, with the reason.
* ``episodes``, ``attempts``, ``groups``, ``jobs``: our bookkeeping.
* ``step_tokens``, ``attempt_phases``, ``attempt_resumes``: additive tables of ours
  (consumer/storage/step_tokens.py, phases.py, resumes.py), created by a writer that opens a store
  lacking them; no schema version.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import orjson

from broker import errors
from broker.records import AttemptRecord, EpisodesEnqueued, JobSpec, StepRecord
from broker.redact import store_identity
from broker.settings import redact_url
from broker.states import AttemptStatus, StoredStatus
from consumer.storage import phases as attempt_phases_table
from consumer.storage import resumes as attempt_resumes_table
from consumer.storage import step_cached as step_cached_table
from consumer.storage import job_audit as job_audit_table
from consumer.storage import step_reasoning as step_reasoning_table
from consumer.storage import schema
from consumer.storage import step_tokens as step_tokens_table
from consumer.storage.browse import StoreBrowse
from consumer.storage.group_stats import reward_mean_std
from consumer.storage.plan import STEPS_LOST, Batch, EpisodeState, Plan, lost_completion, plan_batch, settle
from consumer.storage.reads import StoreReads
from consumer.storage.sqltext import chunks, completed_close_wins, marks, values

log = logging.getLogger("interactor.store")

# What the writer inserts, column for column (schema.py).
STEP_COLUMNS = schema.SESSION_STEPS.insert_columns
_STEP_COLS = ", ".join(STEP_COLUMNS)
EPISODE_COLUMNS = schema.EPISODES.names  # EpisodeState.COLUMNS, then duration_s and updated_at
ATTEMPT_COLUMNS = schema.ATTEMPTS.names
_JOB_COLUMNS = schema.JOBS.names
_JOB_ENV_COLUMNS = schema.JOB_ENVIRONMENTS.insert_columns
_GROUP_COLUMNS = schema.GROUPS.names


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


class ResultStore(StoreReads, StoreBrowse):
    """Base class of the backends. Subclasses provide the primitives marked below; the readers
    come from the mixins (reads.py, browse.py)."""

    #: SQL expression turning an epoch-seconds parameter into the backend's timestamp type.
    TS: str = "?"
    url: str = ""

    @property
    def identity(self) -> str:
        """Which store this is, comparable across processes and free of secrets: what a feed
        server checks against the store its job's consumer writes (``Keys.job_store``)."""
        return store_identity(self.url)

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
            if batch.audit:  # who changed a job and when (consumer/storage/job_audit.py)
                self.executemany(job_audit_table.INSERT, job_audit_table.rows(batch.audit))
            if batch.events:
                plan = self._write_episodes(batch)
                result.session_steps = len(plan.session_steps)
                result.superseded_steps = len(plan.superseded_steps)
                result.completing = [(st.episode_id, st.completed_attempt_id, st.close_entry)
                                     for st in plan.states.values() if st.status == StoredStatus.COMPLETING]
                result.failed_after_completion = list(plan.failed_after_completion)
        return result

    def _write_jobs(self, jobs: list[JobSpec]) -> None:
        # A job id the store already holds under another creation time: Redis forgot the first
        # run (its keys expired after the retention) and the id was submitted again. The first
        # run's rows stay; the new run's episodes share their ids, so their completions are
        # filed completed_by_other (README, limits). Said loudly, once per submission.
        ids = [j.job_id for j in jobs]
        held = dict(self.query(f"SELECT job_id, created_at FROM jobs WHERE job_id IN ({marks(ids)})", ids))
        for j in jobs:
            if j.job_id in held and held[j.job_id] is not None and j.created_at is not None \
                    and abs(float(held[j.job_id]) - float(j.created_at)) > 1e-6:
                log.warning("job %s was submitted again after the store recorded it (created %s, now %s): the "
                            "store keeps the first run, the new run's episodes are stored as completed_by_other; "
                            "use a new job id", j.job_id, held[j.job_id], j.created_at)
        self.executemany(
            # The same run's spec again (its settings corrected on resume, interactor/job_corrections.py)
            # replaces the row; another run's (a reused id) leaves the first run's.
            f"INSERT INTO jobs ({', '.join(_JOB_COLUMNS)}) VALUES ({marks(_JOB_COLUMNS)}) "
            "ON CONFLICT (job_id) DO UPDATE SET model = excluded.model, llm_base_url = excluded.llm_base_url, "
            "spec = excluded.spec WHERE jobs.created_at = excluded.created_at",
            # URLs with their passwords starred: the database is read by more people than Redis.
            [_clean((j.job_id, j.created_at, j.episodes, j.groups, j.model, redact_url(j.llm_base_url),
                     _json(j.sources), _json(j.to_dict() | {"llm_base_url": redact_url(j.llm_base_url)})))
             for j in jobs],
        )

    def _write_announced(self, announced: list[EpisodesEnqueued]) -> None:
        rows = []
        for a in announced:
            images = a.images or {}
            for env_id, env_name, group_id, params in a.episodes:
                text = params.decode() if isinstance(params, (bytes, bytearray)) else _json(params)
                # the entry's env_image; "" for none (and from older producers), as the original stores it
                rows.append(_clean((a.job_id, env_id, env_name, text, images.get(env_id, ""), group_id,
                                    a.created_at)))
        # an announced episode is neither finished nor deleted yet
        exprs = {"finished": "FALSE", "is_deleted": "FALSE", "created_at": self.TS}
        self.executemany(
            f"INSERT INTO job_environments ({', '.join(_JOB_ENV_COLUMNS)}) "
            f"VALUES ({values(_JOB_ENV_COLUMNS, **exprs)}) ON CONFLICT (env_id) DO NOTHING",
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
        # never move (consumer/storage/step_tokens.py).
        token_rows = step_tokens_table.rows(
            [*plan.session_steps, *(s for s, _ in plan.superseded_steps)])
        if token_rows:
            self.executemany(step_tokens_table.INSERT, token_rows)
        # The answers' reasoning, beside their content (consumer/storage/step_reasoning.py).
        answered = [*plan.session_steps, *(s for s, _ in plan.superseded_steps)]
        reasoning_rows = step_reasoning_table.rows(answered)
        if reasoning_rows:
            self.executemany(step_reasoning_table.INSERT, reasoning_rows)
        # The steps answered from the response cache (consumer/storage/step_cached.py).
        cached_rows = step_cached_table.rows(answered)
        if cached_rows:
            self.executemany(step_cached_table.INSERT, cached_rows)
        if plan.closes:
            self._write_closes(plan.closes)
        stored = self._stored_steps(plan.episodes_to_count())
        for st in plan.states.values():
            settle(st, stored.get(st.episode_id))
        self._save_states(plan, now)
        return plan

    def _step_values(self) -> str:
        return values(STEP_COLUMNS, created_at=self.TS)

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
        # A 'completed' close wins over any other close of the same attempt; otherwise the
        # first one stored is kept.
        self.executemany(completed_close_wins("attempts", ATTEMPT_COLUMNS, completed=AttemptStatus.COMPLETED),
                         [_attempt_row(c) for c in closes])
        # where each attempt's time went (records v5), kept by the same rule (consumer/storage/phases.py)
        phase_rows = attempt_phases_table.rows(closes)
        if phase_rows:
            self.executemany(attempt_phases_table.INSERT, phase_rows)
        # which attempts continued their predecessor's env instance, or why not (consumer/storage/resumes.py)
        resume_rows = attempt_resumes_table.rows(closes)
        if resume_rows:
            self.executemany(attempt_resumes_table.INSERT, resume_rows)

    def _load_states(self, ids: Sequence[str]) -> dict[str, EpisodeState]:
        out: dict[str, EpisodeState] = {}
        cols = ", ".join(EpisodeState.COLUMNS)
        for chunk in chunks(ids):
            for row in self.query(f"SELECT {cols} FROM episodes WHERE episode_id IN ({marks(chunk)})", chunk):
                out[row[0]] = EpisodeState.from_row(row)
        return out

    def _stored_steps(self, ids: Sequence[str]) -> dict[str, tuple]:
        out = {}
        for chunk in chunks(ids):
            for eid, n, r, p, c in self.query(
                "SELECT session_id, COUNT(*), COALESCE(SUM(step_reward), 0), COALESCE(SUM(prompt_tokens), 0), "
                f"COALESCE(SUM(completion_tokens), 0) FROM session_steps WHERE session_id IN ({marks(chunk)}) "
                "GROUP BY session_id", chunk,
            ):
                out[eid] = (int(n), float(r), int(p), int(c))
        return out

    def _save_states(self, plan: Plan, now: float) -> None:
        cols = ", ".join(EPISODE_COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in EPISODE_COLUMNS[1:])
        self.executemany(
            f"INSERT INTO episodes ({cols}) VALUES ({marks(EPISODE_COLUMNS)}) "
            f"ON CONFLICT (episode_id) DO UPDATE SET {updates}",
            [_clean(st.row(now)) for st in plan.states.values()],
        )
        flips = [(st.status == StoredStatus.COMPLETED, st.episode_id) for st in plan.states.values()
                 if (st.status == StoredStatus.COMPLETED) != (st.loaded_status == StoredStatus.COMPLETED)]
        if flips:
            self.executemany("UPDATE job_environments SET finished = ? WHERE env_id = ?", flips)
        groups = {}
        for st in plan.states.values():
            if (st.new or st.status != st.loaded_status or st.group_size
                    or (st.status == StoredStatus.COMPLETED and st.total_reward != st.loaded_reward)):
                g = groups.setdefault(st.group_id, [st.job_id, st.env_name, 0])
                g[2] = max(g[2], st.group_size)
        groups.pop(None, None)
        if groups:
            self._refresh_groups(groups)

    def _refresh_groups(self, groups: dict[str, list]) -> None:
        """Recompute each touched group from its members, once per batch."""
        ids = sorted(groups)
        self.lock_groups(ids)
        for chunk in chunks(ids):
            # A group's size: what its closes said, or how many episodes were enqueued in it.
            for gid, size in self.query(f"SELECT group_id, size FROM groups WHERE group_id IN ({marks(chunk)})", chunk):
                if size and size > groups[gid][2]:
                    groups[gid][2] = size
            for gid, n in self.query(f"SELECT group_id, COUNT(*) FROM job_environments WHERE group_id IN "
                                     f"({marks(chunk)}) GROUP BY group_id", chunk):
                if n > groups[gid][2]:
                    groups[gid][2] = int(n)
        # completed rewards, failed (id, reason), how many cancelled
        members: dict[str, list] = {gid: [[], [], 0] for gid in ids}
        for chunk in chunks(ids):
            for gid, ep_id, st, tr, reason in self.query(
                "SELECT group_id, episode_id, status, total_reward, reason FROM episodes "
                f"WHERE group_id IN ({marks(chunk)}) ORDER BY group_id, episode_id", chunk,
            ):
                if st == StoredStatus.COMPLETED:
                    members[gid][0].append(float(tr or 0.0))
                elif st == StoredStatus.FAILED:
                    members[gid][1].append((ep_id, reason))
                elif st == StoredStatus.CANCELLED:
                    members[gid][2] += 1
        rows = []
        for gid in ids:
            job_id, env_name, size = groups[gid]
            done, failed, cancelled = members[gid]
            nc = len(done)
            mean, std = reward_mean_std(done)
            complete = 1 if size > 0 and nc >= size and not failed and not cancelled else 0
            why = None
            if failed:
                why = f"episode {failed[0][0]} failed: {failed[0][1] or 'unknown'}"
                if len(failed) > 1:
                    why += f" (+{len(failed) - 1} more failed)"
            elif cancelled:  # its job was cancelled before the group was through (broker/cancel.py)
                why = errors.CANCELLED
            rows.append((gid, job_id, env_name, size, nc, len(failed), mean, std, complete, why))
        updates = ", ".join(f"{c} = excluded.{c}" for c in _GROUP_COLUMNS[1:])
        self.executemany(
            f"INSERT INTO groups ({', '.join(_GROUP_COLUMNS)}) VALUES ({marks(_GROUP_COLUMNS)}) "
            f"ON CONFLICT (group_id) DO UPDATE SET {updates}",
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
            if st is None or st.status != StoredStatus.COMPLETING or st.completed_attempt_id != attempt_id:
                return ""
            now = time.time()
            self._move_steps(episode_id, attempt_id, STEPS_LOST, now)
            status = lost_completion(st, max_reopens=max_reopens, poisoned=poisoned)
            if status == StoredStatus.FAILED:
                st.finished_at = now
            self._save_states(Plan(states={episode_id: st}), now)
        return status


def _json(obj: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS, default=str).decode()


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


def _call_state(wv: Any, s: StepRecord) -> str:
    """``env_state`` of an agent's call (workers/agent_episode.py): the weight version as for any
    step, with the tools the request offered and the tool calls the answer made
    (docs/protocol.md#agent-episodes): an agent episode has no env state of its own, and the
    original's readers read this column as a JSON object."""
    state: dict[str, Any] = {} if wv is None else {"weight_version": wv}
    if s.tools is not None:
        state["tools"] = s.tools
    if s.tool_calls is not None:
        state["tool_calls"] = s.tool_calls
    return orjson.dumps(state, default=str).decode()


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


def _attempt_row(c: AttemptRecord) -> tuple:
    """An ``attempts`` row, in ATTEMPT_COLUMNS order (schema.ATTEMPTS)."""
    return _clean((c.episode_id, c.attempt_id, c.attempt, c.job_id, c.status, c.reason, c.error_class, c.error,
                   float(c.total_reward or 0.0), c.steps, c.ended_by or None, c.prompt_tokens, c.completion_tokens,
                   c.started_at, c.finished_at, c.worker))


def _step_row(s: StepRecord) -> tuple:
    """A ``session_steps`` row, in STEP_COLUMNS order (schema.STEP_FIELDS)."""
    # the model server's version when it sent one, else the feed's (broker/records.py v4)
    wv = s.weight_version if s.weight_version is not None else s.policy_version
    mj = s.messages_json
    return _clean((
        s.env_id, s.step_id, s.env_name, s.llm_model, s.group_id, s.job_id,
        mj.decode() if isinstance(mj, (bytes, bytearray)) else mj, s.response,
        float(s.step_reward or 0.0), float(s.cumulative_reward or 0.0),
        _env_state(wv) if s.tool_calls is None and s.tools is None else _call_state(wv, s),
        bool(s.terminated), bool(s.truncated), bool(s.episode_finished), bool(s.is_trainable), s.created_at,
        s.attempt, s.attempt_id or f"n{s.attempt}", None if wv is None else str(wv), s.finish_reason,
        s.ended_by or None, s.env_latency_s, s.model_latency_s, s.prompt_tokens, s.completion_tokens,
        s.created_at,
    ))
