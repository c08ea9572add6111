"""A job's tokens and cost from the store: the usage of every stored step of it, its trajectories'
and the steps set aside (a cancelled, lost or superseded attempt's calls were made and paid for
too), beside the budgets its spec had (broker/job_budgets.py).

A step answered from the response cache (``step_cached``) made no call and costs nothing: counted
apart. A step whose server reported no usage is counted as unknown. Read through the episodes'
index (a job's steps are found by their session ids), the same SQL on both backends.
"""

from __future__ import annotations

from typing import Any

from broker.job_budgets import JobBudget
from consumer.storage import schema

_STEPS = ("SELECT session_id, attempt_id, step_id, prompt_tokens, completion_tokens FROM {table} "
          "WHERE session_id IN (SELECT episode_id FROM episodes WHERE job_id = ?)")


def sql(with_cached: bool) -> str:
    """One row: prompt tokens, completion tokens, steps with no usage, cached steps."""
    steps = " UNION ALL ".join(_STEPS.format(table=t) for t in (schema.SESSION_STEPS.name,
                                                                  schema.SUPERSEDED_STEPS.name))
    cached = ("c.session_id IS NOT NULL" if with_cached else "0 = 1")
    join = (f" LEFT JOIN {schema.STEP_CACHED.name} c ON c.session_id = s.session_id "
            "AND c.attempt_id = s.attempt_id AND c.step_id = s.step_id" if with_cached else "")
    return (f"SELECT COALESCE(SUM(CASE WHEN {cached} THEN 0 ELSE s.prompt_tokens END), 0), "
            f"COALESCE(SUM(CASE WHEN {cached} THEN 0 ELSE s.completion_tokens END), 0), "
            f"COALESCE(SUM(CASE WHEN NOT ({cached}) AND s.prompt_tokens IS NULL AND s.completion_tokens IS NULL "
            "THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN {cached} THEN 1 ELSE 0 END), 0) FROM ({steps}) s{join}")


def usage(row: tuple, spec: dict[str, Any] | None, cancelled: int) -> dict[str, Any]:
    """The job's usage as ``results`` shows it: tokens, cost (None: its model has no price), the
    budgets and how much of each is used, and whether a budget was reached with episodes cancelled
    (the stop's own words are in Redis and the audit log while the job is kept there)."""
    prompt, completion, unknown, cached = (int(x or 0) for x in row)
    b = JobBudget.of(_Spec(spec or {}))
    cost = b.price.cost(prompt, completion) if b.price is not None else None
    tokens = prompt + completion
    reached = b.reached(tokens, cost or 0.0) if cancelled else ""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "tokens": tokens, "unknown_steps": unknown,
            "cached_steps": cached, "cost_usd": cost, "price": list(b.price) if b.price is not None else None,
            "max_tokens_total": b.max_tokens_total or None, "budget_usd": b.budget_usd or None,
            "tokens_used": tokens / b.max_tokens_total if b.max_tokens_total else None,
            "cost_used": (cost / b.budget_usd) if b.budget_usd and cost is not None else None,
            "budget_reached": reached or None}


class _Spec:
    """The stored spec's fields as attributes (JobBudget reads a JobSpec)."""

    def __init__(self, d: dict[str, Any]):
        self.max_tokens_total = d.get("max_tokens_total", 0)
        self.budget_usd = d.get("budget_usd", 0)
        self.price = d.get("price")
