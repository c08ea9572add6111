"""Model-side settings end to end: session routing ({root}/{episode_id} per episode) and the
request parameters RL users set (--max-tokens, --top-p, --stop, --llm-params)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from broker.settings import Settings
from interactor.cli import build_parser
from interactor.common import settings_from_args as _settings
from producer.enqueue import job_spec
from producer.planning import PlannedJob
from tests.conftest import ROOT, wait_for
from workers.ports import policy_url


@pytest.mark.unit
def test_flags_fold_into_llm_params():
    args = build_parser().parse_args(
        ["submit", "t.yaml", "--max-tokens", "64", "--top-p", "0.9", "--stop", '["</answer>", "\\n\\n"]',
         "--llm-params", '{"top_k": 20, "max_tokens": 5, "chat_template_kwargs": {"enable_thinking": false}}',
         "--llm-session-routing"])
    s = _settings(args)
    job = job_spec(s, "j", PlannedJob(episodes=[], groups=0, sources=[]))
    assert job.llm_params == {"max_tokens": 64, "top_p": 0.9, "stop": ["</answer>", "\n\n"], "top_k": 20,
                              "chat_template_kwargs": {"enable_thinking": False}}, "the dedicated flags win"
    assert job.session_routing is True
    assert policy_url(job, "job.1.2.3.4") == s.llm_base_url.rstrip("/") + "/job.1.2.3.4"
    # Children get the settings as variables; reading them back changes nothing.
    assert Settings.from_env(s.as_environ()).llm_params == s.llm_params
    assert json.loads(Settings.from_env({}, llm_stop="END").llm_params) == {"stop": "END"}
    assert Settings.from_env({}).llm_params == ""


@pytest.mark.parametrize("kw, words", [
    ({"llm_top_p": 1.5}, "llm_top_p"),
    ({"llm_max_tokens": -1}, "llm_max_tokens"),
    ({"llm_stop": "[1, 2]"}, "llm_stop"),
    ({"llm_max_concurrency": -2}, "llm_max_concurrency"),
    ({"llm_startup_jitter_s": -1}, "llm_startup_jitter_s"),
])
@pytest.mark.unit
def test_bad_model_settings(kw, words):
    from broker.settings import SettingsError

    with pytest.raises(SettingsError, match=words):
        Settings.from_env({}, **kw)


@pytest.mark.integration
def test_session_routing_and_params_end_to_end(settings, procs, env_server, model_server, tmp_path):
    """Submit with the CLI flags; real workers drive the episodes; the model stand-in sees one
    session per episode id, no session-less call, and the request parameters."""
    env, env_url = env_server
    model, model_url = model_server
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(textwrap.dedent(f"""\
        environments:
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{low: 1, high: 32, max_turns: 8}}
            env_num: 3
          - env_name: arithmetic
            base_url: {env_url}
            dataset: [{{question: "What is 2 + 3?", answer: 5}}, {{question: "What is 7 * 6?", answer: 42}}]
            env_num: 2
        """))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    child_env.update(settings.as_environ())
    out = subprocess.run(
        [sys.executable, "-m", "interactor.cli", "submit", str(tasks), "--job-id", "routed",
         "--llm-base-url", model_url + "/v1", "--llm-session-routing", "--max-tokens", "64", "--top-p", "0.9",
         "--stop", "</answer>", "--llm-params", '{"top_k": 20}'],
        env=child_env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["episodes"] == 7

    procs.worker("w1")
    procs.consumer()
    from consumer.storage import open_store
    from tests.storecheck import db_rows

    store = open_store(settings.results_store)
    try:
        wait_for(lambda: store.results("routed")["job"]["completed"] == 7, 90, what="7 episodes stored")
    finally:
        store.close()

    steps = dict(db_rows(settings.results_store, "SELECT session_id, COUNT(*) FROM session_steps "
                                                 "WHERE job_id = 'routed' GROUP BY session_id"))
    stats = model.stats()
    assert set(stats["by_session"]) == set(steps) and len(steps) == 7, "one session per episode id"
    assert stats["by_session"] == steps, "every model call of an episode went to its own session"
    assert stats["sessionless"] == 0
    assert stats["request_params"] == {"max_tokens": ["64"], "top_p": ["0.9"], "stop": ['"</answer>"'],
                                       "top_k": ["20"]}
