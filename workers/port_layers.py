"""The ports an attempt hands its step loop: the model port as one declared chain of layers,
and the env port of an instance.

:data:`POLICY_LAYERS` is the model port's chain, innermost first, as dramatiq declares its
middleware: each layer wraps the port built so far (or leaves it as it is when the job does not
ask for it). Adding a policy is adding a layer to that list; nothing else builds the port. The
env port is the instance's (over HTTP, or in-process), with the job's fleet-wide caps on it.

A port's ``complete(messages, **request)`` passes ``request`` (``tools``, ``tool_choice`` and
other fields of the chat request) through every layer to the endpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from broker.caps import Limits, server_name
from broker.keys import env_instance_id
from broker.records import EpisodeSpec, JobSpec
from workers import limits
from workers.attempt_parts import AttemptParts
from workers.adaptive_caps import AdaptivePacer
from workers.budget import Budget
from workers.fleetcaps import CappedEnv, CappedPolicy
from workers.ports import BoundEnv, BoundPolicy, Guard, policy_url


@dataclass(frozen=True)
class PortContext:
    """What the layers build an attempt's ports from."""

    parts: AttemptParts
    job: JobSpec
    spec: EpisodeSpec
    budget: Budget
    guard: Guard
    check: Callable[[], None]

    def caps(self) -> Limits | None:
        """The job's limits: its spec's, with those changed while it runs over them (``interactor
        job JOB set``; workers/adaptive_caps.py LiveLimits reads them every few seconds, not per call)."""
        spec = Limits.from_dict(self.job.limits) if self.job.limits else None
        fleet = getattr(self.parts, "fleet", None)
        return fleet.live.over(self.job.job_id, spec) if fleet is not None else spec


class Endpoint:
    """The job's model endpoint (session-routed when the job asks), with the key where the
    worker trusts the endpoint with it, under the attempt's budget and the endpoint's breaker."""

    def wrap(self, _inner: None, c: PortContext) -> BoundPolicy:
        p, job = c.parts, c.job
        return BoundPolicy(p.model, job, policy_url(job, c.spec.episode_id), p.trust.api_key_for(job), c.budget,
                           c.guard, p.breakers.for_model(job.llm_base_url))


class EntrySampling:
    """The task entry's own sampling settings (``max_tokens``, ``temperature``, ``stop``:
    EpisodeSpec.sampling, producer/taskfile.py) over the job's, on every call of the episode."""

    def wrap(self, policy: BoundPolicy, c: PortContext) -> BoundPolicy:
        sampling = getattr(c.spec, "sampling", None)
        return dataclasses.replace(policy, sampling=dict(sampling)) if sampling else policy


class Paced:
    """The endpoint's fleet-wide request and token rates (workers/pacing.py). The pacer is asked
    before each try inside the endpoint's retries, so this layer sits right on the endpoint."""

    def wrap(self, policy: BoundPolicy, c: PortContext) -> BoundPolicy:
        caps = c.caps()
        if caps is None or not (caps.model_rpm or caps.model_tpm):
            return policy
        job_id, live = c.job.job_id, c.parts.fleet.live
        pacer = c.parts.pacing.pacer(server_name(c.job.llm_base_url), caps.model_rpm, caps.model_tpm, c.check,
                                     c.budget, live=lambda rpm, tpm: live.rates(job_id, rpm, tpm))
        return dataclasses.replace(policy, pacer=pacer)


class Adaptive:
    """A job whose model cap adapts to the server (``--concurrency auto``, broker/adaptive.py):
    each try's outcome is reported (workers/adaptive_caps.py), and overloads are retried within the
    attempt's budget; with ``--llm-metrics-url``, each try also keeps this process's reads of the
    server's metrics going (MetricsWatch, off the call's path). Beside the pacer, on the
    endpoint, so that every try is seen."""

    def wrap(self, policy: BoundPolicy, c: PortContext) -> BoundPolicy:
        caps = c.caps()
        if caps is None or not caps.model_auto or caps.model <= 0:
            return policy
        cap_key = caps.model_caps(c.parts.keys, c.job.llm_base_url)[0].key
        reporter = c.parts.fleet.adaptive
        reporter.track(cap_key, caps.model)
        metrics = (c.parts.fleet.metrics, caps.model_metrics) if caps.model_metrics else None
        return dataclasses.replace(policy, pacer=AdaptivePacer(policy.pacer, reporter, cap_key, metrics))


