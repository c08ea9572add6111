"""An attempt's wall-clock budget (``episode_budget_s``), paused while the attempt waits for
something that is not the episode's doing: a server's outage (workers/breakers.py), a consumer
that fell behind (backpressure), Redis coming back. Without the pause, a ten-minute env
redeploy would spend the budget of every episode waiting on it and dead-letter them all as
``episode_timeout``; the outage has a budget of its own (``outage_budget_s``).
"""

from __future__ import annotations

import time


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.paused_s = 0.0

    @classmethod
    def until(cls, deadline: float) -> "Budget":
        """A budget ending at ``deadline`` (time.monotonic())."""
        b = cls(0.0)
        b.deadline = deadline
        return b

    def pause(self, seconds: float) -> None:
        """The attempt waited ``seconds`` for something not its own: move the deadline on."""
        if seconds > 0:
            self.deadline += seconds
            self.paused_s += seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()
