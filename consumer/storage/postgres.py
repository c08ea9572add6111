"""The PostgreSQL backend (psycopg 3), for fleets: many consumers in one consumer group write
one database that exports, ``interactor results`` and the results browser read while it grows.

* Several consumers at once: a batch locks its episodes' rows (and then its groups'), each in
  sorted order, before it reads them; a consumer committing steps of an episode while another
  commits that episode's close cannot interleave, and the fixed order leaves no deadlock. An
  episode seen for the first time gets a placeholder row first, so that it can be locked too.
  A deadlock or serialization failure reported anyway is retried.
* Batched writes: ``executemany`` runs in psycopg's pipeline mode (one round trip per batch of
  statements, not per row); every insert is keyed with ``ON CONFLICT DO NOTHING``.
* Schema: created and migrated under an advisory lock, so consumers starting together do it
  once; its version lives in ``store_meta``.
* The original tables' flags are ``BOOLEAN``, as the original system's ORM creates them, so
  its users' ``WHERE is_session_completed`` works; its documentation also writes
  ``WHERE is_session_completed = 1``, which PostgreSQL refuses for a boolean (no ``boolean =
  integer`` operator), so the schema adds that operator (and ``<>``, both ways round: true is 1,
  false is 0) in the tables' schema, and ``sum(boolean)`` (the number of true rows, as SQLite
  sums its 0/1 flags). Token counts are ``BIGINT`` (the model client accepts
  counts up to 2^53). The original tables' ``created_at`` are ``timestamptz``.
* A lost connection is reopened on the next batch (the consumer retries the batch; nothing is
  acknowledged in Redis before its commit).
"""

from __future__ import annotations

import logging
import time
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
from consumer.storage.sqltext import chunks, marks

log = logging.getLogger("interactor.store.postgres")

_SCHEMA_LOCK = 0x696E7472  # pg_advisory_xact_lock key: "intr"
_RETRIES = 5

# This code's tables (schema.py), as PostgreSQL text.
SCHEMA = schema.schema_ddl(schema.POSTGRES)

# ``boolean = integer`` for the original documentation's ``WHERE is_session_completed = 1``
# (schema v3 made the flags BOOLEAN). Created once per schema; CREATE OPERATOR has no IF NOT
# EXISTS, so an existing one (another store in the same schema) is left as it is.
BOOL_INT_OPERATORS = (
    "CREATE OR REPLACE FUNCTION interactor_bool_eq_int(boolean, integer) RETURNS boolean "
    "LANGUAGE sql IMMUTABLE AS 'SELECT $1::integer = $2'",
    "CREATE OR REPLACE FUNCTION interactor_int_eq_bool(integer, boolean) RETURNS boolean "
    "LANGUAGE sql IMMUTABLE AS 'SELECT $1 = $2::integer'",
    "CREATE OR REPLACE FUNCTION interactor_bool_ne_int(boolean, integer) RETURNS boolean "
    "LANGUAGE sql IMMUTABLE AS 'SELECT $1::integer <> $2'",
    "CREATE OR REPLACE FUNCTION interactor_int_ne_bool(integer, boolean) RETURNS boolean "
    "LANGUAGE sql IMMUTABLE AS 'SELECT $1 <> $2::integer'",
    "DO $$ BEGIN "
    "CREATE OPERATOR = (LEFTARG = boolean, RIGHTARG = integer, FUNCTION = interactor_bool_eq_int, "
    "COMMUTATOR = =, NEGATOR = <>); "
    "EXCEPTION WHEN duplicate_function THEN NULL; END $$",
    "DO $$ BEGIN "
    "CREATE OPERATOR = (LEFTARG = integer, RIGHTARG = boolean, FUNCTION = interactor_int_eq_bool, "
    "COMMUTATOR = =, NEGATOR = <>); "
    "EXCEPTION WHEN duplicate_function THEN NULL; END $$",
    "DO $$ BEGIN "
    "CREATE OPERATOR <> (LEFTARG = boolean, RIGHTARG = integer, FUNCTION = interactor_bool_ne_int, "
    "COMMUTATOR = <>, NEGATOR = =); "
    "EXCEPTION WHEN duplicate_function THEN NULL; END $$",
    "DO $$ BEGIN "
    "CREATE OPERATOR <> (LEFTARG = integer, RIGHTARG = boolean, FUNCTION = interactor_int_ne_bool, "
    "COMMUTATOR = <>, NEGATOR = =); "
    "EXCEPTION WHEN duplicate_function THEN NULL; END $$",
    # SUM(finished) counts the true rows, as it does in SQLite and did on the SMALLINT flags
    # (NULL over no non-null rows, as SUM does).
    "CREATE OR REPLACE FUNCTION interactor_sum_bool(bigint, boolean) RETURNS bigint LANGUAGE sql IMMUTABLE "
    "AS 'SELECT CASE WHEN $2 IS NULL THEN $1 ELSE COALESCE($1, 0) + $2::integer END'",
    "DO $$ BEGIN "
    "CREATE AGGREGATE sum(boolean) (SFUNC = interactor_sum_bool, STYPE = bigint); "
    "EXCEPTION WHEN duplicate_function THEN NULL; END $$",
)

