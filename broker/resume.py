"""Whether a new attempt may continue its predecessor's env instance: one pure rule, read by the
attempt (workers/attempt.py) with what START returned.

A worker that dies, or stalls past its lease, leaves an episode half run. Its env instance
lives on in the env server; what the attempt had done is in the ledger's progress snapshot
(``broker.records.Progress``, written fenced by its lease at each point of the step loop). The
successor continues from there, on the same instance, when it is safe:

* the predecessor can no longer call the env: START hands out an attempt only once the previous
  lease has lapsed by the rule every worker fences itself with (it calls nothing past its own
  clock's view of the lease; ``step`` is preceded by a fenced ``stepping`` write, which a
  lapsed lease refuses);
* its last env call is known to have ended: the snapshot is ``ready`` (the next
  ``get_task_prompt`` was never sent) or ``prompted`` (the prompt came back, is kept in the
  snapshot, and its ``step`` was never sent). ``prompting`` and ``stepping`` mean a call whose
  outcome is unknown: ``get_task_prompt`` and ``step`` are not idempotent on real servers, so it
  cannot be sent again;
* the instance still exists: found out at the successor's first env call (a 404 there means an
  env server that restarted meanwhile; the runner then starts afresh within the attempt).

Otherwise the attempt resets a fresh instance and starts from turn one, as before, and says why
(``broker.states.ResumeNote``) in its attempt record.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.records import Progress
from broker.states import ProgressPhase, ResumeNote

#: Snapshots a successor may continue from: no env call can be in flight there.
RESUMABLE = frozenset({ProgressPhase.READY, ProgressPhase.PROMPTED})


@dataclass(frozen=True)
class Start:
    """How an attempt begins: from ``resume`` (its predecessor's snapshot: same instance, same
    trajectory) or afresh, ``note`` saying why not when there was a predecessor."""

    resume: Progress | None = None
    note: str = ""


def decide(progress: Progress | None, *, had_predecessor: bool, enabled: bool, inproc: bool) -> Start:
    if not had_predecessor and progress is None:
        return Start()  # a first attempt: nothing to continue
    if not enabled or inproc or progress is None:
        # resume off for the job; an inproc env died with its worker process; or the predecessor
        # kept no snapshot (it died before its first env call answered, or ran older code)
        return Start(note=ResumeNote.NOT_RESUMABLE)
    if progress.phase not in RESUMABLE:
        return Start(note=ResumeNote.CALL_IN_FLIGHT)
    return Start(resume=progress)
