"""The loop's ports bound to one attempt: its own env instance on its server, its model
endpoint, the attempt's budget, and the servers' circuit breakers.

Each attempt drives an env instance of its own (``broker.keys.env_instance_id``)
(records and the model's session id stay the episode id). An attempt that was given up on
(a stalled worker whose lease passed to another attempt) can then neither step nor close the
instance its successor is using (two attempts driving one instance would corrupt both
episodes); the successor closes its predecessor's instance before its own reset, so a killed
attempt leaves nothing behind for long.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from broker.errors import EpisodeError
from broker.records import EpisodeSpec, JobSpec
from workers.breakers import Breaker
from workers.budget import Budget
from workers.envclient import EnvClient
from workers.modelclient import ModelClient


def policy_url(job: JobSpec, episode_id: str) -> str:
    root = job.llm_base_url.rstrip("/")
    return f"{root}/{episode_id}" if job.session_routing else root


@dataclass
class Guard:
    """Runs one attempt's server calls through their server's breaker (workers/breakers.py).

    A failure that looks like an outage and that the server's readiness confirms opens the
    breaker; the attempt then waits, its budget paused. After the outage the call is made
    again if that is safe (``retry_safe``: reset, close, model calls; or a request the server
    never processed); otherwise the attempt ends with the error marked ``outage``, and its close
    has the episode run again without counting the attempt. ``outage_seen``: this attempt lived
    through an outage (an instance lost to a server restart is the outage's doing too).
    """

    budget: Budget
    check: Callable[[], None]
    outage_budget_s: float
    outage_seen: bool = field(default=False)

    def call(self, breaker: Breaker, fn: Callable[[], Any], *, retry_safe: bool) -> Any:
        while True:
            self.wait(breaker)
            try:
                return fn()
            except EpisodeError as exc:
                if not exc.outage or not breaker.confirm_down(exc):
                    raise
                breaker.trip(str(exc))
                self.outage_seen = True
                if retry_safe or not exc.maybe_applied:
                    continue
                self.wait(breaker)
                raise EpisodeError(exc.reason, f"{exc.args[0]} (the server went down with this call in flight; "
                                               "the attempt starts over once it is back)",
                                   transient=True, status=exc.status, outage=True) from exc

    def wait(self, breaker: Breaker) -> None:
        if breaker.is_open:
            self.outage_seen = True
            breaker.wait(self.check, self.budget, self.outage_budget_s)


@dataclass
class BoundEnv:
    """The env port of the loop: this attempt's instance on one server, under its budget."""

    client: EnvClient
    spec: EpisodeSpec
    instance: str
    budget: Budget
    guard: Guard
    breaker: Breaker

    def reset(self):
        s = self.spec
        return self.guard.call(self.breaker, lambda: self.client.reset(
            s.base_url, s.env_name, self.instance, s.env_params, s.seed, deadline=self.budget.deadline),
            retry_safe=True)

    def get_task_prompt(self):
        s = self.spec
        return self.guard.call(self.breaker, lambda: self.client.get_task_prompt(
            s.base_url, s.env_name, self.instance, deadline=self.budget.deadline), retry_safe=False)

    def step(self, action: str, **tool_calls: Any):
        s = self.spec
        return self.guard.call(self.breaker, lambda: self.client.step(
            s.base_url, s.env_name, self.instance, action, deadline=self.budget.deadline, **tool_calls),
            retry_safe=False)

    def close(self) -> None:
        s = self.spec
        self.client.close(s.base_url, s.env_name, self.instance, deadline=self.budget.deadline)


def sent_sampling(job: JobSpec, sampling: dict | None, request: dict) -> tuple[Any, dict]:
    """The temperature and the other body fields a model call sends: the job's, the task entry's
    own sampling (EpisodeSpec.sampling) over them, the call's ``request`` (tools...) over both.
    The response cache keys its answers by these (workers/response_cache.py)."""
    temperature, params = job.temperature, job.llm_params
    if sampling:
        own = dict(sampling)
        temperature = own.pop("temperature", temperature)
        params = {**(params or {}), **own}
    if request:
        params = {**(params or {}), **request}
    return temperature, params


@dataclass
class BoundPolicy:
    """The policy port: the job's model endpoint. ``api_key`` is empty unless the endpoint is
    one the worker trusts with it."""

    client: ModelClient
    job: JobSpec
    base_url: str
    api_key: str
    budget: Budget
    guard: Guard
    breaker: Breaker
    pacer: Any = None  # the endpoint's fleet-wide rate limits (workers/pacing.py), when the job sets any
    # the task entry's own max_tokens, temperature and stop (EpisodeSpec.sampling), over the job's
    sampling: dict = field(default_factory=dict)

    def complete(self, messages: list[dict], **request: Any):
        j = self.job
        # tokens only when the job asks: a v2 JobSpec has none, and the call stays as it was
        extra = {"tokens": j.tokens} if getattr(j, "tokens", "") else {}
        if self.pacer is not None:
            extra["pacer"] = self.pacer
        temperature, params = sent_sampling(j, self.sampling, request)
        return self.guard.call(self.breaker, lambda: self.client.complete(
            self.base_url, messages, model=j.model, temperature=temperature, params=params,
            deadline=self.budget.deadline, api_key=self.api_key, **extra), retry_safe=True)
