"""An attempt's deadline: an absolute ``time.monotonic()`` that every client call takes.

No request starts without time left (:func:`timeouts`), and no wait, read or back-off runs past
it. Shared by the HTTP clients (workers/envclient.py, workers/modelclient.py), their transport
(workers/http_transport.py) and the in-process env transport (workers/inproc.py).
"""

from __future__ import annotations

import time

from broker.errors import EPISODE_TIMEOUT, EpisodeError

DEADLINE_SLACK_S = 0.005  # a deadline this close counts as passed


def remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def timeouts(deadline: float, connect_s: float, read_s: float, *, what: str) -> tuple[float, float]:
    """``(connect, read)`` timeouts for one request, or EPISODE_TIMEOUT when no time is left."""
    left = remaining(deadline)
    if left <= 0:
        raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out")
    return (min(connect_s, left), min(read_s, left))


def deadline_passed(deadline: float) -> bool:
    return remaining(deadline) <= DEADLINE_SLACK_S
