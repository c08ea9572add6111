"""Unit tests of the step loop (docs/protocol.md#step-loop) with plain Python ports, no broker."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from broker.errors import ENV_MALFORMED, MODEL_BAD_REQUEST, ContextOverflow, EpisodeError
from broker.records import StepRecord
from workers.hooks import HookError, NullHook, load_hook
from workers.loop import LoopConfig, is_trainable, run_episode, trim_messages

pytestmark = pytest.mark.unit  # needs no server: make check runs it

SYS = {"role": "system", "content": "you are a test"}


def conv(n: int, system: bool = True) -> list[dict]:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(n)]
    return ([SYS] if system else []) + msgs


# --- ports ---------------------------------------------------------------------------------


@dataclass
class Result:
    reward: Any = 0.0
    terminated: bool = False
    truncated: bool = False
    info: Any = None


@dataclass
class Completion:
    content: Any = "act"
    finish_reason: Any = "stop"
    weight_version: Any = "w1"


class FakeEnv:
    """Scripted prompts and step results; records every call in order."""

    def __init__(self, prompts=None, results=None, *, reset_exc=None, step_exc_at=None):
        self.prompts = list(prompts) if prompts is not None else None
        self.results = list(results or [])
        self.reset_exc = reset_exc
        self.step_exc_at = step_exc_at  # 1-based step number whose env.step raises
        self.calls: list[tuple] = []
        self.actions: list[str] = []
        self.closed = 0

    def reset(self):
        self.calls.append(("reset",))
        if self.reset_exc:
            raise self.reset_exc
        return {"ok": True}

    def get_task_prompt(self):
        self.calls.append(("get_task_prompt",))
        if self.prompts is None:
            return conv(1)
        i = min(len(self.actions), len(self.prompts) - 1)
        return self.prompts[i]

    def step(self, action):
        self.calls.append(("step", action))
        self.actions.append(action)
        if self.step_exc_at is not None and len(self.actions) == self.step_exc_at:
            raise RuntimeError("env exploded")
        if self.results:
            i = min(len(self.actions) - 1, len(self.results) - 1)
            return self.results[i]
        return Result()

    def close(self):
        self.calls.append(("close",))
        self.closed += 1


class FakePolicy:
    def __init__(self, completions=None):
        self.completions = list(completions or [])
        self.seen: list[list[dict]] = []

    def complete(self, messages):
        self.seen.append(messages)
        if self.completions:
            return self.completions[min(len(self.seen) - 1, len(self.completions) - 1)]
        return Completion(content=f"a{len(self.seen)}")


class RecHook:
    def __init__(self, *, rewrite=None, handle_exc=None, end_exc=None):
        self.rewrite = rewrite
        self.handle_exc = handle_exc
        self.end_exc = end_exc
        self.handled: list[tuple] = []
        self.ended: list[tuple] = []

    def handle(self, env_name, env_id, step_id, prompt):
        self.handled.append((env_name, env_id, step_id, prompt))
        if self.handle_exc:
            raise self.handle_exc
        return self.rewrite(prompt) if self.rewrite else prompt

    def on_episode_end(self, env_name, env_id, total_reward, info):
        self.ended.append((env_name, env_id, total_reward, info))
        if self.end_exc:
            raise self.end_exc


def cfg(**kw) -> LoopConfig:
    base = dict(job_id="job1", episode_id="job1.1.1.1.1", env_name="arith", group_id="job1.1.1.1",
                llm_model="stand-in")
    base.update(kw)
    return LoopConfig(**base)


def run(env, policy=None, hook=None, check=None, **kw):
    records: list[StepRecord] = []
    policy = policy or FakePolicy()
    hook = hook or RecHook()
    extra = {"check": check} if check is not None else {}
    out = run_episode(cfg(**kw), env=env, policy=policy, publish=records.append, hook=hook, **extra)
    return out, records, policy, hook


# --- trimming ------------------------------------------------------------------------------


def test_trim_keeps_system_plus_last_2cut_minus_1():
    p = conv(10)
    assert trim_messages(p, 3) == [SYS] + p[-5:]
    assert trim_messages(p, 1) == [SYS] + p[-1:]
    assert trim_messages(conv(2), 3) == conv(2)  # shorter than the window: everything


def test_trim_without_system_message():
    p = conv(10, system=False)
    assert trim_messages(p, 3) == p[-5:]
    assert trim_messages(p, 2) == p[-3:]
    # a system message that is not first is just a message
    q = conv(6, system=False) + [SYS]
    assert trim_messages(q, 1) == [SYS]


def test_trim_cut_nonpositive_keeps_everything():
    p = conv(20)
    assert trim_messages(p, 0) == p
    assert trim_messages(p, -4) == p


def test_trim_non_list_and_empty():
    assert trim_messages(None, 3) == []
    assert trim_messages("hello", 3) == []
    assert trim_messages({"role": "user"}, 3) == []
    assert trim_messages([], 3) == []
    assert trim_messages([], 0) == []


def test_recorded_messages_are_the_trimmed_ones_sent():
    prompts = [conv(4), conv(8), conv(12)]
    env = FakeEnv(prompts, [Result(), Result(), Result(terminated=True)])
    out, recs, policy, _ = run(env, message_cut=2)
    assert len(recs) == 3
    for i, r in enumerate(recs):
        assert policy.seen[i] == trim_messages(prompts[i], 2)
        assert r.messages == policy.seen[i]
        assert r.messages[0] == SYS and len(r.messages) <= 4
    assert out.ended_by == "terminated"


# --- ending rules --------------------------------------------------------------------------


@pytest.mark.parametrize("empty", [[], None, "not a list"])
def test_empty_prompt_ends_episode_without_model_call(empty):
    env = FakeEnv([empty])
    out, recs, policy, hook = run(env)
    assert recs == []
    assert policy.seen == []
    assert ("step",) not in [c[:1] for c in env.calls]
    assert out.ended_by == "empty_prompt" and out.steps == 0
    assert env.closed == 1
    assert len(hook.ended) == 1


def test_empty_prompt_after_some_steps():
    env = FakeEnv([conv(2), conv(4), []], [Result(reward=1.0)])
    out, recs, policy, _ = run(env)
    assert len(recs) == 2 and len(policy.seen) == 2
    assert out.ended_by == "empty_prompt" and out.total_reward == 2.0


class OverflowPolicy(FakePolicy):
    """Answers until the prompt has more than ``limit`` messages, then refuses it as a server
    whose context is full does (the model client raises ContextOverflow)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def complete(self, messages):
        self.seen.append(messages)
        if len(messages) > self.limit:
            raise ContextOverflow("chat completion: the prompt is longer than the model's context (vLLM): HTTP 400: "
                                  "This model's maximum context length is 64 tokens.", server="vLLM", status=400)
        return TokenCompletion(content=f"a{len(self.seen)}", weight_version=f"w{len(self.seen)}",
                               prompt_tokens=10 * len(messages), completion_tokens=3)


