"""Task-file entries of agent episodes (docs/protocol.md#agent-episodes), for producer/taskfile.py.

An entry may name an agent that owns its loop instead of an env server: ``agent:
module:function`` (allowed by the workers' ``INTERACTOR_AGENTS``) or ``agent_command: [argv...]``
(``INTERACTOR_AGENT_COMMANDS``); the worker runs it against its model gateway and records each of
its model calls as a step (workers/agent_episode.py)::

      - env_name: calculator
        agent: examples.agents.openai_client:solve
        dataset: examples/agents/calculator.jsonl
        env_num: 4

Such an entry has no env server: ``base_url``, ``transport`` and ``env_class`` are errors. Only
the shapes are checked here; whether the agent imports or runs is for the worker to find out.

An entry may instead keep its env server and let the env own the loop: ``env_calls_model: true``
(an env-driven episode, workers/env_driven.py; docs/protocol.md#env-driven-episodes). The worker
then hands the env the gateway in its reset body (``"llm": {"base_url", "api_key", "model"}``),
sends empty actions until the env ends the episode, and records each model call the env made
through the gateway as a step::

      - env_name: verifiers.math
        base_url: http://envs:8080
        env_calls_model: true
        dataset: math.jsonl

Only an env server of the original protocol over http can be handed the gateway: with
``agent``/``agent_command`` (the agent calls the model, not an env), ``transport: inproc`` /
``env_class`` (no reset body crosses a wire) or ``protocol: openenv|ors`` (their resets have no
place for it) it is refused, naming ``env_calls_model`` and the key it conflicts with.
"""

from __future__ import annotations

from typing import Callable

from envs.base import valid_object_path

AGENT_KEYS = ("agent", "agent_command", "env_calls_model")
AGENT_TRANSPORT = "agent"  # an agent episode's: no env server, its agent runs in the worker


def entry_agent(raw: dict, fail: Callable[..., Exception]) -> tuple[str, list[str]]:
    """The entry's agent (``module:function``) or agent command (argv), or ("", [])."""
    agent, command = raw.get("agent"), raw.get("agent_command")
    if agent is None and command is None:
        return "", []
    if agent is not None and command is not None:
        raise fail("agent_command", "an entry names one agent: agent (module:function) or agent_command, not both")
    for key in ("base_url", "transport", "env_class"):
        if raw.get(key) is not None:
            raise fail(key, "not used by an agent episode (its agent calls the model itself, through the gateway); "
                            "remove it")
    if agent is not None:
        if not valid_object_path(agent):
            raise fail("agent", f"must be 'module:function' (e.g. 'mypkg.agents:solve'), got {agent!r}")
        return agent, []
    if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
        raise fail("agent_command", f"must be a non-empty list of non-empty strings (an argv), got {command!r}")
    return "", list(command)


def entry_env_calls_model(raw: dict, fail: Callable[..., Exception]) -> bool:
    """``env_calls_model``: true for an env-driven episode's entry, checked against the keys it
    cannot go with (see the module docstring)."""
    value = raw.get("env_calls_model")
    if value is None or value is False:
        return False
    if not isinstance(value, bool):
        raise fail("env_calls_model", f"must be true or false, got {value!r}")
    for key in ("agent", "agent_command"):
        if raw.get(key) is not None:
            raise fail("env_calls_model", f"cannot go with {key}: an agent calls the model itself, through the "
                                          "gateway; env_calls_model hands the gateway to an env server (base_url) "
                                          f"that owns the loop. Keep one: {key} or env_calls_model")
    if raw.get("transport") == "inproc" or raw.get("env_class") is not None:
        raise fail("env_calls_model", "cannot go with transport: inproc (env_class): the gateway is handed to an "
                                      "env server in its reset body over http; give the entry a base_url")
    protocol = raw.get("protocol")
    if protocol not in (None, ""):
        raise fail("env_calls_model", f"cannot go with protocol: {protocol}: only an env server of the original "
                                      "protocol (reset/step over http) is handed the gateway in its reset body")
    return True
