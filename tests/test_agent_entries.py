"""Task-file entries of agent episodes (producer/agent_entries.py): what is accepted, planned into
episode specs, and refused with the file, entry and field named; the workers' allow-lists for
agents (workers/allowlist.py); entries of env-driven episodes (``env_calls_model: true``) and what they cannot go with."""

from __future__ import annotations

import textwrap

import pytest

from broker.records import EpisodeSpec, JobSpec, unpack
from broker.settings import Settings
from producer.planning import plan_job
from producer.taskfile import TaskFileError
from workers.allowlist import TrustBoundary


def plan(tmp_path, entries: str):
    path = tmp_path / "agents.yaml"
    path.write_text("environments:\n" + textwrap.indent(textwrap.dedent(entries), "  "))
    return plan_job([str(path)], job_id="j1", default_base_url="http://envs:8080")


def test_agent_entries_become_agent_episode_specs(tmp_path):
    planned = plan(tmp_path, """\
        - env_name: calc
          agent: mypkg.agents:solve
          dataset: [{question: "What is 1 + 1?", answer: 2}]
          env_num: 2
        - env_name: cli
          agent_command: [python3, -m, mypkg.cli_agent, --fast]
          env_params: {level: 3}
        """)
    a, b, c = planned.episodes
    assert (a.transport, a.agent, a.agent_command, a.base_url, a.group_size) == ("agent", "mypkg.agents:solve", [], "", 2)
    assert a.env_params["dataset"] == {"question": "What is 1 + 1?", "answer": 2}
    assert (c.agent, c.agent_command, c.env_params["level"]) == ("", ["python3", "-m", "mypkg.cli_agent", "--fast"], 3)
    again = unpack(c.pack())  # through the ledger and back
    assert again.agent_command == c.agent_command and not again.env_calls_model
    # a spec written before agent episodes reads as an env episode
    old = {k: v for k, v in a.to_dict().items() if k not in ("agent", "agent_command", "env_calls_model")}
    assert EpisodeSpec.from_dict(old).agent == ""


@pytest.mark.parametrize("entry, field, says", [
    ("agent: a:b\n  agent_command: [x]", "agent_command", "not both"),
    ("agent: a:b\n  base_url: http://envs:1", "base_url", "not used by an agent episode"),
    ("agent: a:b\n  env_class: m:C", "env_class", "not used by an agent episode"),
    ("agent: not-a-path", "agent", "module:function"),
    ("agent: os.path:join.x", "agent", "module:function"),
    ("agent_command: python3 agent.py", "agent_command", "list of non-empty strings"),
    ("agent_command: []", "agent_command", "list of non-empty strings"),
    ("agent_command: [python3, '']", "agent_command", "list of non-empty strings"),
    ("base_url: http://envs:1\n  env_calls_model: 1", "env_calls_model", "true or false"),
    ("agent: a:b\n  env_calls_model: true", "env_calls_model", "cannot go with agent"),
    ("agent_command: [python3, a.py]\n  env_calls_model: true", "env_calls_model", "cannot go with agent_command"),
    ("transport: inproc\n  env_class: m:C\n  env_calls_model: true", "env_calls_model", "transport: inproc"),
    ("env_class: m:C\n  env_calls_model: true", "env_calls_model", "transport: inproc"),
    ("base_url: http://envs:1\n  protocol: openenv\n  env_calls_model: true", "env_calls_model",
     "protocol: openenv"),
    ("base_url: http://envs:1\n  protocol: ors\n  env_calls_model: true", "env_calls_model", "protocol: ors"),
])
def test_bad_agent_entries_are_refused_naming_entry_and_field(tmp_path, entry, field, says):
    with pytest.raises(TaskFileError) as refused:
        plan(tmp_path, f"- env_name: calc\n  {entry}\n")
    text = str(refused.value)
    assert "entry 1 (calc" in text and f"field {field!r}" in text and says in text, text


