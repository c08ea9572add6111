"""A multi-turn game with a tool as an Open Reward Standard environment, served by openreward's
own ``Server`` (tests/test_env_protocols.py starts its app with uvicorn on a free port; not
``Server.run``, which asks PyPI for updates).

Guess the number with the ``guess`` tool: the prompt says the range ("between 1 and 50"), each
call answers "N is too low." / "too high." (reward 0) until it is right (reward 1, finished)
or the task's ``max_turns`` calls were made (finished, reward 0). The ``train`` split lists a few
tasks (``POST /guessing/tasks``), for task files that name ``split: train``.
"""

from __future__ import annotations

from openreward.environments import Environment, Server, TextBlock, ToolOutput, tool
from pydantic import BaseModel

TASKS = [{"target": t, "high": 50, "max_turns": 8} for t in (7, 23, 42)]


class GuessInput(BaseModel):
    number: int


class Guessing(Environment):
    def __init__(self, task_spec: dict = {}, secrets: dict = {}):  # noqa: B006 - openreward's signature
        super().__init__(task_spec, secrets)
        self.target = int(task_spec.get("target", 17))
        self.high = int(task_spec.get("high", 50))
        self.max_turns = int(task_spec.get("max_turns", 8))
        self.turns = 0

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return TASKS if split == "train" else []

    def get_prompt(self):
        return [TextBlock(text=f"Guess the number between 1 and {self.high} with the guess tool.")]

    @tool
    async def guess(self, params: GuessInput) -> ToolOutput:
        """Guess the number; the answer says whether it is too low or too high."""
        self.turns += 1
        if params.number == self.target:
            return ToolOutput(blocks=[TextBlock(text=f"{params.number} is right!")], reward=1.0, finished=True)
        word = "low" if params.number < self.target else "high"
        return ToolOutput(blocks=[TextBlock(text=f"{params.number} is too {word}.")], reward=0.0,
                          finished=self.turns >= self.max_turns)


app = Server([Guessing]).app
