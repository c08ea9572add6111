import json
import math
import time

import pyarrow as pa
import pyarrow.parquet as pq
import orjson
import pytest

from broker.records import AttemptRecord, JobSpec, StepRecord, unpack
from consumer.export import export_job, parquet_schema
from consumer.store import Store

JOB = "job-1"


def step(ep, n, *, attempt=1, reward=1.0, group="g1", env="echo", last=False, trainable=True, wv="v1", msgs=None, cum=None):
    return StepRecord(
        job_id=JOB, env_id=ep, attempt=attempt, step_id=n, env_name=env, llm_model="m", group_id=group,
        messages_json=orjson.dumps(msgs if msgs is not None else [{"role": "system", "content": "sys"}, {"role": "user", "content": f"turn {n}"}]),
        response=f"action {ep} a{attempt} s{n}", step_reward=reward, cumulative_reward=cum if cum is not None else reward * n,
        terminated=last, truncated=False, episode_finished=last, is_trainable=trainable, weight_version=wv,
        created_at=1000.0 + n,
    )


def close(ep, status, *, attempt=1, total=0.0, steps=0, group="g1", size=2, env="echo", reason=""):
    return AttemptRecord(
        job_id=JOB, episode_id=ep, attempt=attempt, status=status, group_id=group, group_size=size, env_name=env,
        llm_model="m", total_reward=total, steps=steps, reason=reason, error_class="EpisodeError" if reason else "",
        error=f"{reason} happened" if reason else "", started_at=999.0, finished_at=1010.0, worker="w1",
    )


def job():
    return JobSpec(job_id=JOB, llm_base_url="http://llm", model="m", episodes=4, groups=2, sources=["t.yaml"], created_at=900.0)


def episode(ep, rewards, *, attempt=1, group="g1", size=2, env="echo"):
    recs = [step(ep, i + 1, attempt=attempt, reward=r, group=group, env=env, last=i == len(rewards) - 1) for i, r in enumerate(rewards)]
    recs.append(close(ep, "completed", attempt=attempt, total=sum(rewards), steps=len(rewards), group=group, size=size, env=env))
    return recs


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "results.db"))
    yield s
    s.close()


def test_schema_idempotent_and_wal(tmp_path):
    p = str(tmp_path / "r.db")
    Store(p).close()
    s = Store(p)
    try:
        assert s.connection().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        cols = [r[1] for r in s.connection().execute("PRAGMA table_info(session_steps)")]
        for c in ("id", "job_id", "env_id", "step_id", "env_name", "llm_model", "group_id", "messages", "response",
                  "step_reward", "cumulative_reward", "env_state", "weight_version", "terminated", "truncated",
                  "episode_finished", "is_trainable", "created_at", "attempt", "superseded", "finish_reason",
                  "env_latency_s", "model_latency_s"):
            assert c in cols
    finally:
        s.close()


def test_steps_in_order_and_env_state(store):
    recs = [job()] + episode("e1", [0.0, 0.5, 1.0])
    assert store.write_batch(recs) == 1 + 3 + 1
    traj = store.episode_trajectory("e1")
    assert [s["step_id"] for s in traj] == [1, 2, 3]
    assert traj[0]["messages"][1]["content"] == "turn 1"
    assert traj[0]["env_state"] == {"weight_version": "v1"}
    assert traj[-1]["terminated"] and traj[-1]["episode_finished"]
    ep = store.episode("e1")
    assert ep["status"] == "completed" and ep["steps"] == 3 and ep["total_reward"] == pytest.approx(1.5)
    assert ep["attempt"] == 1 and ep["attempts"] == 1
    assert ep["duration_s"] == pytest.approx(11.0)
    # weight_version None -> env_state NULL, as the original driver stored it
    store.write_batch([step("e9", 1, wv=None)])
    assert store.episode_trajectory("e9")[0]["env_state"] is None
    assert store.episode("e9")["status"] == "running"


def test_steps_out_of_order_within_and_across_batches(store):
    recs = episode("e1", [1.0, 2.0, 3.0])
    store.write_batch([recs[2], recs[3]])
    store.write_batch([recs[1], recs[0]])
    assert [s["step_id"] for s in store.episode_trajectory("e1")] == [1, 2, 3]
    assert store.episode("e1")["steps"] == 3


def test_duplicate_batch_stored_once(store):
    recs = [job()] + episode("e1", [1.0, 1.0]) + episode("e2", [0.0, 1.0])
    assert store.write_batch(recs) == 7
    before = store.results(JOB)
    assert store.write_batch(recs) == 0
    # also redelivery of dict-shaped records (as decoded from the stream)
    assert store.write_batch([unpack(r.pack()) for r in recs]) == 0
    assert store.write_batch([r.to_dict() for r in recs]) == 0
    n = store.connection().execute("SELECT COUNT(*) FROM session_steps").fetchone()[0]
    assert n == 4
    assert store.connection().execute("SELECT COUNT(*) FROM attempts").fetchone()[0] == 2
    assert store.results(JOB) == before
    # duplicates inside one batch
    assert store.write_batch([step("e3", 1), step("e3", 1)]) == 1


