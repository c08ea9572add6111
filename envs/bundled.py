"""The bundled stand-in environments (``examples/envserver.py``) as env classes, so that they
run in process too (``env_class: envs.bundled:GuessNumber``)."""

from __future__ import annotations

from typing import Any

from envs.base import EnvError


class BundledEnv:
    """``guess_number`` or ``arithmetic``, chosen by env_name (or ``env_param["env"]``)."""

    def __init__(self, env_name: str = ""):
        self.env_name = env_name
        self.env: Any = None

    def reset(self, env_param: dict, seed: int | None) -> dict:
        from examples import envserver

        name = (env_param or {}).get("env") or self.env_name.split(".", 1)[0]
        cls = envserver.ENVS.get(name)
        if cls is None:
            raise EnvError(f"unknown bundled env {name!r}; known: {envserver.ENV_NAMES}")
        try:
            self.env = cls(env_param or {}, seed)
        except envserver.EnvError as exc:
            raise EnvError(str(exc)) from None
        return self.env.reset_answer()

    def get_task_prompt(self) -> list:
        if self.env is None:
            raise EnvError("reset first")
        return self.env.prompt()

    def step(self, action: str) -> dict:
        from examples import envserver

        if self.env is None:
            raise EnvError("reset first")
        try:
            return self.env.step(action)
        except envserver.EnvError as exc:
            raise EnvError(str(exc)) from None

    def close(self) -> None:
        self.env = None


class GuessNumber(BundledEnv):
    def __init__(self, env_name: str = ""):
        super().__init__("guess_number")


class Arithmetic(BundledEnv):
    def __init__(self, env_name: str = ""):
        super().__init__("arithmetic")
