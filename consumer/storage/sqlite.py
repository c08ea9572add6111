"""The SQLite backend: one file (WAL), the default (``<run_dir>/results.sqlite``).

Durability: ``synchronous = FULL``, so a committed batch is on disk before the consumer
acknowledges it in Redis and the stream is trimmed (with NORMAL, WAL commits are synced only at
checkpoints, and a machine crash could lose batches already gone from Redis). Several writers
(consumers) take turns through SQLite's own lock (``BEGIN IMMEDIATE``, a 30 s busy timeout);
readers never block them.

Schema versions (``PRAGMA user_version``): 3 is this code's. A file of version 1 (the tables
before the original ``session_steps`` names and ``job_environments``) or 2 (before the
episodes' reopen count) is migrated in place, in one transaction, when a writer opens it; a
newer file is refused.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from broker.states import StoredStatus
from consumer.storage import phases as attempt_phases_table
from consumer.storage import resumes as attempt_resumes_table
from consumer.storage import schema
from consumer.storage import step_cached as step_cached_table
from consumer.storage import job_audit as job_audit_table
from consumer.storage import step_reasoning as step_reasoning_table
from consumer.storage import step_tokens as step_tokens_table
from consumer.storage.backend import ResultStore, StoreError
from consumer.storage.schema import BROWSE_INDEXES, SCHEMA_VERSION

TS = "strftime('%Y-%m-%d %H:%M:%f', ?, 'unixepoch')"

# This code's tables (schema.py), as SQLite text: also what the migrations below end with.
SCHEMA = schema.schema_ddl(schema.SQLITE)

# Version 1 -> 2: the original session_steps column names, job_environments, superseded rows in
# a table of their own, attempt ids (v1 rows get "n<attempt>"), no per-row trigger.
_V1_STEP_SELECT = (
    "env_id, step_id, env_name, llm_model, group_id, job_id, messages, response, step_reward, cumulative_reward, "
    "env_state, terminated, truncated, episode_finished, is_trainable, "
    "strftime('%Y-%m-%d %H:%M:%f', created_at, 'unixepoch'), attempt, 'n' || attempt, weight_version, "
    "finish_reason, NULL, env_latency_s, model_latency_s, NULL, NULL, created_at"
)
# The session_steps columns the v1 rows fill, as they were when this migration was written
# (it is history: a column added to the table later stays NULL for these rows).
_STEP_COLS = (
    "session_id, step_id, env_name, llm_model, group_id, job_id, messages, response, step_reward, reward, "
    "env_state, is_terminal, is_truncated, is_session_completed, is_trainable, created_at, attempt, attempt_id, "
    "weight_version, finish_reason, ended_by, env_latency_s, model_latency_s, prompt_tokens, completion_tokens, "
    "created_ts"
)
MIGRATE_1_TO_2 = f"""
ALTER TABLE session_steps RENAME TO v1_session_steps;
ALTER TABLE episodes RENAME TO v1_episodes;
ALTER TABLE attempts RENAME TO v1_attempts;
DROP TRIGGER IF EXISTS session_steps_count;
DROP TABLE IF EXISTS attempt_steps;
DROP INDEX IF EXISTS session_steps_job_trainable;
DROP INDEX IF EXISTS episodes_job;
DROP INDEX IF EXISTS episodes_group;
{SCHEMA}
INSERT INTO session_steps ({_STEP_COLS})
    SELECT {_V1_STEP_SELECT} FROM v1_session_steps s
    WHERE s.superseded = 0 AND NOT EXISTS (
        SELECT 1 FROM v1_episodes e WHERE e.episode_id = s.env_id AND e.status IN ('{StoredStatus.FAILED}', '{StoredStatus.RETRYING}'));
