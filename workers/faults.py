"""A worker stopped at a chosen point of a turn, for the tests that check where its successor
starts (broker/resume.py ``TURN_POINTS``, tests/test_fault_points.py).

The step loop calls its ``fault(point, step)`` port at each point; outside those tests the port
is a no-op. The ``fault_point`` setting ``POINT@STEP:ACTION:MARKER`` arms it: at ``POINT`` of
step ``STEP`` of an episode, once per marker file (the first process to create it acts; a
restarted worker with the same setting does not act again), the worker is

* ``killed``: SIGKILL to its own process, so nothing more runs (no close, no hand-back), or
* ``stopped``: its shutdown clock set to now, as at the end of SIGTERM's grace: each attempt it
  runs hands its episode back at its next check (the runtime's ``unhealthy``: under Celery, the
  process then exits and its supervisor starts a fresh one).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable

log = logging.getLogger("interactor.faults")

ACTIONS = ("killed", "stopped")


def never(point: str, step: int) -> None:
    """The port outside the fault tests."""


def armed(spec: str, stop: Callable[[], None]) -> Callable[[str, int], None]:
    """The port for a ``fault_point`` setting (``never`` when it is empty); ``stop`` sets the
    worker's shutdown clock. A malformed setting is refused with its reason."""
    if not spec:
        return never
    where, _, rest = spec.partition(":")
    action, _, marker = rest.partition(":")
    point, _, step = where.partition("@")
    if not (point and step.isdigit() and action in ACTIONS and marker):
        raise ValueError(f"fault_point {spec!r}: expected POINT@STEP:killed|stopped:MARKER_FILE")
    at = (point, int(step))

    def fault(point: str, step: int) -> None:
        if (point, step) != at:
            return
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # acted once already
        log.warning("fault point %s@%d: this worker is %s here", point, step, action)
        if action == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        stop()

    return fault
