"""Export a job's trajectories for training: JSONL or Parquet, one row per step.

Each row is one trainable (by default) step of an episode's trajectory (its ``session_steps``
rows; completed episodes by default). ``messages`` is the chat shape TRL / verl read: the prompt actually sent plus the
assistant response as the last message; ``prompt`` is the prompt alone and ``completion`` the
response as a one-message list (TRL's conversational prompt-completion shape).

Filters (all optional): complete groups only (every member of the group completed), episodes no
staler than ``max_staleness`` weight versions, trainable steps only (the default), env names.

Group statistics (GRPO, consumer/storage/group_stats.py): over the *exported* episodes of each
group, the mean and population std of the episode rewards; each row carries its episode's
normalized advantage ``(episode_reward - mean) / (std + eps)``, and ``group_rewards_equal``
flags groups whose rewards are all equal (advantage 0: no learning signal). ``group_size`` is
how many episodes of the group were exported.

Staleness: a weight version is read as a number (``"12"``, or the last integer of ``"v12"`` /
``"step-12"``). An episode's version is the oldest among its steps; it is kept when
``current - version <= max_staleness``, ``current`` being the given current version or else
the newest one in the job. With the filter on, episodes without a readable version are dropped.
With ``complete_groups_only``, a group that lost a member to the staleness filter is dropped too.

Rows come out ordered by group, episode, step. The store is read episode by episode (through
its reader, any backend), so memory stays flat for large jobs (the episode list, one small
tuple per episode, is held).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import orjson

from broker.states import StoredStatus
from consumer.storage import ResultStore, open_store
from consumer.storage.group_stats import ADVANTAGE_EPS, group_stats

COLUMNS = (
    "job_id", "episode_id", "group_id", "env_name", "step_id", "attempt", "messages", "prompt",
    "response", "reward", "episode_reward", "weight_version", "is_trainable", "terminated",
    "truncated", "group_complete", "episode_status", "completion", "group_size", "group_reward_mean",
    "group_reward_std", "advantage", "group_rewards_equal", "prompt_tokens", "completion_tokens", "ended_by",
    # token-exact trajectories (null when the job did not ask): the step's own ids as the
    # server gave them, its token status, and token_drift (see consumer/streams.py)
    "prompt_ids", "completion_ids", "completion_logprobs", "token_status", "token_error", "token_drift",
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
            pa.field("completion", message),
            pa.field("group_size", pa.int32()),
            pa.field("group_reward_mean", pa.float64()),
            pa.field("group_reward_std", pa.float64()),
            pa.field("advantage", pa.float64()),
            pa.field("group_rewards_equal", pa.bool_()),
            pa.field("prompt_tokens", pa.int64()),
            pa.field("completion_tokens", pa.int64()),
            pa.field("ended_by", pa.string()),
            pa.field("prompt_ids", pa.list_(pa.int32())),
            pa.field("completion_ids", pa.list_(pa.int32())),
            pa.field("completion_logprobs", pa.list_(pa.float32())),
            pa.field("token_status", pa.string()),
            pa.field("token_error", pa.string()),
            pa.field("token_drift", pa.int32()),
        ]
    )


@dataclass
class ExportSummary:
    rows: int = 0
    episodes: int = 0
    groups: int = 0
    groups_rewards_equal: int = 0  # exported groups with no reward spread
    dropped_stale: int = 0  # episodes older than max_staleness
    dropped_unversioned: int = 0  # episodes without a readable weight_version (staleness filter on)
    dropped_groups: int = 0  # groups left out by complete_groups_only after staleness
    current_version: float | None = None
    by_env: dict[str, int] = field(default_factory=dict)  # rows per env_name


_LAST_INT = re.compile(r"\d+(?!.*\d)")


def version_number(version: Any) -> float | None:
    """A weight version as a number: the value itself, else the last integer in it; None if none."""
    if version is None:
        return None
    if isinstance(version, (int, float)) and not isinstance(version, bool):
        return float(version)
    text = str(version).strip()
    try:
        value = float(text)
        return value if math.isfinite(value) else None
    except ValueError:
        m = _LAST_INT.search(text)
        return float(m.group(0)) if m else None


def _select_episodes(
    store: ResultStore,
    job_id: str,
    *,
    complete_groups_only: bool,
    episode_statuses: Sequence[str] | None,
    env_names: Sequence[str] | None,
    max_staleness: float | None,
    current_version: Any,
    eps: float,
    summary: ExportSummary,
) -> list[tuple]:
    """The exported episodes, in order, each with its group's statistics:
    ``(episode_id, status, total, group_complete, group_size, mean, std, advantage, equal)``."""
    episodes = store.export_episodes(job_id, statuses=episode_statuses, env_names=env_names,
                                     complete_groups_only=complete_groups_only)
    # (episode_id, attempt_id, status, total, group complete, group id, group size)

    if max_staleness is not None:
        oldest: dict[str, float] = {}
        newest: float | None = None
        for env_id, wv in store.weight_versions(job_id):
            v = version_number(wv)
            if v is None:
                continue
            if env_id not in oldest or v < oldest[env_id]:
                oldest[env_id] = v
            newest = v if newest is None or v > newest else newest
        current = version_number(current_version) if current_version is not None else newest
        summary.current_version = current
        kept = []
        for ep in episodes:
            v = oldest.get(ep[0])
            if v is None or current is None:
                summary.dropped_unversioned += 1
            elif current - v > max_staleness:
                summary.dropped_stale += 1
            else:
                kept.append(ep)
        if complete_groups_only:  # a complete group must still be whole after the filter
            present: dict[str, list[int]] = {}  # group -> [episodes kept, group size]
            for ep in kept:
                present.setdefault(ep[5], [0, ep[6]])[0] += 1
            whole = {g for g, (n, size) in present.items() if n >= size}
            summary.dropped_groups = len(present) - len(whole)
            kept = [ep for ep in kept if ep[5] in whole]
        episodes = kept

    out = []
    i = 0
    while i < len(episodes):
        j = i
        gid = episodes[i][5]
        while j < len(episodes) and episodes[j][5] == gid:
            j += 1
        members = episodes[i:j]
        mean, std, adv, equal = group_stats([float(m[3] or 0.0) for m in members], eps)
        summary.groups += 1
        summary.groups_rewards_equal += 1 if equal else 0
        for m, a in zip(members, adv):
            out.append((m[0], m[2], m[3], m[4], len(members), mean, std, a, equal))
        i = j
    summary.episodes = len(out)
    return out


def _iter_rows(
    store: ResultStore,
    episodes: list[tuple],
    *,
    trainable_only: bool,
    summary: ExportSummary,
) -> Iterator[dict[str, Any]]:
    with_tokens = store.has_step_tokens()
    for ep_id, status, total, gcomplete, gsize, gmean, gstd, adv, equal in episodes:
        tokens = {t["step_id"]: t for t in store.episode_tokens(ep_id)} if with_tokens else {}
        for (s_job, env_id, gid, env_name, step_id, att, messages, response, reward, wv, trainable, term, trunc,
             p_tokens, c_tokens, ended_by) in store.export_steps(ep_id, trainable_only=trainable_only):
            prompt = orjson.loads(messages) if messages else []
            completion = [{"role": "assistant", "content": response}]
            summary.by_env[env_name] = summary.by_env.get(env_name, 0) + 1
            yield {
                "job_id": s_job,
                "episode_id": env_id,
                "group_id": gid,
                "env_name": env_name,
                "step_id": step_id,
                "attempt": att,
                "messages": prompt + completion,
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
                "completion": completion,
                "group_size": gsize,
                "group_reward_mean": gmean,
                "group_reward_std": gstd,
                "advantage": adv,
                "group_rewards_equal": equal,
                "prompt_tokens": p_tokens,
                "completion_tokens": c_tokens,
                "ended_by": ended_by,
                **_token_columns(tokens.get(step_id)),
            }


def _token_columns(t: dict | None) -> dict[str, Any]:
    if t is None:
        return {"prompt_ids": None, "completion_ids": None, "completion_logprobs": None, "token_status": None,
                "token_error": None, "token_drift": None}
    return {"prompt_ids": t["prompt_ids"], "completion_ids": t["completion_ids"],
            "completion_logprobs": t["completion_logprobs"], "token_status": t["token_status"],
            "token_error": t["token_error"], "token_drift": t["token_drift"]}


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


def export_training(
    store_path_or_store: str | os.PathLike | ResultStore,
    job_id: str,
    out_path: str | os.PathLike,
    fmt: str = "jsonl",
    *,
    trainable_only: bool = True,
    complete_groups_only: bool = False,
    episode_statuses: Sequence[str] | None = (StoredStatus.COMPLETED,),
    row_group_size: int = 2048,
    env_names: Sequence[str] | None = None,
    max_staleness: float | None = None,
    current_version: Any = None,
    eps: float = ADVANTAGE_EPS,
) -> ExportSummary:
    """Write one row per exported step to ``out_path`` (see the module docstring).

    ``episode_statuses=None`` exports episodes in every status (see the ``episode_status``
    column). JSONL keeps message content as stored (a string or a list of parts); Parquet
    JSON-encodes list-of-parts content so the column type stays ``list<struct<role, content>>``.
    """
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness!r}")
    store, own, out_path, tmp = _export_target(store_path_or_store, out_path, fmt)
    summary = ExportSummary()
    try:
        episodes = _select_episodes(
            store,
            job_id,
            complete_groups_only=complete_groups_only,
            episode_statuses=None if episode_statuses is None else tuple(episode_statuses),
            env_names=tuple(env_names) if env_names else None,
            max_staleness=max_staleness,
            current_version=current_version,
            eps=eps,
            summary=summary,
        )
        rows = _iter_rows(store, episodes, trainable_only=trainable_only, summary=summary)
        n = _write_jsonl(rows, tmp) if fmt == "jsonl" else _write_parquet(rows, tmp, row_group_size)
        os.replace(tmp, out_path)
        summary.rows = n
        return summary
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if own:
            store.close()


def _export_target(store_path_or_store, out_path, fmt: str) -> tuple[ResultStore, bool, str, str]:
    """``(store, opened here, out path, temporary path)``: an export writes a temporary file
    beside its target and renames it when done, so a reader never sees half a file."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"fmt must be 'jsonl' or 'parquet', got {fmt!r}")
    own = not isinstance(store_path_or_store, ResultStore)
    store = open_store(store_path_or_store, readonly=True) if own else store_path_or_store
    out_path = str(out_path)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    return store, own, out_path, out_path + ".tmp"


