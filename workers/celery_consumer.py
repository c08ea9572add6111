"""Celery's task consumer, with a freed slot asking the broker for work at once (gevent pool).

Under the gevent pool Celery runs its blocking ``synloop``, which waits in
``connection.drain_events(timeout=2.0)``. While every slot is busy, kombu's Redis transport has no
BRPOP outstanding (QoS allows no more messages), so when an episode ends and frees a slot
nothing arrives to end that wait: the slot idled for up to 2 s before the next BRPOP went out.
With 20-second episodes that cost a tenth of the throughput (docs/benchmarks.md, "Notes").

``EpisodeConsumer`` (set as ``worker_consumer`` by workers/tasks.py) runs the same loop with each
wait capped at :data:`DRAIN_S`. An idle worker pays one cheap poll round per ``DRAIN_S``;
the threads pool's event loop (asynloop) is left as Celery made it.
"""

from __future__ import annotations

from celery.worker import loops
from celery.worker.consumer import Consumer

DRAIN_S = 0.1


def capped_synloop(obj, connection, *args, **kwargs):
    drain = connection.drain_events

    def drain_capped(timeout=None, **kw):
        return drain(timeout=DRAIN_S if timeout is None else min(timeout, DRAIN_S), **kw)

    connection.drain_events = drain_capped
    try:
        return loops.synloop(obj, connection, *args, **kwargs)
    finally:
        vars(connection).pop("drain_events", None)


class EpisodeConsumer(Consumer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.loop is loops.synloop:
            self.loop = capped_synloop
