"""Agent episodes end to end (workers/agent_episode.py, workers/gateway.py): real worker processes
(the default gevent pool) run agents that own their loop (the plain openai client, the OpenAI
Agents SDK, LangGraph, a process of their own) against the model stand-in through the worker's
gateway; the consumer stores each call as a step. Failing, stalled, killed and hostile agents."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from broker.dlq import DeadLetterQueue
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.storecheck import assert_trajectories_sound, db_rows, store_text
from tests.test_no_orphans import mark  # noqa: F401 - fixture of the feed server's test

pytestmark = pytest.mark.integration

ROW = {"question": "What is (3 + 4) * 5?", "answer": 35}
# the agent process runs on this interpreter (the checkout's venv), as a user's PATH would find it
PYTHON = sys.executable
AGENT_SETTINGS = dict(agents="examples.agents.*,tests.agent_fakes:*",
                      agent_commands=f"{PYTHON} -m examples.agents.subprocess_agent,{PYTHON} -m tests.agent_env_dump")


def write_tasks(folder, entries: str, rows=(ROW,)) -> str:
    (folder / "calc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = folder / "agents.yaml"
    path.write_text("environments:\n" + textwrap.indent(textwrap.dedent(entries), "  "))
    return str(path)


def wait_stored(settings, job_id: str, total: int, timeout: float = 120) -> dict:
    from consumer.storage import open_store

    def stored():
        store = open_store(settings.results_store)
        try:
            res = store.results(job_id)["job"]
        finally:
            store.close()
        return res if res["completed"] + res["failed"] >= total else None

    return wait_for(stored, timeout, what=f"{total} agent episodes of {job_id} stored")


def run_job(settings, procs, redis_client, tasks: str, total: int, workers=("w1",), timeout=120):
    sub = submit(redis_client, settings, [tasks])
    assert sub.job.episodes == total
    for name in workers:
        procs.worker(name)
    procs.consumer()
    return sub.job.job_id, wait_stored(settings, sub.job.job_id, total, timeout)


def steps_of(db, job_id):
    rows = db_rows(db, "SELECT session_id, step_id, messages, response, env_state, step_reward, reward, "
                       "is_session_completed, finish_reason, attempt_id FROM session_steps WHERE job_id = ? "
                       "ORDER BY session_id, step_id", (job_id,))
    by_episode: dict[str, list] = {}
    for r in rows:
        by_episode.setdefault(r[0], []).append(r)
    return by_episode


@pytest.fixture
def agent_settings(settings, model_server, tmp_path):
    _, model_url = model_server
    return settings.replace(llm_base_url=model_url + "/v1", llm_api_key="sk-test-planted-agent-secret-9",
                            **AGENT_SETTINGS)


@pytest.mark.parametrize("pool", ["gevent", "threads"])
def test_agents_of_three_libraries_and_a_process_are_recorded_call_by_call(pool, agent_settings, procs, model_server,
                                                                           redis_client, tmp_path):
    """Under either worker pool: under gevent (the default) an agent function runs on a real OS
    thread of its own, under threads on a thread of the pool's kind."""
    model, _ = model_server
    agent_settings = agent_settings.replace(pool=pool)
    procs.settings = agent_settings
    tasks = write_tasks(tmp_path, """\
        - env_name: calc.openai
          agent: examples.agents.openai_client:solve
          dataset: calc.jsonl
          env_num: 2
        - env_name: calc.agents_sdk
          agent: examples.agents.agents_sdk:solve
          dataset: calc.jsonl
          env_num: 2
        - env_name: calc.langgraph
          agent: examples.agents.langgraph_agent:solve
          dataset: calc.jsonl
          env_num: 2
        - env_name: calc.process
          agent_command: [PYTHON, -m, examples.agents.subprocess_agent]
          dataset: calc.jsonl
          env_num: 2
        """.replace("PYTHON", PYTHON))
    job_id, res = run_job(agent_settings, procs, redis_client, tasks, 8)
    db = agent_settings.results_store
    assert res["completed"] == 8, procs.log("w1")[-4000:]
    assert_trajectories_sound(db, job_id)
    episodes = steps_of(db, job_id)
    assert len(episodes) == 8
    for episode_id, steps in episodes.items():
        # every agent: the question, a calculator call, its result, the answer
        assert [s[1] for s in steps] == [1, 2], episode_id
        first, last = steps
        state = json.loads(first[4])
        assert state["tool_calls"][0]["function"]["name"] == "calculator"
        assert json.loads(state["tool_calls"][0]["function"]["arguments"]) == {"expression": "(3 + 4) * 5"}
        assert state["tools"][0]["function"]["name"] == "calculator" and first[8] == "tool_calls"
        assert json.loads(first[2])[-1]["content"] == ROW["question"]
        prompt = json.loads(last[2])
        assert prompt[-1]["role"] == "tool" and prompt[-1]["content"] == "35"
        assert prompt[-2]["tool_calls"][0]["id"] == state["tool_calls"][0]["id"]
        assert last[3].endswith("<answer>35</answer>")
        assert (first[5], first[7], last[5], last[6], last[7]) == (0.0, 0, 1.0, 1.0, 1)
    # every call the completing attempts made is stored, once: 16 calls, 16 steps. On a starved
    # machine an attempt may lose its lease and run again: the calls of the one set aside reached
    # the model but are in no trajectory (assert_trajectories_sound: one attempt's steps each)
    attempts = db_rows(db, "SELECT COUNT(*) FROM attempts WHERE job_id = ?", (job_id,))[0][0]
    assert sum(len(s) for s in episodes.values()) == 16
    assert model.stats()["requests"] == 16 if attempts == 8 else model.stats()["requests"] > 16
    groups = db_rows(db, "SELECT size, completed, complete, reward_mean FROM groups WHERE job_id = ?", (job_id,))
    assert sorted(groups) == [(2, 2, 1, 1.0)] * 4
    # the model's key went to the model only: not to the agents, Redis, the store or the logs
    assert "planted-agent-secret" not in store_text(db)
    assert "planted-agent-secret" not in procs.log("w1") + procs.log("consumer")
    for key in redis_client.scan_iter(f"{agent_settings.key_prefix}:*"):
        assert b"planted-agent-secret" not in redis_client.dump(key)


