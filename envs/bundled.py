"""The bundled environments, ``guess_number`` (multi-turn), ``arithmetic`` and ``antonym``
(single-turn; envs/antonyms.py, the learning demo's task): served over HTTP by the example
server (examples/envserver.py) and run in process as env classes (``env_class:
envs.bundled:GuessNumber``). See the example server's docstring for their rules.
"""

from __future__ import annotations

import random
import re
from typing import Any

from envs.antonyms import AntonymEnv
from envs.base import EnvError  # bad parameters or a bad request: a 400 over HTTP

# --- the environments --------------------------------------------------------------------


_INT_RE = re.compile(r"-?\d+")
_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")


def _int_param(params: dict, key: str, default: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
            return int(value.strip())
        raise EnvError(f"env_param {key!r} must be an integer, got {value!r}")
    return value


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


class GuessNumberEnv:
    """Multi-turn: guess an integer in [low, high] within max_turns."""

    name = "guess_number"

    def __init__(self, env_param: dict, seed: int | None):
        row = env_param.get("dataset")
        if row is not None and not isinstance(row, dict):
            raise EnvError("env_param 'dataset' must be an object (one dataset row)")
        params = dict(env_param)
        if row:
            params.update({k: row[k] for k in ("low", "high", "max_turns") if k in row})
        self.low = _int_param(params, "low", 1)
        self.high = _int_param(params, "high", 100)
        self.max_turns = _int_param(params, "max_turns", 10)
        self.feedback_pad = _int_param(params, "feedback_pad", 0)  # filler words per feedback
        if self.low > self.high:
            raise EnvError(f"env_param 'low' ({self.low}) must be <= 'high' ({self.high})")
        if self.max_turns < 1:
            raise EnvError("env_param 'max_turns' must be >= 1")
        self.target = random.Random(seed).randint(self.low, self.high)
        self.turns = 0
        self.done = False
        self.history = [
            _msg("system",
                 "You are playing a number-guessing game. The secret number is an integer "
                 f"between {self.low} and {self.high} (inclusive). You have {self.max_turns} "
                 "guesses. After each guess you are told whether it is too low or too high."),
            _msg("user", "Guess the number. Reply with your guess as a single integer."),
        ]
        self.pending: list[dict] = []
        self.served = False  # the current history was already handed out

    def reset_answer(self) -> dict:
        return {
            "observation": {"low": self.low, "high": self.high, "max_turns": self.max_turns},
            "info": {"max_turns": self.max_turns},
        }

    def prompt(self) -> list[dict]:
        if self.done:
            return []
        if self.pending:
            self.history.extend(self.pending)
            self.pending = []
        elif self.served:
            # Like real envs: asking again without answering adds a turn.
            self.history.append(_msg(
                "user",
                "You have not answered yet. Reply with a single integer between "
                f"{self.low} and {self.high}."))
        self.served = True
        return list(self.history)

    def step(self, action: str) -> dict:
        if self.done:
            raise EnvError("the episode is over; reset the instance first")
        self.turns += 1
        numbers = _INT_RE.findall(action)
        reward = 0.0
        terminated = False
        if not numbers:
            result = "not a number"
            feedback = "That is not a number. Reply with a single integer."
        else:
            guess = int(numbers[-1])
            if guess < self.target:
                result, feedback = "too low", f"{guess} is too low."
            elif guess > self.target:
                result, feedback = "too high", f"{guess} is too high."
            else:
                result, feedback = "correct", f"{guess} is correct!"
                reward, terminated = 1.0, True
        truncated = not terminated and self.turns >= self.max_turns
        left = self.max_turns - self.turns
        if not terminated and not truncated:
            feedback += f" Guess again ({left} guess{'es' if left != 1 else ''} left)."
        elif truncated:
            feedback += f" No guesses left; the number was {self.target}."
        self.done = terminated or truncated
        if self.feedback_pad > 0:
            feedback += " (" + " ".join(["filler"] * self.feedback_pad) + ")"
        self.pending.extend([_msg("assistant", action), _msg("user", feedback)])
        self.served = False
        info: dict[str, Any] = {"turn": self.turns, "result": result}
        if self.done:
            info["target"] = self.target
        return {
            "observation": {"feedback": feedback, "turn": self.turns},
            "reward": reward,
            "terminated": terminated,
            "truncated": truncated,
            "info": info,
        }


class ArithmeticEnv:
    """Single-turn: answer the question of one dataset row."""

    name = "arithmetic"

    def __init__(self, env_param: dict, seed: int | None):  # noqa: ARG002
        row = env_param.get("dataset")
        if not isinstance(row, dict):
            raise EnvError("env_param 'dataset' (an object with 'question' and 'answer') "
                           "is required for arithmetic")
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise EnvError("env_param 'dataset.question' (a non-empty string) is required")
        if "answer" not in row or row["answer"] is None or isinstance(row["answer"], bool) \
                or not isinstance(row["answer"], (int, float, str)):
            raise EnvError("env_param 'dataset.answer' (a number or a string) is required")
        self.question = question
        self.answer = row["answer"]
        self.done = False
        self.history = [
            _msg("system", "You are a careful calculator. Solve the problem and end your "
                           "reply with the final number."),
            _msg("user", question),
        ]

    def reset_answer(self) -> dict:
        return {"observation": {"question": self.question}, "info": {}}

    def prompt(self) -> list[dict]:
        return [] if self.done else list(self.history)

    def _correct(self, action: str) -> bool:
        try:
            expected = float(self.answer)
        except (TypeError, ValueError):
            return action.strip().lower().rstrip(".") == str(self.answer).strip().lower()
        numbers = _NUM_RE.findall(action.replace(",", ""))
        return bool(numbers) and abs(float(numbers[-1]) - expected) < 1e-6

    def step(self, action: str) -> dict:
        if self.done:
            raise EnvError("the episode is over; reset the instance first")
        self.done = True
        correct = self._correct(action)
        return {
            "observation": {"correct": correct},
            "reward": 1.0 if correct else 0.0,
            "terminated": True,
            "truncated": False,
            "info": {"correct": correct, "expected": self.answer},
        }


ENVS = {GuessNumberEnv.name: GuessNumberEnv, ArithmeticEnv.name: ArithmeticEnv, AntonymEnv.name: AntonymEnv}
ENV_NAMES = list(ENVS)



# --- as env classes (inproc) ----------------------------------------------------------------


class BundledEnv:
    """``guess_number``, ``arithmetic`` or ``antonym``, chosen by env_name (or ``env_param["env"]``)."""

    def __init__(self, env_name: str = ""):
        self.env_name = env_name
        self.env: Any = None

    def reset(self, env_param: dict, seed: int | None) -> dict:
        name = (env_param or {}).get("env") or self.env_name.split(".", 1)[0]
        cls = ENVS.get(name)
        if cls is None:
            raise EnvError(f"unknown bundled env {name!r}; known: {ENV_NAMES}")
        self.env = cls(env_param or {}, seed)
        return self.env.reset_answer()

    def get_task_prompt(self) -> list:
        if self.env is None:
            raise EnvError("reset first")
        return self.env.prompt()

    def step(self, action: str) -> dict:
        if self.env is None:
            raise EnvError("reset first")
        return self.env.step(action)

    def close(self) -> None:
        self.env = None


class GuessNumber(BundledEnv):
    def __init__(self, env_name: str = ""):
        super().__init__("guess_number")


class Arithmetic(BundledEnv):
    def __init__(self, env_name: str = ""):
        super().__init__("arithmetic")


class Antonym(BundledEnv):
    def __init__(self, env_name: str = ""):
        super().__init__("antonym")
