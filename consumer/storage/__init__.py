"""Where results live: ``open_store(target)`` picks the backend from the target.

* ``postgresql://user@host:5432/db`` (or ``postgres://``): PostgreSQL (:mod:`.postgres`), for
  fleets whose consumers, exports and readers share one database server;
* anything else, a path or ``sqlite:///path``: one SQLite file (:mod:`.sqlite`), the default
  (``<run_dir>/results.sqlite``).

``INTERACTOR_STORE_URL`` (or ``--store``) names it; every role that reads or writes results
opens it through here.
"""

from __future__ import annotations

import os

from consumer.storage.backend import ResultStore, StoreError, WriteResult

__all__ = ["open_store", "is_postgres", "sqlite_path", "ResultStore", "StoreError", "WriteResult"]


def is_postgres(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


def sqlite_path(target: str | os.PathLike) -> str | None:
    """The SQLite file a target names (a path or ``sqlite:///path``); None for PostgreSQL."""
    target = os.fspath(target)
    if is_postgres(target):
        return None
    if target.startswith("sqlite://"):
        target = target[len("sqlite://"):]
        if target.startswith("/") and target[1:2] == "/":
            target = target[1:]  # sqlite:///abs/path -> /abs/path
    return target


def open_store(target: str | os.PathLike, *, readonly: bool = False) -> ResultStore:
    """Open (and create or migrate, unless ``readonly``) the results store at ``target``."""
    target = os.fspath(target)
    if not target:
        raise StoreError("no results store given")
    if is_postgres(target):
        from consumer.storage.postgres import PostgresStore

        return PostgresStore(target, readonly=readonly)
    target = sqlite_path(target)
    if "://" in target:
        raise StoreError(f"unknown results store {target!r}: give a file path, sqlite:///path or postgresql://...")
    from consumer.storage.sqlite import SQLiteStore

    return SQLiteStore(target, readonly=readonly)
