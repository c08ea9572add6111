"""The step loop: docs/protocol.md#step-loop, as a plain function over small ports.

No broker, no Redis, no Celery here: ``run_episode`` takes an env port, a policy port, an
episode hook and a ``publish`` callable, so every rule is unit-testable with plain objects.

How an episode ends (``EpisodeOutcome.ended_by``, broker/states.py ``EndedBy``): the env
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

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol

import orjson

from broker.errors import ENV_MALFORMED, ContextOverflow, EpisodeError
from broker.records import StepRecord
from broker.states import EndedBy, Phase, ProgressPhase
from workers.envport import EnvPort, prompt_parts
from workers.faults import never
from workers.hooks import EpisodeHook
from workers.progress import FIRST_TRACKED_STEP, ProgressTrack
from workers.token_answers import step_token_fields

log = logging.getLogger("interactor.loop")




class PolicyPort(Protocol):
    # -> content, finish_reason, weight_version (and prompt_tokens, completion_tokens if known);
    # raises broker.errors.ContextOverflow when the server refuses a prompt longer than its context
    # ``request``: further fields of the chat request (``tools``, ``tool_choice``), passed through
    def complete(self, messages: list[dict], **request: Any) -> Any: ...


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
    """Where an attempt's time went (broker/states.py ``Phase``), filled in as the loop goes, so
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

    def phase(self, phase: Phase) -> "PhaseLap":
        """Times one call: ``with timings.phase(Phase.MODEL) as lap:``. A block that ends
        normally adds its seconds (``lap.seconds``) to the phase's total; one that raises adds
        nothing, and its lap stays at 0."""
        return PhaseLap(self, f"{phase}_s")


class PhaseLap:
    """One timed call of a phase (:meth:`PhaseTimings.phase`)."""

    __slots__ = ("_timings", "_field", "_started", "seconds")

    def __init__(self, timings: PhaseTimings, field: str):
        self._timings, self._field, self._started, self.seconds = timings, field, 0.0, 0.0

    def __enter__(self) -> "PhaseLap":
        self._started = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.seconds = time.perf_counter() - self._started
            setattr(self._timings, self._field, getattr(self._timings, self._field) + self.seconds)


