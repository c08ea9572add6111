"""Pieces of SQL text that the writer (backend.py), the backends and the readers (reads.py,
browse.py) all build the same way, kept here so that none of them imports another for them.

Every statement is written with ``?`` placeholders (the PostgreSQL backend swaps them for its
driver's ``%s``).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

#: Ids per ``IN (...)`` list: far below SQLite's limit on a statement's parameters (999 in
#: older builds) and PostgreSQL's (65,535).
CHUNK = 500


def marks(items: Sequence[Any]) -> str:
    """``?, ?, ?``: one placeholder per item."""
    return ", ".join("?" for _ in items)


def values(columns: Sequence[str], **exprs: str) -> str:
    """The VALUES list of an insert into ``columns``: ``?`` for each, or the SQL expression
    given for a column (a literal, or the backend's conversion of epoch seconds)."""
    return ", ".join(exprs.get(c, "?") for c in columns)


def chunks(items: Sequence[Any], n: int = CHUNK) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def completed_close_wins(table: str, columns: Sequence[str], status: str = "status", completed: str = "completed"
                         ) -> str:
    """The insert of a per-attempt table keyed ``(episode_id, attempt_id)`` by its first two
    columns: a ``completed`` close replaces any other of the attempt, otherwise the first stored
    stays (the rule of ``attempts`` and of the additive tables beside it)."""
    return (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks(columns)}) "
            "ON CONFLICT (episode_id, attempt_id) DO UPDATE SET "
            + ", ".join(f"{c} = excluded.{c}" for c in columns[2:])
            + f" WHERE excluded.{status} = '{completed}' AND {table}.{status} <> '{completed}'")
