"""The ``job_audit`` table: every change made to a job (broker/audit.py's entries, each an
``AuditEntry`` record on the results stream), so that the browser shows who changed a job and
when after the run's Redis is gone. Additive, as ``step_cached``: created by a writer that opens
a store lacking it (no schema version); keyed by ``(job_id, entry_id)``, so a record stored again
changes nothing.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from broker.control_records import AuditEntry
from consumer.storage import schema

TABLE = schema.JOB_AUDIT.name
COLUMNS = schema.JOB_AUDIT.names
SQLITE_DDL = schema.JOB_AUDIT.ddl(schema.SQLITE)
POSTGRES_DDL = schema.JOB_AUDIT.ddl(schema.POSTGRES)

INSERT = (f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)}) "
          "ON CONFLICT (job_id, entry_id) DO NOTHING")
SELECT = (f"SELECT at, who, action, detail FROM {TABLE} WHERE job_id = ? "
          "ORDER BY at DESC, entry_id DESC LIMIT ?")


def rows(entries: Iterable[AuditEntry]) -> list[tuple]:
    """The rows of these entries (text without NUL: PostgreSQL's text refuses it)."""
    def clean(x: Any) -> str:
        return str(x or "").replace("\x00", "")

    return [(clean(e.job_id), clean(e.entry_id), float(e.at or 0.0), clean(e.who)[:200], clean(e.action)[:64],
             clean(e.detail)) for e in entries]


def entries(store, job_id: str, limit: int = 200) -> list[dict[str, Any]]:
    """The job's newest ``limit`` entries, newest first, in broker/audit.py's shape ([]: a store
    without the table, one written before it existed)."""
    if not store.has_table(TABLE):
        return []
    out = []
    for at, who, action, detail in store.query(SELECT, (job_id, int(limit))):
        try:
            parsed = json.loads(detail) if detail else {}
        except ValueError:
            parsed = {"text": detail}
        out.append({"at": at, "who": who, "action": action, "detail": parsed})
    return out