def test_env_calls_model_entries_become_env_driven_specs_with_their_env_server(tmp_path):
    planned = plan(tmp_path, """\
        - env_name: verifiers.math
          base_url: http://envs:9000
          env_calls_model: true
          dataset: [{question: "What is 1 + 1?"}]
          env_num: 2
        - env_name: default.server
          env_calls_model: true
        - env_name: plain
          env_calls_model: false
        """)
    a, b, c, d = planned.episodes
    assert (a.transport, a.base_url, a.env_calls_model, a.agent, a.agent_command, a.protocol) == (
        "http", "http://envs:9000", True, "", [], "")
    assert (c.base_url, c.env_calls_model) == ("http://envs:8080", True)  # --env-base-url's, as any entry's
    assert not d.env_calls_model
    again = unpack(a.pack())  # through the ledger and back
    assert again.env_calls_model and again.env_params["dataset"] == {"question": "What is 1 + 1?"}
    # nothing of the gateway is in the task: the worker adds it to the reset body, at reset time
    assert b"llm" not in a.pack() and b"api_key" not in a.pack()


def test_a_worker_refuses_an_env_driven_spec_the_submit_would_have_refused():
    from workers.env_driven import unsupported

    base = dict(job_id="j", episode_id="j.1.1.1.1", group_id="j.1.1.1", group_size=1, env_name="calc",
                env_params={}, env_calls_model=True)
    assert unsupported(EpisodeSpec(base_url="http://envs:1", **base)) == ""
    assert "agent" in unsupported(EpisodeSpec(base_url="", transport="agent", agent="m:f", **base))
    assert "protocol 'openenv'" in unsupported(EpisodeSpec(base_url="http://envs:1", protocol="openenv", **base))
    assert "over http" in unsupported(EpisodeSpec(base_url="", transport="inproc", env_class="m:C", **base))


def spec(**kw) -> EpisodeSpec:
    return EpisodeSpec(job_id="j", episode_id="j.1.1.1.1", group_id="j.1.1.1", group_size=1, env_name="calc",
                       base_url="", env_params={}, transport="agent", **kw)


JOB = JobSpec(job_id="j", llm_base_url="http://127.0.0.1:8000/v1", model="m")


def test_workers_run_only_the_agents_their_lists_allow():
    none = TrustBoundary(Settings.from_env({}))
    assert "INTERACTOR_AGENTS" in none.refused(JOB, spec(agent="mypkg.agents:solve"))
    assert "INTERACTOR_AGENT_COMMANDS" in none.refused(JOB, spec(agent_command=["python3", "a.py"]))
    some = TrustBoundary(Settings.from_env({}, agents="mypkg.agents:*,other:solve",
                                           agent_commands="python3 agents/a.py, /usr/bin/agent"))
    assert some.refused(JOB, spec(agent="mypkg.agents:solve")) == ""
    assert some.refused(JOB, spec(agent="other:solve")) == ""
    assert "not on this worker's allow-list" in some.refused(JOB, spec(agent="other:main"))
    assert some.refused(JOB, spec(agent_command=["python3", "agents/a.py", "--x"])) == ""
    assert some.refused(JOB, spec(agent_command=["/usr/bin/agent"])) == ""
    assert "allow-list" in some.refused(JOB, spec(agent_command=["python3", "agents/b.py"]))
    assert "allow-list" in some.refused(JOB, spec(agent_command=["python3"]))  # a prefix of an entry is not one
    assert "non-empty list" in some.refused(JOB, spec(agent_command=["python3", 3]))


def test_preflight_refuses_agents_the_workers_would_not_run_naming_the_setting():
    from interactor.preflight import agents

    episodes = [spec(agent="mypkg.agents:solve"), spec(agent="mypkg.agents:solve"),
                spec(agent_command=["python3", "agents/a.py", "--x"])]
    problems = [str(p) for p in agents(Settings.from_env({}), episodes)]
    assert len(problems) == 2
    assert problems[0].startswith("agent mypkg.agents:solve: not on the workers' allow-list (INTERACTOR_AGENTS")
    assert "INTERACTOR_AGENTS=mypkg.agents:solve" in problems[0]
    assert "INTERACTOR_AGENT_COMMANDS='python3 agents/a.py --x'" in problems[1]
    allowed = Settings.from_env({}, agents="mypkg.agents:*", agent_commands="python3 agents/a.py")
    assert agents(allowed, episodes) == []