@dataclass
class TokenCompletion(Completion):
    prompt_tokens: Any = None
    completion_tokens: Any = None


@pytest.mark.parametrize("message_cut,limit,n", [(0, 6, 4), (3, 5, 3)])
def test_context_overflow_ends_the_episode_truncated_with_its_steps(message_cut, limit, n):
    prompts = [conv(1), conv(3), conv(5), conv(7)]  # the env's history grows by a turn a step
    env = FakeEnv(prompts, [Result(reward=0.5)])
    policy = OverflowPolicy(limit)  # step n's prompt (as trimmed) no longer fits
    out, recs, _, hook = run(env, policy, message_cut=message_cut)
    assert [c for c in env.calls if c[0] == "step"] == [("step", f"a{i}") for i in range(1, n)]
    assert [r.step_id for r in recs] == list(range(1, n + 1)) and not any(r.episode_finished for r in recs[:-1])
    last = recs[-1]
    assert last.ended_by == "context_length" and last.finish_reason == "context_length"
    reward = 0.5 * (n - 1)
    assert last.response == "" and last.step_reward == 0.0 and last.cumulative_reward == reward
    assert last.truncated is True and last.terminated is True and last.episode_finished is True
    # Trainable by the loop's rule: with the full history only this final row carries the trajectory.
    assert last.is_trainable is True
    assert [r.is_trainable for r in recs[:-1]] == [message_cut > 0] * (n - 1)
    assert last.messages == trim_messages(prompts[n - 1], message_cut) == policy.seen[-1]
    # The version of the policy that wrote the trajectory; no usage (the server answered none).
    assert last.weight_version == f"w{n - 1}" and last.prompt_tokens is None and last.completion_tokens is None
    assert out.ended_by == "context_length" and out.steps == n and out.total_reward == reward
    assert out.completion_tokens == 3 * (n - 1)
    assert out.prompt_tokens == sum(10 * len(s) for s in policy.seen[:-1])
    assert hook.ended == [("arith", "job1.1.1.1.1", reward, None)] and env.closed == 1


