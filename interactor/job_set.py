"""``interactor job JOB set``: a running job's limits changed fleet-wide, from any machine.

``--concurrency N|auto[:MIN-MAX]`` (its model calls in flight across the fleet), ``--llm-fleet-rpm
N`` and ``--llm-fleet-tpm N`` (0: no limit). What it writes (broker/adaptive.py):

* the job's live limits (``Keys.job_limits``): workers read them every few seconds
  (workers/adaptive_caps.py LiveLimits) for the attempts they start, and for the rates a running
  attempt's pacer uses;
* the model cap's limit in force (``Keys.caps``): the calls of every worker read it at their next
  take or renewal, so a lowered cap holds within about a keeper tick plus the calls' end. A job
  submitted without a model cap has no running call under one: the cap applies to episodes that
  start from then on, and the command says so;
* an entry in the job's audit log (broker/audit.py), signed ``--as NAME`` or user@host.

A cap is its endpoint's (broker/caps.py): jobs sharing the endpoint share the new limit.
Unknown job, finished job, bad value: a message naming it, exit 2.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from broker.adaptive import LIVE_AUTO, LIVE_MODEL, LIVE_RPM, LIVE_TPM, AdaptiveCaps, parse_concurrency
from broker.audit import JobAudit, bounded_who
from broker.caps import Limits, server_name
from broker.cancel import JobCancel
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


class SetRefused(ValueError):
    pass


def _count(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    text = str(value).strip()
    if not text.isdigit():
        raise SetRefused(f"{flag} must be a whole number >= 0, got {value!r}")
    return int(text)


def cmd_set(args, settings, client) -> int:
    try:
        outcome = set_limits(client, settings, args.job, concurrency=args.set_concurrency,
                             rpm=_count("--llm-fleet-rpm", args.set_rpm), tpm=_count("--llm-fleet-tpm", args.set_tpm),
                             who=args.who)
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
               tpm: int | None = None, who: str | None = None) -> dict[str, Any]:
    """Change ``job_id``'s limits (module docstring); raises SetRefused naming what is wrong."""
    if concurrency is None and rpm is None and tpm is None:
        raise SetRefused("nothing to set: give --concurrency, --llm-fleet-rpm or --llm-fleet-tpm")
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
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.job_limits(job_id), mapping=fields)
    ttl = client.ttl(keys.job_spec(job_id))
    if ttl and ttl > 0:  # a job already given its retention: its live limits go with it
        pipe.expire(keys.job_limits(job_id), ttl)
    pipe.execute()
    JobAudit(client, keys).record(job_id, "set", detail, who=who)
    return {"job": job_id, "set": detail, "who": who, "said": [f"job {job_id}: {s}" for s in said]}
