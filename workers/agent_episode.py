"""Agent episodes: an agent that owns its loop runs against the model gateway (workers/gateway.py)
and each of its model calls is recorded as a step (docs/protocol.md#agent-episodes).

A task entry says which agent, in one of two ways (allowed by the worker's lists,
workers/allowlist.py):

* ``agent: module:function``: the worker calls ``function(task=ROW, base_url=URL, api_key=KEY,
  model=NAME)`` on a thread of its own; ``base_url`` ends in ``/v1`` and points at this
  episode's session on the worker's loopback gateway, ``api_key`` is the session's key (never
  the model's). It returns the reward: a number, or ``{"reward": number, "info": {...}}``.
* ``agent_command: [argv...]``: the worker runs the process with ``OPENAI_BASE_URL``,
  ``OPENAI_API_KEY`` (the session's key) and ``INTERACTOR_MODEL`` set, the worker's own
  secrets (``INTERACTOR_*``, ``REDIS_URL``, ``*_API_KEY``, passwords, tokens) removed from its
  environment, the task row as JSON on its stdin; its last stdout line ``{"reward": ...}`` is
  the reward.

``ROW`` is the entry's dataset row (``env_params["dataset"]``) when it has a dataset, else its
``env_params``. The reward lands on the episode's last step: the recorder holds each call's
record back until the next one is answered, and the last is published with the reward once
the agent has returned (an episode whose agent made no call has nothing to hold the reward
and fails as ``agent_error``).

An agent that raises, exits non-zero, answers no reward, or runs past ``--agent-timeout`` fails
its attempt (``agent_error`` / ``agent_timeout``, transient: the next attempt runs the agent
again) with the reason and its last words (the exception, or its stderr's tail). Its session
ends first, so whatever it still sends is refused (410); the calls it made stay its attempt's
and never mix into another attempt's trajectory. A model call the gateway could not answer
(the model down past its retries and outage waits) ends the attempt with that call's reason,
whatever the agent made of its error. Agents cannot resume: an attempt that is cut off (worker
killed, lease lost) is followed by a fresh one, which runs the agent from the start.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import orjson
import redis

from broker import errors
from broker.records import AttemptRecord, EpisodeSpec, JobSpec, StepRecord
from broker.states import AttemptStatus, EndedBy, LedgerState, ResumeNote
from envs.base import import_object
from workers.gateway import AgentSession, Gateway, advertised_url, local_gateway
from workers.loop import LoopConfig
from workers.port_layers import policy_port
from workers.token_answers import step_token_fields

log = logging.getLogger("interactor.agent")

_WAIT_SLICE_S = 0.05
_LAST_WORDS = 1500  # characters of an agent's last words kept in the attempt's error
# Environment variables of the worker an agent process never inherits: the worker's settings
# (the model's key, Redis' password among them) and anything that looks like a secret.
_SECRET_ENV = re.compile(r"^(INTERACTOR_|REDIS_URL$|OPENAI_)|(API_KEY|PASSWORD|PASSWD|SECRET|TOKEN)", re.I)


@dataclass
class AgentOutcome:
    reward: float
    info: dict | None
    steps: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_s: float = 0.0
    ended_by: str = EndedBy.TERMINATED


def is_agent(spec: EpisodeSpec) -> bool:
    return bool(getattr(spec, "agent", "") or getattr(spec, "agent_command", None))


def task_row(spec: EpisodeSpec) -> Any:
    """What the agent is given as its task: the dataset row, else the entry's params."""
    params = spec.env_params or {}
    row = params.get("dataset")
    if isinstance(row, dict) and row:
        return row
    return {k: v for k, v in params.items() if k != "dataset"}


