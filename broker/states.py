"""Every state and outcome the system names, in one place: the vocabulary of the ledger, of an
attempt's close, of a stored episode row, of an episode's end, of an attempt's phases, of the
close policy, of a resumable attempt's progress, of a feed group and of a continuous job's
producer.

Each vocabulary is a :class:`~enum.StrEnum`. A member *is* its string (``LedgerState.FAILED ==
"failed"``, same hash), so it goes unchanged into Redis, msgpack, JSON, SQL parameters and
count-dict keys, and a value read back from any of them compares equal to the member. What the
classes add is the name of the vocabulary: ``LedgerState.FAILED`` (the ledger's),
``AttemptStatus.FAILED`` (an attempt's close) and ``StoredStatus.FAILED`` (a results-table row) are
one string but three facts, and a reader sees which one a line means.

Where a state must appear inside text that Python does not evaluate - a Lua script, an SQL
statement - it is put there from here: :func:`lua` for the ledger's scripts, an f-string with the
member for SQL (the members are constants of ours, never user input). So no state is spelled as a
bare string anywhere else; ``tests/test_states.py`` holds the code to that.

The strings themselves are part of the wire and the stored tables (docs/protocol.md): readers of
the original system's tables, trainers and dashboards match on them. Never rename a value.
"""

from __future__ import annotations

import re
from enum import StrEnum


class LedgerState(StrEnum):
    """An episode's state in the ledger (broker/ledger.py): the job's state hash and counts."""

    QUEUED = "queued"  # on a queue, waiting for a worker (first attempt, or re-driven)
    RUNNING = "running"  # a worker holds its lease
    RETRYING = "retrying"  # an attempt failed transiently; the next one waits for its back-off
    DONE = "done"  # an attempt completed it
    FAILED = "failed"  # failed for good: dead-lettered
    CANCELLED = "cancelled"  # its job was cancelled before it ended (broker/cancel.py); never runs again


#: The ledger's states that end an episode (re-driving a failed one starts it over; a cancelled
#: one stays cancelled).
LEDGER_FINAL = frozenset({LedgerState.DONE, LedgerState.FAILED, LedgerState.CANCELLED})
#: The ledger's states of an episode not yet running: counted as the job's backlog.
LEDGER_WAITING = frozenset({LedgerState.QUEUED, LedgerState.RETRYING})


class AttemptStatus(StrEnum):
    """How one attempt closed (``AttemptRecord.status``, the ``attempts`` table)."""

    COMPLETED = "completed"  # the episode ended normally; its trajectory is this attempt's
    RETRYING = "retrying"  # transient failure; a fresh attempt is scheduled
    FAILED = "failed"  # permanent failure or attempts exhausted: dead-lettered
    ABANDONED = "abandoned"  # lease lost or handed back at shutdown; another attempt takes over
    CANCELLED = "cancelled"  # its job was cancelled: stopped at a call boundary; not a failure, no dead letter


class StoredStatus(StrEnum):
    """An episode row's status in the results store (consumer/storage/plan.py decides it)."""

    RUNNING = "running"  # steps are arriving
    COMPLETING = "completing"  # its completed close is recorded, its steps not all stored yet
    COMPLETED = "completed"  # every step of the completed attempt is stored
    RETRYING = "retrying"  # its last attempt closed without completing; another one follows
    FAILED = "failed"  # dead-lettered
    CANCELLED = "cancelled"  # its job was cancelled before it ended (waiting, or stopped while it ran)


class EndedBy(StrEnum):
    """Why a completed episode ended (``ended_by`` of its final step and of its attempt's close)."""

    TERMINATED = "terminated"  # the env said so (its goal reached or lost)
    TRUNCATED = "truncated"  # the env cut it off (its own turn limit)
    LENGTH = "length"  # the model's answer was cut off (finish_reason "length")
    # the prompt outgrew the model's context window: the server refused it (broker.errors.ContextOverflow)
    CONTEXT_LENGTH = "context_length"
    EMPTY_PROMPT = "empty_prompt"  # the env had no prompt to give
    MAX_STEPS = "max_steps"  # the job's max_steps was reached


class Phase(StrEnum):
    """Where an attempt's time went (records v5 timings, the phase_seconds histogram). The
    stored column of a phase is ``<phase>_s``, as AttemptRecord names its field."""

    QUEUE_WAIT = "queue_wait"
    RESET = "reset"
    PROMPT = "prompt"
    MODEL = "model"
    ENV_STEP = "env_step"
    CLOSE = "close"


class ProgressPhase(StrEnum):
    """Where a running attempt stands in its step loop, as the ledger keeps it for a successor
    (``Progress.phase``, broker/resume.py): whether its last env call is known to have ended.
    ``get_task_prompt`` and ``step`` are not idempotent, so only a point where no env call can
    be in flight is one a successor may continue from."""

    READY = "ready"  # step k's get_task_prompt not sent yet (the step before it is recorded)
    PROMPTING = "prompting"  # step k's get_task_prompt may be in flight
    PROMPTED = "prompted"  # step k's prompt answered and kept with the progress; its step not sent
    STEPPING = "stepping"  # step k's step may be in flight


