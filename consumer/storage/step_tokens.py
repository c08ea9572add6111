"""The ``step_tokens`` table: one row per step that asked for tokens (docs/protocol.md, "What is
stored"), kept apart from ``session_steps`` so that the original table's columns stay as they
are and a store without tokens pays nothing.

Keyed by ``(session_id, attempt_id, step_id)``, like ``superseded_steps``: a row does not move
when its attempt is set aside; an episode's trajectory's tokens are the rows whose attempt is
the one its ``session_steps`` rows carry (readers join on it).

Ids and logprobs are the packed bytes the worker made (broker/tokens.py: int32 / float32
little-endian) stored as they came, BLOB in SQLite and BYTEA in PostgreSQL; the sampled
tokens' strings as the server spelled them, as JSON text (for people reading them: a trainer
needs the ids only; for servers without ids they are all there is).

Schema step ("tokens", additive): a writer opening a store that lacks the table creates it
(and its index); nothing else changes, so older code keeps reading and writing the store, and
the store's schema version (``PRAGMA user_version`` / ``store_meta``) is not touched by it.
A reader of a store without the table sees no tokens. Its columns are declared with the other
tables' in schema.py.
"""

from __future__ import annotations

from typing import Any, Iterable

import orjson

from broker.records import StepRecord
from broker.tokens import ID_BYTES
from consumer.storage import schema

TABLE = schema.STEP_TOKENS.name
COLUMNS = schema.STEP_TOKENS.insert_columns
SQLITE_DDL = schema.STEP_TOKENS.ddl(schema.SQLITE)
POSTGRES_DDL = schema.STEP_TOKENS.ddl(schema.POSTGRES)

INSERT = (f"INSERT INTO step_tokens ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)}) "
          "ON CONFLICT (session_id, attempt_id, step_id) DO NOTHING")


def rows(steps: Iterable[StepRecord]) -> list[tuple]:
    """The step_tokens rows of the steps that asked for tokens."""
    out = []
    for s in steps:
        if not getattr(s, "token_status", ""):
            continue
        p, c = s.prompt_ids, s.completion_ids
        texts = s.completion_token_texts
        out.append((
            s.env_id, s.attempt_id or f"n{s.attempt}", s.step_id, s.job_id, s.token_source, s.token_status,
            s.token_error or None, s.token_drift,
            None if p is None else len(p) // ID_BYTES, None if c is None else len(c) // ID_BYTES,
            p, c, s.completion_logprobs,
            None if texts is None else orjson.dumps(texts).decode(),
            None if s.weight_version is None else str(s.weight_version),
        ))
    return out


def decode_row(d: dict[str, Any]) -> dict[str, Any]:
    """A step_tokens row with its ids and logprobs as lists."""
    from broker.tokens import unpack_ids, unpack_logprobs

    d = dict(d)
    d["prompt_ids"] = unpack_ids(d.get("prompt_ids"))
    d["completion_ids"] = unpack_ids(d.get("completion_ids"))
    d["completion_logprobs"] = unpack_logprobs(d.get("completion_logprobs"))
    t = d.get("completion_token_texts")
    d["completion_token_texts"] = orjson.loads(t) if t else None
    return d
