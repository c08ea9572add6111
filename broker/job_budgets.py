"""A job's budgets (``--max-tokens-total``, ``--budget-usd`` with ``--model-prices``) and its usage:
the tokens and cost of its model calls, kept in Redis by the consumer, and why a budget stopped it.

Prices are USD per million tokens, input (prompt) and output (completion), per model:
``--model-prices 'gpt-4o-mini=0.15/0.60,Qwen/Qwen3-8B=0.05/0.20'``. A job keeps its own model's
price in its JobSpec (``price``), fixed at submit.

The usage of a job (``Keys.job_usage``, a hash) has one writer: the consumer, which after each
commit adds the batch's tokens and cost (consumer/budget_watch.py) and, when a budget is reached, stops
the job through broker/cancel.py and writes ``stop`` (why, said for people) once. Steps answered
from the response cache cost nothing and are counted apart (``cached``); steps whose server
reported no usage are counted as ``unknown`` (their tokens are not known, so not charged).

This module imports nothing of the settings (broker/settings_checks.py checks prices with it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

MILLION = 1_000_000
# Usage hash fields.
PROMPT, COMPLETION, UNKNOWN, CACHED, COST, STOP, STOP_AT = (
    "prompt", "completion", "unknown", "cached", "cost_usd", "stop", "stop_at")
# A job's budgets changed while it runs (`interactor job JOB set`), fields of its live limits
# (Keys.job_limits, beside broker/adaptive.py's): they replace the JobSpec's.
LIVE_MAX_TOKENS, LIVE_BUDGET_USD = "max_tokens_total", "budget_usd"
PRICES_SYNTAX = "MODEL=INPUT/OUTPUT[,MODEL=INPUT/OUTPUT...] (USD per 1M prompt/completion tokens)"


class ModelPrice(NamedTuple):
    """USD per million tokens of a model: prompt (input) and completion (output)."""

    input: float
    output: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input + completion_tokens * self.output) / MILLION


def parse_model_prices(text: str) -> dict[str, ModelPrice]:
    """``--model-prices``: model -> price. A model name may hold ``/`` and ``=`` (the price is
    after the last ``=``). Raises ValueError naming the entry at fault."""
    prices: dict[str, ModelPrice] = {}
    for entry in (e.strip() for e in str(text or "").split(",")):
        if not entry:
            continue
        model, eq, price = entry.rpartition("=")
        inp, slash, out = price.partition("/")
        try:
            if not (eq and model.strip() and slash):
                raise ValueError
            value = ModelPrice(float(inp), float(out))
        except ValueError:
            raise ValueError(f"model_prices entry {entry!r}: expected {PRICES_SYNTAX}") from None
        if not all(math.isfinite(x) and x >= 0 for x in value):
            raise ValueError(f"model_prices entry {entry!r}: prices must be finite and >= 0")
        if model.strip() in prices:
            raise ValueError(f"model_prices names {model.strip()!r} twice")
        prices[model.strip()] = value
    return prices


def job_price(model_prices: str, model: str) -> ModelPrice | None:
    """The price of ``model`` among ``model_prices`` (None: not priced)."""
    return parse_model_prices(model_prices).get(model)


def budget_problem(max_tokens_total: int, budget_usd: float, model_prices: str, model: str) -> str:
    """Why a job's budgets cannot be enforced ("" when they can): a budget in USD for a model
    without a price."""
    if budget_usd > 0 and job_price(model_prices, model) is None:
        return (f"--budget-usd {budget_usd:g} needs the price of the job's model {model!r}: give it with "
                f"--model-prices '{model}=INPUT/OUTPUT' (USD per 1M prompt/completion tokens; or "
                "INTERACTOR_MODEL_PRICES)")
    return ""


def _number(value: Any, kind: type) -> Any:
    """A budget field of a JobSpec written by another process: a bad value reads as none."""
    try:
        n = kind(value)
    except (TypeError, ValueError):
        return kind(0)
    return n if math.isfinite(n) and n > 0 else kind(0)


@dataclass(frozen=True)
class JobBudget:
    """A job's budgets as its JobSpec has them (0: none) and its model's price (None: unpriced)."""

    max_tokens_total: int = 0
    budget_usd: float = 0.0
    price: ModelPrice | None = None

    @classmethod
    def of(cls, spec: Any) -> "JobBudget":
        raw = getattr(spec, "price", None)
        price = None
        if isinstance(raw, (list, tuple)) and len(raw) == 2:
            inp, out = _number(raw[0], float), _number(raw[1], float)
            price = ModelPrice(inp, out)
        return cls(_number(getattr(spec, "max_tokens_total", 0), int), _number(getattr(spec, "budget_usd", 0), float),
                   price)

    def with_live(self, live: dict[str, Any]) -> "JobBudget":
        """These budgets with those set while the job runs (``live``: its live limits' fields)
        over them; a field another process wrote badly reads as none."""
        out = self
        if LIVE_MAX_TOKENS in live:
            out = dataclasses.replace(out, max_tokens_total=_number(live[LIVE_MAX_TOKENS], int))
        if LIVE_BUDGET_USD in live:
            out = dataclasses.replace(out, budget_usd=_number(live[LIVE_BUDGET_USD], float))
        return out

    @property
    def any(self) -> bool:
        return self.max_tokens_total > 0 or (self.budget_usd > 0 and self.price is not None)

    def reached(self, tokens: int, cost_usd: float) -> str:
        """Why the job must stop, said for people ("" while it may go on)."""
        if self.max_tokens_total > 0 and tokens >= self.max_tokens_total:
            return f"token budget reached ({tokens:,} of {self.max_tokens_total:,} tokens)"
        if self.budget_usd > 0 and self.price is not None and cost_usd >= self.budget_usd:
            return f"cost budget reached (${cost_usd:,.4f} of ${self.budget_usd:,.2f})"
        return ""


@dataclass(frozen=True)
class JobUsage:
    """What a job's model calls used, as the consumer counted it so far (a batch claimed again
    after a consumer crash is counted again; the results store is exact)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    unknown_steps: int = 0  # steps whose server reported no usage
    cached_steps: int = 0  # answered from the response cache: no call, no cost
    cost_usd: float = 0.0
    stop: str = ""  # why a budget stopped the job ("" it did not)
    stop_at: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_hash(cls, raw: dict) -> "JobUsage":
        h = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in (raw or {}).items()}

        def num(name: str, kind: type) -> Any:
            try:
                return kind(float(h.get(name) or 0))
            except (TypeError, ValueError, OverflowError):
                return kind(0)

        return cls(num(PROMPT, int), num(COMPLETION, int), num(UNKNOWN, int), num(CACHED, int), num(COST, float),
                   str(h.get(STOP) or "")[:300], num(STOP_AT, float))

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "tokens": self.tokens, "unknown_steps": self.unknown_steps, "cached_steps": self.cached_steps,
                "cost_usd": self.cost_usd, "stop": self.stop}


