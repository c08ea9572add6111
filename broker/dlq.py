"""The dead-letter queue: episodes that failed for good, with why, ready to re-drive.

Redis has no dead-letter exchange (a rejected Celery task is simply deleted), so dead letters
are written by the same Lua script that marks the episode ``failed`` in the ledger
(broker/ledger.py), and live in a hash keyed like the other episode sets, ``"<job> <episode>"``.

The dead letters of a cancelled job (broker/cancel.py) are not re-driven: the job is never run
again. They stay in the queue, to read or purge.
"""

from __future__ import annotations

import logging
from typing import Iterable

import redis

from broker.audit import JobAudit
from broker.cancel import JobCancel, JobCancelled
from broker.keys import Keys, split_member
from broker.ledger import Ledger
from broker.pause import JobPause, resume_job
from broker.queueing import push_episodes
from broker.records import DeadLetter, unpack
from broker.settings import Settings
from broker.states import LedgerState

log = logging.getLogger("interactor.dlq")


class DeadLetterQueue:
    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.ledger = Ledger.for_settings(client, settings)

    def __len__(self) -> int:
        return int(self.r.hlen(self.keys.dlq))

    def list(self, *, job_id: str | None = None, reason: str | None = None) -> list[DeadLetter]:
        out = []
        for raw in self.r.hvals(self.keys.dlq):
            letter = unpack(raw)
            if job_id and letter.job_id != job_id:
                continue
            if reason and letter.reason != reason:
                continue
            out.append(letter)
        out.sort(key=lambda d: d.dead_at)
        return out

    def newest(self, *, job_id: str | None = None, reason: str | None = None, limit: int = 1000,
               scan_limit: int = 20_000, chunk: int = 500) -> tuple[list[DeadLetter], int, bool]:
        """The newest ``limit`` letters matching the filters, newest first, read through the
        index in chunks: a page shows a bounded number, so it must not unpack a DLQ of a million
        letters to show a thousand. Returns ``(letters, matched, complete)``: ``matched`` counts
        the matches among the letters read, and ``complete`` says whether the whole queue was
        read (otherwise ``matched`` is a lower bound). At most ``scan_limit`` letters are
        unpacked per call."""
        out: list[DeadLetter] = []
        matched = 0
        start = 0
        while start < scan_limit:
            members = self.r.zrevrange(self.keys.dlq_index, start, start + chunk - 1)
            if not members:
                return out, matched, True
            start += len(members)
            if job_id:  # the member is "<job> <episode>": skip other jobs before unpacking
                members = [m for m in members if m.decode().partition(" ")[0] == job_id]
            for raw in self.r.hmget(self.keys.dlq, members) if members else []:
                if raw is None:  # removed between the two reads
                    continue
                letter = unpack(raw)
                if reason and letter.reason != reason:
                    continue
                matched += 1
                if len(out) < limit:
                    out.append(letter)
        return out, matched, int(self.r.zcard(self.keys.dlq_index)) <= start

    def get(self, episode_id: str, job_id: str | None = None) -> DeadLetter | None:
        """One episode's letter, read by its key (episode ids start with their job id)."""
        candidates = [job_id] if job_id else [episode_id[:i] for i, ch in enumerate(episode_id) if ch == "."]
        for job in candidates:
            raw = self.r.hget(self.keys.dlq, f"{job} {episode_id}")
            if raw is not None:
                return unpack(raw)
        for key, raw in self.r.hscan_iter(self.keys.dlq, count=1000):  # an id of another shape
            if key.decode().endswith(" " + episode_id):
                return unpack(raw)
        return None

    def redrive(self, letters: Iterable[DeadLetter], who: str | None = None) -> list[str]:
        """Send dead episodes back to the queue: same episode_id and group_id, new attempts.

        The ledger move failed -> queued is the guard: a letter whose episode is no longer
        failed (re-driven by someone else meanwhile) is only removed from the queue. A letter of
        a cancelled job is left as it is (:meth:`cancelled_jobs` tells the caller which). Each
        job with an episode sent gets a ``redrive`` entry in its audit log, signed ``who``.
        """
        letters = list(letters)
        cancelled = self.cancelled_jobs(letters)
        sent, jobs = [], set()
        by_job: dict[str, list[str]] = {}
        for letter in letters:
            if letter.job_id in cancelled:
                continue
            jobs.add(letter.job_id)
            if self._redrive(letter.job_id, letter.episode_id, letter.spec.get("queue") or ""):
                sent.append(letter.episode_id)
                by_job.setdefault(letter.job_id, []).append(letter.episode_id)
            self._remove(f"{letter.job_id} {letter.episode_id}")
        if sent:
            log.info("re-drove %d dead episodes", len(sent))
        for job_id, episodes in by_job.items():
            self._audit(job_id, episodes, who)
        self._resume(jobs, who)
        return sent

    def redrive_failed(self, job_id: str, who: str | None = None) -> list[str]:
        """Re-drive every episode of a job that the ledger holds as failed, whether or not its
        letter is still there (a purged letter does not make an episode un-re-drivable).
        Refused for a cancelled job (:class:`~broker.cancel.JobCancelled`)."""
        if JobCancel(self.r, self.settings).is_cancelled(job_id):
            raise JobCancelled(job_id, "its failed episodes are not re-driven")
        failed = [e for e, st in self.ledger.states(job_id).items() if st == LedgerState.FAILED]
        specs = self.ledger.episode_specs(job_id, failed)
        sent = [e for e in failed if self._redrive(job_id, e, specs[e].queue if e in specs else "")]
        for e in sent:
            self._remove(f"{job_id} {e}")
        if sent:
            log.info("re-drove %d failed episodes of %s", len(sent), job_id)
            self._audit(job_id, sent, who)
        self._resume({job_id}, who)
        return sent

    def redrive_episodes(self, job_id: str, episode_ids: list[str], *, who: str | None = None,
                         audit: bool = True) -> list[str]:
        """Re-drive these failed episodes of one job (letter or not); returns those sent. The
        caller checked that the job is not cancelled. ``audit``: False when the caller writes the
        job's audit entry itself (a rerun that re-drove its failed episodes)."""
        specs = self.ledger.episode_specs(job_id, episode_ids)
        sent = [e for e in episode_ids if self._redrive(job_id, e, specs[e].queue if e in specs else "")]
        for e in sent:
            self._remove(f"{job_id} {e}")
        if sent and audit:
            self._audit(job_id, sent, who)
        self._resume({job_id}, who)
        return sent

    def cancelled_jobs(self, letters: Iterable[DeadLetter]) -> set[str]:
        """The jobs of ``letters`` that were cancelled: their letters are not re-driven."""
        return JobCancel(self.r, self.settings).cancelled(sorted({d.job_id for d in letters}))

    def _audit(self, job_id: str, episodes: list[str], who: str | None) -> None:
        """One ``redrive`` entry per job and call, naming the first episodes (bounded)."""
        JobAudit(self.r, self.keys).record(job_id, "redrive", {"count": len(episodes), "episodes": episodes[:20]},
                                           who=who)

    def _resume(self, job_ids: set[str], who: str | None = None) -> None:
        """A re-drive says "try again": a job that paused itself (broker/pause.py) continues,
        its parked episodes sent again, else the re-driven episodes would only be parked."""
        pause = JobPause(self.r, self.keys)
        for job_id in job_ids:
            if pause.is_paused(job_id):
                sent = resume_job(self.r, self.settings, job_id, who=who, why="redrive")
                log.info("job %s resumed by the re-drive; %d parked episodes sent again", job_id, len(sent))

    def _redrive(self, job_id: str, episode_id: str, queue: str) -> bool:
        job = self.ledger.job_spec(job_id)
        max_attempts = job.max_attempts if job else self.settings.max_attempts
        if not self.ledger.move(job_id, episode_id, LedgerState.QUEUED, [LedgerState.FAILED]):
            return False
        self.ledger.grant_fresh_attempts(job_id, episode_id, max_attempts)
        push_episodes(self.r, [(job_id, episode_id, self.settings.queue_for(queue))])
        return True

    def purge(self, letters: Iterable[DeadLetter]) -> int:
        """Forget dead letters. The episodes stay failed in the ledger and the database."""
        n = 0
        for letter in letters:
            n += self._remove(f"{letter.job_id} {letter.episode_id}")
        return n

    def withdraw(self, job_id: str, episode_id: str) -> int:
        """Remove one letter (its episode completed after all)."""
        return self._remove(f"{job_id} {episode_id}")

    def _remove(self, m: str) -> int:
        pipe = self.r.pipeline(transaction=True)
        pipe.hdel(self.keys.dlq, m)
        pipe.zrem(self.keys.dlq_index, m)
        return int(pipe.execute()[0])


__all__ = ["DeadLetterQueue", "split_member"]