def test_context_overflow_at_the_first_step_is_recorded_and_warned(caplog):
    env = FakeEnv([conv(9)])
    with caplog.at_level(logging.WARNING, logger="interactor.loop"):
        out, recs, _, _ = run(env, OverflowPolicy(limit=2))
    assert out.ended_by == "context_length" and out.steps == 1 and len(recs) == 1
    assert recs[0].weight_version is None and recs[0].response == "" and recs[0].is_trainable is True
    assert not [c for c in env.calls if c[0] == "step"]
    assert "first step" in caplog.text and "maximum context length is 64" in caplog.text


def test_other_model_errors_still_end_the_attempt():
    class Refusing(FakePolicy):
        def complete(self, messages):
            raise EpisodeError(MODEL_BAD_REQUEST, "HTTP 400: unknown parameter 'top_q'")

    env = FakeEnv(None)
    with pytest.raises(EpisodeError) as ei:
        run(env, Refusing())
    assert ei.value.reason == MODEL_BAD_REQUEST and env.closed == 1


def test_finish_reason_length_records_final_step_without_env_step():
    env = FakeEnv(None, [Result(reward=1.5)])
    policy = FakePolicy([Completion("a1", "stop", "w1"), Completion("cut off", "length", "w2")])
    out, recs, _, hook = run(env, policy)
    steps = [c for c in env.calls if c[0] == "step"]
    assert steps == [("step", "a1")]  # the truncated answer never reaches the env
    assert len(recs) == 2
    last = recs[-1]
    assert last.step_id == 2
    assert last.step_reward == 0.0
    assert last.cumulative_reward == 1.5
    assert last.terminated is True and last.truncated is True
    assert last.is_trainable is True and last.episode_finished is True
    assert last.finish_reason == "length" and last.response == "cut off" and last.weight_version == "w2"
    assert out.ended_by == "length" and out.steps == 2 and out.total_reward == 1.5
    assert hook.ended == [("arith", "job1.1.1.1.1", 1.5, None)]
    assert env.closed == 1


def test_finish_reason_length_is_trainable_even_with_cut_zero():
    env = FakeEnv()
    out, recs, _, _ = run(env, FakePolicy([Completion("x", "length")]), message_cut=0)
    assert len(recs) == 1 and recs[0].is_trainable and recs[0].episode_finished
    assert not any(c[0] == "step" for c in env.calls)


def test_trainable_every_step_when_cut_positive():
    env = FakeEnv(None, [Result(), Result(), Result(terminated=True)])
    _, recs, _, _ = run(env, message_cut=3)
    assert [r.is_trainable for r in recs] == [True, True, True]


def test_trainable_only_final_step_when_cut_nonpositive():
    for cut in (0, -1):
        env = FakeEnv(None, [Result(), Result(), Result(truncated=True)])
        _, recs, _, _ = run(env, message_cut=cut)
        assert [r.is_trainable for r in recs] == [False, False, True]
        assert [r.episode_finished for r in recs] == [False, False, True]
    assert is_trainable(0, False, False) is False
    assert is_trainable(0, True, False) is True
    assert is_trainable(0, False, True) is True
    assert is_trainable(1, False, False) is True


