"""Waiting for a replica at the commit points: what a failover may lose, bounded.

Redis replicates asynchronously: a write the primary acknowledged may not have reached any
replica when the primary's machine dies, and Sentinel then promotes a replica without it. For
most writes that costs little (docs/guarantees.md, "Failover": the recovery that covers a Redis
that lost the last second of its log covers them). For a few it costs re-runs or a group handed
out twice, so they wait until a replica has them before anyone acts on them: an attempt's
START (before its worker calls the env) and FINISH (before its Celery message is
acknowledged), in the ledger; a feed's take (before the groups go to the trainer) and ack;
and a job's submit, checked once at its end (``confirm``).

How: ``WAIT 1 <timeout>`` right after the write, in the same pipeline, so on the same
connection (WAIT waits for that connection's last write, and with it everything written
before it, since replication is one ordered stream) and at the cost of no extra round trip
but the replica's acknowledgement. If the connection breaks in between, redis-py sends the
pipeline again - the write too - to whichever primary answers then; every write that waits is
repeatable (a START by its attempt id, a FINISH by its lease, an ack by its entry).

A WAIT that times out (no replica acknowledged within ``redis_wait_timeout_ms``: the replica is
down, lagging or cut off) does not fail the write, which the primary has: it is logged, and
the next waits are skipped for :data:`SKIP_AFTER_TIMEOUT_S` (then one probes again), so that a
fleet whose replica is gone - down, or promoted by the failover that just happened - runs at
full speed, as it would without waits (and, like it, may lose the last writes to a failover
in that time). A server that refuses WAIT (a proxy that does not know it) turns the
waits off in this process for good, said once.

``redis_wait``: ``on``, ``off``, or ``auto`` (the default): on with a ``redis+sentinel://``
URL, whose primary has replicas by construction; off with a one-server URL, where a WAIT would
find no replica and time out (a managed Redis that fails over to replicas behind one address
takes ``on``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis
from redis.exceptions import NoScriptError

from broker.redisurl import is_sentinel
from broker.settings import Settings

log = logging.getLogger("interactor.replicas")

SKIP_AFTER_TIMEOUT_S = 10.0


class ReplicaWait:
    def __init__(self, enabled: bool, timeout_ms: int = 500):
        self.enabled = enabled
        self.timeout_ms = max(1, int(timeout_ms))
        self._skip_until = 0.0
        self._degraded = False  # the last wait timed out: waits are skipped but for a probe now and then
        self._lock = threading.Lock()
        # what this process saw, for its logs and the tests: waits sent, those that timed out
        self.waits = 0
        self.timeouts = 0

    @classmethod
    def for_settings(cls, settings: Settings) -> "ReplicaWait":
        mode = settings.redis_wait
        enabled = mode == "on" or (mode == "auto" and is_sentinel(settings.redis_url))
        return cls(enabled, settings.redis_wait_timeout_ms)

    @classmethod
    def off(cls) -> "ReplicaWait":
        return cls(False)

    def due(self) -> bool:
        return self.enabled and time.monotonic() >= self._skip_until

    def run(self, client: redis.Redis, build: Callable[[redis.client.Pipeline], None], scripts=()) -> list:
        """The results of the commands ``build`` adds to a pipeline (no transaction), sent with a
        WAIT after them when waits are due. ``scripts``: the redis-py Scripts they call by
        EVALSHA, loaded and sent again if the server does not have them yet."""
        pipe = client.pipeline(transaction=False)
        build(pipe)
        n = len(pipe.command_stack)
        wait = self.due()
        if wait:
            pipe.execute_command("WAIT", 1, self.timeout_ms)
        out = pipe.execute(raise_on_error=False)
        if any(isinstance(x, NoScriptError) for x in out[:n]):
            for script in scripts:  # nothing ran (EVALSHA found no script): load, send again
                client.script_load(script.script)
            return self.run(client, build)
        for x in out[:n]:
            if isinstance(x, Exception):
                raise x
        if wait:
            self._judge(out[n])
        return out[:n]

    def confirm(self, client: redis.Redis, key: str, barrier: str) -> bool:
        """Whether ``key``, written before on any connection, is on the primary that answers now
        and, with waits due, on a replica: for a write made of many commands (a job's submit),
        checked once at its end. WAIT waits for its connection's own last write, and with it
        everything written before (one ordered stream), so the check writes ``barrier`` (a
        counter) first. False: the primary that answers does not have ``key`` (a failover lost
        it)."""
        if not self.due():
            return bool(client.exists(key))
        return bool(self.run(client, lambda pipe: (pipe.exists(key), pipe.incr(barrier)))[0])

    def _judge(self, acked) -> None:
        self.waits += 1
        if isinstance(acked, Exception):
            with self._lock:
                if self.enabled:
                    self.enabled = False
                    log.error("Redis refused WAIT (%s): commit points no longer wait for a replica in this process; "
                              "a failover may lose their last writes", acked)
            return
        if int(acked) >= 1:
            if self._degraded:
                self._degraded = False
                log.warning("a replica acknowledges commits again: commit points wait for it again")
            return
        self.timeouts += 1
        with self._lock:
            self._skip_until = time.monotonic() + SKIP_AFTER_TIMEOUT_S
            if not self._degraded:  # said once per spell (a primary left without replicas stays so)
                self._degraded = True
                log.warning("no replica acknowledged a commit within %d ms (replica down, lagging or cut off, or "
                            "promoted by a failover): commit points wait only once every %.0f s until one does; "
                            "a failover meanwhile may lose their last writes", self.timeout_ms, SKIP_AFTER_TIMEOUT_S)
