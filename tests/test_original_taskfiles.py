"""The original system's own env task files (tests/data/original_taskfiles/: the five it ships, as
they are), read by interactor: each loads, but for a private absolute dataset path, which is then
the one fault named; two of them run end to end through `interactor run` against a stand-in of its
env server (tests/original_envserver.py), which sees each reset's body as the original sends it.

What the original's reader does with them and interactor does alike (producer/taskfile.py):
``env_image`` becomes ``job_environments.image``; keys it ignores (``image``, ``demo_dataset``)
are ignored, with a warning naming them; ``dataset: ""`` is no dataset, and an entry without one
sends ``"dataset": {}``.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys

import pytest

from broker.states import StoredStatus
from envs.antonyms import AntonymEnv
from envs.bundled import GuessNumberEnv
from producer.planning import plan_job
from producer.taskfile import TaskFileError
from tests.conftest import ROOT
from tests.original_envserver import OriginalEnvServer

ORIGINAL = ROOT / "tests" / "data" / "original_taskfiles"
DABSTEP = ORIGINAL / "dabstep" / "dabstep_config.yaml"
DWGYM = ORIGINAL / "dwgym" / "dw_config.yaml"
QAGYM = ORIGINAL / "qagym" / "qa_env.yaml"
EMBODIED = ORIGINAL / "embodiedgym" / "embodied_config.yaml"
MATH500 = ORIGINAL / "math500_text" / "math500_text_env_configs.yaml"
URL = "http://127.0.0.1:9"
QA_IMAGE = "registry.h.pjlab.org.cn/ailab-evobox-evobox_cpu/qa-gym:1.3"


def ignored(path, entries: str, key: str) -> str:
    return f"{path}: {entries}: key {key!r} ignored: neither interactor nor the original system's reader reads it"


def plan(path):
    return plan_job([str(path)], job_id="j", default_base_url=URL)


@pytest.mark.unit
def test_dabstep_loads_its_image_key_ignored_and_an_empty_dataset_sent():
    p = plan(DABSTEP)
    assert len(p.episodes) == 8 and p.groups == 8
    assert p.warnings == [ignored(DABSTEP, "entries 1, 2, 3, 4, 5, 6, 7, 8", "image")]
    for shard, ep in enumerate(p.episodes):
        assert ep.env_params == {"data_dir": "env/dabstep/data", "artifacts_dir": "env/dabstep/artifacts",
                                 "split": "dev", "limit": 1, "shard_index": shard, "num_shards": 8, "max_steps": 10,
                                 "timeout": 60, "dataset": {}}
        assert ep.image == "" and ep.env_name == "dabstepgym"  # `image` is not the original's env_image


@pytest.mark.unit
def test_dwgym_loads():
    p = plan(DWGYM)
    assert [e.env_params["thread_id"] for e in p.episodes] == [11, 12]
    assert all(e.env_params["dataset"] == {} and e.env_params["seed"] == 0 for e in p.episodes)
    assert p.warnings == [ignored(DWGYM, "entries 1, 2", "image")]


@pytest.mark.unit
def test_qagym_loads_with_its_env_image_and_its_dataset_beside_it():
    p = plan(QAGYM)
    rows = [json.loads(line) for line in (QAGYM.parent / "qa_cases.jsonl").read_text().splitlines()]
    assert [e.env_params["dataset"] for e in p.episodes] == rows
    assert all(e.image == QA_IMAGE for e in p.episodes)
    assert p.episodes[0].env_params["judge_model_config"]["model_name"] == "gpt-4o-mini"
    # demo_dataset names a private file the original's reader never reads, nor do we
    assert p.warnings == [ignored(QAGYM, "entry 1", "demo_dataset")]


@pytest.mark.parametrize("path, local, env_name, image", [
    (EMBODIED, "alfred_cases.jsonl", "embodied_alfred", "embodiedbench/alfred:latest"),
    (MATH500, "test.jsonl", "math500_text", ""),
])
@pytest.mark.unit
def test_a_private_absolute_dataset_path_is_the_one_fault_named(tmp_path, path, local, env_name, image):
    text = path.read_text()
    (private,) = re.findall(r"^\s*dataset: (/\S+)$", text, re.M)
    with pytest.raises(TaskFileError) as refused:
        plan(path)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.strip().startswith("- env_name:"))
    assert str(refused.value) == (f"{path}: entry 1 ({env_name}, line {line}): field 'dataset': {private!r}: "
                                  f"file not found (resolved to {private})")
    # That path alone: the same file with a local dataset in its place loads whole.
    copy = tmp_path / path.name
    copy.write_text(text.replace(private, str(path.parent / local)))
    p = plan(copy)
    rows = [json.loads(line) for line in (path.parent / local).read_text().splitlines()]
    assert [e.env_params["dataset"] for e in p.episodes] == rows
    assert all(e.env_name == env_name and e.image == image for e in p.episodes) and p.warnings == []


@pytest.mark.unit
def test_our_envs_take_an_empty_dataset_as_no_dataset(tmp_path):
    """What an entry without a dataset now sends, "dataset": {}, changes nothing for the bundled
    environments and the adapters."""
    a, b = GuessNumberEnv({"low": 1, "high": 50}, 7), GuessNumberEnv({"low": 1, "high": 50, "dataset": {}}, 7)
    assert (a.target, a.prompt()) == (b.target, b.prompt())
    assert AntonymEnv({"word": "hot", "dataset": {}}, 1).prompt() == AntonymEnv({"word": "hot"}, 1).prompt()
    rg = pytest.importorskip("envs.reasoning_gym_env")
    ta = pytest.importorskip("envs.textarena_env")
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("textarena")
    for make, params in ((rg.ReasoningGymEnv, {"task": "basic_arithmetic", "size": 5, "index": 2}),
                         (ta.TextArenaEnv, {"game": "GuessTheNumber-v0"})):
        plain, empty = make(), make()
        plain.reset(params, 3)
        empty.reset({**params, "dataset": {}}, 3)
        assert plain.get_task_prompt() == empty.get_task_prompt()


@pytest.mark.integration
def test_two_of_them_run_end_to_end_as_the_original_sends_them(tmp_path, model_server):
    """dabstep (8 entries, `image` keys, no dataset) and qagym (env_image, a dataset, a key its
    reader ignores) in one `interactor run`: every episode completes; each reset's env_param is
    the entry's params with its row, or with {} where it has none, as the original sends them;
    job_environments stores those and each entry's env_image; the warnings name what was ignored."""
    server = OriginalEnvServer(["dabstepgym", "qa_gym"])
    env_url = server.start()
    try:
        _, model_url = model_server
        env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
        env["PYTHONPATH"] = str(ROOT)
        out = subprocess.run(
            [sys.executable, "-m", "interactor.cli", "run", str(DABSTEP), str(QAGYM), "--env-base-url", env_url,
             "--llm-base-url", model_url + "/v1", "--model", "stand-in", "--concurrency", "4", "--workers", "1",
             "--run-dir", str(tmp_path / "runs")],
            cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        for warning in (ignored(DABSTEP, "entries 1, 2, 3, 4, 5, 6, 7, 8", "image"),
                        ignored(QAGYM, "entry 1", "demo_dataset")):
            assert warning in out.stderr, out.stderr[-3000:]
        job = re.search(r"^job (\S+): 10 episodes in 10 groups", out.stdout, re.M).group(1)
    finally:
        server.shutdown()

    # the env_param each episode's reset should carry and its image, by episode id: the files planned again
    planned = plan_job([str(DABSTEP), str(QAGYM)], job_id=job, default_base_url=env_url)
    expected = {ep.episode_id: (ep.env_params, ep.image) for ep in planned.episodes}
    # at the server: one reset per episode, with its env_param as the original sends it
    sent = {r["env_id"].split("~")[0]: r["body"] for r in server.resets}
    assert len(server.resets) == 10 and set(sent) == set(expected)
    for episode, (params, _) in expected.items():
        assert sent[episode]["env_param"] == params
        assert isinstance(sent[episode]["seed"], int)
    dabstep_sent = [b["env_param"] for e, b in sent.items() if b["env_param"].get("data_dir")]
    assert len(dabstep_sent) == 8 and all(p["dataset"] == {} for p in dabstep_sent)
    # in the results store: what was sent, and each entry's env_image ("" for none, as the original stores it)
    db = sqlite3.connect(tmp_path / "runs" / "results.sqlite")
    try:
        rows = db.execute("SELECT env_id, env_params, image FROM job_environments WHERE job_id = ?", (job,)).fetchall()
        completed = db.execute("SELECT COUNT(*) FROM episodes WHERE job_id = ? AND status = ?",
                               (job, StoredStatus.COMPLETED)).fetchone()[0]
    finally:
        db.close()
    assert completed == 10
    assert {r[0]: (json.loads(r[1]), r[2]) for r in rows} == expected
    assert sorted(image for _, image in expected.values()) == [""] * 8 + [QA_IMAGE] * 2