def test_reward_none_is_zero_and_cumulative_sums():
    env = FakeEnv(None, [Result(reward=1.0), Result(reward=None), Result(reward=2.5), Result(reward=-0.5, terminated=True)])
    out, recs, _, hook = run(env)
    assert [r.step_reward for r in recs] == [1.0, 0.0, 2.5, -0.5]
    assert all(isinstance(r.step_reward, float) for r in recs)
    assert [r.cumulative_reward for r in recs] == [1.0, 1.0, 3.5, 3.0]
    assert out.total_reward == 3.0
    assert hook.ended[0][2] == 3.0


def test_rewards_summing_past_the_float_range_fail_the_episode_as_env_malformed():
    """Each reward is finite, the sum of two of 1e308 is not: the episode fails (permanent,
    naming the step and the reward) before a step with an infinite total is recorded."""
    env = FakeEnv(None, [Result(reward=1e308), Result(reward=1e308), Result(terminated=True)])
    records: list[StepRecord] = []
    hook = RecHook()
    with pytest.raises(EpisodeError) as err:
        run_episode(cfg(), env=env, policy=FakePolicy(), publish=records.append, hook=hook)
    assert err.value.reason == ENV_MALFORMED and not err.value.transient
    assert "step 2" in str(err.value) and "float range" in str(err.value)
    assert [r.cumulative_reward for r in records] == [1e308]
    assert hook.ended == [("arith", "job1.1.1.1.1", 1e308, None)] and env.closed == 1


def test_info_kept_only_if_dict():
    env = FakeEnv(None, [Result(info={"a": 1}), Result(info="text", terminated=True)])
    out, _, _, hook = run(env)
    assert out.last_info is None
    assert hook.ended[0][3] is None

    env = FakeEnv(None, [Result(info="text"), Result(info={"score": 7}, terminated=True)])
    out, _, _, hook = run(env)
    assert out.last_info == {"score": 7}
    assert hook.ended[0][3] == {"score": 7}

    env = FakeEnv(None, [Result(info=[1, 2], terminated=True)])
    out, _, _, _ = run(env)
    assert out.last_info is None


def test_weight_version_and_finish_reason_recorded():
    env = FakeEnv(None, [Result(), Result(terminated=True)])
    policy = FakePolicy([Completion("a", "stop", "v7"), Completion("b", None, None)])
    _, recs, _, _ = run(env, policy)
    assert [r.weight_version for r in recs] == ["v7", None]
    assert [r.finish_reason for r in recs] == ["stop", "stop"]  # None -> "stop"


def test_null_content_becomes_empty_action():
    env = FakeEnv(None, [Result(terminated=True)])
    _, recs, _, _ = run(env, FakePolicy([Completion(None, "stop")]))
    assert env.actions == [""]
    assert recs[0].response == ""


def test_max_steps_bound_and_finished_on_last_step():
    env = FakeEnv()  # never terminates
    out, recs, policy, hook = run(env, max_steps=4)
    assert len(recs) == 4 and len(env.actions) == 4 and len(policy.seen) == 4
    assert [r.episode_finished for r in recs] == [False, False, False, True]
    assert not recs[-1].terminated and not recs[-1].truncated
    assert out.ended_by == "max_steps" and out.steps == 4
    assert len(hook.ended) == 1 and env.closed == 1


def test_max_steps_final_step_is_trainable_with_full_history():
    out, recs, _, _ = run(FakeEnv(), max_steps=3, message_cut=0)
    assert [r.is_trainable for r in recs] == [False, False, True]


def test_stops_on_terminated():
    env = FakeEnv(None, [Result(), Result(terminated=True), Result()])
    out, recs, _, _ = run(env, max_steps=10)
    assert len(recs) == 2 and len(env.actions) == 2
    assert recs[-1].terminated and not recs[-1].truncated and recs[-1].episode_finished
    assert out.ended_by == "terminated"


