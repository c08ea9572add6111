"""What a running attempt tells the ledger of where it stands, so that a successor can continue
its env instance (broker/resume.py has the rule; broker/records.py ``Progress`` the snapshot).

The step loop (workers/loop.py) calls a :class:`ProgressTrack` at each point of a turn:

* after ``get_task_prompt`` answers: ``prompted`` with the prompt (sent in the background:
  should it not arrive before a crash, the snapshot still says ``prompting`` and the successor
  does not resume, which is safe);
* before ``step``: ``stepping``, sent at once and waited for: a ``step`` is never sent before
  the ledger knows it may be in flight (and a lapsed lease refuses the write, so a worker that
  lost its episode never steps it);
* with a step's record: nothing (the ``stepping`` snapshot before it already says that a call
  may be in flight, which is all ``prompting`` would say).

It also knows whether an env call is in flight right now: an attempt handed back at a call
boundary (the worker shutting down) leaves an exact snapshot (``ready`` or ``prompted``) with
its close, instead of the in-flight one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import orjson

from broker.records import Progress
from broker.states import ProgressPhase
from broker.tokens import pack_ids, unpack_ids


# Snapshots start with the second step: continuing an episode at its first saves only a reset
# and a prompt, and single-turn episodes (the bulk of RL rollouts) then pay nothing for
# resumability. Before the first step is recorded there is no snapshot, so a successor starts
# afresh (and closes the instance as its predecessor's).
FIRST_TRACKED_STEP = 2


class ProgressTrack:
    """One attempt's snapshots. ``mark(snapshot, urgent)`` queues one for the ledger (the
    attempt's, fenced by its lease); ``urgent`` ones are waited for. ``resume``: the
    predecessor's snapshot this attempt continues from, or None."""

    def __init__(self, trajectory: str, writer: str, mark: Callable[[Progress, bool], None],
                 resume: Progress | None = None):
        self.trajectory = trajectory
        self.writer = writer
        self._mark = mark
        self.resume = resume
        # A resumed track stands where its predecessor stopped (ready or prompted), totals and all:
        # handed back before its first call, it leaves that same point.
        self.phase = ProgressPhase(resume.phase) if resume is not None else ProgressPhase.READY
        self.step = resume.step if resume is not None else 1
        self.in_call = False
        self.answered = False
        self._prompt_json: bytes | None = resume.prompt_json if resume is not None else None
        self._totals: dict[str, Any] = _totals_of(resume) if resume is not None else {}
        # The totals of the last point at rest (prompted, or a step's record): what a hand-back
        # carries. A ``stepping`` point's totals count the answer about to be stepped, which a
        # successor resuming at ``prompted`` asks for again and counts itself.
        self._rest_totals: dict[str, Any] = dict(self._totals)

    # --- the loop's side ------------------------------------------------------------
    def resumed_totals(self) -> tuple[float, int, int, str | None, list[int] | None]:
        """(total reward, prompt tokens, completion tokens, last weight version, last turn's
        token ids) as the predecessor left them."""
        r = self.resume
        if r is None:
            return 0.0, 0, 0, None, None
        return r.total_reward, r.prompt_tokens, r.completion_tokens, r.weight_version, unpack_ids(r.prev_tokens)

    def resumed_prompt(self) -> Any:
        """The prompt the predecessor got for its last step and never stepped, or None."""
        r = self.resume
        if r is None or r.phase != ProgressPhase.PROMPTED or r.prompt_json is None:
            return None
        return orjson.loads(r.prompt_json)

    @contextlib.contextmanager
    def call(self, phase: str, step: int) -> Iterator[None]:
        """An env call that may be in flight from here (``prompting``, ``stepping``) until it
        answers. One that raised stays in flight: the request may have reached the server."""
        self.phase, self.step, self.in_call = phase, step, True
        yield
        # answered: until the answer is kept (prompted, or the step's record), the call is done
        # but no snapshot says so, and none may say it was not sent
        self.in_call, self.answered = False, True

    def prompted(self, step: int, prompt_json: bytes, **totals) -> None:
        self.phase, self.step, self._prompt_json = ProgressPhase.PROMPTED, step, prompt_json
        self.answered = False
        self._rest_totals = totals
        self._mark(self._snapshot(**totals), False)

    def stepping(self, step: int, **totals) -> None:
        self.phase, self.step = ProgressPhase.STEPPING, step
        self._mark(self._snapshot(**totals), True)

    def stepped(self, step: int, **totals) -> None:
        """Step ``step``'s record is queued: the next prompt may be in flight from here. Nothing is
        written: the ledger's ``stepping`` snapshot already tells a successor what ``prompting``
        would (a call in flight: start afresh), so a record travels alone and resuming costs two
        snapshot writes a turn, not three; a hand-back at rest (:meth:`at_rest`) still leaves
        ``ready`` with these totals."""
        self.phase, self.step, self._prompt_json = ProgressPhase.PROMPTING, step + 1, None
        self.answered = False
        self._rest_totals = totals
        self._totals = totals

    # --- the attempt's side ---------------------------------------------------------
    def supersede(self) -> None:
        """A fresh trajectory where the ledger holds another's snapshot (a predecessor's, or the
        one this attempt found gone): the ledger names this one before its reset is sent, waited
        for. Snapshots otherwise start at the second step, so without it a worker killed during
        step 1 would leave the old snapshot naming the old instance, and the successor would close
        that one while this attempt's new instance lived on in the env server."""
        self.phase, self.step = ProgressPhase.PROMPTING, 1  # an env call may be in flight from here
        self._mark(self._snapshot(), True)

    def at_rest(self) -> Progress | None:
        """The exact snapshot of an attempt stopped between env calls (handed back at a call
        boundary): the call it was about to make was not sent. None while a call may be in flight,
        or has answered without its answer kept yet."""
        if self.in_call or self.answered or self.step < FIRST_TRACKED_STEP:
            return None  # before the first step's record there is nothing to continue (see below)
        phase = {ProgressPhase.PROMPTING: ProgressPhase.READY,
                 ProgressPhase.STEPPING: ProgressPhase.PROMPTED}.get(self.phase, self.phase)
        if phase == ProgressPhase.PROMPTED and self._prompt_json is None:
            return None
        return self._snapshot(phase=phase, **self._rest_totals)

    def _snapshot(self, phase: str | None = None, **totals) -> Progress:
        if totals:
            self._totals = totals
        t = self._totals
        prev = t.get("prev_tokens")
        return Progress(trajectory=self.trajectory, phase=phase or self.phase, step=self.step,
                        total_reward=t.get("total_reward", 0.0), prompt_tokens=t.get("prompt_tokens", 0),
                        completion_tokens=t.get("completion_tokens", 0),
                        prompt_json=self._prompt_json if (phase or self.phase) == ProgressPhase.PROMPTED else None,
                        weight_version=t.get("weight_version"),
                        prev_tokens=pack_ids(prev) if prev is not None else None, writer=self.writer)


def _totals_of(p: Progress) -> dict[str, Any]:
    """A snapshot's running totals, as the loop hands them to the track."""
    return {"total_reward": p.total_reward, "prompt_tokens": p.prompt_tokens, "completion_tokens": p.completion_tokens,
            "weight_version": p.weight_version, "prev_tokens": unpack_ids(p.prev_tokens)}