def test_agents_that_fail_or_are_not_allowed_are_dead_lettered_with_their_last_words(
        agent_settings, procs, redis_client, tmp_path):
    # a timeout far off: an agent process's start counts, and on a loaded machine it can take seconds
    settings = agent_settings.replace(max_attempts=1, agent_timeout_s=120.0)
    procs.settings = settings
    tasks = write_tasks(tmp_path, """\
        - env_name: fails.raises
          agent: tests.agent_fakes:raises
        - env_name: fails.no_reward
          agent: tests.agent_fakes:no_reward
        - env_name: fails.exit
          agent_command: [PYTHON, -m, examples.agents.subprocess_agent]
          env_params: {fail: true}
        - env_name: fails.not_allowed
          agent: examples.model_standin:main
        - env_name: fails.command_not_allowed
          agent_command: [PYTHON, -c, "print(1)"]
        """.replace("PYTHON", PYTHON))
    job_id, res = run_job(settings, procs, redis_client, tasks, 5)
    assert res["failed"] == 5
    letters = {d.env_name: d for d in DeadLetterQueue(redis_client, settings).list(job_id=job_id)}
    assert set(letters) == {"fails.raises", "fails.no_reward", "fails.exit", "fails.not_allowed",
                            "fails.command_not_allowed"}
    assert "agent_error" in letters["fails.raises"].reason
    assert "RuntimeError: the agent's own bug" in letters["fails.raises"].error
    assert "not a reward" in letters["fails.no_reward"].error
    assert "exited with 3" in letters["fails.exit"].error
    assert "the task asked this agent to fail" in letters["fails.exit"].error
    assert letters["fails.not_allowed"].reason == "bad_task" and "INTERACTOR_AGENTS" in letters["fails.not_allowed"].error
    assert "INTERACTOR_AGENT_COMMANDS" in letters["fails.command_not_allowed"].error
    # a failed attempt's calls are not a trajectory
    assert db_rows(settings.results_store, "SELECT count(*) FROM session_steps WHERE job_id = ?", (job_id,)) == [(0,)]


