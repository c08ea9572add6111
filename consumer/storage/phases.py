"""The ``attempt_phases`` table: where each closed attempt's time went (records v5, broker/states.py
``Phase``), one row per ``attempts`` row, so that ``interactor results`` and the results browser
can say whether the env, the model or the queue held a job's episodes up.

A table of its own rather than columns of ``attempts``: adding columns would be a schema
version, and a store of a newer version is refused by older code (a fleet upgraded one
consumer at a time would stop); a new table is an additive step like ``step_tokens``
(consumer/storage/step_tokens.py): a writer opening a store that lacks it creates it, nothing else
changes, the schema version is not touched, older code keeps reading and writing the store
(it simply does not fill the table) and a reader of a store without it sees no timings.

Keyed like ``attempts`` (episode_id, attempt_id), and kept by the same rule: a ``completed``
close wins over any other close of the attempt, otherwise the first one stored stays
(``status`` is kept here so that the rule can be applied without reading ``attempts``).
A phase the attempt did not time (records before v5, the queue wait of a re-run) is NULL,
never 0, so that means are taken over the attempts that timed it. Its columns are declared
with the other tables' in schema.py.
"""

from __future__ import annotations

from broker.records import AttemptRecord
from broker.states import AttemptStatus
from consumer.storage import schema
from consumer.storage.sqltext import completed_close_wins

TABLE = schema.ATTEMPT_PHASES.name
#: Column of each phase (broker/states.py ``Phase``): ``<phase>_s``, as AttemptRecord names it.
PHASE_COLUMNS = schema.PHASE_COLUMNS
COLUMNS = schema.ATTEMPT_PHASES.names
SQLITE_DDL = schema.ATTEMPT_PHASES.ddl(schema.SQLITE)
POSTGRES_DDL = schema.ATTEMPT_PHASES.ddl(schema.POSTGRES)

INSERT = completed_close_wins(TABLE, COLUMNS, completed=AttemptStatus.COMPLETED)


def rows(closes: list[AttemptRecord]) -> list[tuple]:
    """The attempt_phases rows of the closes that timed at least one phase (v5 records)."""
    out = []
    for c in closes:
        values = tuple(getattr(c, col) for col in PHASE_COLUMNS)
        if any(v is not None for v in values):
            out.append((c.episode_id, c.attempt_id, c.job_id, c.status)
                       + tuple(None if v is None else float(v) for v in values))
    return out