def _superseded(store, ep):
    return dict(
        ((a, s), sup)
        for a, s, sup in store.connection().execute(
            "SELECT attempt, step_id, superseded FROM session_steps WHERE env_id = ?", (ep,)
        )
    )


def test_attempt_superseded_by_newer_attempt(store):
    # attempt 1 runs 2 steps, then is abandoned (worker lost)
    store.write_batch([step("e1", 1, reward=5.0), step("e1", 2, reward=5.0)])
    assert store.episode("e1")["status"] == "running"
    assert store.episode("e1")["total_reward"] == 10.0
    store.write_batch([close("e1", "abandoned", total=10.0, steps=2, reason="worker_lost")])
    assert store.episode("e1")["status"] == "retrying"
    assert set(_superseded(store, "e1").values()) == {0}  # no newer attempt yet

    # attempt 2's first step arrives: attempt 1 superseded
    store.write_batch([step("e1", 1, attempt=2, reward=1.0)])
    sup = _superseded(store, "e1")
    assert sup[(1, 1)] == 1 and sup[(1, 2)] == 1 and sup[(2, 1)] == 0
    ep = store.episode("e1")
    assert ep["status"] == "running" and ep["attempt"] == 2 and ep["attempts"] == 2
    assert ep["reason"] is None

    # a late attempt-1 step (a redelivery, or one published just before the crash) is stored superseded
    assert store.write_batch([step("e1", 3, reward=5.0)]) == 1
    assert _superseded(store, "e1")[(1, 3)] == 1

    store.write_batch([step("e1", 2, attempt=2, reward=2.0, last=True), close("e1", "completed", attempt=2, total=3.0, steps=2)])
    traj = store.episode_trajectory("e1")
    assert [(s["attempt"], s["step_id"]) for s in traj] == [(2, 1), (2, 2)]
    ep = store.episode("e1")
    assert ep["status"] == "completed" and ep["total_reward"] == 3.0 and ep["steps"] == 2 and ep["attempts"] == 2
    # a late stale close of attempt 1 changes nothing about the episode
    store.write_batch([close("e1", "retrying", total=99.0, reason="worker_lost")])
    assert store.episode("e1")["status"] == "completed" and store.episode("e1")["total_reward"] == 3.0
    assert [a["attempt"] for a in store.attempts("e1")] == [1, 2]


def test_attempts_in_one_batch_and_close_first(store):
    # both attempts in one batch, older ones listed after newer ones
    store.write_batch([step("e1", 1, attempt=2), step("e1", 1, attempt=1), step("e1", 2, attempt=1)])
    sup = _superseded(store, "e1")
    assert sup == {(2, 1): 0, (1, 1): 1, (1, 2): 1}
    # a higher attempt seen only through its AttemptRecord also supersedes
    store.write_batch([close("e1", "failed", attempt=3, reason="env_bad_request")])
    assert set(_superseded(store, "e1").values()) == {1}
    assert store.episode_trajectory("e1") == []
    ep = store.episode("e1")
    assert ep["attempt"] == 3 and ep["status"] == "failed" and ep["attempts"] == 3


def test_close_before_its_steps_and_reopen(store, tmp_path):
    # a consumer crash can make pending step entries come back after the close was stored
    recs = episode("e1", [1.0, 2.0])
    store.write_batch([recs[-1]])
    ep = store.episode("e1")
    assert ep["status"] == "completed" and ep["total_reward"] == 3.0 and ep["steps"] == 0
    assert store.results(JOB)["job"]["short_trajectories"] == 1
    store.write_batch(recs[:-1])
    ep = store.episode("e1")
    assert ep["status"] == "completed" and ep["steps"] == 2 and ep["attempts"] == 1
    assert store.results(JOB)["job"]["short_trajectories"] == 0
    # a second connection (another process) sees the same, schema untouched
    other = Store(store.path)
    try:
        assert [s["step_id"] for s in other.episode_trajectory("e1")] == [1, 2]
        assert other.results(JOB) == store.results(JOB)
    finally:
        other.close()


