"""The step loop: docs/protocol.md#step-loop, as a plain function over small ports.

No broker, no Redis, no Celery here: ``run_episode`` takes an env port, a policy port, an
episode hook and a ``publish`` callable, so every rule is unit-testable with plain objects.

How an episode ends (``EpisodeOutcome.ended_by``, broker/records.py ``ENDED_BY``): the env
terminates or truncates it, max_steps is reached, the env has no prompt left, or the model side
cuts it off. The model side ends it in two ways, both recorded as a final step that is truncated,
has reward 0, is trainable (``is_trainable``: a truncated step always is) and whose action never
reaches the env:

* ``length``: the answer was cut off (``finish_reason == "length"``); the step keeps it;
* ``context_length``: the prompt outgrew the model's context window and the server refused it
  (``broker.errors.ContextOverflow``). With the full history in every prompt (``message_cut <= 0``)
  this is how a long episode ends, not a failure: its steps stay, and its group stays complete.
  The step has no answer (``response`` empty) and carries the weight version of the last answer,
  whose policy wrote the trajectory in its prompt.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import orjson

from broker.errors import ContextOverflow
from broker.records import StepRecord
from broker.states import EndedBy
from broker.tokens import TOKENS_INVALID, TOKENS_MISSING, TOKENS_OK, first_difference
from workers.envport import EnvPort
from workers.hooks import EpisodeHook
from workers.tokens import warn_once

log = logging.getLogger("interactor.loop")


class PolicyPort(Protocol):
    # -> content, finish_reason, weight_version (and prompt_tokens, completion_tokens if known);
    # raises broker.errors.ContextOverflow when the server refuses a prompt longer than its context
    def complete(self, messages: list[dict]) -> Any: ...


@dataclass(frozen=True)
class LoopConfig:
    job_id: str
    episode_id: str
    env_name: str
    group_id: str
    llm_model: str
    attempt: int = 1
    max_steps: int = 1000
    message_cut: int = 3
    attempt_id: str = ""


@dataclass
class PhaseTimings:
    """Where an attempt's time went (broker/records.py PHASES), filled in as the loop goes, so
    that an attempt that fails half-way still tells its part."""

    reset_s: float = 0.0
    prompt_s: float = 0.0
    model_s: float = 0.0
    env_step_s: float = 0.0
    close_s: float = 0.0

    def record_fields(self) -> dict[str, float]:
        """As AttemptRecord fields."""
        return {"reset_s": self.reset_s, "prompt_s": self.prompt_s, "model_s": self.model_s,
                "env_step_s": self.env_step_s, "close_s": self.close_s}


@dataclass
class EpisodeOutcome:
    total_reward: float = 0.0
    steps: int = 0
    last_info: dict | None = None
    ended_by: str = ""  # one of broker.records.ENDED_BY
    prompt_tokens: int = 0  # sums of the server's usage over the steps (0 when it sends none)
    completion_tokens: int = 0


def trim_messages(prompt: Any, message_cut: int) -> list:
    """Keep a leading system message plus the last ``2*message_cut-1`` messages."""
    if not isinstance(prompt, list) or not prompt:
        return []
    if message_cut <= 0:
        return prompt
    out = []
    start = 0
    if isinstance(prompt[0], dict) and prompt[0].get("role") == "system":
        out.append(prompt[0])
        start = 1
    out.extend(prompt[start:][-(message_cut * 2 - 1):])
    return out


def is_trainable(message_cut: int, terminated: bool, truncated: bool) -> bool:
    # With the full history in every prompt (message_cut <= 0) only the final step carries
    # the whole trajectory; with a cut, each step's prompt is a sample of its own.
    return message_cut > 0 or terminated or truncated


def run_episode(
    cfg: LoopConfig,
    *,
    env: EnvPort,
    policy: PolicyPort,
    publish: Callable[[StepRecord], None],
    hook: EpisodeHook,
    check: Callable[[], None] = lambda: None,
    timings: PhaseTimings | None = None,
) -> EpisodeOutcome:
    """Reset, step until the episode ends, always close and always call the end hook.

    ``check`` is called before every env or model call; it raises to abort (budget spent,
    lease lost, worker shutting down). Every exception propagates after the env is closed.
    """
    out = EpisodeOutcome()
    last_weight_version = None
    # The previous turn's prompt + completion ids: this turn's prompt ids must start with them
    # (an append-only template); where not, the step records token_drift (docs/protocol.md).
    prev_tokens: list[int] | None = None
    tm = timings if timings is not None else PhaseTimings()
    try:
        check()
        t0 = time.perf_counter()
        env.reset()
        reset_s: float | None = time.perf_counter() - t0
        tm.reset_s += reset_s
        for step_id in range(1, cfg.max_steps + 1):
            check()
            t0 = time.perf_counter()
            prompt_raw = env.get_task_prompt()
            env_s = time.perf_counter() - t0
            tm.prompt_s += env_s
            prompt_raw = _hook_handle(hook, cfg, step_id, prompt_raw)
            prompt = trim_messages(prompt_raw, cfg.message_cut)
            if not prompt:
                out.ended_by = EndedBy.EMPTY_PROMPT
                break

            check()
            t0 = time.perf_counter()
            try:
                completion, overflow = policy.complete(prompt), None
            except ContextOverflow as exc:
                completion, overflow = None, exc
            model_s = time.perf_counter() - t0
            tm.model_s += model_s
            if completion is not None:
                last_weight_version = completion.weight_version
                action, finish_reason = completion.content or "", completion.finish_reason or "stop"
            else:
                action, finish_reason = "", EndedBy.CONTEXT_LENGTH
            prompt_tokens = getattr(completion, "prompt_tokens", None)
            completion_tokens = getattr(completion, "completion_tokens", None)
            out.prompt_tokens += prompt_tokens or 0
            out.completion_tokens += completion_tokens or 0
            common = dict(
                job_id=cfg.job_id, env_id=cfg.episode_id, attempt=cfg.attempt, step_id=step_id,
                env_name=cfg.env_name, llm_model=cfg.llm_model, group_id=cfg.group_id,
                messages_json=orjson.dumps(prompt), response=action, weight_version=last_weight_version,
                finish_reason=finish_reason, model_latency_s=model_s, attempt_id=cfg.attempt_id,
                prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                policy_version=getattr(completion, "policy_version", None),  # feed jobs (workers/versions.py)
                prompt_s=env_s, reset_s=reset_s,
            )
            reset_s = None  # on the first step only
            tok = getattr(completion, "tokens", None)
            if tok is not None:
                common.update(tok.record_fields())
                for text in tok.warnings:
                    warn_once(cfg.job_id, text)
                if tok.status in (TOKENS_INVALID, TOKENS_MISSING):
                    # once per job and reason; each step's own reason is stored with it
                    code = tok.error.split(":", 1)[0]
                    warn_once(cfg.job_id, f"token answers {tok.status} ({code}), e.g. episode {cfg.episode_id} "
                                          f"step {step_id}: {tok.error}; the steps keep their text",
                              key=f"{tok.status}:{code}")
                if tok.status == TOKENS_OK:
                    if prev_tokens is not None:
                        common["token_drift"] = first_difference(prev_tokens, tok.prompt_ids)
                    prev_tokens = list(tok.prompt_ids) + list(tok.completion_ids)
                else:
                    prev_tokens = None  # nothing to compare the next turn with

            if overflow is not None or finish_reason == "length":
                # The model side ended it: the prompt did not fit, or the answer was cut off.
                # The env never sees an action; the episode ends truncated.
                out.steps = step_id
                out.ended_by = EndedBy.CONTEXT_LENGTH if overflow is not None else EndedBy.LENGTH
                if overflow is not None:
                    log.log(logging.WARNING if step_id == 1 else logging.INFO,
                            "episode %s step %d: the prompt outgrew the model's context; the episode ends "
                            "truncated%s (%s)", cfg.episode_id, step_id,
                            " at its first step (is max_tokens more than the context leaves?)" if step_id == 1 else "",
                            overflow.args[0] if overflow.args else overflow)
                publish(StepRecord(**common, step_reward=0.0, cumulative_reward=out.total_reward,
                                   terminated=True, truncated=True, episode_finished=True,
                                   is_trainable=is_trainable(cfg.message_cut, True, True), env_latency_s=env_s,
                                   ended_by=out.ended_by))
                break

            check()
            t0 = time.perf_counter()
            result = env.step(action)
            step_s = time.perf_counter() - t0
            tm.env_step_s += step_s
            env_s += step_s
            reward = float(result.reward or 0.0)
            out.total_reward += reward
            out.steps = step_id
            out.last_info = result.info if isinstance(result.info, dict) else None
            done = bool(result.terminated or result.truncated)
            last = done or step_id == cfg.max_steps
            ended_by = ((EndedBy.TERMINATED if result.terminated else EndedBy.TRUNCATED) if done
                        else EndedBy.MAX_STEPS if last else "")
            publish(StepRecord(**common, step_reward=reward, cumulative_reward=out.total_reward,
                               terminated=bool(result.terminated), truncated=bool(result.truncated),
                               episode_finished=last,
                               # The max_steps step is final too: without this, a full-history
                               # episode cut off by max_steps would leave no trainable row.
                               is_trainable=is_trainable(cfg.message_cut, result.terminated,
                                                         result.truncated or step_id == cfg.max_steps),
                               env_latency_s=env_s, ended_by=ended_by, env_step_s=step_s))
            if done:
                out.ended_by = ended_by
                break
        else:
            out.ended_by = EndedBy.MAX_STEPS
        return out
    finally:
        try:
            hook.on_episode_end(cfg.env_name, cfg.episode_id, out.total_reward, out.last_info)
        except Exception:
            log.exception("episode %s: on_episode_end hook failed (ignored)", cfg.episode_id)
        t0 = time.perf_counter()
        try:
            env.close()
        except Exception:
            log.exception("episode %s: closing the env failed (ignored)", cfg.episode_id)
        tm.close_s += time.perf_counter() - t0


def _hook_handle(hook: EpisodeHook, cfg: LoopConfig, step_id: int, prompt: Any) -> Any:
    try:
        return hook.handle(cfg.env_name, cfg.episode_id, step_id, prompt)
    except Exception:
        log.exception("episode %s step %d: episode hook handle() failed; prompt left as is", cfg.episode_id, step_id)
        return prompt
