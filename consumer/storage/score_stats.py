"""How sure a job's scores are: per env_name and per job, the mean reward with its standard error
and a 95% interval, pass@1, pass@k and mean@k over each task's k samples (``env_num`` is k),
and one row per task (which tasks the model always, sometimes or never solves).

docs/results.md says how each number is computed; in short:

* The unit is the **task** (a group: one dataset row, or one entry without a dataset, run
  ``env_num`` times). A task's samples share their question, so they are not independent: the
  standard error of the mean is the cluster-robust one over tasks, ``sqrt(T/(T-1) * sum over
  tasks of (sum of the task's (reward - mean))^2) / N`` for N rewards in T tasks, which is the
  textbook ``s / sqrt(N)`` (``s`` with N-1) when every task has one sample.
* The 95% interval is ``mean ± t * stderr`` with ``t`` Student's 0.975 quantile at T-1 degrees
  of freedom (12.71 for 2 tasks, 2.04 for 31, 1.96 for many).
* Only completed episodes are scored. A failed (dead-lettered) one has no reward: it is an
  infrastructure failure, counted apart (``failed``), never scored 0.
* A sample **solves** its task when its reward is at least ``threshold`` (1.0 by default:
  ``interactor results --pass-threshold``). For a task with n completed samples of which c
  solve it: pass@1 = c / n (the unbiased estimator of Chen et al. 2021 at k = 1), pass@k = 1
  when c > 0 (k = n, every sample drawn), mean@k = the mean of its n rewards. The job's and an
  env_name's pass@1, pass@k and mean@k are their tasks' means, each with the standard error of
  the tasks' values (``s / sqrt(T)``).

Plain Python over the rows the store reads (consumer/storage/reads.py ``score_summary``); the
numbers are the same on every backend.
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple

DEFAULT_THRESHOLD = 1.0  # a sample solves its task when its reward is at least this

# Student's t, 0.975 quantile, for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t975(df: int) -> float:
    """Student's t 0.975 quantile at ``df`` degrees of freedom: the table to 30, beyond it the
    Cornish-Fisher expansion around the normal's 1.96 (within 0.001 of the exact value)."""
    if df < 1:
        raise ValueError("t needs at least one degree of freedom")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


class Sample(NamedTuple):
    """One episode of a task: its env_name, whether it failed (dead-lettered), and its reward
    once completed (None: not completed: failed, cancelled, or not through yet)."""

    group_id: str
    env_name: str
    reward: float | None
    failed: bool = False


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard error (s with n-1, over sqrt(n)) of independent values."""
    n = len(values)
    if not n:
        return None, None
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def summarize(tasks: dict[str, list[float]], failed: int, threshold: float) -> dict:
    """The statistics of one set of tasks (group id -> its completed samples' rewards)."""
    scored = {g: r for g, r in tasks.items() if r}
    rewards = [x for r in scored.values() for x in r]
    n, t = len(rewards), len(scored)
    out = {"episodes": n, "tasks": t, "failed": failed, "mean": None, "stderr": None, "ci95": None,
           "pass@1": None, "pass@1_stderr": None, "pass@k": None, "pass@k_stderr": None,
           "mean@k": None, "mean@k_stderr": None, "k": None}
    if not n:
        return out
    mean = math.fsum(rewards) / n
    out["mean"] = mean
    if t >= 2:
        clustered = math.fsum(math.fsum(x - mean for x in r) ** 2 for r in scored.values())
        se = math.sqrt(t / (t - 1) * clustered) / n
        half = t975(t - 1) * se
        out["stderr"], out["ci95"] = se, [mean - half, mean + half]
    sizes = {len(r) for r in scored.values()}
    out["k"] = sizes.pop() if len(sizes) == 1 else "mixed"
    solved = [sum(1 for x in r if x >= threshold) for r in scored.values()]
    out["pass@1"], out["pass@1_stderr"] = mean_se([c / len(r) for c, r in zip(solved, scored.values())])
    out["pass@k"], out["pass@k_stderr"] = mean_se([1.0 if c else 0.0 for c in solved])
    out["mean@k"], out["mean@k_stderr"] = mean_se([math.fsum(r) / len(r) for r in scored.values()])
    return out


def score_summary(samples: Iterable[Sample], threshold: float = DEFAULT_THRESHOLD) -> dict:
    """``{"threshold", "job": {...}, "by_env": {env_name: {...}}}`` (:func:`summarize`'s fields)
    over every episode of a job; rewards that are no finite number are not scored."""
    tasks: dict[str, list[float]] = {}
    env_of: dict[str, str] = {}
    failed_by_env: dict[str, int] = {}
    for s in samples:
        env_of.setdefault(s.group_id, s.env_name)
        bucket = tasks.setdefault(s.group_id, [])
        if s.failed:
            failed_by_env[s.env_name] = failed_by_env.get(s.env_name, 0) + 1
        elif s.reward is not None and math.isfinite(s.reward):
            bucket.append(float(s.reward))
    by_env: dict[str, dict] = {}
    for env in sorted(set(env_of.values())):
        mine = {g: r for g, r in tasks.items() if env_of[g] == env}
        by_env[env] = summarize(mine, failed_by_env.get(env, 0), threshold)
    return {"threshold": threshold, "job": summarize(tasks, sum(failed_by_env.values()), threshold),
            "by_env": by_env}


def task_rows(samples: Iterable[Sample], threshold: float = DEFAULT_THRESHOLD) -> list[dict]:
    """One row per task, in the order given: its env_name, samples, completed, solved, mean reward,
    and ``solved_by``: always, sometimes, never (of its completed samples), or - (none completed)."""
    rows: dict[str, dict] = {}
    for s in samples:
        row = rows.setdefault(s.group_id, {"group_id": s.group_id, "env_name": s.env_name, "samples": 0,
                                           "completed": 0, "solved": 0, "rewards": []})
        row["samples"] += 1
        if s.reward is not None and math.isfinite(s.reward):
            row["completed"] += 1
            row["solved"] += s.reward >= threshold
            row["rewards"].append(float(s.reward))
    out = []
    for row in rows.values():
        rewards = row.pop("rewards")
        row["mean"] = math.fsum(rewards) / len(rewards) if rewards else None
        c, n = row["solved"], row["completed"]
        row["solved_by"] = "-" if not n else "always" if c == n else "never" if not c else "sometimes"
        out.append(row)
    return out