def test_attempts_counted_once_each(store):
    store.write_batch([step("e1", 1, attempt=1), close("e1", "retrying", attempt=1, reason="env_unreachable")])
    store.write_batch([step("e1", 1, attempt=3)])  # attempt 2 never published anything
    assert store.episode("e1")["attempts"] == 2
    store.write_batch([close("e1", "abandoned", attempt=2, reason="worker_lost")])  # late, stale
    ep = store.episode("e1")
    assert ep["attempts"] == 3 and ep["attempt"] == 3 and ep["status"] == "running"
    store.write_batch([step("e1", 2, attempt=3)])
    assert store.episode("e1")["attempts"] == 3 and store.episode("e1")["steps"] == 2


def test_failed_episode_marks_group_then_redrive_completes(store):
    store.write_batch([job()] + episode("a", [1.0]) + [step("b", 1, reward=0.0), close("b", "failed", total=0.0, steps=1, reason="env_bad_request")])
    g = store.group("g1")
    assert g["size"] == 2 and g["completed"] == 1 and g["failed"] == 1 and g["complete"] == 0
    assert g["incomplete_reason"] == "episode b failed: env_bad_request"
    assert store.episode("b")["status"] == "failed" and store.episode("b")["reason"] == "env_bad_request"
    r = store.results(JOB)
    assert r["job"]["failed"] == 1 and r["groups"]["failed"] == 1 and r["groups"]["complete"] == 0

    # re-driven: attempt 2 completes
    store.write_batch(episode("b", [0.0, 3.0], attempt=2))
    ep = store.episode("b")
    assert ep["status"] == "completed" and ep["attempt"] == 2 and ep["reason"] is None and ep["total_reward"] == 3.0
    g = store.group("g1")
    assert g["complete"] == 1 and g["failed"] == 0 and g["incomplete_reason"] is None and g["completed"] == 2
    assert g["reward_mean"] == pytest.approx(2.0) and g["reward_std"] == pytest.approx(1.0)
    assert store.results(JOB)["groups"]["failed"] == 0


def test_group_mean_std(store):
    rewards = [1.0, 2.0, 4.0, 7.0]
    recs = []
    for i, r in enumerate(rewards):
        recs += episode(f"e{i}", [r], group="gx", size=4)
    store.write_batch(recs[:4])  # two episodes only
    g = store.group("gx")
    assert g["complete"] == 0 and g["completed"] == 2 and g["incomplete_reason"] is None
    store.write_batch(recs[4:])
    g = store.group("gx")
    mean = sum(rewards) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / 4)
    assert g["complete"] == 1 and g["size"] == 4
    assert g["reward_mean"] == pytest.approx(mean) and g["reward_std"] == pytest.approx(std)


def test_results_numbers(store):
    recs = [job()]
    recs += episode("a1", [1.0, 1.0], group="ga", env="alpha")  # 2.0
    recs += episode("a2", [0.0, 0.0], group="ga", env="alpha")  # 0.0
    recs += episode("b1", [3.0], group="gb", env="beta")  # 3.0
    recs += [step("b2", 1, group="gb", env="beta")]  # running
    recs += [step("c1", 1, group="gc", env="beta", reward=9.0), close("c1", "failed", total=9.0, steps=1, group="gc", size=1, env="beta", reason="model_bad_request")]
    store.write_batch(recs)
    assert store.job_ids() == [JOB]
    r = store.results(JOB)
    j = r["job"]
    assert (j["episodes"], j["completed"], j["failed"], j["running"]) == (5, 3, 1, 1)
    assert j["steps"] == 2 + 2 + 1 + 1 + 1
    assert j["mean_reward"] == pytest.approx((2.0 + 0.0 + 3.0) / 3)
    assert j["episodes_expected"] == 4 and j["model"] == "m"
    assert r["by_env"]["alpha"] == {"episodes": 2, "completed": 2, "failed": 0, "mean": 1.0, "min": 0.0, "max": 2.0}
    assert r["by_env"]["beta"] == {"episodes": 3, "completed": 1, "failed": 1, "mean": 3.0, "min": 3.0, "max": 3.0}
    g = r["groups"]
    assert (g["total"], g["complete"], g["incomplete"], g["failed"]) == (3, 1, 2, 1)
    assert g["mean_std"] == pytest.approx(1.0)
    assert store.results("nope")["job"]["episodes"] == 0


def _export_fixture(store):
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    recs = [job()]
    # group g1: complete; e1 has a superseded attempt 1
    recs += [step("e1", 1, reward=7.0), step("e1", 2, reward=7.0)]
    recs += [step("e1", 1, attempt=2, reward=1.0, msgs=[{"role": "user", "content": parts}]), step("e1", 2, attempt=2, reward=0.0, last=True, wv=None)]
    recs += [close("e1", "completed", attempt=2, total=1.0, steps=2)]
    recs += episode("e2", [0.5])
    # group g2: one completed, one failed -> incomplete
    recs += episode("f1", [1.0], group="g2")
    recs += [step("f2", 1, group="g2"), close("f2", "failed", group="g2", steps=1, total=1.0, reason="env_bad_request")]
    # a non-trainable step in e2's group
    recs += [step("e3", 1, group="g3", trainable=False), step("e3", 2, group="g3", last=True), close("e3", "completed", total=2.0, steps=2, group="g3", size=1)]
    store.write_batch(recs)