@dataclass
class EpisodeOutcome:
    total_reward: float = 0.0
    steps: int = 0
    last_info: dict | None = None
    ended_by: str = ""  # one of broker.states.EndedBy
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
    publish: Callable[..., None],  # (record) or (record, progress snapshot to write with it)
    hook: EpisodeHook,
    check: Callable[[], None] = lambda: None,
    timings: PhaseTimings | None = None,
    track: ProgressTrack | None = None,
    keeps_instance: Callable[[BaseException | None], bool] = lambda error: False,
    fault: Callable[[str, int], None] = never,
) -> EpisodeOutcome:
    """Reset, step until the episode ends, then call the end hook and close the env, unless
    the attempt hands the instance on (``keeps_instance(error)``: the attempt's word, when the
    episode goes on elsewhere and a successor may continue this instance).

    ``check`` is called before every env or model call; it raises to abort (budget spent,
    lease lost, worker shutting down). Every exception propagates after the env is closed.
    ``track`` (workers/progress.py) is told where the loop stands, for a successor; with a
    snapshot to resume from, the loop continues the predecessor's instance at its step instead
    of resetting one (its steps before are recorded already, its totals carried on).
    ``fault(point, step)`` is told each point of a turn (broker/resume.py ``TURN_POINTS``): the
    fault tests stop a worker there (workers/faults.py); otherwise it does nothing.
    """
    run = _Run.start(track)
    out = run.out
    tm = timings if timings is not None else PhaseTimings()
    error: BaseException | None = None
    try:
        if run.first_step == 1:
            check()
            with tm.phase(Phase.RESET) as reset:
                env.reset()
            run.reset_s = reset.seconds
        for step_id in range(run.first_step, cfg.max_steps + 1):
            fault("before_prompt", step_id)
            check()
            prompt_raw, prompt_s = _prompt(env, tm, track, run, step_id)
            fault("after_prompt", step_id)
            messages, tools = prompt_parts(prompt_raw)  # an env may offer the model tools with its prompt
            prompt = trim_messages(_hook_handle(hook, cfg, step_id, messages), cfg.message_cut)
            if not prompt:
                out.ended_by = EndedBy.EMPTY_PROMPT
                break

            check()
            with tm.phase(Phase.MODEL) as model:
                completion, overflow = _complete(policy, prompt, tools)
            answer, tokens = run.model_answered(cfg, step_id, prompt, completion, model.seconds, prompt_s)
            calls = getattr(completion, "tool_calls", None) if tools else None
            if tools:  # kept with the step (StepRecord.tools / tool_calls), as an agent episode's are
                answer.update(tools=tools, tool_calls=calls)
            fault("after_model", step_id)
            if overflow is not None or answer["finish_reason"] == EndedBy.LENGTH:
                end = _cut_by_model(cfg, step_id, overflow)  # the env never sees the action
            else:
                check()
                # in the ledger before the call: never sent twice
                if track is not None and step_id >= FIRST_TRACKED_STEP:
                    track.stepping(step_id, **run.totals())
                fault("after_stepping_mark", step_id)
                with tm.phase(Phase.ENV_STEP) as stepped, _env_call(track, ProgressPhase.STEPPING, step_id):
                    # the calls beside the text only where there are any: an env that offers no
                    # tools is sent exactly what it always was
                    result = env.step(answer["response"], tool_calls=calls) if calls else env.step(answer["response"])
                fault("after_step", step_id)
                end = run.env_answered(cfg, step_id, result, stepped.seconds)

            out.steps = step_id
            record = _step_record(answer, tokens, end, out.total_reward)
            if track is not None and not end.finished:
                track.stepped(step_id, **run.totals())  # no write: the stepping snapshot already says "not resumable"
            publish(record)
            fault("after_publish", step_id)
            if end.finished:
                out.ended_by = end.ended_by
                break
        else:
            out.ended_by = EndedBy.MAX_STEPS
        return out
    except BaseException as exc:
        error = exc
        raise
    finally:
        # A trajectory handed on (a successor continues its instance) has not ended: the hook
        # hears of it once, from whichever attempt ends it.
        if not keeps_instance(error):
            _hook_episode_end(hook, cfg, out)
            _close(env, tm, cfg)


@dataclass(frozen=True)
class StepEnd:
    """How a step ended, as its record tells it: the env's answer to the action, or the model
    side's cut (:func:`_cut_by_model`)."""

    reward: float
    terminated: bool
    truncated: bool
    finished: bool  # the episode's final step
    trainable: bool
    ended_by: str  # on the final step: one of broker.states.EndedBy, else ""
    step_s: float | None = None  # the env's step call (None: never sent)


