"""Budgets enforced by the consumer: each committed batch's tokens and cost added to its jobs'
usage in Redis, and a job whose budget is reached stopped cleanly (broker/cancel.py).

:class:`BudgetWatch` is an ``Ingestor`` observer, as consumer/stats.py's recorder is: one
pipeline of HINCRBY/HINCRBYFLOAT per batch, the new totals in its answer, so the workers' hot
path pays nothing. A job whose totals reach its ``--max-tokens-total`` or ``--budget-usd`` is
stopped once (``stop`` is set with HSETNX): its waiting episodes are cancelled at once, its
running ones at their next call, what completed is kept, and every step already made still
reaches the store. The stop is entered in the job's audit log (broker/audit.py). Calls in flight
when the budget is reached, and records not yet committed, still count: a budget is passed by
about one call per running episode plus the consumer's lag.
"""

from __future__ import annotations

import logging
import time

import redis

from broker import job_budgets
from broker.audit import JobAudit
from broker.job_budgets import JobBudget
from broker.cancel import JobCancel
from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import StepRecord
from broker.settings import Settings

log = logging.getLogger("interactor.consumer.budget")

SPEC_FRESH_S = 3.0  # a job's budgets are read again after this long (`job set` may change them)
SPECS_KEPT = 1000  # jobs whose budgets are remembered at once
WHO = "interactor (budget)"


class BudgetWatch:
    """The consumer's side of the budgets: usage per job in ``Keys.job_usage``, and the stop."""

    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.keys = Keys(settings.key_prefix)
        self.ledger = Ledger.for_settings(client, settings)
        self.cancel = JobCancel(client, settings)
        self.audit = JobAudit(client, self.keys)
        self._budgets: dict[str, tuple[float, JobBudget]] = {}

    def __call__(self, records: list) -> None:
        per_job: dict[str, list[int]] = {}  # job_id -> [prompt, completion, unknown, cached]
        for rec in records:
            if type(rec) is not StepRecord:
                continue
            t = per_job.get(rec.job_id)
            if t is None:
                t = per_job[rec.job_id] = [0, 0, 0, 0]
            if rec.cached:
                t[3] += 1
            elif rec.prompt_tokens is None and rec.completion_tokens is None:
                t[2] += 1
            else:
                t[0] += max(0, int(rec.prompt_tokens or 0))
                t[1] += max(0, int(rec.completion_tokens or 0))
        if not per_job:
            return
        # a job whose spec is gone (retention forgot it) keeps no usage: its key would never expire
        budgets = {job_id: b for job_id, b in ((j, self.budget_of(j)) for j in per_job) if b is not None}
        if not budgets:
            return
        pipe = self.r.pipeline(transaction=False)
        for job_id in budgets:
            prompt, completion, unknown, cached = per_job[job_id]
            key = self.keys.job_usage(job_id)
            pipe.hincrby(key, job_budgets.PROMPT, prompt)
            pipe.hincrby(key, job_budgets.COMPLETION, completion)
            pipe.hincrby(key, job_budgets.UNKNOWN, unknown)
            pipe.hincrby(key, job_budgets.CACHED, cached)
            price = budgets[job_id].price
            pipe.hincrbyfloat(key, job_budgets.COST, price.cost(prompt, completion) if price is not None else 0.0)
        answers = iter(pipe.execute())
        for job_id in budgets:
            prompt, completion, _, _, cost = (next(answers) for _ in range(5))
            why = budgets[job_id].reached(int(prompt) + int(completion), float(cost))
            if why:
                self.stop(job_id, why, int(prompt), int(completion), float(cost))

    def budget_of(self, job_id: str) -> JobBudget | None:
        """The job's budgets from its JobSpec in Redis, with those set while it runs over them
        (None when the spec is gone); read again every :data:`SPEC_FRESH_S`."""
        now = time.monotonic()
        held = self._budgets.get(job_id)
        if held is not None and now - held[0] < SPEC_FRESH_S:
            return held[1]
        try:
            spec = self.ledger.job_spec(job_id)
        except ValueError as exc:  # a spec another process wrote badly (RecordError): no budget, said
            log.warning("job %s: its spec could not be read for its budgets (%s)", job_id, exc)
            spec = None
        found = JobBudget.of(spec) if spec is not None else None
        if found is not None:  # budgets changed while it runs (interactor job JOB set)
            try:
                live = {k.decode(): v.decode("utf-8", "replace")
                        for k, v in self.r.hgetall(self.keys.job_limits(job_id)).items()}
            except redis.RedisError as exc:  # the spec's budgets hold until the next read
                log.warning("job %s: its live budgets could not be read (%s)", job_id, exc)
                live = {}
            found = found.with_live(live)
        if len(self._budgets) >= SPECS_KEPT:
            self._budgets.clear()
        self._budgets[job_id] = (now, found)
        return found

    def stop(self, job_id: str, why: str, prompt: int, completion: int, cost: float) -> bool:
        """Stop the job for ``why``, once; False when it was stopped (or cancelled) before."""
        key = self.keys.job_usage(job_id)
        if self.r.hexists(key, job_budgets.STOP) or self.cancel.is_cancelled(job_id):
            return False
        if not self.r.hsetnx(key, job_budgets.STOP, why):
            return False
        self.r.hset(key, job_budgets.STOP_AT, time.time())
        b = self.budget_of(job_id) or JobBudget()
        self.audit.record(job_id, "budget_stop", {
            "why": why, "prompt_tokens": prompt, "completion_tokens": completion, "cost_usd": round(cost, 6),
            "max_tokens_total": b.max_tokens_total, "budget_usd": b.budget_usd}, who=WHO)
        report = self.cancel.cancel(job_id, who=WHO)
        log.warning("job %s stopped: %s (%s)", job_id, why,
                    "no such job in Redis" if report is None else
                    f"{report.waiting} waiting episodes cancelled, {report.running} running told to stop")
        return True
