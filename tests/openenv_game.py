"""A small multi-turn text game as an OpenEnv environment, served by OpenEnv's own
``create_app`` (tests/test_env_protocols.py starts it with uvicorn on a free port).

Guess the number: the reset observation's ``prompt`` says the range ("between 1 and 50"); each
step's action is a text whose last number is the guess, answered "N is too low." / "too high."
(the words the model stand-ins binary-search on) until it is right (reward 1, done) or
``max_turns`` guesses were made (done, reward 0).

``GAME_MAX_ENVS`` (environment variable) sets the server's ``max_concurrent_envs``.
"""

from __future__ import annotations

import os
import random
import re

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    text: str = Field(..., description="the player's message; its last number is the guess")


class GuessObservation(Observation):
    prompt: str = Field(default="", description="what the game says to the player")


class GuessGame(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.target, self.high, self.max_turns = 0, 50, 8

    def reset(self, seed: int | None = None, high: int = 50, max_turns: int = 8, target: int | None = None,
              **_: object) -> GuessObservation:
        self.high, self.max_turns = int(high), int(max_turns)
        self.target = int(target) if target is not None else random.Random(seed).randint(1, self.high)
        self._state = State(step_count=0)
        return GuessObservation(prompt=f"Guess the number between 1 and {self.high}. Answer with one number.",
                                done=False, reward=0.0)

    def step(self, action: GuessAction, **_: object) -> GuessObservation:
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.text)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.target:
            return GuessObservation(prompt=f"{guess} is right!", done=True, reward=1.0)
        over = self._state.step_count >= self.max_turns
        word = "nothing" if guess is None else f"{guess} is too {'low' if guess < self.target else 'high'}."
        return GuessObservation(prompt=word, done=over, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessGame, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=int(os.environ.get("GAME_MAX_ENVS", "8")))
