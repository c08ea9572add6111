"""Env-driven episodes end to end (workers/env_driven.py, ``env_calls_model: true``): a real env
server on loopback, written here, reads the gateway from its reset body and calls the model
stand-in through it (plain ``requests``) while real worker processes step it with empty actions;
the consumer stores each of the env's calls as a step. Envs that call nothing, fail, refuse, and
run past --agent-timeout."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
import requests

from broker.dlq import DeadLetterQueue
from envs.http import JSONHandler, QuietHTTPServer
from producer.enqueue import submit
from producer.taskfile import TaskFileError
from tests.conftest import wait_for
from tests.storecheck import assert_trajectories_sound, db_rows, store_text
from tests.test_agents import steps_of, wait_stored, write_tasks

pytestmark = pytest.mark.integration

REAL_KEY = "sk-test-planted-env-driven-secret-7"


def ask(llm: dict, question: str) -> str:
    """One model call through the gateway the reset body named, as an env that owns its loop makes it."""
    reply = requests.post(f"{llm['base_url']}/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {llm['api_key']}"},
                          json={"model": llm["model"], "messages": [{"role": "user", "content": question}]})
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"] or ""


def score(answers: list[str], expected: list[str]) -> float:
    """The driven env's reward: the share of its answers that hold the right number."""
    return sum(e in a for a, e in zip(answers, expected)) / len(expected)


