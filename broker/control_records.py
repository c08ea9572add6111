"""The records of changes made to a job while it lives, beside broker/records.py's (same
msgpack map with ``kind`` and ``v``, added within version 5; kept here because records.py is
at its size limit): :class:`EpisodeRerun`, a completed episode sent to run again
(broker/rerun.py), and :class:`AuditEntry`, one change made to a job (broker/audit.py), the
durable copy of its Redis audit log. Importing this module makes ``broker.records.unpack`` know
their kinds (the results store's planner imports it); a reader that does not know a kind parks
the record as poison: an older consumer keeps the first trajectory and stores no audit entry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

from broker.records import _KINDS, _Record


@dataclass
class EpisodeRerun(_Record):
    """A completed episode sent to run again as a new attempt (broker/rerun.py): the store sets
    the trajectory it completed with aside (``superseded_steps``, reason ``rerun``) unless that
    trajectory's attempt is numbered above ``after_attempt`` (the attempts the ledger had
    counted when the rerun was made: a later attempt is the rerun's own)."""

    KIND: ClassVar[str] = "episode_rerun"
    job_id: str
    episode_id: str
    after_attempt: int
    at: float = field(default_factory=time.time)
    who: str = ""


@dataclass
class AuditEntry(_Record):
    """One change made to a job (broker/audit.py): when, who, what; ``detail`` the JSON text of
    what changed. ``entry_id`` makes storing it again harmless."""

    KIND: ClassVar[str] = "audit_entry"
    job_id: str
    entry_id: str
    at: float
    who: str
    action: str
    detail: str = "{}"


_KINDS.update({cls.KIND: cls for cls in (EpisodeRerun, AuditEntry)})
