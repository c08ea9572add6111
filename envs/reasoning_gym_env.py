"""reasoning-gym datasets as single-turn environments (``pip install .[reasoning-gym]``).

One episode = one item of a procedural dataset, answered once and rewarded by the dataset's own
``score_answer``. Parameters (``env_params``; a dataset row's keys override them):

``task``
    the generator name (``leg_counting``, ``basic_arithmetic``, ``chain_sum``, ...; any name
    ``reasoning_gym.create_dataset`` knows). Default: the part after ``reasoning_gym.`` in
    env_name.
``size``, ``seed``
    the dataset's size (default 500) and seed (default 0). The seed is the *dataset's*, not the
    episode's, so every sample of a group gets the same item.
``index``
    which item (0-based, default 0). Put it in dataset rows, one row per task:
    ``dataset: [{index: 0}, {index: 1}, ...]``.
``config``
    extra keyword arguments of the generator's config (e.g. ``{min_animals: 2}``).
``system_prompt``
    a name from ``reasoning_gym.utils.SYSTEM_PROMPTS`` (default ``"default"``: answer inside
    ``<answer>...</answer>``) or a literal system message; ``""`` for none.
``answer_tag``
    the tag the answer is extracted from (default ``"answer"``, with
    ``reasoning_gym.utils.extract_answer``); ``""`` scores the whole reply.

A dataset row may instead be a whole reasoning-gym entry (``question``, ``answer``,
``metadata.source_dataset``), e.g. a JSONL written from ``create_dataset``: it is then used as
is and scored by that dataset's ``score_answer``.

The reward is ``score_answer(extracted_answer, entry)``; ``info`` carries the extracted answer,
the expected one and the score.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from envs import install_hint
from envs.base import EnvError, int_param, params_with_row

DEFAULT_SIZE = 500
_CACHE_MAX = 64
_lock = threading.Lock()
_datasets: "OrderedDict[tuple, Any]" = OrderedDict()
_scorers: dict[str, Any] = {}


def _rg():
    try:
        import reasoning_gym
        import reasoning_gym.utils
    except ImportError as exc:
        raise EnvError(f"reasoning-gym is not installed on this server/worker ({exc}); "
                       + install_hint("reasoning_gym")) from None
    return reasoning_gym


def _dataset(task: str, size: int, seed: int, config: dict) -> Any:
    key = (task, size, seed, json.dumps(config, sort_keys=True, default=str))
    with _lock:
        ds = _datasets.get(key)
        if ds is not None:
            _datasets.move_to_end(key)
            return ds
    rg = _rg()
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        known = ", ".join(sorted(DATASETS)[:12])
        raise EnvError(f"unknown reasoning-gym task {task!r} (known: {known}, ... {len(DATASETS)} in all)")
    try:
        with _lock:  # some generators load word lists etc. at construction: build one at a time
            ds = rg.create_dataset(task, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as exc:
        raise EnvError(f"reasoning-gym {task!r}: bad config {config!r}: {type(exc).__name__}: {exc}") from None
    with _lock:
        _datasets[key] = ds
        while len(_datasets) > _CACHE_MAX:
            _datasets.popitem(last=False)
    return ds


def _scorer(task: str) -> Any:
    with _lock:
        fn = _scorers.get(task)
    if fn is None:
        rg = _rg()
        try:
            fn = rg.get_score_answer_fn(task)
        except ValueError as exc:
            raise EnvError(f"reasoning-gym: {exc}") from None
        with _lock:
            _scorers[task] = fn
    return fn


def system_prompt_text(value: Any) -> str:
    if value is None:
        value = "default"
    if not isinstance(value, str):
        raise EnvError(f"env_param 'system_prompt' must be a string, got {value!r}")
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(value, value)


def score(task_or_scorer: Any, response: str, entry: dict, answer_tag: str = "answer") -> tuple[float, str | None]:
    """``(reward, extracted answer)`` for one response: what :meth:`ReasoningGymEnv.step`
    computes (tests recompute stored rewards with it)."""
    from reasoning_gym.utils import extract_answer

    extracted = extract_answer(response, tag_name=answer_tag) if answer_tag else response.strip()
    fn = _scorer(task_or_scorer) if isinstance(task_or_scorer, str) else task_or_scorer
    return float(fn(extracted, entry)), extracted


class ReasoningGymEnv:
    def __init__(self, env_name: str = ""):
        head, _, rest = env_name.partition(".")
        self.default_task = rest
        self.entry: dict | None = None
        self.task = ""
        self.scorer: Any = None
        self.messages: list[dict] = []
        self.answer_tag = "answer"
        self.done = False

    def reset(self, env_param: dict, seed: int | None) -> dict:  # noqa: ARG002 - the item is chosen by index
        _rg()
        p = params_with_row(env_param)
        row = (env_param or {}).get("dataset")
        if isinstance(row, dict) and "question" in row and "answer" in row \
                and isinstance(row.get("metadata"), dict) and row["metadata"].get("source_dataset"):
            entry = row  # a whole reasoning-gym entry
            task = str(row["metadata"]["source_dataset"])
            self.scorer = _scorer(task)
            where = {"task": task, "index": row["metadata"].get("source_index")}
        else:
            task = p.get("task") or self.default_task
            if not task or not isinstance(task, str):
                raise EnvError("env_param 'task' (a reasoning-gym dataset name) is required, "
                               "or name it in env_name: reasoning_gym.<task>")
            size = int_param(p, "size", DEFAULT_SIZE, minimum=1)
            dseed = int_param(p, "seed", 0)
            index = int_param(p, "index", 0, minimum=0)
            if index >= size:
                raise EnvError(f"env_param 'index' ({index}) must be < size ({size})")
            config = p.get("config") or {}
            if not isinstance(config, dict):
                raise EnvError(f"env_param 'config' must be an object, got {config!r}")
            ds = _dataset(task, size, dseed, config)
            with _lock:
                entry = ds[index]
            self.scorer = ds.score_answer
            where = {"task": task, "index": index, "size": size, "seed": dseed}
        question = entry.get("question")
        if not isinstance(question, str) or not question:
            raise EnvError(f"reasoning-gym {task!r}: the item has no question")
        tag = p.get("answer_tag", "answer")
        if not isinstance(tag, str):
            raise EnvError(f"env_param 'answer_tag' must be a string, got {tag!r}")
        self.answer_tag = tag
        system = system_prompt_text(p.get("system_prompt"))
        self.messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
        self.entry, self.task, self.done = entry, task, False
        return {"observation": {"question": question}, "info": where}

    def get_task_prompt(self) -> list:
        if self.entry is None:
            raise EnvError("reset first")
        return [] if self.done else [dict(m) for m in self.messages]

    def step(self, action: str) -> dict:
        if self.entry is None:
            raise EnvError("reset first")
        if self.done:
            raise EnvError("the episode is over; reset the instance first")
        self.done = True
        info: dict[str, Any] = {"task": self.task, "expected": str(self.entry.get("answer"))}
        try:
            reward, extracted = score(self.scorer, action, self.entry, self.answer_tag)
        except Exception as exc:  # noqa: BLE001 - a scorer choking on an answer scores it 0
            reward, extracted = 0.0, None
            info["score_error"] = f"{type(exc).__name__}: {exc}"[:300]
        info.update(answer=extracted, score=reward)
        return {"observation": {"answer": extracted}, "reward": reward, "terminated": True,
                "truncated": False, "info": info}

    def close(self) -> None:
        self.entry = None
        self.messages = []
