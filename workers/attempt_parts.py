"""What an attempt uses of its worker process, handed to it as one frozen object.

:class:`WorkerRuntime` (workers/runner.py) builds :class:`AttemptParts` once; each
:class:`~workers.attempt.Attempt` gets it, and nothing else of the process. A test builds one
from fakes (tests/test_attempt.py) and runs an attempt without Redis or servers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import redis

from broker.settings import Settings

log = logging.getLogger("interactor.worker")


@dataclass(frozen=True)
class AttemptParts:
    """The parts of a worker process an attempt calls, and the process's answers it asks for.

    ``ledger``: START/FINISH and the snapshots (broker/ledger.py); ``publisher``: the step
    records and snapshots, fenced by the lease (workers/publisher.py); ``renewer``: nudged when
    the lease may have lapsed (workers/renewer.py); ``pause_watch``: the jobs' failure streaks
    (workers/pausing.py); ``trust``: what a job may make this worker import, call and send the
    key to (workers/allowlist.py); ``breakers``: the servers' circuit breakers
    (workers/breakers.py); ``env`` / ``model``: the HTTP clients; ``model_gate``: the process's
    cap on model calls at once (None: no cap); ``jitter``: the first wave's spread;
    ``pacing`` / ``fleet``: the fleet-wide rate limits and caps; ``versions``: feed jobs' policy
    versions; ``keys``: the key names of the fleet's Redis prefix; ``queue_orphans``: instances
    for the orphan closers; ``requeue``: (job, episode, queue) triples back on their queues;
    ``fault``: the step loop's fault port (a no-op but in the fault-point tests);
    ``shutting_down``: true once the process's shutdown grace is over; ``unhealthy``: the
    process can no longer run episodes properly (an inproc env wedged); ``redact``: a text with
    the process's secrets starred out; ``cache``: the response cache (broker/cache.py)."""

    settings: Settings
    worker: str
    ledger: Any
    publisher: Any
    renewer: Any
    pause_watch: Any
    trust: Any
    breakers: Any
    env: Any
    model: Any
    model_gate: Any
    jitter: Any
    pacing: Any
    fleet: Any
    versions: Any
    keys: Any
    queue_orphans: Callable[[list[str]], None]
    requeue: Callable[[list[tuple[str, str, str]]], None]
    fault: Callable[[str, int], None]
    shutting_down: Callable[[], bool]
    unhealthy: Callable[[str], None]
    redact: Callable[[str], str]
    cache: Any = None  # the fleet's response cache (broker/cache.py), for jobs run with --cache

    def through_outage(self, name: str, what: str, fn: Callable[[], Any],
                       give_up: Callable[[], bool] = lambda: False) -> Any:
        return through_outage(self.settings.outage_budget_s, name, what, fn, give_up)


def through_outage(budget_s: float, name: str, what: str, fn: Callable[[], Any],
                   give_up: Callable[[], bool] = lambda: False) -> Any:
    """``fn()``, retried with backoff on Redis errors for up to ``budget_s`` (then the last
    error is raised): closing an attempt must outlast a Redis restart, or the episode would be
    reclaimed as a lost worker, an attempt counted against it for our outage. ``name`` names
    the episode (and attempt) in the log; ``give_up()`` true ends the retries early (the last
    error is raised)."""
    t0, delay = time.monotonic(), 0.1
    while True:
        try:
            return fn()
        except redis.RedisError as exc:
            if time.monotonic() - t0 > budget_s or give_up():
                raise
            log.warning("episode %s: %s failed (%s); retrying", name, what, exc)
            time.sleep(delay)
            delay = min(5.0, delay * 2)
