"""Env-driven episodes: an env server that owns the loop calls the model itself, through the
worker's model gateway handed to it in its reset body (docs/protocol.md#env-driven-episodes).

A task entry with an env server of the original protocol (``base_url``, http transport) and
``env_calls_model: true`` (producer/agent_entries.py) is run by the worker as follows:

1. a gateway session is opened for the episode exactly as for an agent (workers/agent_episode.py,
   workers/gateway.py): a per-episode key, valid for this session only and only while the
   attempt runs (401 for another session's path, 410 once ended); the model's real key stays in
   the worker;
2. the attempt's instance is reset with the usual body plus ``"llm": {"base_url": "<session URL
   ending in /v1>", "api_key": "<session key>", "model": "<job model>"}``;
3. the worker does not call the model: it sends ``POST .../step`` ``{"action": ""}`` until the
   answer says terminated or truncated (or ``max_steps`` steps were sent), summing the step
   rewards. The env calls the model through the gateway whenever it likes, during reset and
   during any step (one that owns its loop typically runs its whole rollout in reset or in its
   first step, and answers that step with the reward and ``terminated: true``);
4. the session ends (a call the env makes after the last step's answer is refused, 410), and
   the instance is closed: always, also when the attempt fails.

Each model call the env made is one step of the episode, in the order answered (the
:class:`~workers.agent_episode.CallRecorder` of agent episodes: the same records); the reward
(the sum of the step rewards) lands on the last call's record, the last step answer's ``info``
on the attempt's record, as for agents. An env that made no model call fails the attempt
(``agent_error``: there is nothing to hold its reward).

Env errors are the env client's (workers/envclient.py), classified as in the step loop: a 4xx on
reset is permanent (``env_bad_request``), a 5xx, a dropped connection or an unreachable server
transient; the reset that hands out the gateway is, unlike the step loop's, not repeated once it
may have reached the server (the env may have called the model before it failed). Reset and
steps may take as long as the rollout: their read timeout is the time left under
``--agent-timeout`` (counted from the reset) and the attempt's budget; past ``--agent-timeout``
the attempt fails as ``agent_timeout``, as an agent's does. Env-driven episodes do not resume
(``resume_note`` ``not_resumable``, as agents): a cut-off attempt is followed by a fresh one, which
closes the instance the cut-off one may have left and resets its own.

Secrets: the ``llm`` block is built here, at reset time; it is in no task payload, record or
log line. The reset body is not logged, and the session key is starred out of any error text
the env echoes it in, and of the ``info`` stored with the attempt.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

import orjson

from broker import errors
from broker.keys import env_instance_id
from broker.records import EpisodeSpec
from broker.states import EndedBy
from workers.agent_episode import AgentOutcome, CallRecorder, is_agent
from workers.breakers import Breaker
from workers.budget import Budget
from workers.deadlines import deadline_passed
from workers.envclient import EnvClient
from workers.gateway import AgentSession, Gateway
from workers.loop import LoopConfig
from workers.port_layers import capped_env, policy_port
from workers.ports import Guard

log = logging.getLogger("interactor.agent")

NO_CALL = ("the env server answered without calling the model through the gateway: an env-driven episode "
           "(env_calls_model: true) needs at least one call to record, to hold its reward")


def is_env_driven(spec: EpisodeSpec) -> bool:
    return bool(getattr(spec, "env_calls_model", False))


def unsupported(spec: EpisodeSpec) -> str:
    """Why a worker will not run ``spec`` as an env-driven episode ("" = it will): the submit
    refuses these (producer/agent_entries.py), a job from elsewhere may not have been."""
    if is_agent(spec):
        return "env_calls_model with an agent: the agent calls the model itself; an entry is one or the other"
    if getattr(spec, "protocol", ""):
        return (f"env_calls_model with protocol {spec.protocol!r}: only an env server of the original protocol "
                "is handed the gateway (in its reset body)")
    if spec.transport != "http" or not spec.base_url:
        return "env_calls_model without an env server over http (base_url): there is no reset body to hand it in"
    return ""


@dataclass
class GatewayEnv:
    """The env port of an env-driven episode: the attempt's instance on its server, reset with
    the gateway's ``llm`` block; each call under ``deadline()`` (the attempt's budget and
    ``--agent-timeout``) with no read timeout short of it, through the server's breaker."""

    client: EnvClient
    spec: EpisodeSpec
    instance: str
    llm: dict
    deadline: Callable[[], float]
    budget: Budget
    guard: Guard
    breaker: Breaker

    def reset(self) -> Any:
        s = self.spec
        return self.guard.call(self.breaker, lambda: self.client.reset(
            s.base_url, s.env_name, self.instance, s.env_params, s.seed, deadline=self.deadline(), llm=self.llm,
            read_timeout_s=math.inf), retry_safe=False)

    def step(self, action: str, **tool_calls: Any) -> Any:
        s = self.spec
        return self.guard.call(self.breaker, lambda: self.client.step(
            s.base_url, s.env_name, self.instance, action, deadline=self.deadline(), read_timeout_s=math.inf,
            scrub=self.llm["api_key"]), retry_safe=False)

    def close(self) -> None:
        s = self.spec
        self.client.close(s.base_url, s.env_name, self.instance, deadline=self.budget.deadline)


