"""Training-ready exports: group statistics and advantages, filters (complete groups, staleness,
trainable steps, env names), the Parquet shape TRL/verl read, and the whole user path:
`interactor run` of a reasoning-gym + textarena job, `interactor results`, `interactor export`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import orjson
import pytest

from broker.records import AttemptRecord, JobSpec, StepRecord
from consumer.export import export_training, parquet_schema, version_number
from consumer.storage import open_store
from consumer.storage.group_stats import group_stats
from tests.conftest import ROOT

JOB = "train-1"


def step(ep, n, *, group, env="alpha", reward=0.0, last=False, trainable=True, wv="7", attempt=1):
    return StepRecord(job_id=JOB, env_id=ep, attempt=attempt, step_id=n, env_name=env, llm_model="m", group_id=group,
                      messages_json=orjson.dumps([{"role": "system", "content": "sys"}, {"role": "user", "content": f"{ep} turn {n}"}]),
                      response=f"answer {ep} {n}", step_reward=reward, cumulative_reward=reward, terminated=last,
                      truncated=False, episode_finished=last, is_trainable=trainable, weight_version=wv,
                      created_at=1000.0 + n)


def episode(ep, reward, *, group, size, env="alpha", wvs=("7", "7"), status="completed", trainable_first=True):
    recs = [step(ep, 1, group=group, env=env, wv=wvs[0], trainable=trainable_first),
            step(ep, 2, group=group, env=env, reward=reward, last=True, wv=wvs[1])]
    recs.append(AttemptRecord(job_id=JOB, episode_id=ep, attempt=1, status=status, group_id=group, group_size=size,
                              env_name=env, llm_model="m", total_reward=reward, steps=2,
                              reason="" if status == "completed" else "env_bad_request",
                              started_at=999.0, finished_at=1010.0))
    return recs


@pytest.fixture
def store(tmp_path, store_url):
    s = open_store(store_url)
    recs = [JobSpec(job_id=JOB, llm_base_url="http://llm", model="m", episodes=11, groups=5)]
    recs += episode("a1", 1.0, group="ga", size=3) + episode("a2", 0.0, group="ga", size=3) \
        + episode("a3", 0.5, group="ga", size=3, trainable_first=False)                    # complete, spread
    recs += episode("b1", 1.0, group="gb", size=2) + episode("b2", 1.0, group="gb", size=2)  # complete, all equal
    recs += episode("c1", 1.0, group="gc", size=2) + episode("c2", 0.0, group="gc", size=2, status="failed")  # incomplete
    recs += episode("d1", 2.0, group="gd", size=2, env="beta", wvs=("3", "7")) \
        + episode("d2", 0.0, group="gd", size=2, env="beta", wvs=("step-6", "step-7"))     # one stale member
    recs += episode("e1", 1.0, group="ge", size=2, env="beta", wvs=(None, None)) \
        + episode("e2", 3.0, group="ge", size=2, env="beta")                              # one unversioned
    s.write_batch(recs)
    yield s
    s.close()


def rows_of(path):
    return [json.loads(line) for line in open(path)]


def by_episode(rows):
    out = {}
    for r in rows:
        out.setdefault(r["episode_id"], []).append(r)
    return out


@pytest.mark.unit
def test_group_stats_and_advantages():
    mean, std, adv, equal = group_stats([1.0, 0.0, 0.5])
    assert mean == pytest.approx(0.5) and std == pytest.approx(math.sqrt(1 / 6))
    assert adv == pytest.approx([(1 - 0.5) / (std + 1e-6), (0 - 0.5) / (std + 1e-6), 0.0])
    assert not equal
    assert group_stats([2.0, 2.0]) == (2.0, 0.0, [0.0, 0.0], True)
    assert group_stats([0.3]) == (0.3, 0.0, [0.0], True)
    assert [version_number(v) for v in ("12", "v3", "step-120", 5, None, "latest", "1.5")] == [
        12.0, 3.0, 120.0, 5.0, None, None, 1.5]


def test_every_row_carries_its_group_statistics(store, tmp_path):
    out = tmp_path / "all.jsonl"
    res = export_training(store, JOB, out)
    rows = rows_of(out)
    eps = by_episode(rows)
    assert set(eps) == {"a1", "a2", "a3", "b1", "b2", "c1", "d1", "d2", "e1", "e2"}  # completed episodes only
    assert res.rows == len(rows) and res.episodes == 10 and res.groups == 5
    std = math.sqrt(1 / 6)
    for ep, want in (("a1", 0.5 / (std + 1e-6)), ("a2", -0.5 / (std + 1e-6)), ("a3", 0.0)):
        for r in eps[ep]:
            assert r["advantage"] == pytest.approx(want) and r["group_size"] == 3
            assert r["group_reward_mean"] == pytest.approx(0.5) and r["group_reward_std"] == pytest.approx(std)
            assert r["group_rewards_equal"] is False
    assert [r["step_id"] for r in eps["a3"]] == [2], "trainable steps only by default"
    assert [r["step_id"] for r in eps["a1"]] == [1, 2], "every step row carries its episode's advantage"
    assert all(r["advantage"] == 0.0 and r["group_rewards_equal"] for ep in ("b1", "b2") for r in eps[ep])
    # The incomplete group's survivor is exported alone (without --complete-groups): flagged.
    assert all(r["group_size"] == 1 and r["group_rewards_equal"] and not r["group_complete"] for r in eps["c1"])
    assert res.groups_rewards_equal == 2
    r = eps["a1"][0]
    assert r["completion"] == [{"role": "assistant", "content": "answer a1 1"}]
    assert r["messages"] == r["prompt"] + r["completion"]
    assert res.by_env == {"alpha": sum(len(eps[e]) for e in ("a1", "a2", "a3", "b1", "b2", "c1")),
                          "beta": sum(len(eps[e]) for e in ("d1", "d2", "e1", "e2"))}


def test_filters(store, tmp_path):
    out = tmp_path / "f.jsonl"
    res = export_training(store, JOB, out, complete_groups_only=True)
    assert {r["group_id"] for r in rows_of(out)} == {"ga", "gb", "gd", "ge"} and res.groups == 4
    export_training(store, JOB, out, env_names=["beta"])
    assert {r["env_name"] for r in rows_of(out)} == {"beta"}
    export_training(store, JOB, out, trainable_only=False)
    assert [r["step_id"] for r in by_episode(rows_of(out))["a3"]] == [1, 2]

    # Staleness: current = newest version in the job (7). d1's oldest step is 3 (stale by 4),
    # d2's is step-6 (1), e1 has none.
    res = export_training(store, JOB, out, max_staleness=2)
    eps = by_episode(rows_of(out))
    assert res.current_version == 7.0 and res.dropped_stale == 1 and res.dropped_unversioned == 1
    assert "d1" not in eps and "e1" not in eps and "d2" in eps and "e2" in eps
    assert eps["d2"][0]["group_size"] == 1, "group statistics are over the exported members"
    res = export_training(store, JOB, out, max_staleness=2, complete_groups_only=True)
    assert {r["group_id"] for r in rows_of(out)} == {"ga", "gb"} and res.dropped_groups == 2
    res = export_training(store, JOB, out, max_staleness=0, current_version="v8")
    assert res.rows == 0 and res.dropped_stale == 9
    with pytest.raises(ValueError):
        export_training(store, JOB, out, max_staleness=-1)


def test_parquet_is_chat_shaped_for_trl_and_verl(store, tmp_path):
    out = tmp_path / "train.parquet"
    n = export_training(store, JOB, out, fmt="parquet", complete_groups_only=True).rows
    t = pq.read_table(out)
    assert t.num_rows == n > 0 and t.schema.equals(parquet_schema())
    chat = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
    for name in ("messages", "prompt", "completion"):
        assert t.schema.field(name).type == chat
    for name, typ in (("advantage", pa.float64()), ("group_reward_mean", pa.float64()),
                      ("group_reward_std", pa.float64()), ("group_size", pa.int32()),
                      ("group_rewards_equal", pa.bool_()), ("reward", pa.float64()),
                      ("episode_reward", pa.float64())):
        assert t.schema.field(name).type == typ, name
    row = t.slice(0, 1).to_pylist()[0]
    assert row["messages"][-1]["role"] == "assistant" and row["messages"][:-1] == row["prompt"]


def test_parquet_loads_with_datasets(store, tmp_path):
    datasets = pytest.importorskip("datasets", reason="the `datasets` library is not installed")
    out = tmp_path / "train.parquet"
    n = export_training(store, JOB, out, fmt="parquet").rows
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert ds.num_rows == n and ds[0]["messages"] == pq.read_table(out).slice(0, 1).to_pylist()[0]["messages"]


# --------------------------------------------------------------------------- the user path

@pytest.mark.integration
def test_run_results_and_export_a_library_job(model_server, tmp_path):
    """`interactor run` (embedded Redis, local workers) of reasoning-gym and textarena episodes
    run in process, then `interactor results` and `interactor export --complete-groups`."""
    pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (pip install .[reasoning-gym])")
    pytest.importorskip("textarena", reason="textarena not installed (pip install .[textarena])")
    _, model_url = model_server
    tasks = tmp_path / "libs.yaml"
    tasks.write_text(textwrap.dedent("""\
        environments:
          - env_name: reasoning_gym.chain_sum
            env_class: envs.reasoning_gym_env:ReasoningGymEnv
            env_params: {size: 20, seed: 1}
            dataset: [{index: 0}, {index: 1}, {index: 2}]
            env_num: 4
          - env_name: textarena.GuessTheNumber-v0
            env_class: envs.textarena_env:TextArenaEnv
            env_params: {kwargs: {max_turns: 3}}
            dataset: [{seed: 1}, {seed: 2}]
            env_num: 2
        """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    run_dir = tmp_path / "runs"
    common = ["--run-dir", str(run_dir)]

    def cli(*args, timeout=240):
        return subprocess.run([sys.executable, "-m", "interactor.cli", *args, *common], env=env, cwd=str(ROOT),
                              capture_output=True, text=True, timeout=timeout)

    out = cli("run", str(tasks), "--job-id", "libjob", "--llm-base-url", model_url + "/v1", "--workers", "1",
              "--concurrency", "4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "reasoning_gym.chain_sum" in out.stdout and "textarena.GuessTheNumber-v0" in out.stdout

    res = cli("results", "libjob", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["job"]["completed"] == 3 * 4 + 2 * 2
    assert summary["groups"]["total"] == 5 and summary["groups"]["complete"] == 5
    assert set(summary["by_env"]) == {"reasoning_gym.chain_sum", "textarena.GuessTheNumber-v0"}

    parquet = tmp_path / "libjob.parquet"
    exp = cli("export", "libjob", "--format", "parquet", "--complete-groups", "--out", str(parquet))
    assert exp.returncode == 0, exp.stderr
    assert "groups" in exp.stdout and str(parquet) in exp.stdout
    t = pq.read_table(parquet)
    assert t.schema.equals(parquet_schema())
    rows = t.to_pylist()
    assert {r["group_id"] for r in rows} == {f"libjob.1.{e}.{r}" for e, n in ((1, 3), (2, 2)) for r in range(1, n + 1)}
    # Group statistics agree with the stored episode rewards, recomputed here.
    episodes = {}
    for r in rows:
        episodes[r["episode_id"]] = r
    groups = {}
    for r in episodes.values():
        groups.setdefault(r["group_id"], []).append(r)
    assert len(episodes) == 16
    for gid, members in groups.items():
        rewards = [m["episode_reward"] for m in members]
        mean, std, _, equal = group_stats(rewards)
        for m in members:
            assert m["group_size"] == len(members) and m["group_reward_mean"] == pytest.approx(mean)
            assert m["group_reward_std"] == pytest.approx(std) and m["group_rewards_equal"] == equal
            assert m["advantage"] == pytest.approx(0.0 if equal else (m["episode_reward"] - mean) / (std + 1e-6))
    jsonl = cli("export", "libjob", "--env-name", "textarena.GuessTheNumber-v0", "--out", str(tmp_path / "ta.jsonl"))
    assert jsonl.returncode == 0, jsonl.stderr
    assert {r["env_name"] for r in rows_of(tmp_path / "ta.jsonl")} == {"textarena.GuessTheNumber-v0"}
