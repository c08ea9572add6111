"""Export a job's trajectories for training: JSONL or Parquet, one row per step.

Each row is one trainable (by default), non-superseded step of an episode (completed episodes by
default). ``messages`` is the chat shape TRL / verl read: the prompt actually sent plus the
assistant response as the last message; ``prompt`` is the prompt alone.

Rows come out ordered by group, episode, step. The database is read episode by episode through
the ``(env_id, attempt, step_id)`` index, so memory stays flat for large jobs.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Iterator, Sequence

from consumer.store import EP_COMPLETED, Store

COLUMNS = (
    "job_id", "episode_id", "group_id", "env_name", "step_id", "attempt", "messages", "prompt",
    "response", "reward", "episode_reward", "weight_version", "is_trainable", "terminated",
    "truncated", "group_complete", "episode_status",
)


def parquet_schema():
    import pyarrow as pa

    message = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
    return pa.schema(
        [
            pa.field("job_id", pa.string(), nullable=False),
            pa.field("episode_id", pa.string(), nullable=False),
            pa.field("group_id", pa.string()),
            pa.field("env_name", pa.string()),
            pa.field("step_id", pa.int32(), nullable=False),
            pa.field("attempt", pa.int32(), nullable=False),
            pa.field("messages", message),
            pa.field("prompt", message),
            pa.field("response", pa.string()),
            pa.field("reward", pa.float64()),
            pa.field("episode_reward", pa.float64()),
            pa.field("weight_version", pa.string()),
            pa.field("is_trainable", pa.bool_()),
            pa.field("terminated", pa.bool_()),
            pa.field("truncated", pa.bool_()),
            pa.field("group_complete", pa.bool_()),
            pa.field("episode_status", pa.string()),
        ]
    )


def _iter_rows(
    store: Store,
    job_id: str,
    *,
    trainable_only: bool,
    complete_groups_only: bool,
    episode_statuses: Sequence[str] | None,
) -> Iterator[dict[str, Any]]:
    conn = store.connection()
    where = ["e.job_id = ?"]
    args: list[Any] = [job_id]
    if episode_statuses is not None:
        where.append(f"e.status IN ({','.join('?' * len(episode_statuses))})")
        args.extend(episode_statuses)
    if complete_groups_only:
        where.append("g.complete = 1")
    with store.lock:
        episodes = conn.execute(
            "SELECT e.episode_id, e.attempt, e.status, e.total_reward, COALESCE(g.complete, 0) "
            "FROM episodes e LEFT JOIN groups g ON g.group_id = e.group_id "
            f"WHERE {' AND '.join(where)} ORDER BY e.group_id, e.episode_id",
            args,
        ).fetchall()
    step_sql = (
        "SELECT job_id, env_id, group_id, env_name, step_id, attempt, messages, response, step_reward, "
        "weight_version, is_trainable, terminated, truncated FROM session_steps "
        "WHERE env_id = ? AND attempt = ? AND superseded = 0"
        + (" AND is_trainable = 1" if trainable_only else "")
        + " ORDER BY step_id"
    )
    for ep_id, attempt, status, total, gcomplete in episodes:
        with store.lock:
            steps = conn.execute(step_sql, (ep_id, attempt)).fetchall()
        for (s_job, env_id, gid, env_name, step_id, att, messages, response, reward, wv, trainable, term, trunc) in steps:
            prompt = json.loads(messages) if messages else []
            yield {
                "job_id": s_job,
                "episode_id": env_id,
                "group_id": gid,
                "env_name": env_name,
                "step_id": step_id,
                "attempt": att,
                "messages": prompt + [{"role": "assistant", "content": response}],
                "prompt": prompt,
                "response": response,
                "reward": reward,
                "episode_reward": total,
                "weight_version": None if wv is None else str(wv),
                "is_trainable": bool(trainable),
                "terminated": bool(term),
                "truncated": bool(trunc),
                "group_complete": bool(gcomplete),
                "episode_status": status,
            }


def _flat_messages(msgs: Iterable[Any]) -> list[dict[str, str | None]]:
    """Messages as {role, content: string}; list-of-parts content is JSON-encoded."""
    out = []
    for m in msgs:
        if not isinstance(m, dict):
            out.append({"role": None, "content": json.dumps(m, ensure_ascii=False)})
            continue
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False)
        role = m.get("role")
        out.append({"role": None if role is None else str(role), "content": content})
    return out


def export_job(
    store_path_or_store: str | os.PathLike | Store,
    job_id: str,
    out_path: str | os.PathLike,
    fmt: str = "jsonl",
    *,
    trainable_only: bool = True,
    complete_groups_only: bool = False,
    episode_statuses: Sequence[str] | None = (EP_COMPLETED,),
    row_group_size: int = 2048,
) -> int:
    """Write one row per exported step to ``out_path``; returns the number of rows.

    ``episode_statuses=None`` exports episodes in every status (see the ``episode_status``
    column). JSONL keeps message content as stored (a string or a list of parts); Parquet
    JSON-encodes list-of-parts content so the column type stays ``list<struct<role, content>>``.
    """
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"fmt must be 'jsonl' or 'parquet', got {fmt!r}")
    own = not isinstance(store_path_or_store, Store)
    if own:
        if not os.path.exists(store_path_or_store):
            raise FileNotFoundError(f"no results database at {store_path_or_store}")
        store = Store(str(store_path_or_store))
    else:
        store = store_path_or_store
    out_path = str(out_path)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    try:
        rows = _iter_rows(
            store,
            job_id,
            trainable_only=trainable_only,
            complete_groups_only=complete_groups_only,
            episode_statuses=None if episode_statuses is None else tuple(episode_statuses),
        )
        n = _write_jsonl(rows, tmp) if fmt == "jsonl" else _write_parquet(rows, tmp, row_group_size)
        os.replace(tmp, out_path)
        return n
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if own:
            store.close()


def _write_jsonl(rows: Iterable[dict], path: str) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False))
            f.write("\n")
            n += 1
    return n


def _write_parquet(rows: Iterable[dict], path: str, row_group_size: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    n = 0
    buf: list[dict] = []
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        def flush():
            writer.write_table(pa.Table.from_pylist(buf, schema=schema))
            buf.clear()

        for row in rows:
            row["messages"] = _flat_messages(row["messages"])
            row["prompt"] = _flat_messages(row["prompt"])
            buf.append(row)
            n += 1
            if len(buf) >= row_group_size:
                flush()
        if buf or n == 0:
            flush()  # an empty export still writes a file with the schema
    return n
