"""A background duty: one small class per job a process does on the side (Celery's bootsteps
pattern, ``celery/worker/consumer/heart.py``): lease renewal, sweeping, publishing.

Each duty runs on its own thread, so that a slow one (a long reconcile) never holds up
another (lease renewal). Under the gevent pool the thread is a greenlet, which is fine for
duties that wait on Redis; correctness never depends on a duty's timing (attempts fence
themselves by their own clock, see workers/attempt.py).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("interactor.duty")


class Duty:
    """Runs :meth:`tick` every ``interval_s`` seconds on a daemon thread until :meth:`stop`.

    An exception from ``tick`` is logged and the next round runs as planned: a duty never
    dies of a passing Redis error.
    """

    name = "duty"

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Duty":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def nudge(self) -> None:
        """Run the next round now instead of at the end of the interval."""
        self._wake.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - logged; the next round tries again
                log.warning("%s failed: %s: %s", self.name, type(exc).__name__, exc)

    def tick(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError
