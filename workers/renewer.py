"""The lease renewer: keeps alive the leases of the attempts a worker process runs, and the
reservations of the episodes it received but has not started.

It does nothing else on its thread (sweeps have their own, broker/recovery.py), so a long
reconcile can never hold up a renewal. One pipeline per round renews every lease of the
process; a lease whose token no longer matches is flagged lost, and its attempt stops.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis

from broker.duty import Duty
from broker.lease import Lease
from broker.ledger import Ledger


log = logging.getLogger("interactor.renewer")


class LeaseRenewer(Duty):
    name = "lease-renewer"

    def __init__(self, ledger: Ledger, interval_s: float):
        super().__init__(interval_s)
        self.ledger = ledger
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        # Members received from the broker and not started yet. Their reservations are
        # written on the next round: a task usually starts at once and then never needs one,
        # and a worker that dies before that round took the message with it: reconcile finds
        # the episode queued with no message and no reservation, and sends it again.
        self._received: set[str] = set()
        self._reserved: set[str] = set()
        # The members the broker's consumer still holds (Celery's reserved requests), when the
        # process has one: a delivery it let go of without the runtime hearing of it (a task that
        # failed before START, requests dropped on a broker connection loss) is no longer
        # renewed, so its reservation lapses and the sweeper sends the episode again.
        self.in_hand: Callable[[], set[str]] | None = None
        self.last_renewed = time.monotonic()  # when a round last succeeded
        self.failing_since: float | None = None  # first failed round of the current Redis outage

    # --- bookkeeping, called by the runtime ----------------------------------------------
    def hold(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.token] = lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(lease.token, None)

    def received(self, member: str) -> None:
        with self._lock:
            self._received.add(member)

    def started(self, member: str) -> None:
        with self._lock:
            self._received.discard(member)
            self._reserved.discard(member)

    def live(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    # --- one round -----------------------------------------------------------------------
    def tick(self) -> None:
        held = self.in_hand() if self.in_hand is not None else None
        with self._lock:
            if held is not None:
                let_go = self._received - held
                self._received -= let_go
                self._reserved -= let_go
            leases = list(self._leases.values())
            new = [m for m in self._received if m not in self._reserved]
            written = [m for m in self._received if m in self._reserved]
            self._reserved.update(new)
        since = time.monotonic() - self.last_renewed
        if leases and since > 2 * self.interval_s and self.failing_since is None:
            # Not Redis (that would be failing_since): this process did not get to run the round
            # in time. Worth a line: leases fence their attempts by this very gap.
            log.warning("lease renewal round %.2fs after the last one (every %.2fs planned): the process "
                        "was starved of CPU or stopped", since, self.interval_s)
        try:
            self.ledger.renew(leases)
            self.ledger.reserve(new)
            gone = self.ledger.renew_reservations(written)
        except redis.RedisError:
            if self.failing_since is None:
                self.failing_since = time.monotonic()
                log.error("lease renewal failed: Redis unreachable; running episodes pause before their next call "
                          "until it is back (they fence themselves by their own clock)")
            with self._lock:  # reservations not written: write them on the next round
                self._reserved.difference_update(new)
            raise
        if self.failing_since is not None:
            log.warning("lease renewal works again after %.0fs", time.monotonic() - self.failing_since)
            self.failing_since = None
        if gone:
            with self._lock:
                self._received -= gone
                self._reserved -= gone
        self.last_renewed = time.monotonic()
