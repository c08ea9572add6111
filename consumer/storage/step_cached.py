"""The ``step_cached`` table: the steps whose answer came from the response cache (broker/cache.py), one row each.

Kept apart as ``step_reasoning`` is (consumer/storage/step_reasoning.py says why): the original
system's ``session_steps`` columns stay as they are, a job run without ``--cache`` writes
nothing here, and the table is additive (created by a writer that opens a store lacking it; no
schema version). Keyed by ``(session_id, attempt_id, step_id)``, as ``step_reasoning``: a
trajectory's cached steps are the rows of the attempt its ``session_steps`` rows carry.
"""

from __future__ import annotations

from typing import Iterable

from broker.records import StepRecord
from consumer.storage import schema

TABLE = schema.STEP_CACHED.name
COLUMNS = schema.STEP_CACHED.names
SQLITE_DDL = schema.STEP_CACHED.ddl(schema.SQLITE)
POSTGRES_DDL = schema.STEP_CACHED.ddl(schema.POSTGRES)

INSERT = (f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)}) "
          "ON CONFLICT (session_id, attempt_id, step_id) DO NOTHING")


def rows(steps: Iterable[StepRecord]) -> list[tuple]:
    """The step_cached rows of the steps answered from the cache."""
    return [(s.env_id, s.attempt_id or f"n{s.attempt}", s.step_id, s.job_id) for s in steps
            if getattr(s, "cached", False)]
