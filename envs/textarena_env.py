"""textarena single-player games as multi-turn environments (``pip install .[textarena]``).

Parameters (``env_params``; a dataset row's keys override them):

``game``
    a textarena env id (``GuessTheNumber-v0``, ``2048-v0-ultra-easy``, ``TowerOfHanoi-v0``,
    ``Mastermind-v0``, ``Minesweeper-v0``, ``Sudoku-v0``, ``Wordle-v0``, ...). Default: the part
    after ``textarena.`` in env_name. Two-player games are refused (400).
``seed``
    the game's seed. Default: the episode's seed. For GRPO groups put it in the dataset rows
    (``dataset: [{seed: 1}, {seed: 2}]``): every sample of a group then plays the same game.
``kwargs``
    keyword arguments for the game's constructor (``{max_turns: 8}``).

The conversation is the env's (docs/protocol.md#environment-server): the game's rules (its PROMPT
observations) are the system message, so that trimming by ``message_cut`` keeps them; every
later game message (hints, boards, invalid-move notices) is a user turn, and each action the
assistant turn before it. Actions go through the game's own action wrappers (e.g. textarena's
bracket formatting); only its observation wrappers are left out, since the chat carries the
history.

Rewards and end conditions are the library's: every step rewards 0 until the game is done,
then the step that ended it gets the player's reward from ``env.close()`` (e.g. GuessTheNumber
gives 1 for a win, otherwise how close the last guess was). ``terminated`` is the game's
``done``; ``info`` on the last step has textarena's ``reason`` and ``invalid_move``.

textarena draws from Python's global ``random``. So that concurrent episodes in one process
neither disturb each other nor lose reproducibility, every call runs under one process-wide
lock with the instance's own saved ``random`` state swapped in (numpy's too, when loaded).

Offline: GuessTheNumber, 2048, TowerOfHanoi, Mastermind, Minesweeper, Sudoku, LightsOut,
FifteenPuzzle, FrozenLake, Sokoban, RushHour, PegJump, Crosswords, Cryptarithm and similar work
without network (checked with textarena 0.7.4). Wordle, Hangman, WordLadder and WordSearch need
NLTK's ``words`` corpus (``python -m nltk.downloader words``) and fail with a 400 naming it when
it is missing; games judged by an LLM (TwentyQuestions, ...) need ``OPENROUTER_API_KEY`` and
network, and fail with a 400 without them.
"""

from __future__ import annotations

import random
import sys
import threading
from contextlib import contextmanager
from typing import Any

from envs import install_hint
from envs.base import EnvError, int_param, jsonable, params_with_row

_lock = threading.RLock()  # textarena and the global random state: one call at a time
DEFAULT_USER_TURN = "Make your move."


def _ta():
    try:
        import textarena
    except ImportError as exc:
        raise EnvError(f"textarena is not installed on this server/worker ({exc}); "
                       + install_hint("textarena")) from None
    return textarena


class _RandomState:
    """The instance's own copies of the global random states."""

    def __init__(self, seed: int | None):
        self.py = random.Random(seed).getstate()
        self.np = None

    @contextmanager
    def swapped_in(self):
        np = sys.modules.get("numpy")
        outer_py = random.getstate()
        outer_np = np.random.get_state() if np is not None else None
        random.setstate(self.py)
        if np is not None and self.np is not None:
            np.random.set_state(self.np)
        try:
            yield
        finally:
            self.py = random.getstate()
            random.setstate(outer_py)
            if np is not None:
                self.np = np.random.get_state()
                np.random.set_state(outer_np)


def _missing_resource(game: str, exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if "Resource" in ln or "not found" in ln]
    what = lines[0] if lines else type(exc).__name__
    return (f"textarena {game!r} needs a resource that is not installed here ({what}); "
            "word games need NLTK's corpus: python -m nltk.downloader words")


def _strip_observation_wrappers(ta: Any, env: Any) -> Any:
    """Rebuild ``env`` with its action wrappers only (observations come raw, as tuples)."""
    wrappers = []
    base = env
    while isinstance(base, ta.Wrapper):
        wrappers.append(type(base))
        base = base.env
    for cls in reversed(wrappers):
        if issubclass(cls, ta.ActionWrapper):
            base = cls(base)
    return base


