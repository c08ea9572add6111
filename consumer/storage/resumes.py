"""The ``attempt_resumes`` table: which attempts continued their predecessor's env instance
(broker/resume.py), from which step, and why the others that had a predecessor did not, so
that ``interactor results``, the metrics and the results browser can say what crashes cost.

One row per ``attempts`` row that has something to say (it resumed, or it says why not);
additive like ``attempt_phases`` (consumer/storage/phases.py says why a table of its own), kept
by the same rule: a ``completed`` close wins over any other of the attempt, otherwise the first
stored stays. ``trajectory`` is the "<attempt>:<attempt_id>" whose steps the attempt added to;
``resumed_at`` the first step it ran itself; ``resume_note`` a broker.states.ResumeNote.
"""

from __future__ import annotations

from broker.records import AttemptRecord
from broker.states import AttemptStatus
from consumer.storage import schema
from consumer.storage.sqltext import completed_close_wins

TABLE = schema.ATTEMPT_RESUMES.name
COLUMNS = schema.ATTEMPT_RESUMES.names
SQLITE_DDL = schema.ATTEMPT_RESUMES.ddl(schema.SQLITE)
POSTGRES_DDL = schema.ATTEMPT_RESUMES.ddl(schema.POSTGRES)

INSERT = completed_close_wins(TABLE, COLUMNS, completed=AttemptStatus.COMPLETED)


def rows(closes: list[AttemptRecord]) -> list[tuple]:
    """The attempt_resumes rows of the closes that resumed, or say why they did not."""
    return [(c.episode_id, c.attempt_id, c.job_id, c.status, c.trajectory or None, c.resumed_at or None,
             c.resume_note or None)
            for c in closes if c.resumed_at or c.resume_note]