@dataclass
class _Run:
    """The loop's running state: the outcome so far and what one turn hands the next, fresh or
    as a predecessor's snapshot left them (a resumed trajectory's totals carry on)."""

    out: EpisodeOutcome
    first_step: int = 1
    weight_version: str | None = None  # of the last answer
    # The previous turn's prompt + completion ids: this turn's prompt ids must start with them
    # (an append-only template); where not, the step records token_drift (docs/protocol.md).
    prev_tokens: list[int] | None = None
    resumed_prompt: Any = None  # the predecessor's, answered and never stepped
    reset_s: float | None = None  # for the first step's record only

    @classmethod
    def start(cls, track: ProgressTrack | None) -> "_Run":
        out = EpisodeOutcome()
        if track is None:
            return cls(out)
        out.total_reward, out.prompt_tokens, out.completion_tokens, weight_version, prev_tokens = (
            track.resumed_totals())
        first_step = track.step if track.resume is not None else 1
        out.steps = first_step - 1  # the steps recorded before this attempt's (a resumed trajectory's)
        return cls(out, first_step, weight_version, prev_tokens, track.resumed_prompt())

    def totals(self) -> dict[str, Any]:
        """What a progress snapshot carries of the loop's running totals."""
        out = self.out
        return {"total_reward": out.total_reward, "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens, "weight_version": self.weight_version,
                "prev_tokens": self.prev_tokens}

    def model_answered(self, cfg: LoopConfig, step_id: int, prompt: list, completion: Any, model_s: float,
                       prompt_s: float) -> tuple[dict[str, Any], dict]:
        """The step record's fields known once the model has answered (``completion``; None when
        the server refused the prompt as longer than its context) and its token fields; the
        running totals take the answer's."""
        if completion is not None:
            self.weight_version = completion.weight_version
            action, finish_reason = completion.content or "", completion.finish_reason or "stop"
        else:
            action, finish_reason = "", EndedBy.CONTEXT_LENGTH
        prompt_tokens = getattr(completion, "prompt_tokens", None)
        completion_tokens = getattr(completion, "completion_tokens", None)
        self.out.prompt_tokens += prompt_tokens or 0
        self.out.completion_tokens += completion_tokens or 0
        answer = dict(
            job_id=cfg.job_id, env_id=cfg.episode_id, attempt=cfg.attempt, step_id=step_id,
            env_name=cfg.env_name, llm_model=cfg.llm_model, group_id=cfg.group_id,
            messages_json=orjson.dumps(prompt), response=action, weight_version=self.weight_version,
            finish_reason=finish_reason, model_latency_s=model_s, attempt_id=cfg.attempt_id,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            policy_version=getattr(completion, "policy_version", None),  # feed jobs (workers/versions.py)
            prompt_s=prompt_s, reset_s=self.reset_s,
            reasoning_content=getattr(completion, "reasoning_content", "") or "",
            cached=getattr(completion, "cached", False),  # answered by the response cache (broker/cache.py)
        )
        self.reset_s = None  # on the first step only
        tokens, self.prev_tokens = step_token_fields(cfg.job_id, cfg.episode_id, step_id,
                                                     getattr(completion, "tokens", None), self.prev_tokens)
        return answer, tokens

    def env_answered(self, cfg: LoopConfig, step_id: int, result: Any, step_s: float) -> StepEnd:
        """How the env's answer to the action ends the step; the running totals take its reward."""
        reward = float(result.reward or 0.0)
        self.out.total_reward = _summed(self.out.total_reward, reward, step_id)
        self.out.last_info = result.info if isinstance(result.info, dict) else None
        done = bool(result.terminated or result.truncated)
        last = done or step_id == cfg.max_steps
        return StepEnd(
            reward=reward, terminated=bool(result.terminated), truncated=bool(result.truncated), finished=last,
            # The max_steps step is final too: without this, a full-history episode cut off by
            # max_steps would leave no trainable row.
            trainable=is_trainable(cfg.message_cut, result.terminated, result.truncated or step_id == cfg.max_steps),
            ended_by=((EndedBy.TERMINATED if result.terminated else EndedBy.TRUNCATED) if done
                      else EndedBy.MAX_STEPS if last else ""),
            step_s=step_s)


def _prompt(env: EnvPort, tm: PhaseTimings, track: ProgressTrack | None, run: _Run, step_id: int) -> tuple[Any, float]:
    """This turn's prompt as the env gives it, and the seconds ``get_task_prompt`` took; when
    the attempt resumes at a prompt its predecessor got and never stepped, that one."""
    if run.resumed_prompt is not None:
        prompt, run.resumed_prompt = run.resumed_prompt, None
        return prompt, 0.0
    with tm.phase(Phase.PROMPT) as asked, _env_call(track, ProgressPhase.PROMPTING, step_id):
        prompt = env.get_task_prompt()
    if track is not None and step_id >= FIRST_TRACKED_STEP:
        track.prompted(step_id, orjson.dumps(prompt), **run.totals())
    return prompt, asked.seconds


