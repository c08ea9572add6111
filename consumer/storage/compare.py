"""Two jobs side by side (``interactor compare A B``, the browser's compare page): per env_name the
mean reward of each with its standard error, the difference and whether it is more than noise,
and the task rows one job solves and the other does not.

The numbers, computed here by hand over the rows the store reads (consumer/storage/reads.py
``compare_jobs``); docs/results.md#comparing-two-jobs says the same for users:

* Per job and env_name: the mean reward of the completed episodes and its standard error, as
  ``interactor results`` has them (consumer/storage/score_stats.py: over tasks, which is the
  textbook ``s / sqrt(n)`` when each task ran once).
* The difference is B's mean minus A's, its standard error ``sqrt(se_a^2 + se_b^2)`` (the two
  jobs' samples are independent); it is **more than noise** when ``|diff| > 2 * se_diff``
  (about a 95% two-sided test). A side with fewer than two tasks has no standard error: then
  nothing is said about noise.
* A task row is matched across the jobs by its env_name and what it asked (its dataset row, else
  its env_params: what ``results --rows`` shows), so the same task file run twice matches row by
  row whatever the job ids. A row is **solved** by a job when the mean reward of its completed
  samples is above 0, or at least ``threshold`` when one is given (``--pass-threshold``). Rows
  asked by one job only are counted apart, never called solved by the other.
"""

from __future__ import annotations

import math
from typing import Iterable

from consumer.storage.score_stats import Sample, score_summary

NOISE_RULE = "more than noise when |B - A| > 2 * sqrt(se_A^2 + se_B^2)"


def _side(e: dict | None) -> dict:
    e = e or {}
    return {"episodes": e.get("episodes", 0), "tasks": e.get("tasks", 0), "failed": e.get("failed", 0),
            "mean": e.get("mean"), "stderr": e.get("stderr")}


def difference(a: dict, b: dict) -> dict:
    """B - A, its standard error and whether it is more than noise (None: not known)."""
    if a["mean"] is None or b["mean"] is None:
        return {"diff": None, "se_diff": None, "beyond_noise": None}
    diff = b["mean"] - a["mean"]
    if a["stderr"] is None or b["stderr"] is None:
        return {"diff": diff, "se_diff": None, "beyond_noise": None}
    se = math.sqrt(a["stderr"] ** 2 + b["stderr"] ** 2)
    return {"diff": diff, "se_diff": se, "beyond_noise": abs(diff) > 2 * se}


def task_key(env_name: str, task: str, group_id: str, job_id: str) -> tuple[str, str]:
    """How a task row is known across jobs: its env_name and what it asked; a task that asked
    nothing (no dataset, no params) by its group id without the job's prefix."""
    if task and task != "{}":
        return env_name, task
    prefix = job_id + "."
    return env_name, "#" + (group_id[len(prefix):] if group_id.startswith(prefix) else group_id)


def _rows(samples: list[Sample], asked: dict[str, str], job_id: str) -> dict[tuple, dict]:
    """Per task key: its group, env_name, what it asked and its completed rewards. A key asked
    twice in one job (the same dataset row twice) gets its occurrence number."""
    by_group: dict[str, dict] = {}
    for s in samples:
        row = by_group.setdefault(s.group_id, {"group_id": s.group_id, "env_name": s.env_name,
                                               "task": asked.get(s.group_id, ""), "rewards": []})
        if s.reward is not None and math.isfinite(s.reward):
            row["rewards"].append(float(s.reward))
    out: dict[tuple, dict] = {}
    for row in by_group.values():
        key = task_key(row["env_name"], row["task"], row["group_id"], job_id)
        n = 1
        while (key + (str(n),) if n > 1 else key) in out:
            n += 1
        out[key + (str(n),) if n > 1 else key] = row
    return out


def _solved(row: dict, threshold: float | None) -> bool | None:
    if not row["rewards"]:
        return None  # nothing completed: neither solved nor not
    mean = math.fsum(row["rewards"]) / len(row["rewards"])
    return mean > 0 if threshold is None else mean >= threshold


def compare(job_a: str, samples_a: Iterable[Sample], asked_a: dict[str, str],
            job_b: str, samples_b: Iterable[Sample], asked_b: dict[str, str], threshold: float | None = None) -> dict:
    """``samples_*``: each job's episodes (reads.py ``score_samples``); ``asked_*``: group id ->
    what its task asked (JSON text). Returns ``{"a", "b", "rule", "threshold", "by_env": {env:
    {"a": side, "b": side, "diff", "se_diff", "beyond_noise"}}, "job": {...}, "only_a": rows,
    "only_b": rows, "matched", "unmatched_a", "unmatched_b"}``; ``only_a``: rows A solves and B
    does not, each ``{"env_name", "task", "group_a", "group_b", "mean_a", "mean_b"}``."""
    samples_a, samples_b = list(samples_a), list(samples_b)
    sa, sb = score_summary(samples_a), score_summary(samples_b)
    by_env = {}
    for env in sorted(set(sa["by_env"]) | set(sb["by_env"])):
        a, b = _side(sa["by_env"].get(env)), _side(sb["by_env"].get(env))
        by_env[env] = {"a": a, "b": b, **difference(a, b)}
    a, b = _side(sa["job"]), _side(sb["job"])
    rows_a, rows_b = _rows(samples_a, asked_a, job_a), _rows(samples_b, asked_b, job_b)
    only_a, only_b = [], []
    for key in [k for k in rows_a if k in rows_b]:
        ra, rb = rows_a[key], rows_b[key]
        got_a, got_b = _solved(ra, threshold), _solved(rb, threshold)
        row = {"env_name": ra["env_name"], "task": ra["task"], "group_a": ra["group_id"], "group_b": rb["group_id"],
               "mean_a": math.fsum(ra["rewards"]) / len(ra["rewards"]) if ra["rewards"] else None,
               "mean_b": math.fsum(rb["rewards"]) / len(rb["rewards"]) if rb["rewards"] else None}
        if got_a and got_b is False:
            only_a.append(row)
        elif got_b and got_a is False:
            only_b.append(row)
    matched = sum(1 for k in rows_a if k in rows_b)
    return {"a": job_a, "b": job_b, "rule": NOISE_RULE, "threshold": threshold,
            "solved_rule": "mean reward of its completed samples " + ("> 0" if threshold is None else f">= {threshold:g}"),
            "by_env": by_env, "job": {"a": a, "b": b, **difference(a, b)},
            "only_a": only_a, "only_b": only_b, "matched": matched,
            "unmatched_a": len(rows_a) - matched, "unmatched_b": len(rows_b) - matched}