def test_stops_on_truncated():
    env = FakeEnv(None, [Result(truncated=True), Result()])
    out, recs, _, _ = run(env, max_steps=10)
    assert len(recs) == 1
    assert recs[0].truncated and not recs[0].terminated and recs[0].episode_finished
    assert out.ended_by == "truncated"


def test_step_ids_consecutive_and_attempt_carried():
    env = FakeEnv(None, [Result(), Result(), Result(), Result(), Result(terminated=True)])
    _, recs, _, hook = run(env, attempt=3)
    assert [r.step_id for r in recs] == [1, 2, 3, 4, 5]
    assert all(r.attempt == 3 for r in recs)
    assert all(r.job_id == "job1" and r.env_id == "job1.1.1.1.1" and r.group_id == "job1.1.1.1" for r in recs)
    assert all(r.env_name == "arith" and r.llm_model == "stand-in" for r in recs)
    assert [h[2] for h in hook.handled] == [1, 2, 3, 4, 5]
    assert [r.response for r in recs] == ["a1", "a2", "a3", "a4", "a5"]
    assert env.actions == ["a1", "a2", "a3", "a4", "a5"]


# --- hooks ---------------------------------------------------------------------------------


def test_hook_rewrites_prompt_before_trim():
    extra = [{"role": "user", "content": f"x{i}"} for i in range(6)]
    hook = RecHook(rewrite=lambda p: p + extra)
    env = FakeEnv([conv(2)], [Result(terminated=True)])
    _, recs, policy, _ = run(env, hook=hook, message_cut=2)
    expected = [SYS] + extra[-3:]
    assert policy.seen == [expected]
    assert recs[0].messages == expected
    assert hook.handled[0][:3] == ("arith", "job1.1.1.1.1", 1)


def test_hook_can_empty_prompt():
    hook = RecHook(rewrite=lambda p: [])
    env = FakeEnv()
    out, recs, policy, _ = run(env, hook=hook)
    assert out.ended_by == "empty_prompt" and recs == [] and policy.seen == []


def test_hook_handle_raising_uses_prompt_as_is(caplog):
    hook = RecHook(handle_exc=RuntimeError("hook bug"))
    p = conv(3)
    env = FakeEnv([p], [Result(reward=1.0), Result(terminated=True)])
    with caplog.at_level(logging.ERROR, logger="interactor.loop"):
        out, recs, policy, _ = run(env, hook=hook)
    assert len(recs) == 2 and policy.seen == [trim_messages(p, 3)] * 2
    assert out.ended_by == "terminated" and out.total_reward == 1.0
    assert "hook" in caplog.text


def test_on_episode_end_called_once_after_success():
    env = FakeEnv(None, [Result(reward=2.0, info={"k": "v"}, terminated=True)])
    _, _, _, hook = run(env)
    assert hook.ended == [("arith", "job1.1.1.1.1", 2.0, {"k": "v"})]


def test_env_step_failure_propagates_but_end_hook_and_close_run():
    env = FakeEnv(None, [Result(reward=1.0, info={"n": 1})], step_exc_at=2)
    hook = RecHook()
    records: list[StepRecord] = []
    with pytest.raises(RuntimeError, match="env exploded"):
        run_episode(cfg(), env=env, policy=FakePolicy(), publish=records.append, hook=hook)
    assert len(records) == 1
    assert hook.ended == [("arith", "job1.1.1.1.1", 1.0, {"n": 1})]
    assert env.closed == 1 and env.calls[-1] == ("close",)


def test_on_episode_end_raising_is_logged_not_fatal(caplog):
    env = FakeEnv(None, [Result(reward=1.0, terminated=True)])
    hook = RecHook(end_exc=RuntimeError("end hook bug"))
    with caplog.at_level(logging.ERROR, logger="interactor.loop"):
        out, recs, _, _ = run(env, hook=hook)
    assert out.total_reward == 1.0 and len(recs) == 1
    assert len(hook.ended) == 1
    assert env.closed == 1
    assert "on_episode_end" in caplog.text


