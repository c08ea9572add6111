"""Retry honesty: a job's completed episodes split into those that completed on their first try
and those that needed retries, per env_name, with their mean rewards, and its failed episodes.

An episode is **retried** when an attempt of it that counted failed before the attempt that
completed it: a closed attempt other than the completing one whose status is ``retrying``,
``failed`` or ``abandoned`` (a lost worker), leaving out what never counts against an episode
(broker/closing.py): a hand-back at a worker's shutdown (``abandoned``, ``worker_shutdown``),
an attempt ended by a server's outage (its error carries closing.OUTAGE_NOTE) and a cancelled
one. A completed episode with no such attempt completed on its **first try**, even when its
trajectory went on through a hand-back (broker/resume.py). docs/results.md says so for users:
retries that end in success make a reward rosier than a first-try run would, so the two are
shown apart.
"""

from __future__ import annotations

import math
from typing import Iterable

from broker import errors
from broker.closing import OUTAGE_NOTE
from broker.states import AttemptStatus, StoredStatus
from consumer.storage.score_stats import mean_se

# One row per completed episode: env_name, total reward, and how many of its other attempts counted.
SQL = (
    "SELECT e.env_name, e.total_reward, "
    "COALESCE(SUM(CASE WHEN a.attempt_id IS NOT NULL AND a.attempt_id <> COALESCE(e.completed_attempt_id, '') "
    f"AND a.status IN ('{AttemptStatus.RETRYING}', '{AttemptStatus.FAILED}', '{AttemptStatus.ABANDONED}') "
    f"AND NOT (a.status = '{AttemptStatus.ABANDONED}' AND COALESCE(a.reason, '') = '{errors.WORKER_SHUTDOWN}') "
    "AND COALESCE(a.error, '') NOT LIKE ? THEN 1 ELSE 0 END), 0) "
    "FROM episodes e LEFT JOIN attempts a ON a.episode_id = e.episode_id "
    f"WHERE e.job_id = ? AND e.status = '{StoredStatus.COMPLETED}' GROUP BY e.episode_id, e.env_name, e.total_reward")
FAILED_SQL = (f"SELECT env_name, COUNT(*) FROM episodes WHERE job_id = ? AND status = '{StoredStatus.FAILED}' "
              "GROUP BY env_name")


def args(job_id: str) -> tuple[str, str]:
    return (f"%{OUTAGE_NOTE.strip()}%", job_id)


def _part(rewards: list[float]) -> dict:
    """Completed episodes, their mean reward and its standard error (s with n-1, over sqrt(n))."""
    mean, se = mean_se(rewards)
    return {"completed": len(rewards), "mean": mean, "stderr": se}


def split(rows: Iterable[tuple], failed: dict[str, int]) -> dict:
    """``rows``: (env_name, reward, counted earlier attempts) of each completed episode (:data:`SQL`);
    ``failed``: dead-lettered episodes per env_name. Returns ``{"job": {...}, "by_env": {env:
    {...}}}``, each ``{"first_try": part, "retried": part, "failed": n, "retried_share": r}`` with
    ``part`` = ``{"completed", "mean", "stderr"}``; ``retried_share``: retried / completed."""
    by_env: dict[str, tuple[list[float], list[float]]] = {}
    for env, reward, counted in rows:
        first, again = by_env.setdefault(env or "", ([], []))
        if reward is not None and math.isfinite(float(reward)):
            (again if int(counted or 0) else first).append(float(reward))
    for env in failed:
        by_env.setdefault(env or "", ([], []))

    def summary(first: list[float], again: list[float], n_failed: int) -> dict:
        done = len(first) + len(again)
        return {"first_try": _part(first), "retried": _part(again), "failed": n_failed,
                "retried_share": len(again) / done if done else None}

    out = {env: summary(f, a, int(failed.get(env, 0))) for env, (f, a) in sorted(by_env.items())}
    every_first = [r for f, _ in by_env.values() for r in f]
    every_again = [r for _, a in by_env.values() for r in a]
    return {"job": summary(every_first, every_again, sum(int(n) for n in failed.values())), "by_env": out}