class TextArenaEnv:
    def __init__(self, env_name: str = ""):
        _, _, rest = env_name.partition(".")
        self.default_game = rest
        self.env: Any = None
        self.game = ""
        self.history: list[dict] = []
        self.done = False
        self.closed = False
        self.turns = 0
        self.rng: _RandomState | None = None
        self.player_id = 0

    # -- helpers --------------------------------------------------------------------------
    def _observations(self) -> list[tuple]:
        pid, obs = self.env.get_observation()
        self.player_id = pid if isinstance(pid, int) else self.player_id
        if isinstance(obs, str):  # a game with its own string observations
            return [(-1, obs, None)]
        return [o for o in (obs or []) if isinstance(o, (tuple, list)) and len(o) >= 2]

    def _split(self, observations: list[tuple]) -> tuple[list[str], list[str]]:
        ta = _ta()
        prompt, other = [], []
        for item in observations:
            message = item[1]
            kind = item[2] if len(item) > 2 else None
            if kind == ta.ObservationType.PROMPT:
                prompt.append(str(message))
            elif kind == ta.ObservationType.PLAYER_ACTION:
                continue  # the (only) player's action: already the assistant turn
            else:
                other.append(str(message))
        return prompt, other

    # -- the contract ---------------------------------------------------------------------
    def reset(self, env_param: dict, seed: int | None) -> dict:
        ta = _ta()
        p = params_with_row(env_param)
        game = p.get("game") or self.default_game
        if not game or not isinstance(game, str):
            raise EnvError("env_param 'game' (a textarena env id) is required, "
                           "or name it in env_name: textarena.<game>")
        from textarena.envs.registration import ENV_REGISTRY

        if game not in ENV_REGISTRY:
            raise EnvError(f"unknown textarena game {game!r}")
        kwargs = p.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise EnvError(f"env_param 'kwargs' must be an object, got {kwargs!r}")
        game_seed = int_param(p, "seed", seed)
        self.close()
        self.rng = _RandomState(game_seed)
        with _lock, self.rng.swapped_in():
            try:
                env = _strip_observation_wrappers(ta, ta.make(game, **kwargs))
            except TypeError as exc:
                raise EnvError(f"textarena {game!r}: bad kwargs {kwargs!r}: {exc}") from None
            except LookupError as exc:  # NLTK corpora and the like
                raise EnvError(_missing_resource(game, exc)) from None
            except (ImportError, SyntaxError, ValueError) as exc:  # e.g. games that need an API key
                raise EnvError(f"textarena {game!r} cannot be created here: {type(exc).__name__}: {exc}") from None
            try:
                env.reset(num_players=1, seed=game_seed)
            except AssertionError as exc:
                raise EnvError(f"textarena {game!r} is not a single-player game ({exc})") from None
            except LookupError as exc:
                raise EnvError(_missing_resource(game, exc)) from None
            self.env = env
            self.closed = False
            prompt, other = self._split(self._observations())
        system = "\n".join(prompt).strip()
        first = "\n".join(other).strip() or DEFAULT_USER_TURN
        self.history = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": first}]
        self.game, self.done, self.turns = game, False, 0
        return {"observation": {"game": game}, "info": {"game": game, "seed": game_seed}}

    def get_task_prompt(self) -> list:
        if self.env is None:
            raise EnvError("reset first")
        return [] if self.done else [dict(m) for m in self.history]

    def step(self, action: str) -> dict:
        if self.env is None:
            raise EnvError("reset first")
        if self.done:
            raise EnvError("the game is over; reset the instance first")
        with _lock, self.rng.swapped_in():
            done, step_info = self.env.step(action)
            _, feedback = self._split(self._observations())
            rewards = game_info = None
            if done:
                rewards, game_info = self._close_env()
        self.turns += 1
        self.done = bool(done)
        self.history.append({"role": "assistant", "content": action})
        self.history.append({"role": "user", "content": "\n".join(feedback).strip() or DEFAULT_USER_TURN})
        info: dict[str, Any] = {"game": self.game, "turn": self.turns}
        if isinstance(step_info, dict) and step_info:
            info["step_info"] = jsonable(step_info)
        reward = 0.0
        if done:
            mine = (rewards or {}).get(self.player_id) if isinstance(rewards, dict) else None
            reward = float(mine) if mine is not None else 0.0
            me = (game_info or {}).get(self.player_id) if isinstance(game_info, dict) else None
            if isinstance(me, dict):
                info.update(jsonable({k: me[k] for k in ("reason", "invalid_move", "turn_count") if k in me}))
        return {"observation": {"feedback": feedback}, "reward": reward, "terminated": bool(done),
                "truncated": False, "info": info}

    def _close_env(self) -> tuple[Any, Any]:
        self.closed = True
        out = self.env.close()
        if isinstance(out, tuple) and len(out) == 2:  # textarena >= 0.7: (rewards, game_info)
            return out
        return out, None  # older: rewards only

    def close(self) -> None:
        if self.env is not None and not self.closed:
            try:
                with _lock, self.rng.swapped_in():
                    self._close_env()
            except Exception:  # noqa: BLE001 - closing an unfinished game is best effort
                pass
        self.env = None
        self.closed = True
