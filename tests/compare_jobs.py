"""Two jobs of one task file in a results store, for the compare tests (tests/test_compare.py and
the browser's, tests/test_compare_browser.py): A solves rows 1-4 of six, B rows 3-6, on an env
named in markup; each row ran once; job ids and a task's text are markup too."""

from __future__ import annotations

import orjson

from broker.records import AttemptRecord, EpisodesEnqueued, JobSpec, StepRecord

JOB_A = "base<b>line"
JOB_B = "tuned"
ENV = '<svg onload="alert(1)">'
TASK_MARKUP = "<script>window.__pwned=1</script>"
REWARDS_A = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
REWARDS_B = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def question(row: int) -> dict:
    return {"question": f"What is {row} + 1? {TASK_MARKUP}" if row == 6 else f"What is {row} + 1?"}


def job_records(job_id: str, rewards: list[float]) -> list:
    recs: list = [JobSpec(job_id=job_id, llm_base_url="http://llm/v1", model="m", episodes=len(rewards),
                          groups=len(rewards))]
    announced = []
    for row, reward in enumerate(rewards, 1):
        ep, group = f"{job_id}.1.1.{row}.1", f"{job_id}.1.1.{row}"
        announced.append([ep, ENV, group, orjson.dumps({"dataset": question(row)})])
        recs.append(StepRecord(job_id=job_id, env_id=ep, attempt=1, step_id=1, env_name=ENV, llm_model="m",
                               group_id=group, messages_json=orjson.dumps([{"role": "user", "content": "q"}]),
                               response="a", step_reward=reward, cumulative_reward=reward, terminated=True,
                               truncated=False, episode_finished=True, is_trainable=True, attempt_id=f"{ep}-a1",
                               created_at=1000.0 + row, ended_by="terminated"))
        recs.append(AttemptRecord(job_id=job_id, episode_id=ep, attempt=1, status="completed", group_id=group,
                                  group_size=1, env_name=ENV, llm_model="m", total_reward=reward, steps=1,
                                  attempt_id=f"{ep}-a1", started_at=1000.0, finished_at=1001.0 + row,
                                  ended_by="terminated"))
    return [recs[0], EpisodesEnqueued(job_id, announced), *recs[1:]]


def fill_two_jobs(store) -> None:
    store.write_batch(job_records(JOB_A, REWARDS_A) + job_records(JOB_B, REWARDS_B))