def read_usage(client: Any, keys: Any, job_id: str) -> JobUsage:
    return JobUsage.from_hash(client.hgetall(keys.job_usage(job_id)))


def read_usages(client: Any, keys: Any, job_ids: list[str]) -> dict[str, JobUsage]:
    """Each job's usage, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hgetall(keys.job_usage(job_id))
    return {job_id: JobUsage.from_hash(raw) for job_id, raw in zip(job_ids, pipe.execute())}


def usage_text(usage: JobUsage, budget: JobBudget) -> str:
    """One line: tokens, cost and the budgets with how much is used."""
    parts = [f"{usage.tokens:,} tokens ({usage.prompt_tokens:,} prompt, {usage.completion_tokens:,} completion)"]
    if budget.price is not None:
        parts.append(f"${usage.cost_usd:,.4f}")
    if usage.unknown_steps:
        parts.append(f"{usage.unknown_steps:,} steps with no usage reported (not counted)")
    if usage.cached_steps:
        parts.append(f"{usage.cached_steps:,} cached steps (free)")
    if budget.max_tokens_total:
        parts.append(f"token budget {usage.tokens / budget.max_tokens_total:.0%} used of "
                     f"{budget.max_tokens_total:,}")
    if budget.budget_usd and budget.price is not None:
        parts.append(f"cost budget {usage.cost_usd / budget.budget_usd:.0%} used of ${budget.budget_usd:,.2f}")
    return ", ".join(parts) + (f"; stopped: {usage.stop}" if usage.stop else "")
