"""Why a write failed: the store is unavailable (wait and retry the same records) or it
rejected the data (find the record at fault and park it). The consumer's whole error policy
rests on this split (consumer/ingest.py)."""

from __future__ import annotations

import sqlite3

from consumer.storage.backend import StoreError


class StoreUnavailable(StoreError):
    """The store cannot take any write now: disk full or read-only, I/O error, locked for too
    long, database server down. Nothing about the records themselves."""


class StoreRejected(StoreError):
    """The store refused these records (a value it cannot hold, a constraint): another batch
    would be stored."""


_SQLITE_UNAVAILABLE = ("disk is full", "disk i/o error", "database is locked", "readonly database",
                       "unable to open", "database table is locked", "no such table", "no such column",
                       "out of memory", "database disk image is malformed", "cannot commit", "file is not a database",
                       "access permission denied")

# PostgreSQL SQLSTATE classes that say nothing about the records: the connection or the login
# (08, 28), the database or schema (3D, 3F), the statement against this store's tables and
# grants (42: a dropped table, a revoked privilege, a schema older than the code - another
# record would fail the same way, so parking the lone record of a batch would lose it),
# concurrency (40), a read-only or aborted transaction (25), resources (53), objects busy (55),
# the server shutting down (57), I/O (58) and internal errors (XX). The data classes (22 data
# exception, 23 constraint) and the rest stay "rejected".
_PG_UNAVAILABLE_CLASSES = frozenset({"08", "28", "3D", "3F", "42", "40", "25", "53", "55", "57", "58", "XX"})


def classify(exc: BaseException) -> StoreError:
    """``StoreUnavailable`` or ``StoreRejected`` for an exception raised by a write."""
    if isinstance(exc, (StoreUnavailable, StoreRejected)):
        return exc
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (OSError, MemoryError)):
        return StoreUnavailable(text)
    if isinstance(exc, sqlite3.Error):
        msg = str(exc).lower()
        if isinstance(exc, sqlite3.OperationalError) and any(m in msg for m in _SQLITE_UNAVAILABLE):
            return StoreUnavailable(text)
        return StoreRejected(text)
    try:
        import psycopg
    except ImportError:  # pragma: no cover
        psycopg = None
    if psycopg is not None and isinstance(exc, psycopg.Error):
        state = getattr(exc, "sqlstate", None) or ""
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) or state[:2] in _PG_UNAVAILABLE_CLASSES:
            return StoreUnavailable(text)
        return StoreRejected(text)
    if isinstance(exc, StoreError):
        return StoreUnavailable(text)
    return StoreRejected(text)  # TypeError, ValueError, OverflowError...: the data
