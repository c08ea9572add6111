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