class CallRecorder:
    """The step records of one attempt's agent calls, numbered in the order they were answered;
    each is published when the next is answered, the last with the reward (:meth:`finish`)."""

    def __init__(self, cfg: LoopConfig, publish: Callable[[StepRecord], None]):
        self.cfg, self.publish = cfg, publish
        self.steps = 0
        self.prompt_tokens = self.completion_tokens = 0
        self.model_s = 0.0
        self._held: StepRecord | None = None
        self._prev_tokens: list[int] | None = None

    def record(self, messages: list, request: dict, completion: Any, seconds: float) -> int:
        """One answered call (the gateway calls it under the session's lock)."""
        cfg = self.cfg
        self.steps += 1
        step_id = self.steps
        tokens, self._prev_tokens = step_token_fields(cfg.job_id, cfg.episode_id, step_id,
                                                      getattr(completion, "tokens", None), self._prev_tokens)
        self.prompt_tokens += completion.prompt_tokens or 0
        self.completion_tokens += completion.completion_tokens or 0
        self.model_s += seconds
        record = StepRecord(
            job_id=cfg.job_id, env_id=cfg.episode_id, attempt=cfg.attempt, step_id=step_id, env_name=cfg.env_name,
            llm_model=cfg.llm_model, group_id=cfg.group_id, messages_json=orjson.dumps(messages),
            response=completion.content or "", step_reward=0.0, cumulative_reward=0.0, terminated=False,
            truncated=False, episode_finished=False, is_trainable=True, weight_version=completion.weight_version,
            finish_reason=completion.finish_reason or "stop", model_latency_s=seconds, attempt_id=cfg.attempt_id,
            prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens,
            policy_version=getattr(completion, "policy_version", None),
            cached=getattr(completion, "cached", False),  # answered by the response cache (broker/cache.py)
            tool_calls=completion.tool_calls, tools=request.get("tools") or None, **tokens)
        held, self._held = self._held, record
        if held is not None:
            self.publish(held)
        return step_id

    def finish(self, reward: float, *, ended_by: str = EndedBy.TERMINATED, terminated: bool = True,
               truncated: bool = False, nothing: str = "") -> None:
        """The episode's end: its last call's record, with the reward (and how it ended: an
        env-driven episode's env may truncate it), published; ``nothing``: the failure's text
        when no call was made."""
        last, self._held = self._held, None
        if last is None:
            raise errors.EpisodeError(errors.AGENT_ERROR, nothing or "the agent returned without calling the model: "
                                                                     "an agent episode needs at least one call to record")
        last.step_reward = last.cumulative_reward = reward
        last.terminated, last.truncated, last.episode_finished = terminated, truncated, True
        last.ended_by = ended_by
        self.publish(last)


def run_agent_episode(gateway: Gateway, *, job: JobSpec, spec: EpisodeSpec, cfg: LoopConfig, policy: Any,
                      publish: Callable[[StepRecord], None], check: Callable[[], None],
                      redact: Callable[[str], str], timeout_s: float,
                      route: Callable[[str, bool], None] = lambda session_id, open_: None) -> AgentOutcome:
    """Run the episode's agent against a session of ``gateway`` and record its calls. ``route``
    (session id, open or not) tells `interactor gateway` where the session is served, when
    agents are given its URL."""
    recorder = CallRecorder(cfg, publish)
    session = gateway.table.open(AgentSession(spec.episode_id, job.model, policy, recorder.record, check, redact))
    base_url = gateway.session_url(session)
    try:
        route(session.session_id, True)
        if getattr(spec, "agent", ""):
            result = _run_function(spec.agent, task_row(spec), base_url, session, job.model, check, timeout_s)
        else:
            result = _run_command(list(spec.agent_command), task_row(spec), base_url, session, job.model, check,
                                  timeout_s)
    finally:
        gateway.table.end(session)
        route(session.session_id, False)
    if session.error is not None:
        raise session.error  # a model call failed for good: the attempt ends for the model's reason
    reward, info = _reward(result)
    recorder.finish(reward)
    return AgentOutcome(reward, info, recorder.steps, recorder.prompt_tokens, recorder.completion_tokens,
                        recorder.model_s)


