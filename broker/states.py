"""Every state and outcome the system names, in one place: the vocabulary of the ledger, of an
attempt's close, of a stored episode row, of an episode's end, of an attempt's phases, of the
close policy and of a feed group.

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


#: The ledger's states that end an episode (re-driving a failed one starts it over).
LEDGER_FINAL = frozenset({LedgerState.DONE, LedgerState.FAILED})
#: The ledger's states of an episode not yet running: counted as the job's backlog.
LEDGER_WAITING = frozenset({LedgerState.QUEUED, LedgerState.RETRYING})


class AttemptStatus(StrEnum):
    """How one attempt closed (``AttemptRecord.status``, the ``attempts`` table)."""

    COMPLETED = "completed"  # the episode ended normally; its trajectory is this attempt's
    RETRYING = "retrying"  # transient failure; a fresh attempt is scheduled
    FAILED = "failed"  # permanent failure or attempts exhausted: dead-lettered
    ABANDONED = "abandoned"  # lease lost or handed back at shutdown; another attempt takes over


class StoredStatus(StrEnum):
    """An episode row's status in the results store (consumer/storage/plan.py decides it)."""

    RUNNING = "running"  # steps are arriving
    COMPLETING = "completing"  # its completed close is recorded, its steps not all stored yet
    COMPLETED = "completed"  # every step of the completed attempt is stored
    RETRYING = "retrying"  # its last attempt closed without completing; another one follows
    FAILED = "failed"  # dead-lettered


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


class CloseAction(StrEnum):
    """What the close policy (broker/closing.py ``decide``) says to do with an attempt that did
    not complete."""

    ABANDON = "abandon"  # the lease is lost: whoever holds it now owns the episode; record nothing
    HAND_BACK = "hand_back"  # the worker is shutting down: queued again at once, the attempt not counted
    RETRY = "retry"  # another attempt (the runner after a back-off, the sweeper at once)
    FAIL = "fail"  # failed for good: the attempt failed, the episode dead-lettered


class FeedGroupStatus(StrEnum):
    """A group as the rollout feed announces it (``FeedGroup.status``)."""

    READY = "ready"  # every member completed
    FAILED = "failed"  # a member was dead-lettered


_LUA_NAME = re.compile(r"\$([A-Z][A-Z_]*)\b")


def lua(script: str) -> str:
    """``script`` with each ``$NAME`` replaced by the quoted Lua string of ``LedgerState.NAME``
    (``$RUNNING`` -> ``'running'``), so the ledger's scripts compare and write the very states
    Python reads. A name that is not a state fails at import, not in Redis. Lua's own ``$`` (the
    end-of-string anchor in a pattern) is never followed by a capital letter and is left alone."""

    def quoted(m: re.Match) -> str:
        try:
            return f"'{LedgerState[m.group(1)].value}'"
        except KeyError:
            raise ValueError(f"Lua script names ${m.group(1)}, which is not a LedgerState") from None

    return _LUA_NAME.sub(quoted, script)


__all__ = ["LEDGER_FINAL", "LEDGER_WAITING", "AttemptStatus", "CloseAction", "EndedBy", "LedgerState",
           "FeedGroupStatus", "Phase", "StoredStatus", "lua"]
