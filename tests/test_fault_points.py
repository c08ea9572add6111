"""Where a successor starts, checked on real workers stopped at every point of a turn.

broker/resume.py's model (``TURN_POINTS``, ``successor_at``) says, for each point a worker can be
killed or stopped at, what its successor does. Here a real worker process (Celery, the example
env server and model stand-in on loopback, a consumer, a results store) is killed (SIGKILL to
itself) or stopped (its shutdown clock run out, then replaced) at each point of step 3 and of
step 1, by the fault hook in its step loop (workers/faults.py, armed by the ``fault_point``
setting, once per marker file); the other worker (or the killed one, restarted by its
supervisor) carries the episode on. After each, from the
env server's own log of calls and the store, the three promises:

* the env applied each step at most once: on every instance, prompts and steps alternate (a step
  sent twice has no prompt before it, a prompt sent twice no step);
* every applied step is stored exactly once, or the episode restarted on a fresh instance: the
  completed trajectory's instance got as many steps as the store holds, 1..n once each;
* every instance opened is closed once.
"""

from __future__ import annotations

import pytest

from broker.keys import env_instance_id
from broker.ledger import Ledger
from broker.records import attempt_key
from broker.resume import TURN_POINTS
from broker.states import LedgerState
from consumer.storage import open_store
from producer.enqueue import submit
from tests.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.fault]

TURNS = 6




def instances(env, episode: str) -> dict[str, list[str]]:
    """Per env instance of the episode, its calls in the order the env server saw them."""
    out: dict[str, list[str]] = {}
    for _, op, _, env_id in list(env.request_log):
        if env_id.split("~", 1)[0] == episode:
            out.setdefault(env_id, []).append(op)
    return out


def stored_steps(settings, job_id: str, episode: str) -> tuple[list[int], list[dict]]:
    store = open_store(settings.results_store, readonly=True)
    try:
        steps = [r[0] for r in store.query("SELECT step_id FROM session_steps WHERE session_id = ? ORDER BY step_id",
                                           (episode,))]
        attempts = store.attempts(episode)
    finally:
        store.close()
    return steps, attempts


@pytest.mark.parametrize("action", ["killed", "stopped"])
@pytest.mark.parametrize("point,step", [(p, 3) for p in TURN_POINTS] + [("after_prompt", 1), ("after_step", 1)])
def test_a_worker_stopped_at_each_point_keeps_the_three_promises(point, step, action, settings, procs, redis_client,
                                                                tmp_path, servers):
    env, env_url, model, model_url = servers
    s = settings.replace(llm_base_url=model_url + "/v1")
    procs.settings = s
    tasks = tmp_path / "t.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                     f"    env_params: {{low: 1, high: 1073741824, max_turns: {TURNS}}}\n    env_num: 1\n")
    job = submit(redis_client, s, [str(tasks)]).job
    ledger = Ledger.for_settings(redis_client, s)
    (episode,) = list(ledger.states(job.job_id))
    marker = tmp_path / "fault-acted"
    procs.consumer()
    fault = f"{point}@{step}:{action}:{marker}"  # whichever worker gets there first acts, once
    procs.worker("w1", fault_point=fault)
    procs.worker("w2", fault_point=fault)
    wait_for(marker.exists, 60, what=f"a worker {action} at {point}@{step}")
    wait_for(lambda: ledger.state(job.job_id, episode) == LedgerState.DONE, 120, what="the episode done")
    steps, attempts = wait_for(lambda: (got := stored_steps(s, job.job_id, episode)) and any(
        a["status"] == "completed" for a in got[1]) and got, 60, what="the episode stored")
    wait_for(lambda: all(ops.count("close") for ops in instances(env, episode).values()), 30,
             what="every instance closed")
    calls = instances(env, episode)

    # 1. each step applied at most once: prompts and steps alternate on every instance
    for env_id, ops in calls.items():
        turns = [op for op in ops if op in ("get_task_prompt", "step")]
        assert all(a != b for a, b in zip(turns, turns[1:])), (env_id, ops)
        assert ops.count("reset") == 1, (env_id, ops)
    # 2. stored exactly once: the completed trajectory's instance stepped as often as the store holds
    completed = [a for a in attempts if a["status"] == "completed"]
    assert len(completed) == 1, attempts
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == TURNS, steps
    number, attempt_id = attempt_key(completed[0]["trajectory"]) or (completed[0]["attempt"],
                                                                       completed[0]["attempt_id"])
    assert calls[env_instance_id(episode, number, attempt_id)].count("step") == len(steps), calls
    # 3. every instance opened is closed once
    assert all(ops.count("close") == 1 for ops in calls.values()), calls
    assert env.stats()["live"] == 0