# Version 2 -> 3, in place: the original tables' flags become BOOLEAN (they were SMALLINT 0/1),
# step token counts BIGINT, episodes gain their reopen count. ALTER ... TYPE rewrites each
# table under an exclusive lock: readers and the other consumers wait for it once.
_FLAGS = ("is_terminal", "is_truncated", "is_session_completed", "is_trainable")
MIGRATE_2_TO_3 = (
    "ALTER TABLE job_environments "
    + ", ".join(f"ALTER COLUMN {c} DROP DEFAULT, ALTER COLUMN {c} TYPE BOOLEAN USING {c} <> 0, "
                f"ALTER COLUMN {c} SET DEFAULT FALSE" for c in ("finished", "is_deleted")),
    *(f"ALTER TABLE {t} " + ", ".join([f"ALTER COLUMN {c} TYPE BOOLEAN USING {c} <> 0" for c in _FLAGS]
                                       + [f"ALTER COLUMN {c} TYPE BIGINT" for c in ("prompt_tokens",
                                                                                    "completion_tokens")])
      for t in ("session_steps", "superseded_steps")),
    "ALTER TABLE episodes ADD COLUMN IF NOT EXISTS reopens INTEGER NOT NULL DEFAULT 0",
)


def _driver():
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a dependency
        raise StoreError("PostgreSQL results need psycopg: pip install 'psycopg[binary]'") from None
    return psycopg