def test_an_agent_past_its_timeout_fails_as_agent_timeout_with_nothing_recorded(
        agent_settings, procs, model_server, redis_client, tmp_path):
    model, _ = model_server
    settings = agent_settings.replace(max_attempts=1, agent_timeout_s=3.0)  # from the function's call
    procs.settings = settings
    tasks = write_tasks(tmp_path, """\
        - env_name: fails.timeout
          agent: tests.agent_fakes:sleeps
        """)
    job_id, res = run_job(settings, procs, redis_client, tasks, 1)
    assert res["failed"] == 1
    (letter,) = DeadLetterQueue(redis_client, settings).list(job_id=job_id)
    assert "agent_timeout" in letter.reason and "--agent-timeout (3s)" in letter.error
    assert db_rows(settings.results_store, "SELECT count(*) FROM session_steps WHERE job_id = ?", (job_id,)) == [(0,)]


def test_calls_after_the_end_and_with_anothers_session_are_refused_and_never_recorded(
        agent_settings, procs, model_server, redis_client, tmp_path):
    model, _ = model_server
    marks = tmp_path / "marks"
    marks.mkdir()
    procs.settings = agent_settings
    tasks = write_tasks(tmp_path, f"""\
        - env_name: late
          agent: tests.agent_fakes:calls_after_its_end
          env_params: {{marks: "{marks}"}}
        - env_name: other
          agent: tests.agent_fakes:uses_anothers_key
          env_params: {{marks: "{marks}"}}
          env_num: 2
        - env_name: env
          agent_command: [PYTHON, -m, tests.agent_env_dump]
          env_params: {{marks: "{marks}"}}
        """.replace("PYTHON", PYTHON))
    job_id, res = run_job(agent_settings, procs, redis_client, tasks, 4)
    assert res["completed"] == 4
    wait_for(lambda: (marks / "late-status").exists(), 30, what="the late call's answer")
    assert (marks / "late-status").read_text() == "410"
    others = sorted(p.read_text() for p in marks.glob("other-*"))
    assert others == ["401", "401"]  # each agent's key on its group mate's session
    steps = steps_of(agent_settings.results_store, job_id)
    assert sorted(len(s) for s in steps.values()) == [1, 1, 1, 1]
    assert model.stats()["requests"] == 4  # the refused calls never reached the model
    # an agent process gets its session's key, never the worker's secrets
    seen = json.loads((marks / "env.json").read_text())
    assert seen["OPENAI_API_KEY"].startswith("ixs-") and seen["INTERACTOR_MODEL"] == "stand-in"
    assert "/sessions/" in seen["OPENAI_BASE_URL"] and seen["OPENAI_BASE_URL"].endswith("/v1")
    assert not [n for n in seen["names"] if n.startswith("INTERACTOR_") and n != "INTERACTOR_MODEL"]
    assert "REDIS_URL" not in seen["names"]
    assert "planted-agent-secret" not in (marks / "env.json").read_text()


def test_with_tokens_each_call_keeps_its_ids_and_the_episode_is_one_stream_where_calls_extend_each_other(
        agent_settings, procs, redis_client, tmp_path):
    from consumer.storage import open_store
    from consumer.streams import START_DRIFT, build

    settings = agent_settings.replace(tokens="vllm")
    procs.settings = settings
    tasks = write_tasks(tmp_path, """\
        - env_name: chat
          agent: tests.agent_fakes:chats_twice
        - env_name: tool
          agent: examples.agents.openai_client:solve
          dataset: calc.jsonl
        """)
    job_id, res = run_job(settings, procs, redis_client, tasks, 2)
    assert res["completed"] == 2
    store = open_store(settings.results_store)
    try:
        streams = {}
        for episode_id in steps_of(settings.results_store, job_id):
            rows = store.episode_tokens(episode_id)
            assert [r["step_id"] for r in rows] == [1, 2] and {r["token_status"] for r in rows} == {"ok"}
            streams[store.episode(episode_id)["env_name"]] = build(rows)
    finally:
        store.close()
    chat = streams["chat"]
    assert chat.single  # the second call's prompt extends the first call's prompt and answer
    (segment,) = chat.segments
    assert segment.steps == [1, 2] and sum(segment.mask) > 0 and segment.mask[0] == 0
    # the tool agent's first answer is a tool call, not text the template renders back: its
    # second call starts a segment of its own, and says why
    tool = streams["tool"]
    assert [s.starts_because for s in tool.segments] == ["first", START_DRIFT]