def test_on_episode_end_raising_does_not_mask_loop_error():
    env = FakeEnv(None, step_exc_at=1)
    hook = RecHook(end_exc=ValueError("end hook bug"))
    with pytest.raises(RuntimeError, match="env exploded"):
        run(env, hook=hook)
    assert env.closed == 1


def test_close_called_when_reset_fails():
    env = FakeEnv(reset_exc=ConnectionError("env down"))
    hook = RecHook()
    with pytest.raises(ConnectionError):
        run(env, hook=hook)
    assert env.calls == [("reset",), ("close",)]
    assert hook.ended == [("arith", "job1.1.1.1.1", 0.0, None)]


def test_close_failure_is_not_fatal():
    env = FakeEnv(None, [Result(terminated=True)])

    def bad_close():
        env.calls.append(("close",))
        raise OSError("close failed")

    env.close = bad_close
    out, recs, _, _ = run(env)
    assert out.ended_by == "terminated" and len(recs) == 1


class Abort(Exception):
    pass


def _check_after(env, n_calls):
    """A check that raises once the env has seen ``n_calls`` calls."""

    def check():
        if len(env.calls) >= n_calls:
            raise Abort()

    return check


@pytest.mark.parametrize("allowed, last_call", [
    (0, None),                    # before reset
    (1, "reset"),                 # before the first get_task_prompt
    (2, "get_task_prompt"),       # before the model call
])
def test_check_raising_aborts_before_next_call(allowed, last_call):
    env = FakeEnv(None, [Result()])
    policy = FakePolicy()
    hook = RecHook()
    with pytest.raises(Abort):
        run(env, policy, hook, check=_check_after(env, allowed))
    calls = [c[0] for c in env.calls]
    assert calls[-1] == "close"
    assert calls[:-1] == (["reset", "get_task_prompt"][:allowed])
    assert policy.seen == []
    assert len(hook.ended) == 1 and env.closed == 1


def test_check_raising_before_env_step():
    env = FakeEnv(None, [Result()])
    policy = FakePolicy()
    n = {"checks": 0}

    def check():
        n["checks"] += 1
        if len(policy.seen) == 1:  # the model has answered: the next check guards env.step
            raise Abort()

    with pytest.raises(Abort):
        run(env, policy, check=check)
    assert not any(c[0] == "step" for c in env.calls)
    assert env.calls[-1] == ("close",)


def test_check_called_before_every_env_and_model_call():
    env = FakeEnv(None, [Result(), Result(terminated=True)])
    n = {"checks": 0}

    def check():
        n["checks"] += 1

    run(env, check=check)
    # reset + 2 * (prompt, model, step)
    assert n["checks"] == 1 + 2 * 3


# --- load_hook -----------------------------------------------------------------------------


def test_load_hook_empty_is_noop():
    hook = load_hook("")
    assert isinstance(hook, NullHook)
    p = conv(2)
    assert hook.handle("e", "id", 1, p) is p
    assert hook.on_episode_end("e", "id", 1.0, None) is None


@pytest.mark.parametrize("path", ["no_such_module_xyz:factory", "json:no_such_factory", "nocolon", ":factory", "json:"])
def test_load_hook_bad_path_raises_hookerror_naming_it(path):
    with pytest.raises(HookError) as ei:
        load_hook(path)
    assert repr(path) in str(ei.value) or path in str(ei.value)


def test_load_hook_factory_with_only_handle(tmp_path, monkeypatch):
    mod = f"hookmod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(
        "class OnlyHandle:\n"
        "    def handle(self, env_name, env_id, step_id, prompt):\n"
        "        return prompt + [{'role': 'user', 'content': 'added'}]\n"
        "def make():\n"
        "    return OnlyHandle()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = load_hook(f"{mod}:make")
    assert load_hook(f"{mod}:make") is hook  # one instance per path
    assert hook.on_episode_end("e", "id", 0.0, None) is None
    env = FakeEnv([conv(0)], [Result(terminated=True)])
    _, recs, policy, _ = run(env, hook=hook)
    assert policy.seen[0] == [SYS, {"role": "user", "content": "added"}]
    assert recs[0].messages == policy.seen[0]