INSERT INTO superseded_steps ({_STEP_COLS}, superseded_reason, superseded_at)
    SELECT {_V1_STEP_SELECT},
        CASE WHEN s.superseded = 1 THEN 'superseded'
             ELSE 'closed:' || (SELECT e.status FROM v1_episodes e WHERE e.episode_id = s.env_id) END,
        s.created_at
    FROM v1_session_steps s
    WHERE s.superseded = 1 OR EXISTS (
        SELECT 1 FROM v1_episodes e WHERE e.episode_id = s.env_id AND e.status IN ('{StoredStatus.FAILED}', '{StoredStatus.RETRYING}'));
INSERT INTO episodes (episode_id, job_id, group_id, env_name, llm_model, status, attempt, attempt_id,
        attempt_started, attempt_closed, completed_attempt_id, attempts, total_reward, steps, expected_steps,
        reason, error_class, error, ended_by, prompt_tokens, completion_tokens, started_at, finished_at,
        group_size, close_entry, duration_s, updated_at)
    SELECT episode_id, job_id, group_id, env_name, llm_model, status, attempt, 'n' || attempt,
        started_at, CASE status WHEN '{StoredStatus.RUNNING}' THEN '' ELSE status END,
        CASE status WHEN '{StoredStatus.COMPLETED}' THEN 'n' || attempt ELSE '' END, attempts, total_reward,
        CASE WHEN status IN ('{StoredStatus.FAILED}', '{StoredStatus.RETRYING}') THEN 0 ELSE steps END, steps,
        reason, error_class, error, NULL, 0, 0, started_at, finished_at,
        (SELECT g.size FROM groups g WHERE g.group_id = v1_episodes.group_id), '', duration_s, updated_at
    FROM v1_episodes;
INSERT INTO attempts (episode_id, attempt_id, attempt, job_id, status, reason, error_class, error, total_reward,
        steps, ended_by, prompt_tokens, completion_tokens, started_at, finished_at, worker)
    SELECT episode_id, 'n' || attempt, attempt, job_id, status, reason, error_class, error, total_reward, steps,
        NULL, 0, 0, started_at, finished_at, worker FROM v1_attempts;
INSERT INTO job_environments (job_id, env_id, env_name, env_params, image, group_id, finished, is_deleted,
        created_at)
    SELECT job_id, episode_id, env_name, '{{}}', NULL, group_id, CASE status WHEN '{StoredStatus.COMPLETED}' THEN 1 ELSE 0 END, 0,
        strftime('%Y-%m-%d %H:%M:%f', COALESCE(started_at, updated_at), 'unixepoch')
    FROM v1_episodes ORDER BY COALESCE(started_at, updated_at), episode_id;