def test_agent_groups_reach_a_trainer_through_the_feed_with_their_calls_and_token_stream(model_server, tmp_path,
                                                                                          mark):  # noqa: F811
    from interactor.feed_client import Feed
    from tests.test_feed_serve import FeedServer, take_and_ack_all

    _, model_url = model_server
    tasks = write_tasks(tmp_path, """\
        - env_name: calc
          agent: tests.agent_fakes:chats_twice
          env_num: 2
        - env_name: tool
          agent: examples.agents.openai_client:solve
          dataset: calc.jsonl
          env_num: 2
        """)
    server = FeedServer(tmp_path, mark, model_url, tasks, "--epochs", "1", "--tokens=vllm",
                        extra_env={"INTERACTOR_AGENTS": AGENT_SETTINGS["agents"]})
    try:
        assert server.health()["job_id"], server.output()
        got = take_and_ack_all(Feed(server.url, trainer="grpo-0"), 2)
    finally:
        server.stop()
    by_env = {g["samples"][0]["steps"][0]["env_name"]: g for g in got}
    assert set(by_env) == {"calc", "tool"}
    for g in got:
        assert g["status"] == "ready" and [s["reward"] for s in g["samples"]] == [1.0, 1.0]
        for sample in g["samples"]:
            steps = sample["steps"]
            assert [s["step_id"] for s in steps] == [1, 2] and all(s["is_trainable"] for s in steps)
            assert all(s["token_status"] == "ok" and s["completion_ids"] for s in steps)
            stream = sample["stream"]
            ids = [i for seg in stream["segments"] for i in seg["ids"]]
            assert len(ids) == sum(len(seg["mask"]) for seg in stream["segments"])
            # the sampled tokens are the trainable ones: each call's completion, in order
            sampled = [i for seg in stream["segments"] for i, m in zip(seg["ids"], seg["mask"]) if m]
            assert sampled == [i for s in steps for i in s["completion_ids"]]
    assert by_env["calc"]["samples"][0]["stream"]["single"]
    assert [seg["starts_because"] for seg in by_env["tool"]["samples"][0]["stream"]["segments"]] == [
        "first", "token_drift"]


def test_a_worker_killed_mid_agent_ends_the_episode_once_with_a_fresh_attempt(agent_settings, procs, model_server,
                                                                              redis_client, tmp_path):
    model, _ = model_server
    marks = tmp_path / "marks"
    marks.mkdir()
    procs.settings = agent_settings
    tasks = write_tasks(tmp_path, f"""\
        - env_name: stalls
          agent: tests.agent_fakes:stalls_first_time
          env_params: {{marks: "{marks}"}}
        """)
    sub = submit(redis_client, agent_settings, [str(tasks)])
    procs.worker("w1")
    procs.consumer()
    wait_for(lambda: (marks / "started").exists(), 60, what="the agent's first run inside its call")
    procs.kill("w1")
    procs.worker("w2")
    res = wait_stored(agent_settings, sub.job.job_id, 1, 90)
    assert res["completed"] == 1
    db = agent_settings.results_store
    assert_trajectories_sound(db, sub.job.job_id)
    steps = steps_of(db, sub.job.job_id)
    (episode_steps,) = steps.values()
    # the second run's two calls; the first run's call is its own attempt's and not among them
    assert [json.loads(s[2])[0]["content"] for s in episode_steps] == ["What is 3 + 2?", "What is 10 + 10?"]
    attempts = db_rows(db, "SELECT attempt, status, reason FROM attempts WHERE episode_id = ? ORDER BY attempt",
                       (next(iter(steps)),))
    assert [a[1] for a in attempts][-1] == "completed" and len(attempts) == 2
    assert attempts[0][2] == "worker_lost"
    assert model.stats()["requests"] == 3