class PostgresStore(ResultStore):
    TS = "to_timestamp(?)"

    def __init__(self, url: str, *, readonly: bool = False):
        self.url = url
        self._psycopg = _driver()
        self._conn = None
        self._sql_cache: dict[str, str] = {}
        self._in_tx = False
        self._connect()
        self._tables: set[str] = set()
        if not readonly:
            self._ensure_schema()
            for table, ddl in ((step_tokens_table.TABLE, step_tokens_table.POSTGRES_DDL),
                               (attempt_phases_table.TABLE, attempt_phases_table.POSTGRES_DDL),
                               (attempt_resumes_table.TABLE, attempt_resumes_table.POSTGRES_DDL),
                               (step_reasoning_table.TABLE, step_reasoning_table.POSTGRES_DDL),
                               (step_cached_table.TABLE, step_cached_table.POSTGRES_DDL),
                               (job_audit_table.TABLE, job_audit_table.POSTGRES_DDL)):
                self._ensure_table(table, ddl)
        else:
            self._check_version()

    # --- connection and schema ----------------------------------------------------------
    def _connect(self) -> None:
        try:
            self._conn = self._psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        except self._psycopg.OperationalError as exc:
            raise StoreError(f"cannot connect to the results database: {_redact(self.url)}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None

    def _live(self):
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._connect()
        return self._conn

    def _ensure_schema(self) -> None:
        conn = self._live()
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for stmt in schema.STORE_META.statements(schema.POSTGRES):  # where the version is kept
                conn.execute(stmt)
            row = conn.execute("SELECT value FROM store_meta WHERE key = 'schema_version'").fetchone()
            version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise StoreError(f"{_redact(self.url)}: results schema v{version} is newer than this code "
                                 f"(v{SCHEMA_VERSION})")
            if version < SCHEMA_VERSION:
                if version == 2:
                    for stmt in MIGRATE_2_TO_3:
                        conn.execute(stmt)
                for stmt in SCHEMA.split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
                for stmt in BOOL_INT_OPERATORS:
                    conn.execute(stmt)
                conn.execute("INSERT INTO store_meta (key, value) VALUES ('schema_version', %s) "
                             "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))
            else:
                # Indexes added after the store was made: looked up first, because CREATE INDEX
                # IF NOT EXISTS locks the table against writes even when the index is there.
                have = {r[0] for r in conn.execute(
                    "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()").fetchall()}
                for index in BROWSE_INDEXES:
                    if index.name not in have:
                        conn.execute(index.ddl)

    def _ensure_table(self, table: str, ddl: str) -> None:
        """An additive schema step (a table of its own: step_tokens, attempt_phases; see their
        modules): looked up first (CREATE ... IF NOT EXISTS would take locks even when the
        table is there), created under the schema lock once."""
        conn = self._live()
        if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None:
            return
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for stmt in ddl.split(";"):
                if stmt.strip():
                    conn.execute(stmt)

    def has_table(self, table: str) -> bool:
        if table not in self._tables:  # a missing one is looked up again: a writer may create it meanwhile
            if self._live().execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None:
                self._tables.add(table)
        return table in self._tables

    def _check_version(self) -> None:
        try:
            row = self._live().execute("SELECT value FROM store_meta WHERE key = 'schema_version'").fetchone()
        except self._psycopg.errors.UndefinedTable:
            raise StoreError(f"{_redact(self.url)}: no results tables yet (no consumer has written here)") from None
        if row and int(row[0]) > SCHEMA_VERSION:
            raise StoreError(f"{_redact(self.url)}: results schema v{row[0]} is newer than this code")

    def schema_version(self) -> int:
        row = self._live().execute("SELECT value FROM store_meta WHERE key = 'schema_version'").fetchone()
        return int(row[0]) if row else 0

    # --- primitives -----------------------------------------------------------------------
    def _q(self, sql: str) -> str:
        out = self._sql_cache.get(sql)
        if out is None:
            out = self._sql_cache[sql] = sql.replace("%", "%%").replace("?", "%s")
        return out

    @contextmanager
    def transaction(self) -> Iterator[None]:
        conn = self._live()
        with conn.transaction():
            self._in_tx = True
            try:
                yield
            finally:
                self._in_tx = False

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        cur = self._live().execute(self._q(sql), args)
        return cur.rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            with self._live().cursor() as cur:
                cur.executemany(self._q(sql), rows)

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        return self._live().execute(self._q(sql), args).fetchall()

    def query_dicts(self, sql: str, args: Sequence[Any] = ()) -> list[dict]:
        from psycopg.rows import dict_row

        with self._live().cursor(row_factory=dict_row) as cur:
            return cur.execute(self._q(sql), args).fetchall()

    def lock_episodes(self, episode_ids: Sequence[str]) -> None:
        # Placeholders make new episodes lockable; the planner reads attempt 0 with no id as
        # nothing seen yet.
        self.executemany(
            "INSERT INTO episodes (episode_id, job_id, status, attempt, attempt_id, attempts) "
            f"VALUES (?, '', '{StoredStatus.RUNNING}', 0, '', 0) ON CONFLICT (episode_id) DO NOTHING",
            [(e,) for e in episode_ids])
        for chunk in chunks(list(episode_ids)):
            self.query(f"SELECT 1 FROM episodes WHERE episode_id IN ({marks(chunk)}) ORDER BY episode_id FOR UPDATE",
                       chunk)

    def lock_groups(self, group_ids: Sequence[str]) -> None:
        self.executemany("INSERT INTO groups (group_id, size, completed, failed, complete) VALUES (?, 0, 0, 0, 0) "
                         "ON CONFLICT (group_id) DO NOTHING", [(g,) for g in group_ids])
        for chunk in chunks(list(group_ids)):
            self.query(f"SELECT 1 FROM groups WHERE group_id IN ({marks(chunk)}) ORDER BY group_id FOR UPDATE", chunk)

    def write_batch(self, records, entry_ids=None):
        records = list(records)
        errors = (self._psycopg.errors.DeadlockDetected, self._psycopg.errors.SerializationFailure)
        for attempt in range(1, _RETRIES + 1):
            try:
                return super().write_batch(records, entry_ids)
            except errors as exc:
                if attempt == _RETRIES:
                    raise
                log.warning("batch rolled back (%s); retrying (%d/%d)", type(exc).__name__, attempt, _RETRIES)
                time.sleep(0.05 * attempt)
            except self._psycopg.OperationalError:
                self._conn = None  # reconnect on the next call; the caller retries the batch
                raise

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


def _redact(url: str) -> str:
    from broker.settings import redact_url

    return redact_url(url)
