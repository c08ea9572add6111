"""A worker whose Celery consumer stopped taking work is replaced, not left idle.

Under the gevent pool, Celery's consumer can come back from a Redis restart connected but no
longer fetching: it logs "Connection to broker lost. Trying to re-establish the connection..."
and then nothing, for good (celery/celery#9191 and its relatives). In the fault suite a job
sat for minutes with episodes queued and every worker idle. Nothing was lost (the ledger and
the queue still held everything), but nothing moved either, and the supervisor restarts only
a process that exits.

This duty watches for exactly that, whatever its cause: episodes wait in a queue this
process serves, it has free slots, and it has received nothing for ``stall_s``. Then the
process is marked unhealthy (``WorkerRuntime.unhealthy``: its running episodes are handed back
uncounted, Celery shuts down warm) and the supervisor starts a fresh one. While Redis is
unreachable nothing is judged: the consumer is then waiting for Redis, as it should.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import redis

from broker.duty import Duty
from broker.queueing import sub_queues

log = logging.getLogger("interactor.consumer_watch")


class ConsumerWatch(Duty):
    name = "consumer-watch"

    def __init__(self, client: redis.Redis, queues: list[str], slots: int, *, in_hand: Callable[[], int],
                 last_received: Callable[[], float], on_stall: Callable[[str], None], stall_s: float,
                 stopping: Callable[[], bool] = lambda: False, interval_s: float = 1.0):
        super().__init__(interval_s)
        self.r = client
        self.served = list(queues)
        self.queues = [name for q in queues for _, name in sub_queues(q)]
        self.stopping = stopping  # a shutting-down consumer stops taking work on purpose
        self.slots = slots
        self.in_hand = in_hand
        self.last_received = last_received
        self.on_stall = on_stall
        self.stall_s = stall_s
        self._starved_since: float | None = None  # free slots and waiting episodes, since when

    def waiting(self) -> int:
        pipe = self.r.pipeline(transaction=False)
        for name in self.queues:
            pipe.llen(name)
        return sum(int(n) for n in pipe.execute())

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.stopping() or self.in_hand() >= self.slots:
            self._starved_since = None
            return
        try:
            waiting = self.waiting()
        except (redis.RedisError, OSError):
            self._starved_since = None  # Redis away: the consumer is waiting for it too
            return
        if not waiting:
            self._starved_since = None
            return
        if self._starved_since is None or self.last_received() > self._starved_since:
            self._starved_since = now
            return
        if now - self._starved_since >= self.stall_s:
            reason = (f"its Celery consumer took no task for {now - self._starved_since:.0f}s while {waiting} "
                      f"episodes waited in {', '.join(self.served)} and {self.slots - self.in_hand()} of its "
                      f"{self.slots} slots were free")
            self._starved_since = None
            self.on_stall(reason)
