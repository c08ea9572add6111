"""Cancelling a job: ``interactor cancel JOB`` stops it cleanly.

What a cancel does, and who does it:

* It marks the job cancelled (``Keys.job_cancel``), once. From then on nothing of the job
  starts: the ledger's START refuses its episodes (a task message still in a queue is dropped
  when a worker receives it), a feed job's continuous producer stops producing for it
  (producer/continuous.py), and a pause of the job is lifted (there is nothing left to resume).
* Its waiting episodes, queued or retrying, become ``cancelled`` at once (:meth:`JobCancel.
  cancel_waiting`): counted, taken off the retry schedule and the reservations, and announced to
  the results store in the same script (an :class:`~broker.records.EpisodesCancelled` record), so
  the store shows them cancelled. No attempt is spent on them. An env instance one of them kept
  for its next attempt (handed back at a worker's shutdown, or left by a lost worker) is queued
  for the orphan closers (workers/orphans.py) in the same script.
* Its running episodes end where they run: the lease renewal (every third of the lease TTL at
  most) tells the attempt (broker/ledger.py ``_RENEW``), which stops before its next call, closes
  its env instance and closes as ``cancelled`` (workers/attempt.py): not a failure, no dead letter,
  its partial trajectory set aside. One whose worker died is ended cancelled by the sweeper
  once its lease expired (broker/recovery.py).
* What completed or failed before stays as it is.

An attempt that closed as handed back or retrying in the very moment of the cancel (before a
renewal told it) leaves its episode waiting again; such stragglers are cancelled by the next
pass: the sweeper's reconcile makes one for every cancelled job with waiting episodes, and
``interactor cancel`` makes one each time it looks while it waits. So a cancelled job is
finished once nothing of it runs: ``interactor run`` stops waiting for it, ``interactor status``
shows it finished, and retention expires its keys.

A cancelled job stays cancelled: a re-drive of its dead letters and ``interactor run --resume``
refuse it (:class:`JobCancelled`); its completed episodes are in the results store, and what is
left is run by submitting a new job. Cancelling twice changes nothing more than the first time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import redis

from broker import closing
from broker.audit import JobAudit
from broker.keys import Keys
from broker.ledger import COUNTS_FN, Ledger
from broker.lua_scripts import lua_file
from broker.records import EpisodesCancelled
from broker.settings import Settings
from broker.states import LEDGER_WAITING, LedgerState

CHUNK = 1000  # episodes per cancelling script (and per EpisodesCancelled record)

# Its scripts' Lua: broker/lua/cancel_*.lua (broker/lua_scripts.py).
_MARK = lua_file("cancel_mark")
_CANCEL_WAITING = COUNTS_FN + lua_file("cancel_waiting")


class JobCancelled(ValueError):
    """What was asked of a cancelled job is refused (it is never run again)."""

    def __init__(self, job_id: str, refused: str):
        super().__init__(f"job {job_id!r} was cancelled (interactor cancel): {refused}. Its completed episodes "
                         "are in the results store; submit a new job to run the rest")
        self.job_id = job_id


@dataclass(frozen=True)
class CancelReport:
    """What :meth:`JobCancel.cancel` did: whether the job was cancelled before (``already``),
    how many waiting episodes this call cancelled, and how many ran (their workers stop them)."""

    job_id: str
    already: bool
    waiting: int
    running: int


class JobCancel:
    """Cancelled jobs, in Redis: the CLI cancels, the sweeper finishes what a cancel left,
    and everything that would run a job again asks :meth:`is_cancelled` first."""

    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.keys = Keys(settings.key_prefix)
        self.ledger = Ledger.for_settings(client, settings)
        self._mark = client.register_script(_MARK)
        self._cancel_waiting = client.register_script(_CANCEL_WAITING)

    def cancel(self, job_id: str, who: str | None = None) -> CancelReport | None:
        """Cancel the job (None: no such job in Redis): mark it, cancel its waiting episodes,
        and count those still running (their renewals tell them). The first cancel is entered
        in the job's audit log, signed ``who`` (broker/audit.py)."""
        k = self.keys
        marked = int(self._mark(keys=[k.job_spec(job_id), k.job_cancel(job_id), k.job_pause(job_id),
                                      k.job_streak(job_id), k.job_parked(job_id)], args=[time.time()]))
        if marked < 0:
            return None
        waiting = self.cancel_waiting(job_id)
        running = self.ledger.counts(job_id)[LedgerState.RUNNING]
        if marked > 0:
            JobAudit(self.r, self.keys).record(job_id, "cancel", {"waiting_cancelled": waiting, "running_to_stop": running},
                                               who=who)
        return CancelReport(job_id, already=marked == 0, waiting=waiting, running=running)

    def is_cancelled(self, job_id: str) -> bool:
        return bool(self.r.exists(self.keys.job_cancel(job_id)))

    def cancelled(self, job_ids: Sequence[str]) -> set[str]:
        """The cancelled ones among ``job_ids`` (one round trip)."""
        if not job_ids:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(self.keys.job_cancel(job_id))
        return {j for j, yes in zip(job_ids, pipe.execute()) if yes}

    def cancelled_at(self, job_id: str) -> float | None:
        at = self.r.hget(self.keys.job_cancel(job_id), "at")
        return float(at) if at else None

    def cancel_waiting(self, job_id: str) -> int:
        """Cancel the waiting (queued, retrying) episodes of a cancelled job, ``CHUNK`` per
        script; returns how many. Nothing to do (no waiting episode by the job's counts) costs
        one read; so the sweeper can call it for every cancelled job it sees waiting."""
        counts = self.ledger.counts(job_id)
        if not any(counts[s] for s in LEDGER_WAITING):
            return 0
        job = self.ledger.job_spec(job_id)
        model = job.model if job is not None else ""
        done, batch = 0, []
        for episode_id, state in self.r.hscan_iter(self.keys.job_state(job_id), count=CHUNK):
            if state.decode() in LEDGER_WAITING:
                batch.append((episode_id.decode(), state.decode()))
            if len(batch) >= CHUNK:
                done += self._cancel_chunk(job_id, model, batch)
                batch = []
        if batch:
            done += self._cancel_chunk(job_id, model, batch)
        return done

    def _cancel_chunk(self, job_id: str, model: str, waiting: list[tuple[str, str]]) -> int:
        """One script's worth: the record names each episode's group, env and latest attempt
        (for the store: a cancel closes that attempt), read before the script runs, and the env
        instance each may leave open, which the script queues for closing with the episodes it
        cancels: a queued episode's (handed back or re-queued after a lost worker, its instance
        kept for the next attempt: the one its snapshot names, else its latest attempt's). A
        retrying episode's attempt closed its own."""
        episode_ids = [episode_id for episode_id, _ in waiting]
        specs = self.ledger.episode_specs(job_id, episode_ids)
        attempts = self.ledger.latest_attempts(job_id, episode_ids)
        snapshots = self.ledger.progresses(job_id, episode_ids)
        rows, per_episode = [], []
        for (episode_id, state), latest, snapshot in zip(waiting, attempts, snapshots):
            spec = specs.get(episode_id)
            rows.append([episode_id, spec.group_id if spec else None, spec.group_size if spec else 0,
                         spec.env_name if spec else "", *latest])
            kept = snapshot.trajectory_key if snapshot is not None else latest
            left_open = closing.orphans(spec, [kept]) if state == LedgerState.QUEUED else []
            per_episode += [episode_id, len(left_open), *left_open]
        record = EpisodesCancelled(job_id=job_id, episodes=rows, llm_model=model).pack()
        k = self.keys
        n = int(self._cancel_waiting(keys=[k.job_state(job_id), k.job_counts(job_id), k.retry, k.reserved, k.results,
                                           k.job_cancel(job_id), k.orphans, k.job_progress(job_id),
                                           k.job_progress_seq(job_id)], args=[record, job_id, *per_episode]))
        return max(0, n)


__all__ = ["CancelReport", "JobCancel", "JobCancelled"]
