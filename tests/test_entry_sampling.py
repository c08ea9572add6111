"""Per-entry sampling settings in task files (issue 48): an entry's ``max_tokens``,
``temperature`` and ``stop`` are checked, stored with each of its episodes
(``EpisodeSpec.sampling``), and reach that entry's model calls over the job's flags; ``n`` is
the entry's samples per task, as ``env_num``."""

from __future__ import annotations

import textwrap

import pytest

from broker.records import EpisodeSpec, unpack
from producer.planning import plan_job
from producer.taskfile import TaskFileError

URL = "http://env.local:8000"


def plan(tmp_path, body: str):
    path = tmp_path / "tasks.yaml"
    path.write_text(textwrap.dedent(body).lstrip("\n"))
    return plan_job([str(path)], job_id="j1")


def test_an_entrys_sampling_is_stored_with_each_of_its_episodes(tmp_path):
    job = plan(tmp_path, f"""
        environments:
          - env_name: short
            base_url: {URL}
            max_tokens: 32
            temperature: 0
            stop: "</answer>"
            n: 3
          - env_name: plain
            base_url: {URL}
        """)
    short = [e for e in job.episodes if e.env_name == "short"]
    plain = [e for e in job.episodes if e.env_name == "plain"]
    assert len(short) == 3 and {e.group_size for e in short} == {3}
    assert all(e.sampling == {"max_tokens": 32, "temperature": 0.0, "stop": ["</answer>"]} for e in short)
    assert [e.sampling for e in plain] == [{}]
    # through the ledger's packing and back, as a worker reads it
    back = unpack(short[0].pack())
    assert isinstance(back, EpisodeSpec) and back.sampling == short[0].sampling


def test_a_spec_packed_without_sampling_reads_as_the_jobs():
    spec = EpisodeSpec("j", "j.1.1.1.1", "j.1.1.1", 1, "e", URL, {})
    raw = spec.to_dict()
    del raw["sampling"]
    assert EpisodeSpec.from_dict(raw).sampling == {}


@pytest.mark.parametrize("line, says", [
    ("max_tokens: 0", "'max_tokens': must be an integer >= 1"),
    ("max_tokens: lots", "'max_tokens': must be an integer >= 1"),
    ("temperature: -1", "'temperature': must be a number >= 0"),
    ("temperature: hot", "'temperature': must be a number >= 0"),
    ("stop: []", "'stop': must be a non-empty string or a list of them"),
    ("stop: [1, 2]", "'stop': must be a non-empty string or a list of them"),
    ("n: 0", "'n': must be an integer >= 1"),
    ("n: 2\n    env_num: 3", "'n': is 2 and env_num is 3"),
    ("max_token: 5", "did you mean 'max_tokens'"),
])
def test_bad_sampling_is_refused_naming_the_entry_and_field(tmp_path, line, says):
    with pytest.raises(TaskFileError) as err:
        plan(tmp_path, f"environments:\n  - env_name: e1\n    base_url: {URL}\n    {line}\n")
    assert says in str(err.value) and "entry 1 (" in str(err.value)