def run_agent_attempt(attempt: Any, episode: Callable[..., AgentOutcome] | None = None) -> str:
    """An attempt (workers/attempt.py ``Attempt``) of an agent episode, from its ports to its
    close: the agent runs on this process's loopback gateway instead of the step loop. An
    attempt before it is never continued (an agent's state is its own): the agent runs afresh.
    ``episode(attempt, gateway, cfg, route)``: what runs instead of the agent (an env-driven
    episode, workers/env_driven.py, whose env server calls the model through the gateway)."""
    parts, lease, spec, job, base = attempt.parts, attempt.lease, attempt.spec, attempt.job, attempt.base
    if lease.attempt == 1:
        base["queue_wait_s"] = max(0.0, attempt.t_start - job.created_at)
    base.update(trajectory="", resumed_at=0,
                resume_note=ResumeNote.NOT_RESUMABLE if attempt.progress is not None or attempt.earlier else "")
    cfg = LoopConfig(job_id=job.job_id, episode_id=spec.episode_id, env_name=spec.env_name, group_id=spec.group_id,
                     llm_model=job.model, attempt=lease.attempt, max_steps=job.max_steps, message_cut=0,
                     attempt_id=lease.attempt_id)
    try:
        parts.jitter.wait(attempt.check)
        s = parts.settings
        gateway = local_gateway(s.gateway_max_body_bytes, s.gateway_host, s.gateway_url)
        if episode is not None:
            outcome = episode(attempt, gateway, cfg, _router(attempt, gateway))
        else:
            outcome = run_agent_episode(gateway, job=job, spec=spec, cfg=cfg, policy=policy_port(attempt.ports),
                                        publish=attempt.publish, check=attempt.check, redact=parts.redact,
                                        timeout_s=s.agent_timeout_s, route=_router(attempt, gateway))
    except errors.EpisodeError as exc:
        return attempt.close_error(exc, "", outage_seen=attempt.guard.outage_seen)
    except redis.RedisError as exc:
        err = errors.EpisodeError(errors.BROKER_OUTAGE, f"Redis unreachable: {type(exc).__name__}: {exc}",
                                  transient=True, outage=True)
        return attempt.close_error(err, "")
    except Exception as exc:  # noqa: BLE001 - a bug of ours: parked with its traceback
        err = errors.EpisodeError(errors.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}", transient=False)
        return attempt.close_error(err, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__,
                                                                           limit=-6))[-4000:])
    record = AttemptRecord(**base, status=AttemptStatus.COMPLETED, total_reward=outcome.reward, steps=outcome.steps,
                           last_info=outcome.info, ended_by=outcome.ended_by, prompt_tokens=outcome.prompt_tokens,
                           completion_tokens=outcome.completion_tokens, model_s=outcome.model_s)
    if not attempt.finish(record, LedgerState.DONE):
        log.warning("episode %s attempt %d: lease lost before completion was recorded", spec.episode_id,
                    lease.attempt)
        return errors.LEASE_LOST
    parts.pause_watch.succeeded(job)
    log.info("episode %s attempt %d (%s) completed: reward=%.3f calls=%d", spec.episode_id, lease.attempt,
             "agent" if episode is None else "env-driven", outcome.reward, outcome.steps)
    return AttemptStatus.COMPLETED


def _router(attempt: Any, gateway: Gateway) -> Callable[[str, bool], None]:
    """Where `interactor gateway` (workers/gateway_router.py) finds a session this worker serves:
    ``<prefix>:gateway:<session>`` holds this gateway's URL while the agent runs (no key without
    ``gateway_url``: agents then call the worker's gateway directly)."""
    parts = attempt.parts
    if not parts.settings.gateway_url:
        return lambda session_id, open_: None
    url = advertised_url(gateway, parts.settings.gateway_advertise_host)
    ttl = int(attempt.job.episode_budget_s) + 60
    client = parts.ledger.r

    def route(session_id: str, open_: bool) -> None:
        key = parts.keys.gateway_route(session_id)
        def write() -> None:
            if open_:
                client.set(key, url, ex=ttl)
            elif client.get(key) == url.encode():  # not a later attempt's, served by another worker
                client.delete(key)

        attempt._through_outage("routing its agent's session", write)

    return route


def _run_function(path: str, row: Any, base_url: str, session: AgentSession, model: str,
                  check: Callable[[], None], timeout_s: float) -> Any:
    outcome: dict[str, Any] = {}
    done: list[bool] = []

    def call() -> None:
        try:
            try:
                with _IMPORTS:
                    fn = import_object(path)
            except Exception as exc:  # noqa: BLE001 - an agent that does not import is the task's error
                outcome["bad"] = f"agent {path!r} could not be imported: {type(exc).__name__}: {exc}"
                return
            if not callable(fn):
                outcome["bad"] = f"agent {path!r} is not callable"
                return
            outcome["called_at"] = time.monotonic()  # --agent-timeout counts from here: imports are not the agent's run
            outcome["result"] = fn(task=row, base_url=base_url, api_key=session.key, model=model)
        except BaseException as exc:  # noqa: BLE001 - whatever the agent raises is its failure
            outcome["error"] = exc
            outcome["words"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-4))
        finally:
            done.append(True)

    _start_thread(call, f"agent:{session.session_id}")
    _wait(lambda: bool(done), check, timeout_s, path, lambda: outcome.get("called_at"))
    if "bad" in outcome:
        raise errors.EpisodeError(errors.BAD_TASK, outcome["bad"], transient=False)
    if "error" in outcome:
        exc = outcome["error"]
        raise errors.EpisodeError(errors.AGENT_ERROR, f"agent {path} raised {type(exc).__name__}: "
                                                      f"{session.redact(str(exc))[:300]}; last words: "
                                                      f"{_tail(session.redact(outcome['words']))}")
    return outcome.get("result")


