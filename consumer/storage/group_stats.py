"""Group statistics (GRPO): the mean and population standard deviation of a group's episode
rewards, and each episode's advantage ``(reward - mean) / (std + eps)``.

Several places need the same numbers: the writer stores each group's mean and std in
``groups`` (backend.py), an export recomputes them over the episodes it exports
(consumer/export.py), the feed hands advantages to a trainer (interactor/feed_service.py), and the
results browser shows each member's advantage from the stored row (interactor/ui/formatting.py).
With a copy of the formula in each, a change to one (sample std, another epsilon) would have
made the browser disagree with the exported files. Plain Python, no database: the numbers are
the same on every backend.

They stay finite: finite rewards whose sum or squares overflow get the statistics of the same
rewards scaled down, and a group with a reward that is not a finite number (a record from a
worker that did not check its total) has none (``None``: unusable for training, never NaN).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

#: Added to the std so that a group whose rewards are all equal divides by something
#: (``interactor export --eps`` overrides it for an export).
ADVANTAGE_EPS = 1e-6


def reward_mean_std(rewards: Sequence[float]) -> tuple[float | None, float | None]:
    """``(mean, population std)`` of the rewards; ``(None, None)`` for none, and for a group
    with a reward that is no finite number (it has no statistics a trainer could use)."""
    n = len(rewards)
    if not n or not all(math.isfinite(r) for r in rewards):
        return None, None
    try:
        mean = sum(rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
        if math.isfinite(mean) and math.isfinite(std):
            return mean, std
    except OverflowError:  # a square past the float range (|r - mean| > 1e154)
        pass
    # Finite rewards whose sum or squares overflow: the same numbers computed on rewards scaled
    # into [-1, 1]. The mean and the std of finite rewards are within their range, so finite.
    scale = max(abs(r) for r in rewards)
    scaled = [r / scale for r in rewards]
    m = math.fsum(scaled) / n
    return m * scale, math.sqrt(math.fsum((x - m) ** 2 for x in scaled) / n) * scale


def advantage(reward: float, mean: float, std: float | None, eps: float = ADVANTAGE_EPS) -> float | None:
    """One episode's normalized advantage in its group (a missing std counts as 0); None when
    a number is not finite (no advantage to give)."""
    if not (math.isfinite(reward) and math.isfinite(mean) and math.isfinite(std or 0.0)):
        return None
    diff = reward - mean
    denom = (std or 0.0) + eps
    if math.isinf(diff):  # both finite, their difference past the float range: halved, the same ratio
        return (reward / 2 - mean / 2) / (denom / 2)
    return diff / denom


class GroupStats(NamedTuple):
    """``mean``, ``std`` and every advantage are None for a group with a reward that is no
    finite number: it is unusable for training, and said so rather than given NaN."""

    mean: float | None
    std: float | None
    advantages: list[float | None]
    equal: bool  # every reward the same: no learning signal, every advantage 0

    @property
    def usable(self) -> bool:
        return self.mean is not None


def group_stats(rewards: Sequence[float], eps: float = ADVANTAGE_EPS) -> GroupStats:
    """The statistics of one group's (one or more) episode rewards, with each one's advantage;
    a group whose rewards are all equal gets advantages of exactly 0."""
    if not rewards:
        raise ValueError("a group's statistics need at least one reward")
    mean, std = reward_mean_std(rewards)
    if mean is None:
        return GroupStats(None, None, [None] * len(rewards), False)
    equal = max(rewards) == min(rewards)
    adv = [0.0] * len(rewards) if equal else [advantage(r, mean, std, eps) for r in rewards]
    return GroupStats(mean, std, adv, equal)
