"""What one batch of records does to the database, decided in plain Python (every backend
applies the same plan, so the rules below hold on SQLite and PostgreSQL alike).

The rules (docs/protocol.md, "What is stored"):

* ``session_steps`` (the original table) holds, for each episode, the rows of exactly one
  attempt: the one running now, or the one that completed the episode. Rows of any other
  attempt live in ``superseded_steps`` with the reason they are not the trajectory.
* An attempt is named by its number and its ``attempt_id`` (a random token). The episode's
  *current* attempt is the newest one seen: the higher number, or, for the same number under two
  ids (a Redis rollback issued one number twice), the run that started later. A step of an
  older attempt is set aside; a step of a newer one moves the older one's rows aside.
* The first completion wins: once an attempt's completion is stored, no other attempt's steps
  enter ``session_steps``, whatever the ledger later says (a lost write in Redis can re-run an
  episode that already completed; the database keeps the first trajectory).
* A completion is never set aside for its number. The ledger writes a completion only while the
  attempt holds the lease, so every completion in the stream completed the episode; numbers
  can repeat or go down (a Redis rollback that lost two STARTs numbers the re-run 1 again), and
  worker clocks that break a tie can be wrong. So while the store holds no completion for the
  episode, the completion of an attempt the numbers called older becomes the episode's: its
  rows set aside so far come back to ``session_steps`` and the current attempt's leave it. A
  dead letter (a ``failed`` close) of such an attempt likewise fails the episode: the ledger
  holds it failed, and a database still saying running would leave its job unfinished. (A
  re-driven attempt arriving after it takes over again, by its higher number.)
* An attempt that closes without completing (retrying, failed) has its rows moved aside; a
  failed episode keeps no rows in ``session_steps``. An *abandoned* attempt (its worker died or
  handed it back) keeps them: the next attempt may continue its trajectory (broker/resume.py).
  A continuing attempt records its steps under the trajectory's attempt number and id, so they
  join the rows already there; its own close names the trajectory (``AttemptRecord.trajectory``)
  and is routed by it. A next attempt that starts afresh is a newer attempt, and moves them aside.
* A cancelled episode (its job was cancelled, broker/cancel.py) keeps no rows in
  ``session_steps`` either. It ends by its running attempt's ``cancelled`` close, or, while it
  waited, by an ``EpisodesCancelled`` record naming the attempt the ledger last started, which
  the cancel closes: steps of that attempt arriving later are set aside, its other closes change
  nothing. Only a completion changes a cancelled episode (what completed is never lost), and a
  cancel changes nothing of a completed or failed one.
* A rerun (``interactor job JOB rerun``, broker/rerun.py; an ``EpisodeRerun`` record, written
  before any step of the new attempt) undoes the first-completion rule once: the completed
  trajectory's rows move to ``superseded_steps`` as ``rerun``, the episode is ``retrying``
  (reason ``rerun``) and the next attempt's steps and completion are its trajectory. A rerun
  whose completion is of an attempt above the record's ``after_attempt`` changes nothing (it is
  the rerun's own: the record stored again). Rows of the new attempt stored before the record
  (several consumers commit out of order) come back when the new attempt takes over.
* A completed attempt whose steps are not all stored yet is ``completing``; it becomes
  ``completed`` when the last step arrives (with several consumers, steps and the close may be
  committed in any order). The consumer re-runs a completion whose steps were lost in Redis.

Redelivery of a batch changes nothing: every insert is keyed and ignores a duplicate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from broker import errors
from broker.errors import STEPS_LOST
from broker.control_records import AuditEntry, EpisodeRerun
from broker.records import AttemptRecord, EpisodesCancelled, EpisodesEnqueued, EpisodeSpec, JobSpec, StepRecord
from broker.states import AttemptStatus, StoredStatus

# The row status an attempt's close (other than completed) leaves its episode in.
_CLOSED_STATUS = {AttemptStatus.FAILED: StoredStatus.FAILED, AttemptStatus.RETRYING: StoredStatus.RETRYING,
                  AttemptStatus.ABANDONED: StoredStatus.RETRYING, AttemptStatus.CANCELLED: StoredStatus.CANCELLED}
# The row statuses that keep their finish time (the episode ended).
_ENDED = (StoredStatus.FAILED, StoredStatus.CANCELLED)

# Why rows are in superseded_steps (superseded_steps.superseded_reason).
SUPERSEDED = "superseded"  # a newer attempt took over
STALE = "stale"  # a step of an attempt older than the current one, arriving late
ROLLED_BACK = "rolled_back"  # the same attempt number ran twice (Redis lost writes); the earlier run
COMPLETED_BY_OTHER = "completed_by_other"  # the episode was completed by another attempt first
RERUN = errors.RERUN  # the episode was run again (interactor job rerun): its earlier completed trajectory
# STEPS_LOST (broker/errors.py): completed, but some of its steps never reached the database


def closed_reason(close: AttemptRecord) -> str:
    """The superseded reason of an attempt that closed without completing: ``closed:<status>``
    plus the failure reason when there is one, e.g. ``closed:retrying:env_unreachable``."""
    return f"closed:{close.status}" + (f":{close.reason}" if close.reason else "")


@dataclass
class EpisodeState:
    """One episodes row, as the planner reads and writes it."""

    episode_id: str
    job_id: str = ""
    group_id: str = ""
    env_name: str = ""
    llm_model: str = ""
    status: str = StoredStatus.RUNNING
    attempt: int = 0  # the current attempt's number (0: none seen)
    attempt_id: str = ""
    attempt_started: float | None = None
    attempt_closed: str = ""  # the current attempt's close status ("" while it runs)
    completed_attempt_id: str = ""
    attempts: int = 0  # the highest attempt number seen
    total_reward: float = 0.0
    steps: int = 0
    expected_steps: int = 0  # steps the completed attempt reported
    reason: str | None = None
    error_class: str | None = None
    error: str | None = None
    ended_by: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    group_size: int = 0
    close_entry: str = ""  # stream id of the completed close (to tell lost steps from late ones)
    reopens: int = 0  # times a completion of this episode was set aside because its steps were lost
    new: bool = False  # not in the database yet
    loaded_attempt_id: str = ""  # the current attempt when loaded (its rows may be stored)
    loaded_status: str = ""
    loaded_reward: float | None = None

    COLUMNS = ("episode_id", "job_id", "group_id", "env_name", "llm_model", "status", "attempt", "attempt_id",
               "attempt_started", "attempt_closed", "completed_attempt_id", "attempts", "total_reward", "steps",
               "expected_steps", "reason", "error_class", "error", "ended_by", "prompt_tokens",
               "completion_tokens", "started_at", "finished_at", "group_size", "close_entry", "reopens")

    @property
    def placeholder(self) -> bool:
        """A row made only to be locked (PostgreSQL, an episode's first batch), nothing in it."""
        return not self.attempt_id and not self.attempts and not self.job_id

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> "EpisodeState":
        st = cls(*row)
        st.loaded_attempt_id = st.attempt_id
        st.loaded_status = st.status
        st.loaded_reward = st.total_reward
        return st

    def row(self, now: float) -> tuple:
        duration = (self.finished_at - self.started_at
                    if self.finished_at is not None and self.started_at is not None else None)
        return tuple(getattr(self, c) for c in self.COLUMNS) + (max(0.0, duration) if duration is not None else None,
                                                                 now)


@dataclass(frozen=True)
class Cancel:
    """One episode of an :class:`~broker.records.EpisodesCancelled` record: cancelled while it
    waited; ``attempt``/``attempt_id``: the attempt the ledger last started (0, "": none)."""

    job_id: str
    episode_id: str
    group_id: str | None
    group_size: int
    env_name: str
    llm_model: str
    attempt: int
    attempt_id: str
    cancelled_at: float

    @classmethod
    def each(cls, rec: EpisodesCancelled) -> list["Cancel"]:
        out = []
        for row in rec.episodes:
            episode_id, group_id, group_size, env_name, attempt, attempt_id = row
            out.append(cls(rec.job_id, str(episode_id), group_id, int(group_size or 0), env_name or "",
                           rec.llm_model, int(attempt or 0), attempt_id or "", float(rec.cancelled_at)))
        return out


@dataclass
class Batch:
    """A batch of records sorted by kind, in stream order within each episode."""

    jobs: list[JobSpec] = field(default_factory=list)
    announced: list[EpisodesEnqueued] = field(default_factory=list)
    events: dict[str, list[tuple[Any, str]]] = field(default_factory=dict)  # episode -> [(record, entry id)]
    audit: list[AuditEntry] = field(default_factory=list)  # changes made to jobs (consumer/storage/job_audit.py)

    @classmethod
    def collect(cls, records: Iterable[Any], entry_ids: Sequence[str] | None = None) -> "Batch":
        b = cls()
        ids = entry_ids if entry_ids is not None else ()
        for i, r in enumerate(records):
            entry = ids[i] if i < len(ids) else ""
            t = type(r)
            if t is StepRecord:
                b.events.setdefault(r.env_id, []).append((r, entry))
            elif t is AttemptRecord:
                b.events.setdefault(r.episode_id, []).append((r, entry))
            elif t is JobSpec:
                b.jobs.append(r)
            elif t is EpisodesEnqueued:
                b.announced.append(r)
            elif t is EpisodesCancelled:
                for c in Cancel.each(r):
                    b.events.setdefault(c.episode_id, []).append((c, entry))
            elif t is EpisodeRerun:
                b.events.setdefault(r.episode_id, []).append((r, entry))
            elif t is AuditEntry:
                b.audit.append(r)
            elif t is EpisodeSpec:
                pass  # the ledger owns specs
            else:
                raise TypeError(f"cannot store a {t.__name__}")
        return b

    @property
    def episode_ids(self) -> list[str]:
        return sorted(self.events)


@dataclass
class Plan:
    """Row operations, applied in this order: moves, restores, then inserts, then the rest."""

    moves: list[tuple[str, str, str]] = field(default_factory=list)  # (episode, attempt_id, reason)
    # (episode, attempt_id): rows of an attempt whose completion was taken after its rows had
    # been set aside, back from superseded_steps (applied after the moves)
    restores: list[tuple[str, str]] = field(default_factory=list)
    session_steps: list[StepRecord] = field(default_factory=list)
    superseded_steps: list[tuple[StepRecord, str]] = field(default_factory=list)  # (step, reason)
    closes: list[AttemptRecord] = field(default_factory=list)
    states: dict[str, EpisodeState] = field(default_factory=dict)
    failed_after_completion: list[tuple[str, str]] = field(default_factory=list)  # (job, episode)

    def episodes_to_count(self) -> list[str]:
        """Episodes whose stored steps must be counted after the inserts."""
        return sorted(self.states)


def attempt_key(rec: Any) -> str:
    """A record's attempt_id; for records written before attempt ids (v1), ``n<attempt>``."""
    return rec.attempt_id or f"n{rec.attempt}"


class _Planner:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.pending: dict[str, list[StepRecord]] = {}  # episode -> rows queued for session_steps

    # --- attempts -----------------------------------------------------------------------
    def _newer(self, st: EpisodeState, number: int, started: float | None) -> int:
        """+1 when an attempt (number, started) is newer than the current one, -1 older."""
        if number != st.attempt:
            return 1 if number > st.attempt else -1
        if st.attempt_started is None or started is None:
            return 1
        return 1 if started >= st.attempt_started else -1

    def _set_aside_current(self, st: EpisodeState, reason: str) -> None:
        """The current attempt's rows leave session_steps: those queued in this batch go to
        superseded_steps directly, those already stored are moved."""
        for s in self.pending.pop(st.episode_id, ()):
            self.plan.superseded_steps.append((s, reason))
        if st.attempt_id and st.attempt_id == st.loaded_attempt_id:
            self.plan.moves.append((st.episode_id, st.attempt_id, reason))

    def _switch(self, st: EpisodeState, number: int, attempt_id: str, started: float | None, same_number: bool) -> None:
        if st.attempt_id:
            self._set_aside_current(st, ROLLED_BACK if same_number else SUPERSEDED)
        if st.status == StoredStatus.FAILED or st.reason == errors.RERUN:
            # A failed episode taken over (a re-drive; or an attempt that was running when a
            # lower-numbered dead letter was processed after its rows and set them aside): any
            # rows of the attempt set aside so far are its trajectory again.
            self._bring_back(st, attempt_id)
        self._make_current(st, number, attempt_id, started)
        st.attempts = max(st.attempts, number)

    def _route(self, st: EpisodeState, number: int, attempt_id: str, started: float | None) -> str | None:
        """None when the attempt is (now) the current one; else why its rows are set aside."""
        if st.completed_attempt_id:
            return None if attempt_id == st.completed_attempt_id else COMPLETED_BY_OTHER
        if attempt_id == st.attempt_id:
            return None
        order = self._newer(st, number, started)
        if order < 0:
            return ROLLED_BACK if number == st.attempt else STALE
        self._switch(st, number, attempt_id, started, same_number=(number == st.attempt))
        return None

    def _adopt(self, st: EpisodeState, number: int, attempt_id: str, started: float | None, completed: bool) -> None:
        """A completion (or a dead letter) of an attempt other than the current one, with no
        completion stored: that attempt becomes the current one, and completes (its rows set
        aside so far come back) or fails in :meth:`close`."""
        if st.attempt_id:
            self._set_aside_current(st, COMPLETED_BY_OTHER if completed else SUPERSEDED)
        if completed:
            self._bring_back(st, attempt_id)
        self._make_current(st, number, attempt_id, started)

    @staticmethod
    def _make_current(st: EpisodeState, number: int, attempt_id: str, started: float | None) -> None:
        """The episode runs under this attempt now: whatever ended the previous one is forgotten."""
        st.attempt, st.attempt_id, st.attempt_started = number, attempt_id, started
        st.attempt_closed = ""
        st.status = StoredStatus.RUNNING
        st.reason = st.error_class = st.error = st.ended_by = None
        st.finished_at = None

    def _bring_back(self, st: EpisodeState, attempt_id: str) -> None:
        """The attempt's rows set aside so far go (back) to session_steps: those of this batch
        directly, stored ones by a restore."""
        back = [s for s, _ in self.plan.superseded_steps if s.env_id == st.episode_id and attempt_key(s) == attempt_id]
        if back:
            self.plan.superseded_steps = [(s, why) for s, why in self.plan.superseded_steps
                                          if not (s.env_id == st.episode_id and attempt_key(s) == attempt_id)]
            self.pending.setdefault(st.episode_id, []).extend(back)
        self.plan.restores.append((st.episode_id, attempt_id))

    # --- records ------------------------------------------------------------------------
    def step(self, st: EpisodeState, s: StepRecord) -> None:
        attempt_id = attempt_key(s)
        st.attempts = max(st.attempts, s.attempt)
        if st.started_at is None or (s.created_at and s.created_at < st.started_at):
            st.started_at = s.created_at
        why = self._route(st, s.attempt, attempt_id, s.created_at)
        if why is None and st.attempt_closed == AttemptStatus.ABANDONED:
            # its trajectory goes on: continued by the next attempt (or a step its dead worker
            # published just before it died, stored late)
            st.attempt_closed, st.status = "", StoredStatus.RUNNING
            st.reason = st.error_class = st.error = None
        elif why is None and st.attempt_closed and st.attempt_closed != AttemptStatus.COMPLETED:
            why = f"closed:{st.attempt_closed}"
        if why is not None:
            self.plan.superseded_steps.append((s, why))
            return
        if st.attempt_started is None or s.created_at < st.attempt_started:
            st.attempt_started = s.created_at
        self.pending.setdefault(st.episode_id, []).append(s)

    def close(self, st: EpisodeState, c: AttemptRecord, entry: str) -> None:
        if not c.attempt_id:
            c.attempt_id = attempt_key(c)
        self.plan.closes.append(c)
        st.attempts = max(st.attempts, c.attempt)
        if c.group_size and c.group_size > st.group_size:
            st.group_size = c.group_size
        if c.started_at and c.started_at > 0 and (st.started_at is None or c.started_at < st.started_at):
            st.started_at = c.started_at
        # Routed as the trajectory its steps were recorded under (a continuing attempt's is its
        # predecessor's): the rows it completes, or leaves, are that trajectory's.
        number, attempt_id = c.trajectory_key
        started = c.started_at or None
        if c.trajectory and attempt_id == st.attempt_id:
            started = st.attempt_started
        why = self._route(st, number, attempt_id, started)
        if why in (STALE, ROLLED_BACK) and c.status in (AttemptStatus.COMPLETED, AttemptStatus.FAILED):
            self._adopt(st, number, attempt_id, started, completed=c.status == AttemptStatus.COMPLETED)
            why = None
        if why is not None:
            # An older attempt's close, or a close after another attempt's completion: recorded,
            # no effect. A dead letter after a completion means Redis forgot the completion.
            if why == COMPLETED_BY_OTHER and c.status == AttemptStatus.FAILED:
                self.plan.failed_after_completion.append((c.job_id, c.episode_id))
            return
        if st.completed_attempt_id:
            return  # the completing attempt's close, again
        if st.reason == errors.RERUN and attempt_id == st.attempt_id:
            return  # the close of the trajectory a rerun set aside, stored again
        if st.attempt_closed == AttemptStatus.CANCELLED and c.status != AttemptStatus.COMPLETED:
            return  # the job was cancelled: only a completion ends the episode otherwise
        if c.started_at and c.started_at > 0 and not c.trajectory:
            st.attempt_started = c.started_at
        st.attempt_closed = c.status
        if c.status == AttemptStatus.COMPLETED:
            st.completed_attempt_id = attempt_id
            st.expected_steps = c.steps
            st.total_reward = float(c.total_reward or 0.0)
            st.ended_by = c.ended_by or None
            st.finished_at = c.finished_at
            st.close_entry = entry
            st.reason = st.error_class = st.error = None
            return
        if c.status != AttemptStatus.ABANDONED:  # an abandoned trajectory may be continued: its rows stay
            self._set_aside_current(st, closed_reason(c))
        st.status = _CLOSED_STATUS.get(c.status, StoredStatus.RETRYING)
        st.reason, st.error_class, st.error = c.reason or None, c.error_class or None, c.error or None
        st.finished_at = c.finished_at if st.status in _ENDED else None

    def rerun(self, st: EpisodeState, r: EpisodeRerun) -> None:
        """The completed episode runs again: its trajectory set aside, the episode waiting for
        the new attempt. Nothing completed, or completed by the rerun's own attempt: no change."""
        if not st.completed_attempt_id or st.attempt > r.after_attempt:
            return
        self._set_aside_current(st, RERUN)
        st.completed_attempt_id, st.close_entry = "", ""
        st.attempt_closed, st.status = AttemptStatus.RETRYING, StoredStatus.RETRYING
        st.reason, st.error_class, st.ended_by, st.finished_at = errors.RERUN, None, None, None
        st.error = f"run again (interactor job rerun) by {r.who}"[:300]
        st.expected_steps, st.total_reward = 0, 0.0

    def cancel(self, st: EpisodeState, c: Cancel) -> None:
        """The episode's job was cancelled while it waited: it ends cancelled, its latest attempt
        closed by the cancel (made the current one first, if the store has not seen it yet: its
        late steps and closes then find it closed). A completed or failed episode stays so."""
        st.group_size = max(st.group_size, c.group_size)
        if st.completed_attempt_id or st.status == StoredStatus.FAILED or st.attempt_closed == AttemptStatus.CANCELLED:
            return
        if c.attempt_id and c.attempt_id != st.attempt_id:
            self._route(st, c.attempt, c.attempt_id, None)  # switches to it, unless it is older
            st.attempts = max(st.attempts, c.attempt)
        self._set_aside_current(st, f"closed:{AttemptStatus.CANCELLED}")
        st.attempt_closed = AttemptStatus.CANCELLED
        st.status = StoredStatus.CANCELLED
        st.reason, st.error_class = errors.CANCELLED, None
        st.error = "its job was cancelled (interactor cancel) while it waited"
        st.finished_at = c.cancelled_at


def plan_batch(batch: Batch, loaded: dict[str, EpisodeState]) -> Plan:
    """The row operations of ``batch``, given the stored state of its episodes (``loaded``;
    missing ones are new). Mutates and returns the states in ``plan.states``."""
    plan = Plan()
    planner = _Planner(plan)
    for episode_id in batch.episode_ids:
        events = batch.events[episode_id]
        st = loaded.get(episode_id)
        if st is None or st.placeholder:
            # a rerun of an episode this store never saw completed has nothing to set aside
            events = [e for e in events if type(e[0]) is not EpisodeRerun]
            if not events:
                continue
            first = events[0][0]
            st = EpisodeState(episode_id, job_id=first.job_id, group_id=first.group_id, env_name=first.env_name,
                              llm_model=first.llm_model, new=True)
        plan.states[episode_id] = st
        for rec, entry in events:
            t = type(rec)
            if t is StepRecord:
                planner.step(st, rec)
            elif t is Cancel:
                planner.cancel(st, rec)
            elif t is EpisodeRerun:
                planner.rerun(st, rec)
            else:
                planner.close(st, rec, entry)
    for rows in planner.pending.values():
        plan.session_steps.extend(rows)
    return plan


def settle(st: EpisodeState, stored: tuple[int, float, int, int] | None) -> None:
    """Final status and totals of an episode from what session_steps holds for it now
    (``(rows, reward sum, prompt tokens, completion tokens)``)."""
    n, reward, p_tokens, c_tokens = stored or (0, 0.0, 0, 0)
    if st.completed_attempt_id:
        st.steps = n
        st.prompt_tokens, st.completion_tokens = p_tokens, c_tokens
        st.status = StoredStatus.COMPLETED if n >= st.expected_steps else StoredStatus.COMPLETING
        return
    if st.attempt_closed and st.attempt_closed != AttemptStatus.COMPLETED:
        st.steps, st.total_reward = 0, 0.0
        return
    st.status = StoredStatus.RUNNING
    st.steps, st.total_reward = n, reward
    st.prompt_tokens, st.completion_tokens = p_tokens, c_tokens


def lost_completion(st: EpisodeState, *, max_reopens: int | None, poisoned: bool) -> str:
    """Set aside a completion whose steps can no longer all arrive (the caller moves its rows
    to superseded_steps as ``steps_lost``). Returns the episode's new status:

    * ``retrying``: the episode is to run again (the steps were lost in Redis, and a re-run
      brings new ones);
    * ``failed``: running it again cannot help or has not: a missing step was refused by the
      store and parked as poison (``poisoned``; a re-run would most likely produce the same
      data), or the episode was already reopened ``max_reopens`` times. Without this bound an
      episode whose steps never arrive would be re-run forever and its job never end."""
    lost = st.expected_steps - st.steps
    attempt_id = st.completed_attempt_id
    if poisoned:
        why = f"a step of attempt {attempt_id} was refused by the store (parked as poison)"
    elif max_reopens is not None and st.reopens >= max_reopens:
        why = f"steps lost again after {st.reopens} re-run(s)"
    else:
        why = ""
    st.completed_attempt_id = ""
    st.reason, st.error_class = STEPS_LOST, "StepsLost"
    st.error = (f"attempt {attempt_id} completed with {st.expected_steps} steps, {st.steps} reached the database"
                + (f": {why}" if why else "")) if lost > 0 else why or None
    st.steps, st.total_reward, st.close_entry = 0, 0.0, ""
    if why:
        st.status, st.attempt_closed = StoredStatus.FAILED, AttemptStatus.FAILED
        return StoredStatus.FAILED
    st.reopens += 1
    st.status, st.attempt_closed, st.finished_at = StoredStatus.RETRYING, AttemptStatus.RETRYING, None
    return StoredStatus.RETRYING


def now() -> float:
    return time.time()
