"""``interactor job JOB set``: a running job's limits changed fleet-wide, from any machine.

``--concurrency N|auto[:MIN-MAX]`` (its model calls in flight across the fleet), ``--llm-fleet-rpm
N`` and ``--llm-fleet-tpm N`` (0: no limit), ``--max-tokens-total N`` and ``--budget-usd X`` (0: no
budget). What it writes (broker/adaptive.py, broker/job_budgets.py):

* the job's live limits (``Keys.job_limits``): workers read them every few seconds
  (workers/adaptive_caps.py LiveLimits) for the attempts they start, and for the rates a running
  attempt's pacer uses;
* the model cap's limit in force (``Keys.caps``): the calls of every worker read it at their next
  take or renewal, so a lowered cap holds within about a keeper tick plus the calls' end. A job
  submitted without a model cap has no running call under one: the cap applies to episodes that
  start from then on, and the command says so;
* its budgets, among its live limits too: the consumer reads them with the job's spec every few
  seconds (consumer/budget_watch.py) and stops the job at its next committed batch past one. A USD
  budget needs the price of the job's model, which the job got at submit (``--model-prices``);
* an entry in the job's audit log (broker/audit.py), signed ``--as NAME`` or user@host.

A cap is its endpoint's (broker/caps.py): jobs sharing the endpoint share the new limit.
Unknown job, finished job, bad value: a message naming it, exit 2.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from broker.adaptive import LIVE_AUTO, LIVE_MODEL, LIVE_RPM, LIVE_TPM, AdaptiveCaps, parse_concurrency
from broker.audit import JobAudit, bounded_who
from broker.caps import Limits, server_name
from broker.cancel import JobCancel
from broker.job_budgets import LIVE_BUDGET_USD, LIVE_MAX_TOKENS, JobBudget
from broker.keys import Keys
from broker.ledger import Ledger
from broker.states import LEDGER_FINAL


def add_flags(sp) -> None:
    """``set``'s flags on the ``job`` command's parser (interactor/jobcmd.py)."""
    sp.add_argument("--concurrency", dest="set_concurrency", default=None, metavar="N|auto[:MIN-MAX]",
                    help="set: the job's model calls in flight across the fleet, N or adaptive (auto: 1-256); "
                         "within seconds for running calls under a cap, from the next episodes for a job that had none")
    sp.add_argument("--llm-fleet-rpm", dest="set_rpm", default=None, metavar="N",
                    help="set: requests per minute to the job's model endpoint, fleet-wide (0: no limit)")
    sp.add_argument("--llm-fleet-tpm", dest="set_tpm", default=None, metavar="N",
                    help="set: tokens per minute to the job's model endpoint, fleet-wide (0: no limit)")
    sp.add_argument("--max-tokens-total", dest="set_max_tokens", default=None, metavar="N",
                    help="set: stop the job once its model calls used this many tokens (0: no token budget); "
                         "below what it used already: it stops within seconds")
    sp.add_argument("--budget-usd", dest="set_budget_usd", default=None, metavar="X",
                    help="set: stop the job once its model calls cost this many USD (0: no cost budget); needs "
                         "the price its model got at submit (--model-prices)")


class SetRefused(ValueError):
    pass


def _count(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    text = str(value).strip()
    if not text.isdigit():
        raise SetRefused(f"{flag} must be a whole number >= 0, got {value!r}")
    return int(text)


def _usd(flag: str, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        usd = float(str(value).strip())
    except ValueError:
        usd = -1.0
    if not math.isfinite(usd) or usd < 0:
        raise SetRefused(f"{flag} must be a number of USD >= 0, got {value!r}")
    return usd


def cmd_set(args, settings, client) -> int:
    try:
        outcome = set_limits(client, settings, args.job, concurrency=args.set_concurrency,
                             rpm=_count("--llm-fleet-rpm", args.set_rpm), tpm=_count("--llm-fleet-tpm", args.set_tpm),
                             max_tokens_total=_count("--max-tokens-total", args.set_max_tokens),
                             budget_usd=_usd("--budget-usd", args.set_budget_usd), who=args.who)
    except SetRefused as exc:
        print(f"interactor job {args.job} set: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(outcome, indent=2))
    else:
        for line in outcome["said"]:
            print(line)
    return 0


def set_limits(client, settings, job_id: str, *, concurrency: str | None = None, rpm: int | None = None,
               tpm: int | None = None, max_tokens_total: int | None = None, budget_usd: float | None = None,
               who: str | None = None) -> dict[str, Any]:
    """Change ``job_id``'s limits (module docstring); raises SetRefused naming what is wrong."""
    if concurrency is None and rpm is None and tpm is None and max_tokens_total is None and budget_usd is None:
        raise SetRefused("nothing to set: give --concurrency, --llm-fleet-rpm, --llm-fleet-tpm, --max-tokens-total "
                         "or --budget-usd")
    keys = Keys(settings.key_prefix)
    ledger = Ledger.for_settings(client, settings)
    job = ledger.job_spec(job_id)
    if job is None:
        raise SetRefused(f"no job {job_id!r} in this Redis (interactor status lists the jobs it holds)")
    counts = ledger.counts(job_id)
    if JobCancel(client, settings).is_cancelled(job_id):
        raise SetRefused("the job was cancelled: nothing of it runs any more")
    if sum(counts.values()) and not any(n for s, n in counts.items() if s not in LEDGER_FINAL):
        raise SetRefused("the job has finished: every episode ended")
    fleet = None
    if concurrency is not None:
        try:
            fleet = parse_concurrency(concurrency)
        except ValueError as exc:
            raise SetRefused(f"--concurrency: {exc}") from None
        if not fleet.auto and fleet.fixed < 1:
            raise SetRefused("--concurrency must be >= 1 (a cap of 0 would stop the job; cancel it instead)")
    who = bounded_who(who)
    spec = Limits.from_dict(job.limits)
    live = {k.decode(): v.decode() for k, v in client.hgetall(keys.job_limits(job_id)).items()}
    had_cap = spec.model > 0 or int(live.get(LIVE_MODEL) or 0) > 0
    said, detail, fields = [], {}, {}
    if fleet is not None:
        cap = Limits(model=1).model_caps(keys, job.llm_base_url)[0]
        adaptive = AdaptiveCaps(client, keys)
        if fleet.auto:
            limit = adaptive.configure(cap.key, fleet.low, fleet.high, fleet.start, f"set: auto:{fleet.bounds} by {who}",
                                       keep_limit=had_cap)
            fields.update({LIVE_MODEL: limit, LIVE_AUTO: fleet.bounds})
            said.append(f"model calls in flight: adaptive {fleet.bounds}, now {limit}")
        else:
            limit = fleet.fixed
            adaptive.fix(cap.key, limit, f"set: {limit} by {who}")
            fields.update({LIVE_MODEL: limit, LIVE_AUTO: ""})
            said.append(f"model calls in flight: at most {limit} across the fleet")
        detail["concurrency"] = str(fleet)
        said.append("running calls hold it within seconds" if had_cap else
                    "the job had no model cap: episodes that start from now on hold it (within a few seconds); "
                    "those running now finish under none")
    rates = {LIVE_RPM: rpm, LIVE_TPM: tpm}
    for name, value in rates.items():
        if value is not None:
            fields[name] = value
            detail[name] = value
    if rpm is not None or tpm is not None:
        now_rpm = rpm if rpm is not None else int(live.get(LIVE_RPM) or spec.model_rpm)
        now_tpm = tpm if tpm is not None else int(live.get(LIVE_TPM) or spec.model_tpm)
        if now_rpm or now_tpm:
            client.hset(keys.rates, server_name(job.llm_base_url), f"{now_rpm} {now_tpm}")
        said.append(f"rate limits: {now_rpm or 'no'} requests and {now_tpm or 'no'} tokens per minute; each "
                    "running episode's next request paces at them within a few seconds, a job that had none from "
                    "its next episodes")
    said += _budgets(job, fields, detail, max_tokens_total, budget_usd)
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.job_limits(job_id), mapping=fields)
    ttl = client.ttl(keys.job_spec(job_id))
    if ttl and ttl > 0:  # a job already given its retention: its live limits go with it
        pipe.expire(keys.job_limits(job_id), ttl)
    pipe.execute()
    JobAudit(client, keys).record(job_id, "set", detail, who=who)
    return {"job": job_id, "set": detail, "who": who, "said": [f"job {job_id}: {s}" for s in said]}


def _budgets(job, fields: dict, detail: dict, max_tokens_total: int | None, budget_usd: float | None) -> list[str]:
    """The budgets' part of a set: its live fields and what is said of it."""
    said = []
    if budget_usd and JobBudget.of(job).price is None:
        raise SetRefused(f"--budget-usd needs the price of the job's model {job.model!r}, which it did not get at "
                         "submit (--model-prices); a token budget (--max-tokens-total) needs none")
    for field, value, what, shown in ((LIVE_MAX_TOKENS, max_tokens_total, "token budget", lambda v: f"{v:,} tokens"),
                                      (LIVE_BUDGET_USD, budget_usd, "cost budget", lambda v: f"${v:,.2f}")):
        if value is not None:
            fields[field] = value
            detail[field] = value
            said.append(f"{what}: {shown(value) if value else 'none'}")
    if said:
        said.append("the consumer stops the job at its first committed batch past a budget (read every few seconds)")
    return said
