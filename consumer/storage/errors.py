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
                       "unable to open", "database table is locked", "no such table", "out of memory",
                       "database disk image is malformed", "cannot commit", "file is not a database")


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
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) or getattr(exc, "sqlstate", "") in (
                "53100", "53200", "53300", "57P01", "57P02", "57P03", "25006", "40001", "40P01"):
            return StoreUnavailable(text)
        return StoreRejected(text)
    if isinstance(exc, StoreError):
        return StoreUnavailable(text)
    return StoreRejected(text)  # TypeError, ValueError, OverflowError...: the data