class Versioned:
    """A feed job's answers carry the policy version they were made under (workers/versions.py)."""

    def wrap(self, policy: Any, c: PortContext) -> Any:
        return c.parts.versions.wrap(policy, c.job.job_id)


class ProcessGate:
    """The worker process's cap on model calls at once (workers/limits.py)."""

    def wrap(self, policy: Any, c: PortContext) -> Any:
        return limits.LimitedPolicy(policy, c.parts.model_gate, lambda: c.budget.deadline, c.check)


class FleetCaps:
    """The job's fleet-wide caps on calls to its model (workers/fleetcaps.py); no round trip
    when it sets none."""

    def wrap(self, policy: Any, c: PortContext) -> Any:
        caps = c.caps()
        model_caps = caps.model_caps(c.parts.keys, c.job.llm_base_url) if caps is not None else None
        if not model_caps:
            return policy
        return CappedPolicy(policy, c.parts.fleet, model_caps, c.check, c.budget)


class Cached:
    """The response cache (workers/response_cache.py, broker/cache.py), for a job run with
    ``--cache``; a job without it does not have the layer in its port at all.

    Outermost, on purpose: a cached answer must cost nothing of what limits calls to the model.
    Inside it come the fleet-wide caps (a hit must not hold a slot of the endpoint's in-flight
    cap), the process's gate (nor one of this worker's model slots), the feed's version stamp (a
    cached answer was not made under the trainer's current policy, so it is recorded with no
    ``policy_version`` rather than a wrong one) and, in the endpoint, the rate limits and the
    breaker (a hit takes no RPM/TPM token and is answered while the model server is down). Its
    key is what the endpoint would send, entry sampling included (workers/ports.py
    ``sent_sampling``), so it needs no inner layer's work to compute it. A miss goes through
    every inner layer as an uncached call does."""

    def wrap(self, policy: Any, c: PortContext) -> Any:
        cache = getattr(c.parts, "cache", None)
        if not getattr(c.job, "cache", "") or cache is None:
            return policy
        from workers.response_cache import CachedPolicy

        return CachedPolicy(policy, cache, c.job, getattr(c.spec, "sampling", None))


POLICY_LAYERS = (Endpoint(), EntrySampling(), Paced(), Adaptive(), Versioned(), ProcessGate(), FleetCaps(), Cached())


def policy_port(c: PortContext, layers=POLICY_LAYERS) -> Any:
    """The model port: ``layers`` applied innermost first."""
    policy = None
    for layer in layers:
        policy = layer.wrap(policy, c)
    return policy


def env_port(c: PortContext, instance: tuple[int, str]) -> Any:
    """The env of a trajectory: ``instance`` is (number, attempt_id) of the attempt that reset
    it. Uncapped: what closes an instance goes through here too."""
    spec, p = c.spec, c.parts
    if spec.protocol:  # an OpenEnv or ORS server (workers/env_protocols.py)
        from workers.env_protocols import protocol_env_port

        return protocol_env_port(spec, instance, settings=p.settings, client=p.env, budget=c.budget, guard=c.guard,
                                 breakers=p.breakers, check=c.check)
    if spec.transport == "inproc":
        from workers.inproc import InprocEnv  # the env class runs inside this worker process

        return InprocEnv(spec, c.budget, p.settings, on_wedged=p.unhealthy)
    return BoundEnv(p.env, spec, env_instance_id(spec.episode_id, *instance), c.budget, c.guard,
                    p.breakers.for_env(spec.base_url))


def capped_env(c: PortContext, env: Any) -> Any:
    """``env`` under the job's fleet-wide caps on calls to its server and on live instances."""
    caps = c.caps()
    if caps is None or c.spec.transport == "inproc":
        return env
    call_caps = caps.env_call_caps(c.parts.keys, c.spec.base_url, c.spec.env_name)
    instance_caps = caps.env_instance_caps(c.parts.keys, c.spec.base_url)
    if not (call_caps or instance_caps):
        return env
    return CappedEnv(env, c.parts.fleet, call_caps, instance_caps, c.check, c.budget)
