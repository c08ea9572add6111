"""The response cache (issue 50): `--cache` answers a later job's identical model requests from
Redis and marks those steps cached; a changed sampling field is a miss; the cache stays within
its bound; `interactor cache clear` empties it; a sampled job with plain `--cache` is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from broker.cache import request_key
from broker.records import JobSpec, StepRecord, unpack

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 1 + 2?"}]


def test_the_key_is_the_exact_request():
    base = request_key("m", MSGS, 0, {"max_tokens": 32, "seed": 7})
    assert base == request_key("m", [dict(m) for m in MSGS], 0.0, {"seed": 7, "max_tokens": 32})  # same request
    assert len(base) == 64
    others = [
        request_key("m2", MSGS, 0, {"max_tokens": 32, "seed": 7}),
        request_key("m", MSGS, 0.7, {"max_tokens": 32, "seed": 7}),
        request_key("m", MSGS, 0, {"max_tokens": 33, "seed": 7}),
        request_key("m", MSGS, 0, {"max_tokens": 32, "seed": 8}),
        request_key("m", MSGS, 0, {"max_tokens": 32}),
        request_key("m", MSGS, 0, {"max_tokens": 32, "seed": 7, "top_p": 0.9}),
        request_key("m", MSGS, 0, {"max_tokens": 32, "seed": 7, "tools": [{"type": "function"}]}),
        request_key("m", MSGS, 0, {"max_tokens": 32, "seed": 7}, tokens="vllm"),
        request_key("m", list(reversed(MSGS)), 0, {"max_tokens": 32, "seed": 7}),  # message order matters
        request_key("m", MSGS[1:], 0, {"max_tokens": 32, "seed": 7}),
    ]
    assert base not in others and len(set(others)) == len(others)


def test_the_key_is_what_the_endpoint_sends():
    """The cache layer's key follows the entry's sampling over the job's, as the request does."""
    from workers.response_cache import CachedPolicy

    job = JobSpec("j", "http://m/v1", "m", temperature=0.0, llm_params={"max_tokens": 100})
    plain = CachedPolicy(None, None, job, {}).key(MSGS, {})
    own = CachedPolicy(None, None, job, {"max_tokens": 32}).key(MSGS, {})
    assert plain == request_key("m", MSGS, 0.0, {"max_tokens": 100})
    assert own == request_key("m", MSGS, 0.0, {"max_tokens": 32}) != plain


def test_old_records_read_uncached_and_cached_steps_pack_the_flag():
    step = StepRecord("j", "e", 1, 1, "env", "m", "g", b"[]", "hi", 0.0, 0.0, True, False, True, True)
    assert "cached" not in step.to_dict() and unpack(step.pack()).cached is False
    step.cached = True
    assert unpack(step.pack()).cached is True
    spec = JobSpec("j", "http://m/v1", "m").to_dict()
    del spec["cache"]
    assert JobSpec.from_dict(spec).cache == ""


def test_a_stored_answer_comes_back_as_a_cached_completion():
    from workers.modelclient import Completion
    from workers.response_cache import answer_of, completion_of
    from workers.token_answers import TokenAnswer

    c = Completion("4", "stop", "v3", 1.5, 2, 10, 5, TokenAnswer(source="vllm", status="ok", completion_ids=[1, 2]),
                   [{"id": "c1", "type": "function"}], "because")
    back = completion_of(json.loads(json.dumps(answer_of(c))))
    assert (back.content, back.finish_reason, back.weight_version, back.prompt_tokens, back.completion_tokens,
            back.tool_calls, back.reasoning_content) == ("4", "stop", "v3", 10, 5, c.tool_calls, "because")
    assert back.tokens.completion_ids == [1, 2] and back.latency_s == 0.0 and back.cached is True