def test_export_jsonl(store, tmp_path):
    _export_fixture(store)
    out = tmp_path / "out.jsonl"
    n = export_job(store, JOB, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == len(rows) == 2 + 1 + 1 + 1
    assert {(r["episode_id"], r["attempt"], r["step_id"]) for r in rows} == {("e1", 2, 1), ("e1", 2, 2), ("e2", 1, 1), ("f1", 1, 1), ("e3", 1, 2)}
    e1 = [r for r in rows if r["episode_id"] == "e1"]
    assert [r["step_id"] for r in e1] == [1, 2]
    assert e1[0]["messages"][-1] == {"role": "assistant", "content": "action e1 a2 s1"}
    assert e1[0]["messages"][:-1] == e1[0]["prompt"]
    assert isinstance(e1[0]["prompt"][0]["content"], list)  # jsonl keeps parts as-is
    assert e1[0]["episode_reward"] == 1.0 and e1[0]["reward"] == 1.0 and e1[0]["weight_version"] == "v1"
    assert e1[1]["weight_version"] is None
    assert all(r["episode_status"] == "completed" for r in rows)
    assert {r["episode_id"]: r["group_complete"] for r in rows} == {"e1": True, "e2": True, "f1": False, "e3": True}
    assert set(rows[0]) == set(parquet_schema().names)

    n = export_job(str(store.path), JOB, out, complete_groups_only=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == 4 and {r["group_id"] for r in rows} == {"g1", "g3"}

    n = export_job(store, JOB, out, trainable_only=False, episode_statuses=None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == 2 + 1 + 1 + 1 + 2
    assert {r["episode_status"] for r in rows if r["episode_id"] == "f2"} == {"failed"}
    assert not any(r["attempt"] == 1 and r["episode_id"] == "e1" for r in rows)


def test_export_parquet(store, tmp_path):
    _export_fixture(store)
    out = tmp_path / "out.parquet"
    n = export_job(store, JOB, out, fmt="parquet")
    t = pq.read_table(out)
    assert t.num_rows == n == 5
    assert t.schema.equals(parquet_schema())
    msg_type = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
    assert t.schema.field("messages").type == msg_type and t.schema.field("prompt").type == msg_type
    rows = t.to_pylist()
    assert not any(r["episode_id"] == "e1" and r["attempt"] == 1 for r in rows)  # superseded rows absent
    assert not any(r["reward"] == 7.0 for r in rows)
    e1s1 = next(r for r in rows if r["episode_id"] == "e1" and r["step_id"] == 1)
    assert json.loads(e1s1["prompt"][0]["content"])[0] == {"type": "text", "text": "look"}
    assert e1s1["messages"][-1] == {"role": "assistant", "content": "action e1 a2 s1"}

    n = export_job(store, JOB, out, fmt="parquet", complete_groups_only=True)
    t = pq.read_table(out)
    assert n == 4 and set(t.column("group_id").to_pylist()) == {"g1", "g3"}
    assert all(t.column("group_complete").to_pylist())

    # empty export still has the schema
    n = export_job(store, "no-such-job", out, fmt="parquet")
    t = pq.read_table(out)
    assert n == 0 and t.schema.equals(parquet_schema())


def test_ingest_throughput(tmp_path):
    s = Store(str(tmp_path / "perf.db"))
    msgs = [
        {"role": "system", "content": "You are a careful agent. " * 20},
        {"role": "user", "content": "observation: " + "x" * 1200},
        {"role": "assistant", "content": "previous action " + "y" * 600},
        {"role": "user", "content": "feedback " + "z" * 500},
    ]
    assert 2500 < len(json.dumps(msgs)) < 3500
    episodes, steps_per = 400, 50  # 20k step records, interleaved as concurrent workers would publish
    recs = [
        step(f"ep{e:04d}", n, group=f"g{e // 8}", msgs=msgs)
        for n in range(1, steps_per + 1)
        for e in range(episodes)
    ]
    batch = 500
    t0 = time.perf_counter()
    for i in range(0, len(recs), batch):
        s.write_batch(recs[i : i + batch])
    dt = time.perf_counter() - t0
    rate = len(recs) / dt
    print(f"\ningest: {len(recs)} step records (~3 KB) in {dt:.2f}s = {rate:,.0f} records/s")
    assert s.results(JOB)["job"]["steps"] == len(recs)
    s.close()
    assert rate > 2000
