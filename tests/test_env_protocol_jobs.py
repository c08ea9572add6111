"""OpenEnv and ORS environments as jobs, end to end: task files naming ``protocol:``, real
worker and consumer processes, the servers made from the packages (tests/protocol_servers.py)
and a model stand-in that plays their games, in text or with tool calls. A worker SIGKILLed
mid-run and servers restarted mid-run; preflight naming a server that speaks another protocol.
"""

from __future__ import annotations

import json
import sqlite3
import textwrap

import pytest
import requests

from broker.keys import env_instance_id
from broker.records import EpisodeSpec
from broker.states import EnvProtocol, ResumeNote
from interactor import preflight
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.protocol_servers import Policy, Uvicorn, openenv_template
from tests.storecheck import assert_trajectories_sound, db_rows

pytestmark = pytest.mark.integration
pytest.importorskip("openenv.core.env_server.http_server")
pytest.importorskip("openreward.environments")


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    server = Uvicorn("openenv_game:app", Uvicorn.tests_dir(), log=tmp_path_factory.mktemp("game") / "log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    folder = openenv_template(tmp_path_factory.mktemp("tmpl"))
    server = Uvicorn("server.app:app", folder, log=folder / "server.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ors(tmp_path_factory):
    server = Uvicorn("ors_game:app", Uvicorn.tests_dir(), log=tmp_path_factory.mktemp("ors") / "log").start()
    yield server
    server.stop()


def write_tasks(folder, entries: str) -> str:
    path = folder / "tasks.yaml"
    path.write_text("environments:\n" + textwrap.indent(textwrap.dedent(entries), "  "))
    return str(path)


def results(settings, job_id: str) -> dict:
    from consumer.storage import open_store

    store = open_store(settings.results_store)
    try:
        return store.results(job_id)["job"]
    finally:
        store.close()


def wait_stored(settings, job_id: str, total: int, timeout: float = 180) -> dict:
    def stored():
        res = results(settings, job_id)
        return res if res["completed"] + res["failed"] >= total else None

    return wait_for(stored, timeout, what=f"{total} episodes of {job_id} stored")


def episode_rewards(db: str, job_id: str) -> dict[str, float]:
    return dict(db_rows(db, "SELECT session_id, reward FROM session_steps WHERE job_id = ? AND is_session_completed",
                        (job_id,)))


def steps_stored(db: str, job_id: str) -> int:
    import os

    if not os.path.exists(db):  # the consumer has not made it yet
        return 0
    try:
        return db_rows(db, "SELECT COUNT(*) FROM session_steps WHERE job_id = ?", (job_id,))[0][0]
    except sqlite3.OperationalError:  # made, its tables not yet
        return 0


def test_openenv_and_ors_environments_run_as_jobs_without_adapter_code(settings, procs, redis_client, game, template,
                                                                      ors, tmp_path):
    policy = Policy()
    settings = settings.replace(llm_base_url=policy.url, max_steps=8, message_cut=0, concurrency=6)
    procs.settings = settings
    tasks = write_tasks(tmp_path, f"""\
        - env_name: guess
          protocol: openenv
          base_url: {game.url}
          dataset: [{{target: 37}}, {{target: 5}}]
          env_num: 2
        - env_name: tmpl_env             # the openenv init template, as generated: one session at a time
          protocol: openenv
          base_url: {template.url}
          env_num: 3
        - env_name: guessing
          protocol: ors
          base_url: {ors.url}
          split: train                   # the tasks: POST /guessing/tasks of the server
          env_num: 2
        """)
    sub = submit(redis_client, settings, [tasks])
    assert sub.job.episodes == 4 + 3 + 6
    procs.worker("w1")
    procs.consumer()
    res = wait_stored(settings, sub.job.job_id, 13)
    assert res["completed"] == 13, procs.log("w1")[-4000:]
    db = settings.results_store
    assert_trajectories_sound(db, sub.job.job_id)
    rewards = episode_rewards(db, sub.job.job_id)
    by_entry: dict[str, list[float]] = {}
    for episode, reward in rewards.items():
        by_entry.setdefault(episode.split(".")[2], []).append(reward)
    assert by_entry["1"] == [1.0] * 4  # every game won, by the binary search
    assert by_entry["2"] == pytest.approx([4.0] * 3)  # 8 steps of "hello": 0.5 each
    assert by_entry["3"] == [1.0] * 6  # every ORS game won through tool calls
    # An ORS step keeps the tools offered and the calls made, beside its text (as agent steps do)
    ors_steps = db_rows(db, "SELECT messages, response, env_state FROM session_steps WHERE job_id = ? AND "
                            "env_name = 'guessing' ORDER BY session_id, step_id", (sub.job.job_id,))
    first_messages, response, env_state = ors_steps[0]
    assert json.loads(first_messages) == [{"role": "user",
                                           "content": "Guess the number between 1 and 50 with the guess tool."}]
    assert response == "" and "tool_calls" in (env_state or "")
    later = json.loads(ors_steps[1][0])
    assert later[1]["tool_calls"][0]["function"]["name"] == "guess" and later[2]["role"] == "tool"
    # the model was offered the env's tool in OpenAI's shape; text envs offered none
    offered = [r.get("tools") for r in policy.requests]
    assert any(t and t[0]["function"]["name"] == "guess" for t in offered) and None in offered


def test_a_worker_killed_mid_run_costs_a_fresh_start_with_its_reason(settings, procs, redis_client, game, ors,
                                                                     tmp_path):
    policy = Policy(latency_s=0.4)
    settings = settings.replace(llm_base_url=policy.url, max_steps=8, message_cut=0, concurrency=8)
    procs.settings = settings
    tasks = write_tasks(tmp_path, f"""\
        - env_name: guess
          protocol: openenv
          base_url: {game.url}
          dataset: [{{target: 37}}, {{target: 11}}]
          env_num: 2
        - env_name: guessing
          protocol: ors
          base_url: {ors.url}
          dataset: [{{target: 42}}, {{target: 9}}]
          env_num: 2
        """)
    sub = submit(redis_client, settings, [tasks])
    procs.worker("w1")
    procs.consumer()
    wait_for(lambda: steps_stored(settings.results_store, sub.job.job_id) >= 6, 120, what="steps of w1")
    procs.kill("w1")
    procs.worker("w2")
    res = wait_stored(settings, sub.job.job_id, 8, timeout=240)
    assert res["completed"] == 8, procs.log("w2")[-4000:]
    db = settings.results_store
    assert_trajectories_sound(db, sub.job.job_id)
    assert set(episode_rewards(db, sub.job.job_id).values()) == {1.0}
    # the killed attempts were followed by fresh ones that say why: neither protocol's session
    # can be continued by another worker
    notes = db_rows(db, "SELECT r.resume_note FROM attempt_resumes r JOIN attempts a ON a.episode_id = r.episode_id "
                        "AND a.attempt_id = r.attempt_id WHERE r.job_id = ? AND a.attempt > 1", (sub.job.job_id,))
    assert notes and all(note == ResumeNote.NOT_RESUMABLE for (note,) in notes), notes
    # the ORS sessions of the killed attempts were deleted (closed once, by their successors)
    killed = db_rows(db, "SELECT a.episode_id, a.attempt, a.attempt_id FROM attempts a JOIN episodes e ON "
                         "e.episode_id = a.episode_id WHERE a.job_id = ? AND e.env_name = 'guessing' AND "
                         "a.status != 'completed'", (sub.job.job_id,))
    assert killed, "no ORS attempt was cut off by the kill"
    for episode, number, attempt_id in killed:
        sid = env_instance_id(episode, number, attempt_id)
        assert requests.post(f"{ors.url}/ping", headers={"X-Session-ID": sid}, timeout=5).status_code == 404


def test_servers_restarted_mid_run_are_waited_for_and_their_episodes_rerun(settings, procs, redis_client, game, ors,
                                                                           tmp_path):
    policy = Policy(latency_s=0.3)
    settings = settings.replace(llm_base_url=policy.url, max_steps=8, message_cut=0, concurrency=8,
                                outage_budget_s=60)
    procs.settings = settings
    tasks = write_tasks(tmp_path, f"""\
        - env_name: guess
          protocol: openenv
          base_url: {game.url}
          dataset: [{{target: 37}}, {{target: 11}}]
          env_num: 2
        - env_name: guessing
          protocol: ors
          base_url: {ors.url}
          dataset: [{{target: 42}}, {{target: 9}}]
          env_num: 2
        """)
    sub = submit(redis_client, settings, [tasks])
    procs.worker("w1")
    procs.consumer()
    wait_for(lambda: steps_stored(settings.results_store, sub.job.job_id) >= 6, 120, what="steps before the restart")
    game.restart()
    ors.restart()
    res = wait_stored(settings, sub.job.job_id, 8, timeout=240)
    assert res["completed"] == 8, procs.log("w1")[-4000:]
    assert_trajectories_sound(settings.results_store, sub.job.job_id)
    assert set(episode_rewards(settings.results_store, sub.job.job_id).values()) == {1.0}


def test_preflight_names_a_server_that_speaks_another_protocol(settings, game, ors):
    def spec(url, protocol, env_name):
        return EpisodeSpec(job_id="j", episode_id="e", group_id="g", group_size=1, env_name=env_name, base_url=url,
                           env_params={}, protocol=protocol)

    policy = Policy()
    settings = settings.replace(llm_base_url=policy.url)
    assert preflight.check(settings, [spec(game.url, EnvProtocol.OPENENV, "guess"),
                                      spec(ors.url, EnvProtocol.ORS, "guessing")]) == []
    wrong = preflight.check(settings, [spec(ors.url, EnvProtocol.OPENENV, "guessing"),
                                       spec(game.url, EnvProtocol.ORS, "guess"),
                                       spec(ors.url, EnvProtocol.ORS, "nosuch")])
    text = sorted(str(p) for p in wrong)
    assert len(text) == 3, text
    assert any("does not speak protocol openenv: GET /metadata answers HTTP 404" in t for t in text)
    assert any("does not speak protocol ors: GET /list_environments answers HTTP 404" in t for t in text)
    assert any("does not serve env_name 'nosuch'" in t and "guessing" in t for t in text)
