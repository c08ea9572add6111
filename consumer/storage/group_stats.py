"""Group statistics (GRPO): the mean and population standard deviation of a group's episode
rewards, and each episode's advantage ``(reward - mean) / (std + eps)``.

Several places need the same numbers: the writer stores each group's mean and std in
``groups`` (backend.py), an export recomputes them over the episodes it exports
(consumer/export.py), the feed hands advantages to a trainer (interactor/feed.py), and the
results browser shows each member's advantage from the stored row (interactor/ui/app.py).
With a copy of the formula in each, a change to one (sample std, another epsilon) would have
made the browser disagree with the exported files. Plain Python, no database: the numbers are
the same on every backend.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

#: Added to the std so that a group whose rewards are all equal divides by something
#: (``interactor export --eps`` overrides it for an export).
ADVANTAGE_EPS = 1e-6


def reward_mean_std(rewards: Sequence[float]) -> tuple[float | None, float | None]:
    """``(mean, population std)`` of the rewards; ``(None, None)`` for none."""
    n = len(rewards)
    if not n:
        return None, None
    mean = sum(rewards) / n
    return mean, math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)


def advantage(reward: float, mean: float, std: float | None, eps: float = ADVANTAGE_EPS) -> float:
    """One episode's normalized advantage in its group (a missing std counts as 0)."""
    return (reward - mean) / ((std or 0.0) + eps)


class GroupStats(NamedTuple):
    mean: float
    std: float
    advantages: list[float]
    equal: bool  # every reward the same: no learning signal, every advantage 0


def group_stats(rewards: Sequence[float], eps: float = ADVANTAGE_EPS) -> GroupStats:
    """The statistics of one group's (one or more) episode rewards, with each one's advantage;
    a group whose rewards are all equal gets advantages of exactly 0."""
    mean, std = reward_mean_std(rewards)
    if mean is None:
        raise ValueError("a group's statistics need at least one reward")
    equal = max(rewards) == min(rewards)
    adv = [0.0] * len(rewards) if equal else [advantage(r, mean, std, eps) for r in rewards]
    return GroupStats(mean, std, adv, equal)
