"""The results browser's lists: a job's episodes and groups filtered, sorted and paged by
keyset, their counts, the filters' choices, and the job-wide aggregates its pages poll.

A mixin of :class:`consumer.storage.backend.ResultStore`, apart from the job and episode
readers (reads.py) because the results browser (interactor/ui/) is what reads these and they
carry its own rules: which sorts exist and how a sort value from a URL is typed, which sorts are backed by
an index (schema.BROWSE_INDEXES), and keyset paging that costs the same at any depth. These
methods use nothing of a backend but ``query`` and ``query_dicts``; the same SQL runs on
SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Any, Sequence

from broker.states import StoredStatus
from consumer.storage.sqltext import chunks, marks


class StoreBrowse:
    """The browser's filtered, sorted, paged reads (a mixin of ResultStore: needs its
    ``query`` and ``query_dicts``)."""

    EPISODE_SORTS = {"episode_id": "episode_id", "reward": "total_reward", "steps": "steps", "status": "status",
                     "attempts": "attempts", "started": "started_at", "duration": "duration_s",
                     "env_name": "env_name", "group": "group_id"}

    def _episode_filter(self, job_id: str, env_names=None, statuses=None, reward_min=None, reward_max=None,
                        reason=None, attempts_min=None, group_id=None) -> tuple[str, list]:
        where, args = ["job_id = ?"], [job_id]
        if env_names:
            where.append(f"env_name IN ({marks(env_names)})")
            args.extend(env_names)
        if statuses:
            where.append(f"status IN ({marks(statuses)})")
            args.extend(statuses)
        if reward_min is not None:
            where.append("total_reward >= ?")
            args.append(float(reward_min))
        if reward_max is not None:
            where.append("total_reward <= ?")
            args.append(float(reward_max))
        if reason:
            where.append("(reason = ? OR ended_by = ?)")
            args.extend([reason, reason])
        if attempts_min is not None:
            where.append("attempts >= ?")
            args.append(int(attempts_min))
        if group_id:
            where.append("group_id = ?")
            args.append(group_id)
        return " AND ".join(where), args

    #: How each sort key compares in Python: a cursor value from a URL is turned back into it.
    EPISODE_SORT_TYPES = {"episode_id": str, "reward": float, "steps": int, "status": str, "attempts": int,
                          "started": float, "duration": float, "env_name": str, "group": str}
    #: Sorts backed by an index on (job_id, column, episode_id) (schema.BROWSE_INDEXES): a page
    #: is one index seek at any depth. The others sort the job's matching rows (bounded top-N);
    #: more indexes on ``episodes`` would slow the consumer's upserts, measured in the comment
    #: above BROWSE_INDEXES.
    INDEXED_EPISODE_SORTS = ("episode_id", "reward")

    def page_episodes(self, job_id: str, *, sort: str = "episode_id", descending: bool = False, limit: int = 50,
                      after: tuple[Any, str] | None = None, **filters: Any) -> list[dict]:
        """One page of a job's episodes by keyset: the ``limit`` rows that follow ``after`` (the
        ``(sort value, episode_id)`` of the previous page's last row; None: from the start).

        The order is total: the sort column, then episode_id; NULLs come first ascending and last
        descending (SQLite's own order, spelled out so that PostgreSQL pages the same way). Unlike
        OFFSET, a page deep in 100,000 episodes costs what the first one does. Going backwards is
        the same call with ``descending`` flipped and the page reversed.
        """
        col = self.EPISODE_SORTS.get(sort)
        if col is None:
            raise ValueError(f"unknown sort {sort!r}; one of {sorted(self.EPISODE_SORTS)}")
        where, args = self._episode_filter(job_id, **filters)
        return self._keyset_page("episodes", where, args, col, "episode_id", descending, after, limit)

    def list_episodes(self, job_id: str, *, sort: str = "episode_id", descending: bool = False, limit: int = 50,
                      offset: int = 0, **filters: Any) -> list[dict]:
        """A page by OFFSET, for tests and tools that walk a job's episodes (the browser pages by
        keyset, :meth:`page_episodes`: OFFSET reads every row it skips)."""
        where, args = self._episode_filter(job_id, **filters)
        col = self.EPISODE_SORTS.get(sort)
        if col is None:
            raise ValueError(f"unknown sort {sort!r}; one of {sorted(self.EPISODE_SORTS)}")
        order = f"{col} {'DESC' if descending else 'ASC'}, episode_id"
        return self.query_dicts(f"SELECT * FROM episodes WHERE {where} ORDER BY {order} LIMIT ? OFFSET ?",
                                (*args, int(limit), int(offset)))

    def count_episodes(self, job_id: str, **filters: Any) -> int:
        where, args = self._episode_filter(job_id, **filters)
        return int(self.query(f"SELECT COUNT(*) FROM episodes WHERE {where}", args)[0][0])

    GROUP_SORTS = {"group_id": "group_id", "mean": "reward_mean", "std": "reward_std", "completed": "completed",
                   "failed": "failed", "env_name": "env_name"}
    GROUP_SORT_TYPES = {"group_id": str, "mean": float, "std": float, "completed": int, "failed": int,
                        "env_name": str}

    def _group_filter(self, job_id: str, env_names=None, complete=None, zero_std=None) -> tuple[str, list]:
        where, args = ["job_id = ?"], [job_id]
        if env_names:
            where.append(f"env_name IN ({marks(env_names)})")
            args.extend(env_names)
        if complete is not None:
            where.append("complete = ?")
            args.append(1 if complete else 0)
        if zero_std:
            where.append("complete = 1 AND reward_std = 0")
        return " AND ".join(where), args

    def page_groups(self, job_id: str, *, sort: str = "group_id", descending: bool = False, limit: int = 50,
                    after: tuple[Any, str] | None = None, **filters: Any) -> list[dict]:
        """One page of a job's groups, by keyset as :meth:`page_episodes`. Filters: env_names,
        complete (True/False), zero_std (complete groups whose rewards are all equal)."""
        col = self.GROUP_SORTS.get(sort)
        if col is None:
            raise ValueError(f"unknown sort {sort!r}; one of {sorted(self.GROUP_SORTS)}")
        where, args = self._group_filter(job_id, **filters)
        return self._keyset_page("groups", where, args, col, "group_id", descending, after, limit)

    def count_groups(self, job_id: str, **filters: Any) -> int:
        where, args = self._group_filter(job_id, **filters)
        return int(self.query(f"SELECT COUNT(*) FROM groups WHERE {where}", args)[0][0])

    def _keyset_page(self, table: str, where: str, args: list, col: str, id_col: str, descending: bool,
                     after: tuple[Any, str] | None, limit: int) -> list[dict]:
        """Rows of ``table`` matching ``where`` that follow ``after`` in the order (col, id_col).

        The rows fall into two runs, the NULLs of ``col`` and its values, each read by one range
        query on an index of (job_id, col, id) (ascending: NULLs first; descending: values
        first), so a row-value comparison ``(col, id) > (?, ?)`` never meets a NULL.
        """
        limit = max(0, int(limit))
        if limit == 0:
            return []
        d = "DESC" if descending else "ASC"
        gt = "<" if descending else ">"
        runs: list[tuple[str, list, str]] = []  # (condition, args, order)
        if col == id_col:
            runs.append((f"{id_col} {gt} ?" if after is not None else "", [after[1]] if after is not None else [],
                         f"{id_col} {d}"))
        else:
            nulls = (f"{col} IS NULL", [], f"{id_col} {d}")
            values = (f"{col} IS NOT NULL", [], f"{col} {d}, {id_col} {d}")
            if after is None:
                runs = [values, nulls] if descending else [nulls, values]
            elif after[0] is None:
                runs = [(f"{col} IS NULL AND {id_col} {gt} ?", [after[1]], f"{id_col} {d}")]
                if not descending:
                    runs.append(values)
            else:
                runs = [(f"({col}, {id_col}) {gt} (?, ?)", [after[0], after[1]], f"{col} {d}, {id_col} {d}")]
                if descending:
                    runs.append(nulls)
        out: list[dict] = []
        for cond, extra, order in runs:
            sql = f"SELECT * FROM {table} WHERE {where}" + (f" AND {cond}" if cond else "")
            out += self.query_dicts(f"{sql} ORDER BY {order} LIMIT ?", (*args, *extra, limit - len(out)))
            if len(out) >= limit:
                break
        return out

    def job_progress(self, job_id: str) -> dict:
        """What the jobs page polls: episodes per status, steps, mean reward and the time span,
        in one pass over the job's rows (:meth:`results` makes five)."""
        out = {"job_id": job_id, "statuses": {}, "steps": 0, "reward_sum": 0.0, "first_started": None,
               "last_finished": None}
        for status, n, steps, reward, first, last in self.query(
            "SELECT status, COUNT(*), COALESCE(SUM(steps), 0), COALESCE(SUM(total_reward), 0), MIN(started_at), "
            "MAX(finished_at) FROM episodes WHERE job_id = ? GROUP BY status", (job_id,),
        ):
            out["statuses"][status] = int(n)
            out["steps"] += int(steps)
            if status == StoredStatus.COMPLETED:
                out["reward_sum"] = float(reward)
            if first is not None and (out["first_started"] is None or first < out["first_started"]):
                out["first_started"] = first
            if last is not None and (out["last_finished"] is None or last > out["last_finished"]):
                out["last_finished"] = last
        done = out["statuses"].get(StoredStatus.COMPLETED, 0)
        out["mean_reward"] = out["reward_sum"] / done if done else None
        rows = self.query("SELECT episodes, groups, model, created_at FROM jobs WHERE job_id = ?", (job_id,))
        out["episodes_expected"], out["groups_expected"], out["model"], out["created_at"] = (
            rows[0] if rows else (None, None, None, None))
        return out

    def episode_facets(self, job_id: str) -> dict[str, dict[str, int]]:
        """How many of a job's episodes have each env_name, status, ended_by and reason: the
        episode filters' choices, with counts (``None`` keys: not set)."""
        out = {}
        for col in ("env_name", "status", "ended_by", "reason"):
            out[col] = {k: int(n) for k, n in self.query(
                f"SELECT {col}, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY {col} ORDER BY {col}", (job_id,))}
        return out

    def group_members_many(self, group_ids: Sequence[str]) -> dict[str, list[dict]]:
        """The members (episode_id, status, total_reward) of several groups: a page of the
        groups table with each sample's advantage, in one query per 500 groups."""
        out: dict[str, list[dict]] = {g: [] for g in group_ids}
        for chunk in chunks(list(group_ids)):
            for d in self.query_dicts(
                "SELECT group_id, episode_id, status, total_reward FROM episodes "
                f"WHERE group_id IN ({marks(chunk)}) ORDER BY group_id, episode_id", chunk,
            ):
                out.setdefault(d["group_id"], []).append(d)
        return out

    def env_names(self, job_id: str) -> list[str]:
        return [r[0] for r in self.query("SELECT DISTINCT env_name FROM episodes WHERE job_id = ? ORDER BY env_name",
                                         (job_id,))]

    def reward_points(self, job_id: str) -> list[tuple[str, float, float | None]]:
        """(env_name, total reward, finished at) of every completed episode: distributions, trends."""
        return [(e, float(r or 0.0), f) for e, r, f in self.query(
            "SELECT env_name, total_reward, finished_at FROM episodes "
            f"WHERE job_id = ? AND status = '{StoredStatus.COMPLETED}' "
            "ORDER BY finished_at", (job_id,))]
