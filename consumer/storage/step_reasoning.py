"""The ``step_reasoning`` table: a model answer's ``reasoning_content`` (vLLM's reasoning
parser, llama.cpp's ``--reasoning-format``, DeepSeek's API), one row per step that had one,
beside the answer's content in ``session_steps.response``.

Kept apart, as ``step_tokens`` is (consumer/storage/step_tokens.py says why): the original
system's ``session_steps`` columns stay as they are, a store whose model gives no reasoning pays
nothing, and the table is additive (created by a writer that opens a store lacking it; no
schema version). Keyed by ``(session_id, attempt_id, step_id)``: a row does not move when its
attempt is set aside; a trajectory's reasoning is the rows of the attempt its ``session_steps``
rows carry.
"""

from __future__ import annotations

from typing import Iterable

from broker.records import StepRecord
from consumer.storage import schema

TABLE = schema.STEP_REASONING.name
COLUMNS = schema.STEP_REASONING.names
SQLITE_DDL = schema.STEP_REASONING.ddl(schema.SQLITE)
POSTGRES_DDL = schema.STEP_REASONING.ddl(schema.POSTGRES)

INSERT = (f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)}) "
          "ON CONFLICT (session_id, attempt_id, step_id) DO NOTHING")


def rows(steps: Iterable[StepRecord]) -> list[tuple]:
    """The step_reasoning rows of the steps whose answer had reasoning (NUL characters dropped:
    PostgreSQL text refuses them)."""
    return [(s.env_id, s.attempt_id or f"n{s.attempt}", s.step_id, s.job_id, s.reasoning_content.replace("\x00", ""))
            for s in steps if getattr(s, "reasoning_content", "")]
