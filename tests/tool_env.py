"""An env class of our own protocol that offers the model a tool (docs/protocol.md#tools): the
guessing game, each guess a ``guess`` call. Served by ``interactor serve-env`` or run inproc
(tests/test_env_protocols.py)."""

from __future__ import annotations

import json


class ToolGuess:
    def __init__(self, env_name: str = ""):
        self.messages: list[dict] = []
        self.target, self.done, self.calls_seen = 6, False, 0

    def reset(self, env_param: dict, seed: int | None) -> dict:
        self.target = int((env_param.get("dataset") or {}).get("target", 6))
        self.messages, self.done = [{"role": "user", "content": "Guess the number between 1 and 9."}], False
        return {"observation": {}, "info": {}}

    def get_task_prompt(self):
        if self.done:
            return []
        tools = [{"type": "function", "function": {"name": "guess", "parameters": {
            "type": "object", "properties": {"number": {"type": "integer"}}}}}]
        return {"messages": self.messages, "tools": tools}

    def step(self, action: str, tool_calls: list | None = None) -> dict:
        if not tool_calls:
            raise ValueError("no tool call: this env is played with its guess tool")
        self.calls_seen += len(tool_calls)
        guess = json.loads(tool_calls[0]["function"]["arguments"])["number"]
        self.done = guess == self.target
        said = f"{guess} is right!" if self.done else f"{guess} is too {'low' if guess < self.target else 'high'}."
        self.messages = [*self.messages, {"role": "assistant", "content": action, "tool_calls": tool_calls},
                         {"role": "tool", "tool_call_id": tool_calls[0].get("id", ""), "content": said}]
        return {"reward": 1.0 if self.done else 0.0, "terminated": self.done, "truncated": False, "info": {}}

    def close(self) -> None:
        self.messages = []
