"""The checks a :class:`~broker.settings.Settings` passes before anything uses it: each problem
named, all of them at once (``Settings.validated`` raises them as one SettingsError)."""

from __future__ import annotations

import json
import math
from typing import Any

from broker.job_budgets import parse_model_prices
from broker.adaptive import parse_concurrency
from broker.errors import parse_retry_on
from broker.redact import redact_url
from broker.redisurl import redis_url_problem
from broker.tokens import TOKEN_MODES
from broker.urls import url_problem

# The values some settings may take.
FEED_STALE_POLICIES = ("requeue", "drop")  # broker/feed.py STALE_REQUEUE, STALE_DROP
FEED_FAILED_POLICIES = ("report", "refill")  # broker/feed.py FAILED_REPORT, FAILED_REFILL
POOLS = ("gevent", "threads", "prefork", "solo")
REDIS_WAITS = ("auto", "on", "off")  # broker/replicas.py

# The numeric settings with a least value: (name, ">=" or ">", the least, what the message adds).
_LEAST = (
    ("max_steps", ">=", 1, ""), ("concurrency", ">=", 1, ""), ("max_attempts", ">=", 1, ""),
    ("lease_ttl_s", ">", 1, ""), ("episode_budget_s", ">", 0, ""), ("llm_max_tokens", ">=", 0, " (0 = not sent)"),
    ("llm_max_concurrency", ">=", 0, ""), ("llm_max_connections", ">=", 0, ""), ("llm_startup_jitter_s", ">=", 0, ""),
    *((name, ">=", 0, " (0 = none)") for name in ("pause_after_failures", "env_fleet_max_concurrency",
                                                  "env_fleet_max_instances", "llm_fleet_rpm", "llm_fleet_tpm")),
    ("experience_top_k", ">=", 1, ""), ("outage_budget_s", ">=", 0, ""), ("shutdown_hard_exit_s", ">", 0, ""),
    ("worker_stall_s", ">=", 0, " (0 turns the consumer watch off)"), ("job_retention_s", ">", 0, ""),
    ("feed_max_ahead", ">=", 1, ""), ("feed_refill_max", ">=", 0, ""), ("feed_ack_timeout_s", ">", 0, ""),
    ("feed_max_connections", ">=", 1, ""), ("feed_request_timeout_s", ">", 0, ""),
    ("redis_wait_timeout_ms", ">=", 1, " (a WAIT without timeout would never end)"),
)


def settings_problems(s: Any) -> list[str]:
    """What is wrong with the settings ``s`` ([] when nothing is)."""
    problems: list[str] = []
    for name, op, least, note in _LEAST:
        value = getattr(s, name)
        if value < least or (op == ">" and value == least):
            problems.append(f"{name} must be {op} {least}{note}")
    if s.pool not in POOLS:
        problems.append(f"pool must be threads, prefork, gevent or solo, not {s.pool!r}")
    if s.llm_params:
        try:
            if not isinstance(json.loads(s.llm_params), dict):
                raise ValueError
        except ValueError:
            problems.append(f"llm_params must be a JSON object, got {s.llm_params!r}")
    if s.tokens not in TOKEN_MODES:
        problems.append(f"tokens must be one of {', '.join(repr(m) for m in TOKEN_MODES)}, not {s.tokens!r}")
    if s.cache not in ("", "on", "sampled") or s.cache_max_entries < 1:
        problems.append(f"cache must be on (bare --cache) or sampled, not {s.cache!r}; cache_max_entries >= 1")
    if not 0 <= s.llm_top_p <= 1:
        problems.append("llm_top_p must be in (0, 1] (0 = not sent)")
    stop = s.convenience_params().get("stop")
    if stop is not None and not (isinstance(stop, str) or (
            isinstance(stop, list) and stop and all(isinstance(x, str) for x in stop))):
        problems.append(f"llm_stop must be a string or a JSON list of strings, got {s.llm_stop!r}")
    if str(s.llm_fleet_max_concurrency).strip().startswith("-"):
        problems.append("llm_fleet_max_concurrency must be >= 0 (0 = none)")
    else:
        try:
            parse_concurrency(s.llm_fleet_max_concurrency)
        except ValueError as exc:
            problems.append(f"llm_fleet_max_concurrency: {exc}")
    if s.feed_stale_policy not in FEED_STALE_POLICIES:
        problems.append(f"feed_stale_policy must be requeue or drop, not {s.feed_stale_policy!r}")
    if s.feed_failed_policy not in FEED_FAILED_POLICIES:
        problems.append(f"feed_failed_policy must be report or refill, not {s.feed_failed_policy!r}")
    # URLs the workers connect to: the same check a task file's base_url gets (broker/urls.py).
    for name in ("llm_base_url", "env_base_url", "llm_metrics_url"):
        value = getattr(s, name)
        if value or name == "llm_base_url":
            problem = url_problem(value)
            if problem:
                problems.append(f"{name} {redact_url(value)!r}: {problem}")
    for origin in (o.strip() for o in s.llm_trusted_origins.split(",")):
        problem = url_problem(origin) if origin else ""
        if problem:
            problems.append(f"llm_trusted_origins entry {redact_url(origin)!r}: {problem}")
    problem = redis_url_problem(s.redis_url) if s.redis_url else ""
    if problem:
        problems.append(f"redis_url {redact_url(s.redis_url)!r}: {problem}")
    if s.redis_wait not in REDIS_WAITS:
        problems.append(f"redis_wait must be auto, on or off, not {s.redis_wait!r}")
    try:
        parse_retry_on(s.retry_on)
    except ValueError as exc:
        problems.append(str(exc))
    problems += budget_problems(s)
    return problems


def budget_problems(s: Any) -> list[str]:
    """The budgets' own checks; whether the job's model has a price is the submit's
    (producer/enqueue.py: a worker's settings name no job's model)."""
    problems = []
    if s.max_tokens_total < 0:
        problems.append(f"max_tokens_total must be >= 0 (0 = none), not {s.max_tokens_total}")
    if not (math.isfinite(s.budget_usd) and s.budget_usd >= 0):
        problems.append(f"budget_usd must be a number >= 0 (0 = none), not {s.budget_usd}")
    try:
        parse_model_prices(s.model_prices)
    except ValueError as exc:
        problems.append(str(exc))
    return problems