def run_env_episode(attempt: Any, gateway: Gateway, cfg: LoopConfig,
                    route: Callable[[str, bool], None] = lambda session_id, open_: None) -> AgentOutcome:
    """The episode of ``attempt`` (workers/attempt.py ``Attempt``), its env server driving the
    model through a session of ``gateway``; ``route`` as for agents (workers/agent_episode.py)."""
    parts, spec, job = attempt.parts, attempt.spec, attempt.job
    problem = unsupported(spec)
    if problem:
        raise errors.EpisodeError(errors.BAD_TASK, problem, transient=False)
    key = "ixs-" + secrets.token_urlsafe(24)

    def redact(text: str) -> str:
        return parts.redact(text).replace(key, "***")

    recorder = CallRecorder(cfg, attempt.publish)
    session = gateway.table.open(AgentSession(spec.episode_id, job.model, policy_port(attempt.ports),
                                              recorder.record, attempt.check, redact, key=key))
    llm = {"base_url": gateway.session_url(session), "api_key": key, "model": job.model}
    timeout_s = parts.settings.agent_timeout_s
    limit = time.monotonic() + timeout_s if timeout_s > 0 else math.inf

    def deadline() -> float:
        return min(attempt.budget.deadline, limit)

    port = GatewayEnv(parts.env, spec, env_instance_id(spec.episode_id, attempt.lease.attempt,
                                                       attempt.lease.attempt_id),
                      llm, deadline, attempt.budget, attempt.guard, parts.breakers.for_env(spec.base_url))
    env = capped_env(attempt.ports, port)
    attempt.close_earlier()  # the instances earlier attempts may have left (a second close is a no-op)
    try:
        route(session.session_id, True)
        try:
            total, last, sent = _drive(env, attempt.check, job.max_steps, limit, timeout_s, spec.env_name)
        finally:
            gateway.table.end(session)
            env.close()
    except errors.EpisodeError as exc:
        if session.error is not None:
            raise session.error from exc  # the model failed the env's call for good: the attempt ends for that
        if exc.reason == errors.EPISODE_TIMEOUT and limit <= attempt.budget.deadline and deadline_passed(limit):
            raise _timed_out(spec.env_name, timeout_s) from exc
        raise
    finally:
        route(session.session_id, False)
    if session.error is not None:
        raise session.error
    if last.terminated:
        ended_by = EndedBy.TERMINATED
    elif last.truncated:
        ended_by = EndedBy.TRUNCATED
    else:
        ended_by = EndedBy.MAX_STEPS
    recorder.finish(total, ended_by=ended_by, terminated=last.terminated, truncated=last.truncated, nothing=NO_CALL)
    log.debug("episode %s: env-driven, %d step(s) sent, %d model call(s)", spec.episode_id, sent, recorder.steps)
    return AgentOutcome(total, _scrubbed(last.info, key), recorder.steps, recorder.prompt_tokens,
                        recorder.completion_tokens, recorder.model_s, ended_by=ended_by)


def _drive(env: Any, check: Callable[[], None], max_steps: int, limit: float, timeout_s: float,
           env_name: str) -> tuple[float, Any, int]:
    """Reset, then empty actions until the env ends the episode or ``max_steps`` were sent:
    (the sum of the step rewards, the last step answer, steps sent)."""
    env.reset()
    total, last, sent = 0.0, None, 0
    while sent < max(1, max_steps):
        check()
        if time.monotonic() >= limit:
            raise _timed_out(env_name, timeout_s)
        last = env.step("")
        sent += 1
        total += last.reward
        if last.terminated or last.truncated:
            break
    return total, last, sent


def _timed_out(env_name: str, timeout_s: float) -> errors.EpisodeError:
    return errors.EpisodeError(errors.AGENT_TIMEOUT, f"env server {env_name} (env_calls_model) ran past "
                                                     f"--agent-timeout ({timeout_s:g}s)")


def _scrubbed(info: dict | None, key: str) -> dict | None:
    """The env's ``info`` with the session key starred out, should the env have echoed it."""
    if not info:
        return info
    try:
        text = orjson.dumps(info)
    except (TypeError, orjson.JSONEncodeError):
        return info  # the attempt's close replaces an unencodable info anyway
    return orjson.loads(text.replace(key.encode(), b"***")) if key.encode() in text else info
