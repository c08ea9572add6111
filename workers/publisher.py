"""The step publisher: every episode of a worker process hands its step records here, and one
thread sends them to the results stream, many records per Redis round trip.

Why: a fenced XADD per step was a Redis round trip per step, about an eighth of a worker's CPU
(a blocking-pool checkout, a command, a reply; docs/benchmarks.md "Notes"). Records of all the
episodes a process runs now share round trips: :meth:`StepPublisher.publish` queues a record
and returns, and the publisher sends what has queued every ``linger_s`` in one ``publish_many``
Lua call, which still checks *each* record's own lease token before its XADD. Fencing is
unchanged: an abandoned attempt's record is refused, and its lease is flagged lost, so the
attempt stops at its next check.

Order and completeness: records go out in the order they were queued, so an attempt's steps
stay in order. :meth:`StepPublisher.flush` waits until every record queued under a lease has
been sent or refused; an attempt flushes before it closes, so an AttemptRecord
never reaches the stream ahead of its steps, and a completed attempt's steps are all there.

Redis unreachable: the batch is sent again with capped backoff until Redis answers; the
records wait in memory. An attempt cannot run on for long meanwhile: its lease is not renewed,
and it fences itself by its own clock (workers/attempt.py).

Backpressure: when the stream holds more than ``backlog_max`` records (the consumer is behind),
:meth:`publish` waits until it drains instead of Redis memory growing.

Progress snapshots (broker/resume.py) that need not be waited for (``prompted``) travel the
same way (:meth:`mark`). One that must be in Redis before the attempt goes on - ``stepping``,
before a ``step`` call - does not: the attempt flushes what it queued here, then writes it
itself (``Ledger.mark``, a commit point), one small script instead of a turn of this thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import redis

from broker.lease import Lease
from broker.ledger import Ledger
from broker.records import Progress

log = logging.getLogger("interactor.publisher")

LINGER_S = 0.02  # gather records this long after the first one before sending
MAX_BATCH = 256
_BACKOFF_MAX_S = 2.0
_WAIT_SLICE_S = 0.25


class StepPublisher:
    def __init__(self, ledger: Ledger, *, backlog_max: int, linger_s: float = LINGER_S,
                 max_batch: int = MAX_BATCH):
        self.ledger = ledger
        self.backlog_max = backlog_max
        self.linger_s = linger_s
        self.max_batch = max_batch
        self._items: deque[tuple[Lease, bytes, Progress | None]] = deque()
        self._unconfirmed: dict[str, int] = {}  # lease token -> records queued, not sent yet
        self._cv = threading.Condition()
        self._stop = False
        self.backlog = 0  # stream length at the last send
        self.stats = {"batches": 0, "records": 0, "refused": 0, "send_errors": 0}
        self._thread = threading.Thread(target=self._run, name="step-publisher", daemon=True)
        self._thread.start()

    # --- episodes' side ---------------------------------------------------------------
    def publish(self, lease: Lease, payload: bytes, check: Callable[[], None] = lambda: None,
                waited: Callable[[float], None] = lambda s: None, progress: Progress | None = None) -> None:
        """Queue one record of ``lease``'s attempt (with the progress snapshot after it, if
        given). Waits only while the stream is over its backlog bound (``check`` runs between
        waits and may raise to abort; ``waited`` is told each slice waited, so that the
        attempt's budget does not run out on the consumer)."""
        try:
            while self.backlog > self.backlog_max and not self._stop:
                t0 = time.monotonic()
                with self._cv:
                    self._cv.wait(_WAIT_SLICE_S)
                waited(time.monotonic() - t0)
                check()
        finally:
            # Queued even when ``check`` stops the wait: the env has applied the step, so its
            # record must reach the stream before the attempt's close (which flushes), or a
            # successor would continue past a step nobody recorded. One record over the bound
            # is no harm; the bound is for the episodes that keep running.
            self._queue(lease, payload, progress)

    def mark(self, lease: Lease, progress: Progress) -> None:
        """Queue a progress snapshot of ``lease``'s attempt alone."""
        self._queue(lease, b"", progress)

    def _queue(self, lease: Lease, payload: bytes, progress: Progress | None) -> None:
        with self._cv:
            self._items.append((lease, payload, progress))
            self._unconfirmed[lease.token] = self._unconfirmed.get(lease.token, 0) + 1
            self._cv.notify_all()

    def flush(self, lease: Lease, timeout: float | None = None) -> bool:
        """Wait until every record queued under ``lease`` was sent or refused. False when
        ``timeout`` (seconds) passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._unconfirmed.get(lease.token):
                left = _WAIT_SLICE_S if end is None else min(_WAIT_SLICE_S, end - time.monotonic())
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def pending(self, lease: Lease) -> int:
        with self._cv:
            return self._unconfirmed.get(lease.token, 0)

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    # --- the publishing thread ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._stop:
                    if self.backlog > self.backlog_max:
                        break  # nothing queued, but waiters need to see the stream drain
                    self._cv.wait()
                if self._stop and not self._items:
                    return
            if self._items:
                self._linger()  # let more records join this round trip
            with self._cv:
                n = min(len(self._items), self.max_batch)
                batch = [self._items.popleft() for _ in range(n)]
            if batch:
                self._send(batch)
            else:
                self._refresh_backlog()

    def _linger(self) -> None:
        """Wait ``linger_s`` for more items."""
        end = time.monotonic() + self.linger_s
        with self._cv:
            while not self._stop:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(left)

    def _send(self, batch: list[tuple[Lease, bytes, Progress | None]]) -> None:
        delay = 0.05
        while True:
            try:
                added, length = self.ledger.publish_many(batch)
                if length >= 0:  # -1: snapshots alone, the stream not read
                    self.backlog = length
                break
            except redis.RedisError as exc:
                self.stats["send_errors"] += 1
                if self._stop:  # the process is going away; its attempts are abandoned anyway
                    added = [False] * len(batch)
                    break
                log.warning("publishing %d step records failed (%s); retrying in %.2fs", len(batch), exc, delay)
                time.sleep(delay)
                delay = min(_BACKOFF_MAX_S, delay * 2)
        refused = added.count(False)
        self.stats["batches"] += 1
        self.stats["records"] += len(batch) - refused
        self.stats["refused"] += refused
        with self._cv:
            for lease, *_ in batch:
                left = self._unconfirmed.get(lease.token, 0) - 1
                if left > 0:
                    self._unconfirmed[lease.token] = left
                else:
                    self._unconfirmed.pop(lease.token, None)
            self._cv.notify_all()

    def _refresh_backlog(self) -> None:
        time.sleep(_WAIT_SLICE_S * 2)
        try:
            self.backlog = self.ledger.results_length()
        except redis.RedisError as exc:
            log.warning("reading the results stream's length failed: %s", exc)
        with self._cv:
            self._cv.notify_all()