DROP TABLE v1_session_steps;
DROP TABLE v1_episodes;
DROP TABLE v1_attempts;
"""

# Version 2 -> 3: episodes gain their reopen count. The flags of the original tables are
# declared BOOLEAN in new files, as the original system's ORM declares them; a version 2 file
# keeps INTEGER (SQLite cannot change a column's declared type in place, and both hold the same
# 0/1 integers, so every query answers the same).
MIGRATE_2_TO_3 = "ALTER TABLE episodes ADD COLUMN reopens INTEGER NOT NULL DEFAULT 0"


class SQLiteStore(ResultStore):
    TS = TS

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False):
        self.path = str(path)
        self.url = self.path
        if readonly:
            if not os.path.exists(self.path):
                raise StoreError(f"no results database at {self.path}")
        else:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            if self.path != ":memory:" and not os.path.exists(self.path):
                # Readable by this user only (SQLite gives its -wal and -shm files the same mode):
                # prompts and answers can be confidential.
                try:
                    os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
                except OSError as exc:
                    raise StoreError(f"cannot create {self.path}: {exc}") from None
        self._lock = threading.RLock()
        try:
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self.path}: {exc}") from None
        c = self._conn
        # page_size only takes effect before the first table is created: 16 KiB pages hold a
        # few-KB step row without overflow pages.
        c.execute("PRAGMA page_size = 16384")
        c.execute("PRAGMA journal_mode = WAL")
        c.execute("PRAGMA synchronous = FULL")
        c.execute("PRAGMA busy_timeout = 30000")
        c.execute("PRAGMA cache_size = -65536")  # 64 MiB
        c.execute("PRAGMA temp_store = MEMORY")
        c.execute("PRAGMA wal_autocheckpoint = 8192")  # pages: ~64 MiB of WAL between checkpoints
        c.execute("PRAGMA journal_size_limit = 67108864")
        self._ensure_schema(readonly)
        self._tables: set[str] = set()
        if not readonly:
            for table, ddl in ((step_tokens_table.TABLE, step_tokens_table.SQLITE_DDL),
                               (attempt_phases_table.TABLE, attempt_phases_table.SQLITE_DDL),
                               (attempt_resumes_table.TABLE, attempt_resumes_table.SQLITE_DDL),
                               (step_reasoning_table.TABLE, step_reasoning_table.SQLITE_DDL),
                               (step_cached_table.TABLE, step_cached_table.SQLITE_DDL),
                               (job_audit_table.TABLE, job_audit_table.SQLITE_DDL)):
                self._ensure_table(table, ddl)

    def _ensure_schema(self, readonly: bool) -> None:
        c = self._conn
        with self._lock:
            (uv,) = c.execute("PRAGMA user_version").fetchone()
            if uv > SCHEMA_VERSION:
                c.close()
                raise StoreError(f"{self.path}: results schema v{uv} is newer than this code (v{SCHEMA_VERSION})")
            if readonly:
                return
            if uv == SCHEMA_VERSION:
                self._ensure_indexes()
                return
            c.execute("BEGIN IMMEDIATE")
            try:
                (uv,) = c.execute("PRAGMA user_version").fetchone()  # another writer may have done it
                if uv == 0:
                    has_v1 = c.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'session_steps' "
                                       "AND sql LIKE '%superseded%'").fetchone()
                    uv = 1 if has_v1 else 0
                if uv == 0:
                    _script(c, SCHEMA)
                elif uv == 1:
                    _script(c, MIGRATE_1_TO_2)  # straight to this version's tables
                elif uv == 2:
                    _script(c, MIGRATE_2_TO_3)
                c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

    def _ensure_indexes(self) -> None:
        """Indexes added to the schema after a store was made (BROWSE_INDEXES), created once by
        the first writer that opens it; the write lock is taken only when one is missing."""
        c = self._conn
        have = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        missing = [i.ddl for i in BROWSE_INDEXES if i.name not in have]
        if missing:
            c.execute("BEGIN IMMEDIATE")
            try:
                for ddl in missing:
                    c.execute(ddl)
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

    def _ensure_table(self, table: str, ddl: str) -> None:
        """An additive schema step (a table of its own: step_tokens, attempt_phases; see their
        modules): created once, by the first writer that opens a store lacking it."""
        c = self._conn
        if c.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone():
            return
        c.execute("BEGIN IMMEDIATE")
        try:
            _script(c, ddl)  # IF NOT EXISTS: another writer may have been first
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def has_table(self, table: str) -> bool:
        if table not in self._tables:  # a missing one is looked up again: a writer may create it meanwhile
            if self.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)):
                self._tables.add(table)
        return table in self._tables

    # --- primitives -----------------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                if c.in_transaction:
                    c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._lock:
            return self._conn.execute(sql, args).rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            with self._lock:
                self._conn.executemany(sql, rows)

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def query_dicts(self, sql: str, args: Sequence[Any] = ()) -> list[dict]:
        with self._lock:
            cur = self._conn.execute(sql, args)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def schema_version(self) -> int:
        return int(self.query("PRAGMA user_version")[0][0])


def _script(c: sqlite3.Connection, script: str) -> None:
    """Run statements one by one inside the caller's transaction (executescript would COMMIT)."""
    for stmt in script.split(";"):
        if stmt.strip():
            c.execute(stmt)