def _complete(policy: PolicyPort, prompt: list, tools: list | None = None) -> tuple[Any, ContextOverflow | None]:
    """The model's answer, or None and the server's refusal of a prompt longer than its context;
    ``tools`` (OpenAI function schemas the env offered) go into the request."""
    try:
        return (policy.complete(prompt, tools=tools) if tools else policy.complete(prompt)), None
    except ContextOverflow as exc:
        return None, exc


def _cut_by_model(cfg: LoopConfig, step_id: int, overflow: ContextOverflow | None) -> StepEnd:
    """The model side ended the episode: the prompt did not fit (``overflow``), or the answer
    was cut off. The env never sees an action; the episode ends truncated."""
    if overflow is not None:
        log.log(logging.WARNING if step_id == 1 else logging.INFO,
                "episode %s step %d: the prompt outgrew the model's context; the episode ends "
                "truncated%s (%s)", cfg.episode_id, step_id,
                " at its first step (is max_tokens more than the context leaves?)" if step_id == 1 else "",
                overflow.args[0] if overflow.args else overflow)
    return StepEnd(reward=0.0, terminated=True, truncated=True, finished=True,
                   trainable=is_trainable(cfg.message_cut, True, True),
                   ended_by=EndedBy.CONTEXT_LENGTH if overflow is not None else EndedBy.LENGTH)


def _step_record(answer: dict[str, Any], tokens: dict, end: StepEnd, cumulative_reward: float) -> StepRecord:
    """The one place a step's record is made: what the model answered, its tokens, and how the step ended."""
    env_latency_s = answer["prompt_s"] if end.step_s is None else answer["prompt_s"] + end.step_s
    return StepRecord(**answer, **tokens, step_reward=end.reward, cumulative_reward=cumulative_reward,
                      terminated=end.terminated, truncated=end.truncated, episode_finished=end.finished,
                      is_trainable=end.trainable, env_latency_s=env_latency_s, ended_by=end.ended_by,
                      env_step_s=end.step_s)


def _env_call(track: ProgressTrack | None, phase: ProgressPhase, step_id: int) -> ContextManager[None]:
    """An env call the progress track holds in flight (nothing to hold without a track)."""
    return track.call(phase, step_id) if track is not None else contextlib.nullcontext()


def _summed(total: float, reward: float, step_id: int) -> float:
    """The episode's total reward with this step's. Each reward is finite (the env port checks
    it), their sum may not be: then there is no total a group could be ranked by, and the env's
    answer is refused before a step carrying it is recorded."""
    out = total + reward
    if not math.isfinite(out):
        raise EpisodeError(ENV_MALFORMED, f"step {step_id}: reward {reward!r} takes the episode's total reward "
                                          f"from {total!r} past the float range")
    return out


def _hook_episode_end(hook: EpisodeHook, cfg: LoopConfig, out: EpisodeOutcome) -> None:
    try:
        hook.on_episode_end(cfg.env_name, cfg.episode_id, out.total_reward, out.last_info)
    except Exception:
        log.exception("episode %s: on_episode_end hook failed (ignored)", cfg.episode_id)


def _close(env: EnvPort, tm: PhaseTimings, cfg: LoopConfig) -> None:
    with tm.phase(Phase.CLOSE):
        try:
            env.close()
        except Exception:
            log.exception("episode %s: closing the env failed (ignored)", cfg.episode_id)


def _hook_handle(hook: EpisodeHook, cfg: LoopConfig, step_id: int, prompt: Any) -> Any:
    try:
        return hook.handle(cfg.env_name, cfg.episode_id, step_id, prompt)
    except Exception:
        log.exception("episode %s step %d: episode hook handle() failed; prompt left as is", cfg.episode_id, step_id)
        return prompt
