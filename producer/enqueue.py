"""Submitting a job: plan every episode, record the ledger, then send the tasks.

The ledger is written first (every episode ``queued``), the tasks second: a crash in between
leaves episodes that the ledger knows and no queue holds, which ``interactor reconcile``
finds and sends. The other order could leave tasks for episodes nobody knows about.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass

import redis

from broker import errors
from broker.adaptive import AdaptiveCaps, bounds_of, parse_concurrency
from broker.job_budgets import budget_problem, job_price
from broker.caps import MAX_CONCURRENCY, MAX_INSTANCES, FleetSlots, Limits, server_name
from broker.keys import Keys
from broker.ledger import Ledger
from broker.queueing import push_episodes
from broker.records import JobSpec
from broker.replicas import ReplicaWait
from broker.settings import Settings, SettingsError
from envs.base import valid_object_path
from producer.readroots import ReadRoots
from producer.planning import PlannedJob, plan_job

log = logging.getLogger("interactor.producer")


def new_job_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def check_job_settings(settings: Settings) -> None:
    """What the job takes from the settings, checked before anything is asked of a server."""
    if settings.episode_hook and not valid_object_path(settings.episode_hook):
        # Workers refuse it too; saying so here spares a job whose every episode is dead-lettered.
        raise SettingsError(f"episode_hook must be 'module:attribute' (no dotted attribute path), "
                            f"got {settings.episode_hook!r}")
    problem = budget_problem(settings.max_tokens_total, settings.budget_usd, settings.model_prices, settings.model)
    if problem:
        raise SettingsError(problem)
    if settings.llm_metrics_url and not parse_concurrency(settings.llm_fleet_max_concurrency).auto:
        raise SettingsError(_metrics_refused(f"--llm-fleet-max-concurrency is {settings.llm_fleet_max_concurrency!r}"))


def _metrics_refused(why: str) -> str:
    """The server's metrics are a second overload signal: only an adaptive cap has a rule to tell."""
    return (f"--llm-metrics-url is read only to adapt the fleet's model concurrency, and {why}: give "
            "--llm-fleet-max-concurrency auto[:MIN-MAX] (run: --concurrency auto) with it, or leave it out")


def job_spec(settings: Settings, job_id: str, plan: PlannedJob) -> JobSpec:
    check_job_settings(settings)
    return JobSpec(
        job_id=job_id,
        llm_base_url=settings.llm_base_url,
        model=settings.model,
        temperature=settings.temperature,
        max_steps=settings.max_steps,
        message_cut=settings.message_cut,
        episode_budget_s=settings.episode_budget_s,
        max_attempts=settings.max_attempts,
        session_routing=settings.llm_session_routing,
        episode_hook=settings.episode_hook,
        llm_params=json.loads(settings.llm_params) if settings.llm_params else {},
        episodes=len(plan.episodes),
        groups=plan.groups,
        sources=plan.sources,
        # the command line's --tokens / INTERACTOR_TOKENS wins; else what the task files say
        tokens=settings.tokens if settings.tokens else (plan.tokens or ""),
        # the task files' own win over the settings
        pause_after_failures=(plan.pause_after_failures if plan.pause_after_failures is not None
                              else settings.pause_after_failures),
        limits=job_limits(settings, plan).to_dict(),
        # off when either says so: the command line (--no-resume) or the task files (resume: false)
        resume=not settings.no_resume and plan.resume is not False,
        retry_on=errors.parse_retry_on(settings.retry_on),
        cache=job_cache(settings, plan),
        max_tokens_total=settings.max_tokens_total,
        budget_usd=settings.budget_usd,
        price=list(job_price(settings.model_prices, settings.model) or ()),
    )


def job_cache(settings: Settings, plan: PlannedJob) -> str:
    """The job's response-cache mode (broker/cache.py). Plain ``--cache`` on a job whose
    requests sample (a temperature above 0, the job's or an entry's own) is refused: a cached
    answer would be one sample handed out again for every later one, which is not sampling
    (an RL rollout, a pass@k). ``--cache=sampled`` says that is meant. The command line's
    ``--cache`` wins; else the task files' ``cache:``."""
    mode = settings.cache or plan.cache or ""
    if mode != "on":
        return mode
    params = json.loads(settings.llm_params) if settings.llm_params else {}
    job_temp = params.get("temperature", settings.temperature)
    sampled = {}
    for e in plan.episodes:
        temp = (e.sampling or {}).get("temperature", job_temp)
        if not isinstance(temp, (int, float)) or temp > 0:
            sampled.setdefault(e.env_name, temp)
    if sampled:
        where = ", ".join(f"{name} at temperature {temp}" for name, temp in sorted(sampled.items())[:5])
        raise SettingsError(
            f"{'--cache' if settings.cache else 'the task files cache: true'} refused: this job samples ({where}); a cached answer would hand one sample out again for every "
            "identical request, which is not sampling (RL rollouts, pass@k). Set --temperature 0 (and no entry's own "
            "temperature above 0) for a greedy evaluation, or --cache=sampled to reuse sampled answers on purpose "
            "(a re-run after a fix)")
    return mode


