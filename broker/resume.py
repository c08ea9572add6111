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
  env server that restarted meanwhile; the attempt then starts afresh, within itself);
* a ``prompted`` snapshot is the last word: the ``stepping`` write before a ``step`` waits for a
  replica where replica waits are on (workers/publisher.py), and a snapshot written before an
  outage or a failover the sweep clock recorded is not trusted to be (``outage_since``), since
  Redis may have lost what came after it.

Otherwise the attempt resets a fresh instance and starts from turn one, as before, and says why
(``broker.states.ResumeNote``) in its attempt record.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.records import EpisodeSpec, Progress
from broker.states import EnvProtocol, ProgressPhase, ResumeNote

#: Snapshots a successor may continue from: no env call can be in flight there.
RESUMABLE = frozenset({ProgressPhase.READY, ProgressPhase.PROMPTED})


def outlives_worker(spec: EpisodeSpec) -> bool:
    """Whether an env instance of ``spec`` can outlive the worker that drives it, so that a
    successor may continue it: an instance on an env server of the original protocol can (the
    env keeps the conversation); an inproc env dies with its process, an OpenEnv session with
    its WebSocket (the server destroys a session when its socket closes: openenv's
    http_server.py ``websocket_endpoint``), and an ORS session, which its server keeps, is
    half an episode: the conversation, the tools' results in it, is the worker's
    (workers/ors_port.py). Those start afresh, ``not_resumable``."""
    return spec.transport != "inproc" and spec.protocol == EnvProtocol.ORIGINAL


@dataclass(frozen=True)
class Start:
    """How an attempt begins: from ``resume`` (its predecessor's snapshot: same instance, same
    trajectory) or afresh, ``note`` saying why not when there was a predecessor."""

    resume: Progress | None = None
    note: str = ""


def decide(progress: Progress | None, *, had_predecessor: bool, enabled: bool, inproc: bool,
           outage_since: bool = False) -> Start:
    """``outage_since``: the sweep clock recorded an outage or a failover after ``progress`` was
    written (START says so)."""
    if not had_predecessor and progress is None:
        return Start()  # a first attempt: nothing to continue
    if not enabled or inproc:
        # resume off for the job; an inproc env died with its worker process
        return Start(note=ResumeNote.NOT_RESUMABLE)
    if progress is None:
        # the predecessor closed its own trajectory, or kept no snapshot (it died before its
        # first step was recorded, or ran older code)
        return Start(note=ResumeNote.NOTHING_KEPT)
    if progress.phase not in RESUMABLE:
        return Start(note=ResumeNote.CALL_IN_FLIGHT)
    if progress.phase == ProgressPhase.PROMPTED and outage_since:
        # The ``stepping`` write that may have followed it is the one write a failover to a
        # replica behind (or a restart that lost its last second of log) could have taken with
        # it: the step may have been sent. ``ready`` needs no such care: it is written with the
        # step's record, and the snapshot before it says the step may be in flight.
        return Start(note=ResumeNote.OUTAGE_SINCE_SNAPSHOT)
    return Start(resume=progress)


# --- the model: every point a worker can stop at, and where its successor starts ------------------
# One tracked turn k (k >= 2) of the step loop (workers/loop.py), in order, as the fleet sees it:
# the env calls sent, and the ledger writes (the prompted snapshot and a step's record go in the
# background, in order; the stepping snapshot is waited for, and with replica waits on, waits for
# a replica too). A fault hook in the attempt (workers/faults.py) stops a real worker at each
# point; tests/test_fault_points.py drives them and tests/test_resume_rules.py checks this table.
TURN_POINTS: tuple[str, ...] = (
    "before_prompt",        # the previous step's record queued; get_task_prompt not sent
    "after_prompt",         # get_task_prompt answered; the prompted snapshot queued
    "after_model",          # the model answered; the stepping snapshot not written
    "after_stepping_mark",  # the stepping snapshot in Redis; step not sent
    "after_step",           # step answered (applied by the env); its record not queued
    "after_publish",        # the step's record queued (alone: no snapshot goes with it)
)

