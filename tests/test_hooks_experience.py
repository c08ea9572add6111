"""Episode hooks by dotted path, and the built-in experience-injection hook (template mode)."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import EpisodeSpec, JobSpec, StepRecord, unpack
from workers import hooks
from workers.envport import StepResult
from workers.experience import HEADER, TemplateExperienceHook, inject
from workers.loop import LoopConfig, run_episode
from workers.modelclient import Completion
from workers.runner import WorkerRuntime


def skills_dir(tmp_path, index: str, files: dict[str, str]):
    root = tmp_path / "skills"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "index.yaml").write_text(textwrap.dedent(index))
    return root


INDEX = """\
environments:
  guess_number:
    - name: binary-search
      trigger: the feedback says too high or too low
      success_rate: 0.9
    - name: start-in-the-middle
      success_rate: 0.95
    - name: guess-randomly
      success_rate: 0.1
    - name: missing-file
      success_rate: 0.99
  arithmetic:
    - name: check-twice
      success_rate: 0.5
      path: shared/check.md
"""
FILES = {
    "guess_number/binary-search/SKILL.md": "Halve the range every time.\n",
    "guess_number/start-in-the-middle/SKILL.md": "First guess the middle.",
    "guess_number/guess-randomly/SKILL.md": "Pick anything.",
    "shared/check.md": "Recompute before answering.",
}


@pytest.fixture
def exp(tmp_path):
    return skills_dir(tmp_path, INDEX, FILES)


@pytest.mark.unit
def test_template_mode_best_success_rate_first_appended_to_system(exp):
    hook = TemplateExperienceHook(exp, top_k=2)
    prompt = [{"role": "system", "content": "Play well."}, {"role": "user", "content": "Guess."}]
    out = hook.handle("guess_number", "e1", 1, prompt)
    assert prompt[0]["content"] == "Play well.", "the env's prompt is not modified in place"
    system = out[0]["content"]
    assert system.startswith(f"Play well.\n\n{HEADER}\n\n")
    # missing-file (0.99) is skipped; then 0.95, 0.9; top_k=2 leaves out 0.1
    assert system.index("**Experience: start-in-the-middle**") < system.index("**Experience: binary-search**")
    assert "*Apply when*: the feedback says too high or too low\n\nHalve the range every time." in system
    assert "\n\n---\n\n" in system and "guess-randomly" not in system and "missing-file" not in system
    assert out[1:] == prompt[1:]
    # Every later step of the episode gets the same text; other env types get theirs.
    later = hook.handle("guess_number", "e1", 2, prompt + [{"role": "assistant", "content": "50"}])
    assert later[0]["content"] == system
    arith = hook.handle("arithmetic", "e2", 1, [{"role": "user", "content": "1+1?"}])
    assert arith[0] == {"role": "system", "content": f"{HEADER}\n\n**Experience: check-twice**\n\nRecompute before answering."}
    assert hook.handle("sokoban", "e3", 1, prompt) == prompt  # nothing matches: unchanged
    # env types match by containment both ways, like the original
    assert HEADER in hook.handle("guess_number.hard", "e4", 1, prompt)[0]["content"]


@pytest.mark.unit
def test_cached_per_episode_until_it_ends_and_index_reloads(exp):
    hook = TemplateExperienceHook(exp, top_k=1)
    prompt = [{"role": "system", "content": "S"}]
    first = hook.handle("guess_number", "e1", 1, prompt)[0]["content"]
    assert "start-in-the-middle" in first
    time.sleep(0.01)
    (exp / "index.yaml").write_text(INDEX.replace("success_rate: 0.95", "success_rate: 0.05"))
    os.utime(exp / "index.yaml", ns=(time.time_ns(), time.time_ns() + 10_000_000))
    assert hook.handle("guess_number", "e1", 2, prompt)[0]["content"] == first, "fixed for the running episode"
    hook.on_episode_end("guess_number", "e1", 1.0, {"turn": 3})
    assert "binary-search" in hook.handle("guess_number", "e2", 1, prompt)[0]["content"], "new episodes see the new index"


@pytest.mark.unit
def test_inject_shapes():
    assert inject([{"role": "system", "content": [{"type": "text", "text": "S"}]}], "X")[0]["content"] == [
        {"type": "text", "text": "S"}, {"type": "text", "text": "\n\nX"}]
    assert inject([{"role": "system", "content": None}], "X") == [{"role": "system", "content": "X"}]
    assert inject([{"role": "user", "content": "u"}, {"role": "system", "content": "late"}], "X")[1]["content"] == "late\n\nX"
    assert inject([], "X") == [{"role": "system", "content": "X"}]


@pytest.mark.unit
def test_no_or_bad_index_leaves_prompts_alone(tmp_path, caplog):
    prompt = [{"role": "user", "content": "u"}]
    assert TemplateExperienceHook(tmp_path / "none").handle("guess_number", "e", 1, prompt) == prompt
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "index.yaml").write_text("environments: [1, 2\n")
    assert TemplateExperienceHook(bad).handle("guess_number", "e", 1, prompt) == prompt
    assert "experience index" in caplog.text


@pytest.mark.unit
def test_factory_reads_the_worker_settings(exp, monkeypatch):
    monkeypatch.setattr(hooks, "_cache", {})
    monkeypatch.setenv("INTERACTOR_EXPERIENCE_DIR", str(exp))
    monkeypatch.setenv("INTERACTOR_EXPERIENCE_TOP_K", "1")
    hook = hooks.load_hook("workers.experience:template")
    assert isinstance(hook.inner, TemplateExperienceHook) and hook.inner.top_k == 1
    assert hooks.load_hook("workers.experience:template") is hook, "one instance per process"
    monkeypatch.setattr(hooks, "_cache", {})
    monkeypatch.delenv("INTERACTOR_EXPERIENCE_DIR")
    empty = hooks.load_hook("workers.experience:template")
    assert empty.handle("guess_number", "e", 1, ["p"]) == ["p"]
    with pytest.raises(hooks.HookError, match="module:factory"):
        hooks.load_hook("workers.experience.template")


# --------------------------------------------------------------------------- hooks in the loop

class TwoStepEnv:
    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.n = 0

    def reset(self):
        return {}

    def get_task_prompt(self):
        return [{"role": "system", "content": "S"}, {"role": "user", "content": f"turn {self.n}"}]

    def step(self, action):
        self.n += 1
        if self.fail_at == self.n:
            raise RuntimeError("env broke")
        return StepResult(reward=0.5, terminated=self.n >= 2, truncated=False, info={"turn": self.n})

    def close(self):
        pass


class Policy:
    def __init__(self):
        self.seen = []

    def complete(self, messages):
        self.seen.append(messages)
        return Completion(content="ok", finish_reason="stop", weight_version=None, latency_s=0.0)


class Recorder:
    def __init__(self, fail=False):
        self.fail = fail
        self.ends = []

    def handle(self, env_name, env_id, step_id, prompt):
        if self.fail:
            raise ValueError("hook bug")
        return [*prompt, {"role": "user", "content": f"hint for step {step_id}"}]

    def on_episode_end(self, env_name, env_id, total_reward, info):
        self.ends.append((env_name, env_id, total_reward, info))
        if self.fail:
            raise ValueError("hook bug at the end")


CFG = LoopConfig(job_id="j", episode_id="ep1", env_name="toy", group_id="g", llm_model="m", message_cut=0)


@pytest.mark.unit
def test_handle_rewrites_prompts_and_end_gets_the_total_and_last_info():
    hook, policy, steps = Recorder(), Policy(), []
    out = run_episode(CFG, env=TwoStepEnv(), policy=policy, publish=steps.append, hook=hooks._Adapter(hook))
    assert [m[-1]["content"] for m in policy.seen] == ["hint for step 1", "hint for step 2"]
    assert steps[0].messages[-1]["content"] == "hint for step 1", "records keep what was actually sent"
    assert hook.ends == [("toy", "ep1", 1.0, {"turn": 2})] and out.total_reward == 1.0


@pytest.mark.unit
def test_hook_errors_are_logged_never_fatal_and_end_runs_for_failed_episodes(caplog):
    hook, steps = Recorder(fail=True), []
    out = run_episode(CFG, env=TwoStepEnv(), policy=Policy(), publish=steps.append, hook=hooks._Adapter(hook))
    assert out.ended_by == "terminated" and len(steps) == 2
    assert "hook bug" in caplog.text and "on_episode_end hook failed" in caplog.text
    ok = Recorder()
    with pytest.raises(RuntimeError, match="env broke"):
        run_episode(CFG, env=TwoStepEnv(fail_at=2), policy=Policy(), publish=lambda r: None, hook=hooks._Adapter(ok))
    assert ok.ends == [("toy", "ep1", 0.5, {"turn": 1})]


def test_experience_hook_through_the_worker(exp, settings, redis_client, env_server, model_server, monkeypatch):
    """A job naming the built-in hook: the prompts the worker sent carry the skills."""
    monkeypatch.setattr(hooks, "_cache", {})
    monkeypatch.setenv("INTERACTOR_EXPERIENCE_DIR", str(exp))
    _, env_url = env_server
    _, model_url = model_server
    job = JobSpec(job_id="hj", llm_base_url=model_url + "/v1", model="stand-in", episodes=1, groups=1,
                  episode_hook="workers.experience:template")
    ep = EpisodeSpec(job_id="hj", episode_id="hj.1.1.1.1", group_id="hj.1.1.1", group_size=1, env_name="guess_number",
                     base_url=env_url, env_params={"low": 1, "high": 64}, seed=3, queue=settings.queue)
    Ledger(redis_client, Keys(settings.key_prefix)).create_job(job, [ep])
    rt = WorkerRuntime(settings, name="hook-worker")
    try:
        assert rt.run(job.job_id, ep.episode_id) == "completed"
    finally:
        rt.stop()
    steps = [r for r in (unpack(f[b"r"]) for _, f in redis_client.xrange(Keys(settings.key_prefix).results))
             if isinstance(r, StepRecord)]
    assert len(steps) >= 2
    for s in steps:
        assert s.messages[0]["role"] == "system" and "**Experience: start-in-the-middle**" in s.messages[0]["content"]
    assert steps[-1].step_reward == 1.0, "the stand-in still plays the game through the longer system message"