def job_limits(settings: Settings, plan: PlannedJob) -> Limits:
    """The job's fleet-wide caps: the task files' ``limits``, and for what they leave out the
    settings' (``llm_fleet_max_concurrency``, ``llm_fleet_rpm``, ``llm_fleet_tpm``,
    ``env_fleet_max_concurrency`` and ``env_fleet_max_instances``, the last two for every env
    server the job uses)."""
    limits = Limits.from_dict(plan.limits)
    fleet = parse_concurrency(settings.llm_fleet_max_concurrency)
    if not limits.model and fleet.auto:  # adaptive: it starts at fleet.start (broker/adaptive.py)
        limits.model, limits.model_auto = fleet.start, fleet.bounds
    elif not limits.model and fleet.fixed > 0:
        limits.model = fleet.fixed
    if settings.llm_metrics_url:
        if not limits.model_auto:
            raise SettingsError(_metrics_refused("the task files' limits fix the model's max_concurrency"))
        limits.model_metrics = settings.llm_metrics_url
    limits.model_rpm = limits.model_rpm or settings.llm_fleet_rpm
    limits.model_tpm = limits.model_tpm or settings.llm_fleet_tpm
    defaults = {k: n for k, n in ((MAX_CONCURRENCY, settings.env_fleet_max_concurrency),
                                  (MAX_INSTANCES, settings.env_fleet_max_instances)) if n > 0}
    if defaults:
        for url in {server_name(e.base_url) for e in plan.episodes if e.transport != "inproc" and e.base_url}:
            limits.env_servers[url] = {**defaults, **limits.env_servers.get(url, {})}
    return limits


class SubmitLost(RuntimeError):
    """A job written to a primary that failed over before a replica had it: the new primary does
    not have it, so nothing of it would ever run."""

    def __init__(self, job_id: str):
        super().__init__(f"job {job_id}: Redis failed over while the job was being submitted, and the promoted "
                         "replica does not have it: nothing of it will run; submit it again")
        self.job_id = job_id


@dataclass
class Submitted:
    job: JobSpec
    plan: PlannedJob
    enqueue_s: float


def plan(settings: Settings, paths: list[str], job_id: str | None = None, roots: ReadRoots | None = None) -> PlannedJob:
    """Read and validate every task file and the job's settings; raises TaskFileError or
    SettingsError naming the fault. ``roots`` bounds what a request's paths may read."""
    check_job_settings(settings)
    return plan_job(paths, job_id=job_id or new_job_id(), default_base_url=settings.env_base_url,
                    default_queue=settings.queue, roots=roots)


def submit_plan(client: redis.Redis, settings: Settings, planned: PlannedJob) -> Submitted:
    job_id = planned.episodes[0].job_id if planned.episodes else new_job_id()
    job = job_spec(settings, job_id, planned)
    t0 = time.perf_counter()
    Ledger.for_settings(client, settings).create_job(job, planned.episodes)
    limits = Limits.from_dict(job.limits)
    keys = Keys(settings.key_prefix)
    FleetSlots(client, keys, int(settings.lease_ttl_s * 1000)).register(limits.all_caps(keys, job.llm_base_url))
    bounds = bounds_of(limits.model_auto)
    for cap in limits.model_caps(keys, job.llm_base_url):  # its limit in force, adaptive or not (broker/adaptive.py)
        if bounds:
            AdaptiveCaps(client, keys).configure(cap.key, *bounds, limits.model, f"start: job {job_id}")
        else:
            AdaptiveCaps(client, keys).fix(cap.key, limits.model, f"start: job {job_id}")
    if limits.model_rpm or limits.model_tpm:  # shown by status and metrics
        client.hset(keys.rates, server_name(job.llm_base_url), f"{limits.model_rpm} {limits.model_tpm}")
    push_episodes(client, ((job_id, e.episode_id, settings.queue_for(e)) for e in planned.episodes))
    # With replica waits on, the submit returns once a replica has the job; one written to a
    # primary that died before passing it on is said, not reported as enqueued (broker/replicas.py).
    if not ReplicaWait.for_settings(settings).confirm(client, keys.job_spec(job_id), keys.replica_barrier):
        raise SubmitLost(job_id)
    dt = time.perf_counter() - t0
    log.debug("job %s: %d episodes in %d groups enqueued in %.2fs", job_id, len(planned.episodes), planned.groups, dt)
    return Submitted(job, planned, dt)


def submit(client: redis.Redis, settings: Settings, paths: list[str], *, job_id: str | None = None) -> Submitted:
    """Validate every task file, then enqueue; a bad file raises TaskFileError and sends nothing."""
    return submit_plan(client, settings, plan(settings, paths, job_id))