class DrivingEnvs(QuietHTTPServer):
    """Env servers that own their loop, one kind per env_name's first part:

    * ``driven``: in its first step, two calls; answers terminated with the share of right
      answers as reward (and, carelessly, the key in its ``info``);
    * ``steps``: a call in reset, one in step 1 (reward 0.25), none in step 2 (0.5, truncated);
    * ``silent``: answers its first step terminated without calling the model;
    * ``broken``: one call, then 500 with an error text that echoes its reset body (the key);
    * ``refuses``: 400 on reset;
    * ``slow``: one call, then holds its first step's answer for a minute."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _EnvHandler)
        self.lock = threading.Lock()
        self.resets: dict[str, dict] = {}  # instance -> its reset body
        self.steps: Counter = Counter()
        self.closed: list[str] = []
        self.stopping = threading.Event()

    def shutdown(self) -> None:
        self.stopping.set()
        super().shutdown()


class _EnvHandler(JSONHandler):
    server: DrivingEnvs

    def dispatch(self, method: str) -> None:
        srv = self.server
        body = self.read_body() if method in ("POST", "DELETE") else b""
        parts = self.split_path()
        if parts == ["envs"]:
            return self.send_json(200, ["driven", "steps", "silent", "broken", "refuses", "slow"])
        if len(parts) == 2 and method == "DELETE":
            with srv.lock:
                srv.closed.append(parts[1])
            return self.send_json(200, {"status": "ok"})
        if len(parts) != 3 or method != "POST":
            return self.send_json(404, {"error": f"no route for {method} {self.path}"})
        name, instance, op = parts
        kind = name.split(".")[0]
        payload = json.loads(body or b"{}")
        if op == "reset":
            if kind == "refuses":
                return self.send_json(400, {"error": "no such task here"})
            with srv.lock:
                srv.resets[instance] = payload
            if kind == "steps":
                ask(payload["llm"], "What is 6 + 1?")
            return self.send_json(200, {"observation": {}, "info": {}})
        with srv.lock:
            srv.steps[instance] += 1
            n, llm = srv.steps[instance], srv.resets[instance]["llm"]
        assert payload == {"action": ""}, payload
        return self.send_json(*self.step(kind, n, llm))

    def step(self, kind: str, n: int, llm: dict) -> tuple[int, dict]:
        def answer(reward: float, *, terminated: bool = False, truncated: bool = False, info=None) -> tuple[int, dict]:
            return 200, {"observation": {}, "reward": reward, "terminated": terminated, "truncated": truncated,
                         "info": info or {}}

        if kind == "driven":
            answers = [ask(llm, "What is 2 + 3?"), ask(llm, "What is 4 + 4?")]
            return answer(score(answers, ["5", "8"]), terminated=True, info={"answers": answers, "echo": llm})
        if kind == "steps":
            if n == 1:
                ask(llm, "What is 7 + 1?")
                return answer(0.25)
            return answer(0.5, truncated=True)
        if kind == "silent":
            return answer(1.0, terminated=True)
        if kind == "broken":
            ask(llm, "What is 1 + 1?")
            return 500, {"error": f"internal error: RuntimeError: could not use {json.dumps(llm)}"}
        if kind == "slow":
            ask(llm, "What is 1 + 1?")
            self.server.stopping.wait(60)
            return answer(1.0, terminated=True)
        return 400, {"error": f"unknown kind {kind}"}


@pytest.fixture
def driving_envs():
    server, url = DrivingEnvs().serve_in_thread("driving-envs")
    yield server, url
    server.shutdown()


@pytest.fixture
def driven_settings(settings, model_server):
    _, model_url = model_server
    return settings.replace(llm_base_url=model_url + "/v1", llm_api_key=REAL_KEY)


def run_job(settings, procs, redis_client, tasks: str, total: int) -> tuple[str, dict]:
    sub = submit(redis_client, settings, [tasks])
    assert sub.job.episodes == total
    procs.worker("w1")
    procs.consumer()
    return sub.job.job_id, wait_stored(settings, sub.job.job_id, total, 120)


def test_an_env_that_owns_its_loop_has_each_of_its_model_calls_stored_once_in_order_with_its_reward(
        driven_settings, procs, model_server, driving_envs, redis_client, tmp_path):
    model, _ = model_server
    envs, env_url = driving_envs
    procs.settings = driven_settings
    tasks = write_tasks(tmp_path, f"""\
        - env_name: driven
          base_url: {env_url}
          env_calls_model: true
          env_num: 2
        - env_name: steps
          base_url: {env_url}
          env_calls_model: true
        """)
    job_id, res = run_job(driven_settings, procs, redis_client, tasks, 3)
    db = driven_settings.results_store
    assert res["completed"] == 3, procs.log("w1")[-4000:]
    assert_trajectories_sound(db, job_id)
    episodes = steps_of(db, job_id)
    assert len(episodes) == 3
    names = dict(db_rows(db, "SELECT episode_id, env_name FROM episodes WHERE job_id = ?", (job_id,)))
    totals = dict(db_rows(db, "SELECT episode_id, total_reward FROM episodes WHERE job_id = ?", (job_id,)))
    for episode_id, steps in episodes.items():
        questions = [json.loads(s[2])[-1]["content"] for s in steps]
        if names[episode_id] == "driven":
            # both calls of the env's step, once each, in the order they were answered
            assert [s[1] for s in steps] == [1, 2] and questions == ["What is 2 + 3?", "What is 4 + 4?"]
            reward = score([s[3] for s in steps], ["5", "8"])  # what the env computed from those answers
            assert (steps[0][5], steps[0][7]) == (0.0, 0)
            assert (steps[1][5], steps[1][6], steps[1][7]) == (pytest.approx(reward), pytest.approx(reward), 1)
        else:
            # a call in reset and one in step 1; step 2's reward (no call) sums onto the last call
            assert questions == ["What is 6 + 1?", "What is 7 + 1?"]
            reward = 0.75
            assert (steps[1][5], steps[1][7]) == (pytest.approx(0.75), 1)
        assert totals[episode_id] == pytest.approx(reward)
    ended = dict(db_rows(db, "SELECT episode_id, ended_by FROM attempts WHERE job_id = ? AND status = 'completed'",
                         (job_id,)))
    assert sorted(ended.values()) == ["terminated", "terminated", "truncated"]
    # every call the completing attempts' envs made is stored, once
    attempts = db_rows(db, "SELECT COUNT(*) FROM attempts WHERE job_id = ?", (job_id,))[0][0]
    assert sum(len(s) for s in episodes.values()) == 6
    assert model.stats()["requests"] == 6 if attempts == 3 else model.stats()["requests"] > 6
    # each instance was reset with the gateway, stepped with empty actions and closed
    assert set(envs.resets) <= set(envs.closed)
    keys = []
    for instance, body in envs.resets.items():
        llm = body["llm"]
        assert set(body) == {"env_param", "seed", "llm"} and body["env_param"] == {"dataset": {}}
        assert llm["api_key"].startswith("ixs-") and llm["api_key"] != REAL_KEY and llm["model"] == "stand-in"
        assert llm["base_url"].endswith("/v1") and f"/sessions/{instance.split('~')[0]}/v1" in llm["base_url"]
        keys.append(llm["api_key"])
        # the episode has ended: its key is refused, and nothing more reaches the model
        late = requests.post(f"{llm['base_url']}/chat/completions", timeout=10,
                             headers={"Authorization": f"Bearer {llm['api_key']}"},
                             json={"model": "x", "messages": [{"role": "user", "content": "What is 9 + 9?"}]})
        assert late.status_code == 410, late.text
    assert len(set(keys)) == len(keys) == attempts
    assert model.stats()["requests"] == 6 if attempts == 3 else model.stats()["requests"] > 6
    # neither the session keys nor the model's key are in any record, Redis or a log
    stored, logs = store_text(db), procs.log("w1") + procs.log("consumer")
    for secret in keys + [REAL_KEY]:
        assert secret not in stored and secret not in logs
        for key in redis_client.scan_iter(f"{driven_settings.key_prefix}:*"):
            assert secret.encode() not in (redis_client.dump(key) or b"")  # None: gone since the scan


def test_envs_that_call_nothing_fail_refuse_or_run_past_the_agent_timeout_fail_their_attempts(
        driven_settings, procs, driving_envs, redis_client, tmp_path):
    envs, env_url = driving_envs
    settings = driven_settings.replace(max_attempts=1, agent_timeout_s=8.0)
    procs.settings = settings
    tasks = write_tasks(tmp_path, "".join(f"- env_name: {kind}\n  base_url: {env_url}\n  env_calls_model: true\n"
                                          for kind in ("silent", "broken", "refuses", "slow")))
    job_id, res = run_job(settings, procs, redis_client, tasks, 4)
    assert res["failed"] == 4, procs.log("w1")[-4000:]
    letters = {d.env_name: d for d in DeadLetterQueue(redis_client, settings).list(job_id=job_id)}
    assert letters["silent"].reason == "agent_error"
    assert "without calling the model through the gateway" in letters["silent"].error
    assert letters["broken"].reason == "env_server_error" and "HTTP 500" in letters["broken"].error
    assert letters["refuses"].reason == "env_bad_request" and "no such task here" in letters["refuses"].error
    assert letters["slow"].reason == "agent_timeout" and "--agent-timeout (8s)" in letters["slow"].error
    # the broken env echoed its reset body in its error: the key is starred out of the letter
    key = next(body["llm"]["api_key"] for instance, body in envs.resets.items()
               if instance.split("~")[0] == letters["broken"].episode_id)
    assert key not in letters["broken"].error and "***" in letters["broken"].error
    assert key not in procs.log("w1")
    # a failed attempt's calls are not a trajectory; every instance reset was closed
    assert db_rows(settings.results_store, "SELECT count(*) FROM session_steps WHERE job_id = ?", (job_id,)) == [(0,)]
    wait_for(lambda: set(envs.resets) <= set(envs.closed), 15, what="every instance closed")


@pytest.mark.parametrize("entry, conflict", [
    ("agent: examples.agents.openai_client:solve", "cannot go with agent"),
    ("base_url: http://127.0.0.1:9\n  protocol: openenv", "cannot go with protocol: openenv"),
])
def test_an_env_driven_entry_the_worker_cannot_run_is_refused_at_submit_naming_the_key(
        settings, redis_client, tmp_path, entry, conflict):
    tasks = write_tasks(tmp_path, f"- env_name: calc\n  {entry}\n  env_calls_model: true\n")
    with pytest.raises(TaskFileError) as refused:
        submit(redis_client, settings, [tasks])
    assert "field 'env_calls_model'" in str(refused.value) and conflict in str(refused.value)
    assert not list(redis_client.scan_iter(f"{settings.key_prefix}:*"))  # nothing was enqueued


def test_the_session_key_is_starred_out_of_the_info_an_env_echoes_it_in():
    from workers.env_driven import _scrubbed

    key = "ixs-abc_DEF-123"
    info = {"echo": {"api_key": key, "base_url": "http://h/sessions/e/v1"}, "n": 2, "note": f"used {key}"}
    assert _scrubbed(info, key) == {"echo": {"api_key": "***", "base_url": "http://h/sessions/e/v1"}, "n": 2,
                                    "note": "used ***"}
    assert _scrubbed({"n": 1}, key) == {"n": 1} and _scrubbed(None, key) is None