class ResumeNote(StrEnum):
    """Why an attempt did not continue its predecessor's env instance (``AttemptRecord.resume_note``):
    it started a fresh one from turn one, as every attempt did before episodes were resumable."""

    CALL_IN_FLIGHT = "call_in_flight"  # the predecessor died inside get_task_prompt or step: outcome unknown
    INSTANCE_GONE = "instance_gone"  # the env server no longer has the instance (it restarted)
    # the job's episodes are not continued: resume off, an inproc env, or an OpenEnv session (it
    # lives only as long as its WebSocket, which died with the worker)
    NOT_RESUMABLE = "not_resumable"
    # the attempt before left nothing to continue: it closed its own instance (it failed, its close
    # said so), or it died before its first step was recorded (snapshots begin at the second)
    NOTHING_KEPT = "nothing_kept"
    # prompted before an outage or a failover: the ``stepping`` write that may have followed could be lost
    OUTAGE_SINCE_SNAPSHOT = "outage_since_snapshot"


class EnvProtocol(StrEnum):
    """What an env server speaks (a task entry's ``protocol``, ``EpisodeSpec.protocol``):
    docs/environments.md#environments-from-other-ecosystems."""

    ORIGINAL = ""  # the original system's protocol (docs/protocol.md#environment-server): the default
    OPENENV = "openenv"  # OpenEnv's create_app servers: a WebSocket session per episode (workers/openenv_port.py)
    ORS = "ors"  # the Open Reward Standard: HTTP sessions, tool calls answered over SSE (workers/ors_port.py)


class StartStatus(StrEnum):
    """What became of a delivery before any attempt ran: the ledger's START answer
    (``Ledger.start``), or ``parked`` when the worker did not send it (its job is paused,
    broker/pause.py). Anything but ``ok`` drops the delivery and counts nothing."""

    OK = "ok"  # an attempt started under a fresh lease
    BUSY = "busy"  # another attempt holds the episode's lease
    FINISHED = "finished"  # the episode ended already: a stale message
    UNKNOWN = "unknown"  # the ledger has no such episode
    REFUSED = "refused"  # its job was cancelled: nothing of it starts
    PARKED = "parked"  # its job is paused: handed back before START, until `interactor resume`


class CloseAction(StrEnum):
    """What the close policy (broker/closing.py ``decide``) says to do with an attempt that did
    not complete."""

    ABANDON = "abandon"  # the lease is lost: whoever holds it now owns the episode; record nothing
    HAND_BACK = "hand_back"  # the worker is shutting down: queued again at once, the attempt not counted
    RETRY = "retry"  # another attempt (the attempt's close after a back-off, the sweeper at once)
    FAIL = "fail"  # failed for good: the attempt failed, the episode dead-lettered
    CANCEL = "cancel"  # the job was cancelled: the episode ends cancelled, the attempt neither failed nor counted


class FeedGroupStatus(StrEnum):
    """A group as the rollout feed announces it (``FeedGroup.status``)."""

    READY = "ready"  # every member completed
    FAILED = "failed"  # a member was dead-lettered


class ProducerState(StrEnum):
    """A continuous job's producer as it reports itself (``Keys.feed_producer``, broker/feed.py
    ``producer_status``)."""

    RUNNING = "running"  # producing, or waiting for the trainer to take
    BACKING_OFF = "backing_off"  # its last round failed (logged, counted); it tries again after a pause
    STOPPED = "stopped"  # its feed server stopped it (or its job's feed is gone)
    SILENT = "silent"  # not heard from for a while: the process that ran it is gone or stuck (read side only)


_LUA_NAME = re.compile(r"\$([A-Z][A-Z_]*)\b")


def lua(script: str) -> str:
    """``script`` with each ``$NAME`` replaced by the quoted Lua string of ``LedgerState.NAME``
    (``$RUNNING`` -> ``'running'``), and each ``$START_NAME`` by that of ``StartStatus.NAME``
    (``$START_BUSY`` -> ``'busy'``, START's answers), so the ledger's scripts compare and write
    the very states Python reads. A name that is neither fails at import, not in Redis. Lua's own
    ``$`` (the end-of-string anchor in a pattern) is never followed by a capital letter and is
    left alone."""

    def quoted(m: re.Match) -> str:
        name = m.group(1)
        try:
            if name.startswith("START_"):
                return f"'{StartStatus[name[len('START_'):]].value}'"
            return f"'{LedgerState[name].value}'"
        except KeyError:
            raise ValueError(f"Lua script names ${name}, which is neither a LedgerState nor START_ and a "
                             "StartStatus") from None

    return _LUA_NAME.sub(quoted, script)


__all__ = ["LEDGER_FINAL", "LEDGER_WAITING", "AttemptStatus", "CloseAction", "EndedBy", "LedgerState",
           "FeedGroupStatus", "Phase", "ProducerState", "StartStatus", "StoredStatus", "lua"]