# What is true at each point: (get_task_prompt k sent, step k sent, the last snapshot write issued, whether
# that write is waited for). A background write issued may or may not have landed when a worker
# dies; the one before it has (writes land in order, and a waited one is in Redis before the loop
# goes on).
_POINT_FACTS: dict[str, tuple[bool, bool, tuple[ProgressPhase, int] | None, bool]] = {
    "before_prompt": (False, False, (ProgressPhase.STEPPING, -1), True),
    "after_prompt": (True, False, (ProgressPhase.PROMPTED, 0), False),
    "after_model": (True, False, (ProgressPhase.PROMPTED, 0), False),
    "after_stepping_mark": (True, False, (ProgressPhase.STEPPING, 0), True),
    "after_step": (True, True, (ProgressPhase.STEPPING, 0), True),
    "after_publish": (True, True, (ProgressPhase.STEPPING, 0), True),
}
# the snapshot write before each of those (what the ledger holds when the last one has not landed)
_BEFORE = {ProgressPhase.PROMPTED: (ProgressPhase.STEPPING, -1), ProgressPhase.STEPPING: (ProgressPhase.PROMPTED, 0)}

#: How a worker stops: killed (nothing more runs), stopped at shutdown (it hands the episode back
#: at its next check, with the exact point it stands at: ``ProgressTrack.at_rest``), or killed
#: with its last write lost by Redis (a failover to a replica behind, a restart that lost the last
#: second of its log: the sweep clock records both).
FAULTS = ("killed", "stopped", "write_lost")


@dataclass(frozen=True)
class Outcome:
    """Where the successor of a worker stopped at a point of turn ``k`` starts: ``resume_at``
    (phase, step) on the same instance, or afresh (``note`` says why); and whether that is safe:
    no env call sent twice."""

    resume_at: tuple[str, int] | None
    note: str
    prompt_sent_twice: bool
    step_sent_twice: bool


def successor_at(point: str, fault: str, *, replica_wait: bool, landed: bool = True, k: int = 3) -> Outcome:
    """The model: the snapshot a successor finds after ``fault`` at ``point`` of turn ``k`` (the
    last background write ``landed`` or not), what :func:`decide` makes of it, and whether the
    calls it would send were sent before."""
    prompt_sent, step_sent, (phase, offset), waited = _POINT_FACTS[point]
    last = (phase, k + offset)
    before = (_BEFORE[phase][0], k + offset + _BEFORE[phase][1])
    outage = False
    if fault == "stopped":
        # handed back at the next check with where it stands between calls (an answered call
        # whose answer is not kept yet leaves nothing exact: the snapshot in Redis stays)
        snapshot = {"before_prompt": (ProgressPhase.READY, k), "after_prompt": (ProgressPhase.PROMPTED, k),
                    "after_model": (ProgressPhase.PROMPTED, k), "after_stepping_mark": None,
                    "after_step": None, "after_publish": (ProgressPhase.READY, k + 1)}[point]
        if snapshot is None:  # the step goes out before the next check: its record follows, then READY k+1
            snapshot = (ProgressPhase.READY, k + 1)
            step_sent = True
    elif fault == "write_lost":
        if waited and replica_wait:
            snapshot = last  # on a replica before the loop went on: a failover keeps it
        else:
            snapshot = before
        outage = True
    else:
        snapshot = last if (landed or waited) else before
    start = decide(Progress(trajectory="1:a", phase=snapshot[0], step=snapshot[1]), had_predecessor=True,
                   enabled=True, inproc=False, outage_since=outage)
    if start.resume is None:
        return Outcome(None, start.note, False, False)
    phase_at, step_at = start.resume.phase, start.resume.step
    # a successor continuing at READY j sends get_task_prompt j, at PROMPTED j the step j
    prompt_twice = phase_at == ProgressPhase.READY and (step_at < k or (step_at == k and prompt_sent))
    step_twice = (step_at < k) or (step_at == k and step_sent)
    return Outcome((phase_at, step_at), "", prompt_twice, step_twice)
