"""The env port (what the step loop, workers/loop.py, drives) and what crosses it: the answer
types and the checks of decoded answers, shared by both env transports (the HTTP client,
workers/envclient.py, and the in-process one, workers/inproc.py), so that a malformed answer
fails with the same reason either way, and the budget a ``close`` gets in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from broker.errors import ENV_MALFORMED, EpisodeError

CLOSE_BUDGET_S = 10.0  # close's own overall budget
CLOSE_MIN_BUDGET_S = 2.0  # close still gets this long when the episode's deadline has passed


class EnvPort(Protocol):
    """One environment instance, already bound to its base_url, env_name and env_id."""

    def reset(self) -> Any: ...
    def get_task_prompt(self) -> Any: ...
    # -> object with reward, terminated, truncated, info; ``tool_calls`` (the model's, when the
    # prompt offered tools and it called some) is passed only when there are any
    def step(self, action: str, **tool_calls: Any) -> Any: ...
    def close(self) -> None: ...


@dataclass
class StepResult:
    reward: float
    terminated: bool
    truncated: bool
    info: dict | None


def _bool_like(value: Any) -> bool | None:
    """True/False for bool, 0/1, "true"/"false" (and null/absent -> False); None if not bool-like."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "0", "1"):
        return value.strip().lower() in ("true", "1")
    return None


# Validation of decoded answers, shared by the HTTP client and the inproc transport
# (workers/inproc.py), so that a malformed answer fails with the same reason either way.


def check_reset_answer(obj: Any, what: str) -> dict:
    if not isinstance(obj, dict):
        raise EpisodeError(ENV_MALFORMED, f"{what}: answer is a JSON {type(obj).__name__}, not an object")
    return obj


def prompt_parts(prompt: Any) -> tuple[Any, list | None]:
    """The messages of a prompt answer and the tools it offers the model (None: none). A prompt
    is a list of messages, or ``{"messages": [...], "tools": [...]}`` when the env offers tools
    (docs/protocol.md#tools)."""
    if isinstance(prompt, dict):
        return prompt.get("messages") or [], prompt.get("tools") or None
    return prompt, None


def check_prompt_answer(obj: Any, what: str) -> list | dict:
    """A prompt answer checked: a list of messages, or an object of ``messages`` and the
    ``tools`` (a list of objects: OpenAI function schemas) the env offers the model."""
    if isinstance(obj, dict) and "tools" in obj:
        tools = obj["tools"]
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise EpisodeError(ENV_MALFORMED, f"{what}: 'tools' is not a list of objects")
        check_prompt_answer(obj.get("messages"), what)
        return {"messages": obj["messages"], "tools": tools} if tools else obj["messages"]
    if not isinstance(obj, list):
        raise EpisodeError(ENV_MALFORMED, f"{what}: answer is a JSON {type(obj).__name__}, not a list of messages")
    for i, msg in enumerate(obj):
        if not isinstance(msg, dict):
            raise EpisodeError(ENV_MALFORMED, f"{what}: message {i} is a {type(msg).__name__}, not an object")
        if not isinstance(msg.get("role"), str) or "content" not in msg:
            raise EpisodeError(ENV_MALFORMED, f"{what}: message {i} lacks a string 'role' or a 'content'")
        if not isinstance(msg["content"], (str, list, type(None))):
            raise EpisodeError(
                ENV_MALFORMED, f"{what}: message {i} content is a {type(msg['content']).__name__}, not a string or list"
            )
    return obj


def check_step_answer(obj: Any, what: str) -> StepResult:
    if not isinstance(obj, dict):
        raise EpisodeError(ENV_MALFORMED, f"{what}: answer is a JSON {type(obj).__name__}, not an object")
    reward = obj.get("reward")
    if reward is None:
        reward = 0.0
    elif isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EpisodeError(ENV_MALFORMED, f"{what}: reward is not a finite number or null ({type(reward).__name__})")
    flags = {}
    for name in ("terminated", "truncated"):
        flag = _bool_like(obj.get(name))
        if flag is None:
            raise EpisodeError(ENV_MALFORMED, f"{what}: {name} is not a boolean ({type(obj.get(name)).__name__})")
        flags[name] = flag
    info = obj.get("info")
    return StepResult(
        reward=float(reward),
        terminated=flags["terminated"],
        truncated=flags["truncated"],
        info=info if isinstance(info, dict) else None,
    )
