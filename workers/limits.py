"""Per-worker-process limits on the policy side (the original driver's ``max_concurrency``,
``max_connections`` and ``startup_jitter_s``), as small pieces the runtime wires in:

* :class:`ModelGate` / :func:`shared_gate`: at most ``llm_max_concurrency`` model requests in
  flight per worker process, whatever the number of episodes running (0 = no cap beyond
  ``concurrency``). Waiting for a slot respects the attempt's deadline and its ``check``
  (lease lost, shutdown).
* :class:`LimitedPolicy`: a :class:`~workers.loop.PolicyPort` that holds a slot of the gate
  around each ``complete`` call.
* :func:`model_session`: the model client's connection pool, sized ``llm_max_connections``
  (0 = auto: ``max(10, 2 * min(concurrency, llm_max_concurrency or concurrency))``). It caps
  kept-alive connections; the gate is what caps requests in flight.
* :class:`FirstWaveJitter`: each of the first ``concurrency`` episodes a worker process starts
  waits ``uniform(0, llm_startup_jitter_s)`` first, so that a fleet starting at once does not
  hit the model server with one synchronized burst; later episodes start at once.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

import requests

from broker.errors import EPISODE_TIMEOUT, EpisodeError
from broker.settings import Settings
from workers.http_transport import make_session

__all__ = ["ModelGate", "shared_gate", "LimitedPolicy", "model_session", "FirstWaveJitter"]

_SLICE_S = 0.25  # waits are cut into slices so that `check` runs between them


class ModelGate:
    """A counting semaphore with a little bookkeeping (``in_flight``, ``peak``, ``waits``)."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError("a gate needs a limit >= 1")
        self.limit = limit
        self._sem = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.waits = 0  # acquisitions that had to wait

    def acquire(self, deadline: float, check: Callable[[], None] = lambda: None) -> None:
        """Take a slot, or raise: ``check``'s error, or EPISODE_TIMEOUT at ``deadline``."""
        if not self._sem.acquire(blocking=False):
            with self._lock:
                self.waits += 1
            while True:
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EpisodeError(EPISODE_TIMEOUT, f"waited for one of the {self.limit} model request slots "
                                                        "of this worker until the attempt's budget ran out")
                if self._sem.acquire(timeout=min(_SLICE_S, left)):
                    break
        with self._lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def release(self) -> None:
        with self._lock:
            self.in_flight -= 1
        self._sem.release()


_gates: dict[int, ModelGate] = {}
_gates_lock = threading.Lock()


def shared_gate(limit: int) -> ModelGate | None:
    """The process-wide gate for ``limit`` (None when ``limit <= 0``: no cap)."""
    if limit <= 0:
        return None
    with _gates_lock:
        gate = _gates.get(limit)
        if gate is None:
            gate = _gates[limit] = ModelGate(limit)
        return gate


class LimitedPolicy:
    """Wraps a policy port: each ``complete`` holds one slot of ``gate`` (None: no limit)."""

    def __init__(self, inner: Any, gate: ModelGate | None, deadline: float | Callable[[], float],
                 check: Callable[[], None] = lambda: None):
        self.inner = inner
        self.gate = gate
        # A callable reads the attempt's deadline when needed (a paused budget moves it).
        self.deadline = deadline if callable(deadline) else (lambda: deadline)
        self.check = check

    def complete(self, messages: list[dict], **request: Any) -> Any:
        if self.gate is None:
            return self.inner.complete(messages, **request)
        self.gate.acquire(self.deadline(), self.check)
        try:
            return self.inner.complete(messages, **request)
        finally:
            self.gate.release()


def model_session(settings: Settings) -> requests.Session:
    """A Session for the model client whose pool keeps ``llm_max_connections`` connections
    (0 = auto), without urllib3 retries (the client decides retries)."""
    size = settings.llm_max_connections
    if size <= 0:
        in_flight = min(settings.concurrency, settings.llm_max_concurrency or settings.concurrency)
        size = max(10, 2 * in_flight)
    return make_session(settings, pool_size=size)


class FirstWaveJitter:
    """``uniform(0, max_s)`` for each of the first ``wave`` calls of :meth:`delay`, 0 after."""

    def __init__(self, max_s: float, wave: int, rng: random.Random | None = None):
        self.max_s = max(0.0, float(max_s))
        self.left = max(0, int(wave)) if self.max_s > 0 else 0
        self._rng = rng or random.Random()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> "FirstWaveJitter":
        return cls(settings.llm_startup_jitter_s, settings.concurrency)

    def delay(self) -> float:
        with self._lock:
            if self.left <= 0:
                return 0.0
            self.left -= 1
            return self._rng.uniform(0.0, self.max_s)

    def wait(self, check: Callable[[], None] = lambda: None,
             sleep: Callable[[float], None] = time.sleep) -> float:
        """Sleep this episode's delay in short slices, calling ``check`` between them (it
        raises to abort: lease lost, shutdown). Returns the delay."""
        total = self.delay()
        end = time.monotonic() + total
        while True:
            check()
            left = end - time.monotonic()
            if left <= 0:
                return total
            sleep(min(_SLICE_S, left))