def _write_jsonl(rows: Iterable[dict], path: str) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False))
            f.write("\n")
            n += 1
    return n


def _write_parquet(rows: Iterable[dict], path: str, row_group_size: int) -> int:
    def flat(rows: Iterable[dict]) -> Iterator[dict]:
        for row in rows:
            row["messages"] = _flat_messages(row["messages"])
            row["prompt"] = _flat_messages(row["prompt"])
            row["completion"] = _flat_messages(row["completion"])
            yield row

    return _write_parquet_rows(flat(rows), path, parquet_schema(), row_group_size)


def _write_parquet_rows(rows: Iterable[dict], path: str, schema, row_group_size: int) -> int:
    """Rows to a zstd Parquet file in row groups of ``row_group_size``; the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 0
    buf: list[dict] = []
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        def flush():
            writer.write_table(pa.Table.from_pylist(buf, schema=schema))
            buf.clear()

        for row in rows:
            buf.append(row)
            n += 1
            if len(buf) >= row_group_size:
                flush()
        if buf or n == 0:
            flush()  # an empty export still writes a file with the schema
    return n


# --------------------------------------------------------------------------- token streams
def stream_schema():
    import pyarrow as pa

    return pa.schema([
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string()),
        pa.field("env_name", pa.string()),
        pa.field("episode_status", pa.string()),
        pa.field("episode_reward", pa.float64()),
        pa.field("group_size", pa.int32()),
        pa.field("group_reward_mean", pa.float64()),
        pa.field("group_reward_std", pa.float64()),
        pa.field("advantage", pa.float64()),
        pa.field("segment", pa.int32(), nullable=False),
        pa.field("segments", pa.int32(), nullable=False),
        pa.field("first_step", pa.int32()),
        pa.field("last_step", pa.int32()),
        pa.field("starts_because", pa.string()),
        pa.field("drift_at", pa.int32()),
        pa.field("token_drift", pa.bool_()),
        pa.field("steps_without_ids", pa.list_(pa.int32())),
        pa.field("weight_versions", pa.list_(pa.string())),
        pa.field("token_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("logprobs", pa.list_(pa.float32())),
    ])


def export_streams(
    store_path_or_store: str | os.PathLike | ResultStore,
    job_id: str,
    out_path: str | os.PathLike,
    fmt: str = "parquet",
    *,
    complete_groups_only: bool = False,
    episode_statuses: Sequence[str] | None = (StoredStatus.COMPLETED,),
    env_names: Sequence[str] | None = None,
    max_staleness: float | None = None,
    current_version: Any = None,
    eps: float = ADVANTAGE_EPS,
    row_group_size: int = 512,
) -> ExportSummary:
    """One row per token-stream segment of each exported episode (consumer/streams.py): the
    ids, the loss mask (1: the model's tokens) and the logprobs a trainer trains on. An episode
    whose turns all extend one another is one row (``segments`` = 1, ``token_drift`` false);
    otherwise each segment is a row, ``starts_because`` / ``drift_at`` saying why it began.
    Episodes without token rows are left out. Filters as :func:`export_training`."""
    from consumer.streams import build

    store, own, out_path, tmp = _export_target(store_path_or_store, out_path, fmt)
    summary = ExportSummary()
    try:
        episodes = _select_episodes(
            store, job_id, complete_groups_only=complete_groups_only,
            episode_statuses=None if episode_statuses is None else tuple(episode_statuses),
            env_names=tuple(env_names) if env_names else None, max_staleness=max_staleness,
            current_version=current_version, eps=eps, summary=summary)

        def rows() -> Iterator[dict]:
            for ep_id, status, total, gcomplete, gsize, gmean, gstd, adv, equal in episodes:
                token_rows = store.episode_tokens(ep_id)
                if not token_rows:
                    continue
                stream = build(token_rows)
                env = store.episode(ep_id) or {}
                n = len(stream.segments)
                summary.by_env[env.get("env_name")] = summary.by_env.get(env.get("env_name"), 0) + n
                versions = {r["step_id"]: r.get("weight_version") for r in token_rows}
                for k, seg in enumerate(stream.segments):
                    yield {
                        "job_id": job_id, "episode_id": ep_id, "group_id": env.get("group_id"),
                        "env_name": env.get("env_name"), "episode_status": status, "episode_reward": total,
                        "group_size": gsize, "group_reward_mean": gmean, "group_reward_std": gstd, "advantage": adv,
                        "segment": k, "segments": n, "first_step": seg.first_step, "last_step": seg.last_step,
                        "starts_because": seg.starts_because, "drift_at": seg.drift_at,
                        "token_drift": not stream.single, "steps_without_ids": stream.steps_without_ids,
                        # the weights that sampled each turn of the segment, in step order
                        "weight_versions": [versions.get(step) for step in seg.steps],
                        "token_ids": seg.ids, "loss_mask": seg.mask, "logprobs": seg.logprobs,
                    }

        if fmt == "jsonl":
            n = _write_jsonl(rows(), tmp)
        else:
            n = _write_parquet_rows(rows(), tmp, stream_schema(), row_group_size)
        os.replace(tmp, out_path)
        summary.rows = n
        return summary
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if own:
            store.close()
