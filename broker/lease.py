"""A lease: the right to run one attempt of one episode, as the ledger hands it out
(broker/ledger.py ``start``) and the worker keeps it (workers/renewer.py renews it, an attempt
checks it before every call: workers/attempt.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from broker.keys import member


@dataclass
class Lease:
    """The right to run one attempt of one episode; lost when its token stops matching.

    ``attempt_id`` is the attempt's own random token (broker/records.py): the lease token
    carries it, and so does every record of the attempt."""

    job_id: str
    episode_id: str
    attempt: int
    token: str
    attempt_id: str = ""
    lost: threading.Event = field(default_factory=threading.Event)
    # Set by a renewal that found the job cancelled (broker/cancel.py): the attempt stops at its
    # next call and closes as cancelled.
    cancelled: threading.Event = field(default_factory=threading.Event)
    ttl_s: float = 30.0
    # Until when (time.monotonic()) the lease certainly still holds, by this process's own
    # clock: its last successful renewal's send time plus the TTL, less a margin. An attempt
    # past it stops calling anything until a renewal lands (fence by local time: a stalled or
    # partitioned worker cannot act on a lease that may have passed to another attempt).
    valid_until: float = 0.0

    def __post_init__(self) -> None:
        if not self.valid_until:
            self.renewed(time.monotonic())

    @property
    def member(self) -> str:
        return member(self.job_id, self.episode_id)

    @property
    def attempt_value(self) -> str:
        """What the ledger keeps for this attempt: ``"<attempt>:<attempt_id>"``."""
        return f"{self.attempt}:{self.attempt_id}"

    def renewed(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` (monotonic) succeeded."""
        margin = min(2.0, self.ttl_s / 4)
        self.valid_until = max(self.valid_until, sent_at + self.ttl_s - margin)

    def valid(self) -> bool:
        return not self.lost.is_set() and time.monotonic() < self.valid_until
