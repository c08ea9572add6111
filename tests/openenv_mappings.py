"""Mappings a task entry can name for an OpenEnv environment (tests/test_env_protocols.py):
the template ``openenv init`` writes, prompted with a system message of our own, its action
marked as mapped."""

from __future__ import annotations


def with_rules(observation: dict, conversation: list[dict]) -> list[dict]:
    rules = {"role": "system", "content": "Answer with one word."}
    return [rules, *conversation[1:], {"role": "user", "content": observation["echoed_message"]}]


def marked(text: str, tool_calls: list | None, action_schema: dict) -> dict:
    return {"message": f"mapped: {text}"}