@pytest.mark.integration
def test_each_entrys_sampling_reaches_its_model_calls_and_reasoning_is_kept_and_shown(tmp_path, env_server):
    """`interactor run` of a task file whose first entry sets its own sampling, with the job's
    flags set otherwise: the first entry's requests carry its own, the second's the job's. The
    model's reasoning_content is stored beside each answer and shown on the episode's page."""
    import json
    import os
    import subprocess
    import sys

    from consumer.storage import open_store
    from interactor.ui.app import create_app
    from interactor.ui.source import Source
    from tests.conftest import ROOT
    from tests.recording_model import REASONING, RecordingModel

    _, env_url = env_server
    model = RecordingModel("smollm2")
    try:
        tasks = tmp_path / "tasks.yaml"
        tasks.write_text(textwrap.dedent(f"""
            environments:
              - env_name: arithmetic
                base_url: {env_url}
                dataset: [{{question: "What is 1 + 2?", answer: 3}}, {{question: "What is 2 + 2?", answer: 4}}]
                max_tokens: 32
                temperature: 0
                stop: "</answer>"
                n: 2
              - env_name: arithmetic
                base_url: {env_url}
                dataset: [{{question: "What is 10 + 20?", answer: 30}}]
            """))
        env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
        run_dir = tmp_path / "runs"
        run = subprocess.run([sys.executable, "-m", "interactor.cli", "run", str(tasks), "--llm-base-url", model.url,
                              "--model", "smollm2", "--max-tokens", "100", "--temperature", "0.5", "--run-dir",
                              str(run_dir), "--concurrency", "2", "--workers", "1", "--job-id", "sampled"],
                             env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    finally:
        model.stop()

    def asked(body):
        return next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")

    own = [b for b in model.bodies if "10 + 20" not in asked(b)]
    jobs = [b for b in model.bodies if "10 + 20" in asked(b)]
    assert len(own) == 4 and len(jobs) == 1, [asked(b) for b in model.bodies]
    assert all((b["max_tokens"], b["temperature"], b["stop"]) == (32, 0.0, ["</answer>"]) for b in own), own
    assert (jobs[0]["max_tokens"], jobs[0]["temperature"], "stop" in jobs[0]) == (100, 0.5, False), jobs

    db = str(run_dir / "results.sqlite")
    store = open_store(db, readonly=True)
    try:
        (episode,) = [e for (e,) in store.sql("SELECT episode_id FROM episodes WHERE job_id = 'sampled' "
                                              "ORDER BY episode_id LIMIT 1")]
        (step,) = store.episode_trajectory(episode)
        assert step["reasoning_content"] == REASONING and step["response"] == "<answer>3</answer>"
        page = create_app(Source(store, store_shown=db)).test_client().get(f"/episodes/{episode}")
        html = page.get_data(as_text=True)
        assert page.status_code == 200 and 'class="reasoning"' in html and REASONING in html
        spec = json.loads(store.sql("SELECT spec FROM jobs WHERE job_id = 'sampled'")[0][0])
        assert spec["llm_params"] == {"max_tokens": 100}
    finally:
        store.close()


def test_an_entry_without_base_url_is_told_what_serves_envs(tmp_path):
    """The README's first evaluation run without --env-base-url (issue 48): the error names the
    flag and the command that serves the bundled envs, as the user types them."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    tasks = tmp_path / "tasks.yaml"
    tasks.write_text("environments:\n  - env_name: guess_number\n    env_params: {low: 1, high: 100}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "run", str(tasks), "--run-dir",
                          str(tmp_path / "runs")], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "entry 1 (guess_number, line 2): field 'base_url': missing" in out.stderr
    assert "--env-base-url URL" in out.stderr and "interactor serve-env --port 8080" in out.stderr
    assert not (tmp_path / "runs" / "redis").exists()  # nothing started


@pytest.mark.parametrize("message, kept", [
    ({"content": "4", "reasoning_content": "2 and 2"}, "2 and 2"),
    ({"content": "4", "reasoning": "2 and 2"}, "2 and 2"),  # servers that name it reasoning
    ({"content": "4"}, ""),
    ({"content": "4", "reasoning_content": None}, ""),
    ({"content": "4", "reasoning_content": {"steps": [1]}}, ""),  # no string: no reasoning, the answer kept
    ({"content": "4", "reasoning_content": ["a"], "reasoning": 7}, ""),
])
def test_an_answers_reasoning_is_read_beside_its_content(message, kept):
    import json

    from workers.http_transport import Reply
    from workers.modelclient import _parse

    body = json.dumps({"choices": [{"message": {"role": "assistant", **message}, "finish_reason": "stop"}]}).encode()
    got = _parse(Reply(200, {}, body, 0.01), "model", 1)
    assert (got.content, got.reasoning_content) == ("4", kept)