@pytest.mark.integration
def test_cache_across_jobs_misses_bound_clear_and_refusal(tmp_path, redis_server, env_server):
    from consumer.storage import open_store
    from tests.conftest import ROOT
    from tests.recording_model import RecordingModel

    _, env_url = env_server
    prefix = f"c{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "runs"
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(textwrap.dedent(f"""
        environments:
          - env_name: arithmetic
            base_url: {env_url}
            dataset: [{{question: "What is 1 + 2?", answer: 3}}, {{question: "What is 2 + 2?", answer: 4}},
                      {{question: "What is 3 + 4?", answer: 7}}]
        """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    common = ["--redis-url", redis_server.url, "--key-prefix", prefix, "--queue", prefix, "--run-dir", str(run_dir),
              "--model", "smollm2", "--concurrency", "2", "--workers", "1"]
    model = RecordingModel("smollm2")

    def cli(*argv, extra_env=None, check=True):
        out = subprocess.run([sys.executable, "-m", "interactor.cli", *argv], env={**env, **(extra_env or {})},
                             cwd=str(ROOT), capture_output=True, text=True, timeout=300)
        if check:
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out

    def run(job, *flags, extra_env=None):
        cli("run", str(tasks), *common, "--llm-base-url", model.url, "--job-id", job, *flags, extra_env=extra_env)

    def stats():
        return json.loads(cli("cache", "stats", "--json", "--redis-url", redis_server.url, "--key-prefix",
                              prefix).stdout)

    try:
        run("first", "--temperature", "0", "--cache")
        asked = len(model.bodies)
        assert asked == 3, model.bodies
        assert stats()["entries"] == 3
        run("second", "--temperature", "0", "--cache")  # identical requests: all from the cache
        assert len(model.bodies) == asked
        s = stats()
        assert (s["entries"], s["hits"], s["misses"]) == (3, 3, 3), s
        status = cli("status", "second", "--redis-url", redis_server.url, "--key-prefix", prefix).stdout
        assert "second: 3 model calls answered from the response cache, 0 asked of the model" in status, status

        run("longer", "--temperature", "0", "--cache", "--max-tokens", "50")  # one sampling field changed: misses
        assert len(model.bodies) == asked + 3 and all(b.get("max_tokens") == 50 for b in model.bodies[asked:])

        # plain --cache on a sampled job is refused at submit, saying why; nothing runs
        refused = cli("run", str(tasks), *common, "--llm-base-url", model.url, "--job-id", "hot", "--temperature",
                      "0.7", "--cache", check=False)
        assert refused.returncode == 2 and "--cache refused: this job samples (arithmetic at temperature 0.7)" \
            in refused.stderr and "not sampling" in refused.stderr and "--cache=sampled" in refused.stderr
        run("sampled", "--temperature", "0.7", "--cache=sampled")  # asked for: cached, a miss at a new temperature
        assert len(model.bodies) == asked + 6

        # the bound: at most 4 answers, whatever the number of distinct requests
        run("bounded", "--temperature", "0", "--cache", "--max-tokens", "60",
            extra_env={"INTERACTOR_CACHE_MAX_ENTRIES": "4"})
        s = stats()
        assert s["entries"] == 4 and s["evicted"] == 8, s

        cleared = cli("cache", "clear", "--redis-url", redis_server.url, "--key-prefix", prefix).stdout
        assert "4 answers dropped" in cleared
        assert stats()["entries"] == 0
        run("after-clear", "--temperature", "0", "--cache")  # asked again
        assert len(model.bodies) == asked + 12
    finally:
        model.stop()

    store = open_store(str(run_dir / "results.sqlite"), readonly=True)
    try:
        def cached_by_job(job):
            episodes = [e for (e,) in store.sql(f"SELECT episode_id FROM episodes WHERE job_id = '{job}'")]
            steps = [s for e in episodes for s in store.episode_trajectory(e)]
            return len(steps), sum(1 for s in steps if s["cached"])

        assert cached_by_job("first") == (3, 0)
        assert cached_by_job("second") == (3, 3)
        assert cached_by_job("longer") == (3, 0)
        (latency,) = store.sql("SELECT max(model_latency_s) FROM session_steps WHERE job_id = 'second'")[0]
        assert latency < 0.05
        spec = json.loads(store.sql("SELECT spec FROM jobs WHERE job_id = 'second'")[0][0])
        assert spec["cache"] == "on"
        # the episode page says which answers came from the cache
        from interactor.ui.app import create_app
        from interactor.ui.source import Source

        client = create_app(Source(store, store_shown=str(run_dir))).test_client()
        (hit,) = store.sql("SELECT episode_id FROM episodes WHERE job_id = 'second' LIMIT 1")[0]
        (asked_,) = store.sql("SELECT episode_id FROM episodes WHERE job_id = 'first' LIMIT 1")[0]
        assert "cached answer" in client.get(f"/episodes/{hit}").get_data(as_text=True)
        assert "cached answer" not in client.get(f"/episodes/{asked_}").get_data(as_text=True)
    finally:
        store.close()


def _plan(tmp_path, top: str, entry: str = ""):
    from producer.planning import plan_job

    path = tmp_path / "tasks.yaml"
    path.write_text(f"{top}environments:\n  - env_name: e1\n    base_url: http://env.local:8000\n{entry}")
    return plan_job([str(path)], job_id="j1")


def test_a_task_file_may_ask_for_the_cache_and_sampled_jobs_are_refused(tmp_path):
    from broker.settings import Settings, SettingsError
    from producer.enqueue import job_spec
    from producer.taskfile import TaskFileError

    greedy = Settings.from_env({}, temperature=0)
    assert job_spec(greedy, "j1", _plan(tmp_path, "cache: true\n")).cache == "on"
    assert job_spec(greedy, "j1", _plan(tmp_path, "cache: sampled\n")).cache == "sampled"
    assert job_spec(greedy, "j1", _plan(tmp_path, "")).cache == ""
    assert job_spec(Settings.from_env({}, temperature=0, cache="on"), "j1", _plan(tmp_path, "")).cache == "on"
    with pytest.raises(SettingsError, match=r"the task files cache: true refused: this job samples \(e1 at "
                                            r"temperature 0.3\).*not sampling"):
        job_spec(Settings.from_env({}), "j1", _plan(tmp_path, "cache: true\n"))
    # an entry's own temperature counts, over a greedy job's
    with pytest.raises(SettingsError, match=r"--cache refused: this job samples \(e1 at temperature 0.5\)"):
        job_spec(Settings.from_env({}, temperature=0, cache="on"), "j1",
                 _plan(tmp_path, "", "    temperature: 0.5\n"))
    assert job_spec(Settings.from_env({}, temperature=0.5, cache="sampled"), "j1", _plan(tmp_path, "")).cache \
        == "sampled"
    with pytest.raises(TaskFileError, match="'cache' must be true, false or \"sampled\", got 'maybe'"):
        _plan(tmp_path, "cache: maybe\n")
