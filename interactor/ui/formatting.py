"""How the results browser's pages show values: numbers, counts, times, durations, and a group
member's advantage (template globals)."""

from __future__ import annotations

import math
import time
from typing import Any

from consumer.storage import group_stats


def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{nd}f}"
    return str(x)


def fmt_int(x: Any) -> str:
    return "-" if x is None else f"{int(x):,}"


def fmt_time(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))


def fmt_dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def advantage(reward: float | None, group: dict | None) -> float | None:
    """A member's advantage from its group's stored mean and std, with the export's default
    epsilon; None when the group has no completed member yet."""
    if reward is None or not group or group.get("reward_mean") is None:
        return None
    return group_stats.advantage(float(reward), group["reward_mean"], group.get("reward_std"))