def _run_command(argv: list[str], row: Any, base_url: str, session: AgentSession, model: str,
                 check: Callable[[], None], timeout_s: float) -> Any:
    env = {k: v for k, v in os.environ.items() if not _SECRET_ENV.search(k)}
    env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY=session.key, INTERACTOR_MODEL=model)
    shown = " ".join(argv)[:200]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, start_new_session=True)
    except OSError as exc:
        raise errors.EpisodeError(errors.BAD_TASK, f"agent command {shown!r} could not be started: {exc}",
                                  transient=False) from None
    out: dict[str, bytes] = {}

    def talk() -> None:
        try:
            out["stdout"], out["stderr"] = proc.communicate(orjson.dumps(row) + b"\n")
        except Exception as exc:  # noqa: BLE001 - a broken pipe: the process exits, its code says more
            out.setdefault("stderr", f"{type(exc).__name__}: {exc}".encode())

    talker = threading.Thread(target=talk, name=f"agent-cmd:{session.session_id}", daemon=True)
    talker.start()
    try:
        started = time.monotonic()
        _wait(lambda: not talker.is_alive(), check, timeout_s, shown, lambda: started)
    except BaseException:
        _kill(proc)
        raise
    words = session.redact((out.get("stderr") or b"").decode("utf-8", "replace"))
    if proc.returncode != 0:
        raise errors.EpisodeError(errors.AGENT_ERROR, f"agent command {shown!r} exited with {proc.returncode}; "
                                                      f"last words: {_tail(words) or '(nothing on stderr)'}")
    lines = [line for line in (out.get("stdout") or b"").decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        raise errors.EpisodeError(errors.AGENT_ERROR, f"agent command {shown!r} printed no reward line "
                                                      f"({{\"reward\": ...}} as its last line of stdout); last "
                                                      f"words: {_tail(words) or '(nothing on stderr)'}")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise errors.EpisodeError(errors.AGENT_ERROR, f"agent command {shown!r}: its last stdout line is not "
                                                      f"JSON: {lines[-1][:200]!r}") from None


def _os_lock():
    """A lock of the OS, also under gevent's patching (whose locks, waited on in a thread other than
    the hub's, are not reliably woken by a release in another)."""
    try:
        from gevent import monkey
    except ImportError:
        return threading.Lock()
    if monkey.is_module_patched("threading"):
        return monkey.get_original("_thread", "allocate_lock")()
    return threading.Lock()


# Agent threads import their agents one at a time. Under the gevent pool, importlib's per-module
# locks are gevent's; two agent threads importing one module at once (two episodes of the same
# agent starting together) could leave the second waiting on a lock whose release never woke it,
# until the episode's budget ran out (seen under load: a raising agent ended as episode_timeout).
_IMPORTS = _os_lock()


def _start_thread(fn: Callable[[], None], name: str) -> None:
    """``fn`` on an OS thread of its own. Under the gevent pool, a real one (the unpatched
    ``_thread``), not a greenlet: asyncio keeps its running loop per OS thread, so two agents on
    asyncio (the OpenAI Agents SDK's ``run_sync``) in greenlets of one thread would see each
    other's loop; and an agent's imports and computing would stall every other episode of the
    process (its lease renewals included) if it ran in the hub's thread."""
    try:
        from gevent import monkey
    except ImportError:
        monkey = None
    if monkey is not None and monkey.is_module_patched("threading"):
        monkey.get_original("_thread", "start_new_thread")(fn, ())
        return
    threading.Thread(target=fn, name=name, daemon=True).start()


def _wait(finished: Callable[[], bool], check: Callable[[], None], timeout_s: float, what: str,
          started: Callable[[], float | None]) -> None:
    """Until ``finished()``; the attempt's ``check`` is asked between slices (lease, budget,
    cancel, shutdown), and ``timeout_s`` past ``started()`` (None: not started yet, its import
    still running, which only the attempt's budget bounds) the agent is given up on."""
    while not finished():
        check()
        t0 = started()
        if timeout_s > 0 and t0 is not None and time.monotonic() - t0 > timeout_s:
            raise errors.EpisodeError(errors.AGENT_TIMEOUT, f"agent {what} ran past --agent-timeout "
                                                            f"({timeout_s:g}s)")
        time.sleep(_WAIT_SLICE_S)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _reward(result: Any) -> tuple[float, dict | None]:
    """The agent's reward and info, from a number or ``{"reward": number, "info": {...}}``."""
    value, info = result, None
    if isinstance(result, dict):
        value, info = result.get("reward"), result.get("info")
        if info is not None and not isinstance(info, dict):
            raise errors.EpisodeError(errors.AGENT_ERROR, f"the agent's info is a {type(info).__name__}, not a mapping")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        shown = repr(result)[:200]
        raise errors.EpisodeError(errors.AGENT_ERROR, f"the agent returned {shown}, not a reward (a finite number, "
                                                      "or {\"reward\": number, \"info\": {...}})")
    return float(value), info


def _tail(text: str) -> str:
    text = text.strip()
    return ("..." + text[-_LAST_WORDS:]) if len(text) > _LAST_WORDS else text
