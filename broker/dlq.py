"""The dead-letter queue: episodes that failed for good, with why, ready to re-drive.

Redis has no dead-letter exchange (a rejected Celery task is simply deleted), so dead letters
are written by the same Lua script that marks the episode ``failed`` in the ledger
(broker/ledger.py), and live in a hash keyed like the other episode sets, ``"<job> <episode>"``.
"""

from __future__ import annotations

import logging
from typing import Iterable

import redis

from broker.keys import Keys, split_member
from broker.ledger import Ledger
from broker.queueing import send_episodes
from broker.records import FAILED, QUEUED, DeadLetter, unpack
from broker.settings import Settings

log = logging.getLogger("interactor.dlq")


class DeadLetterQueue:
    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.ledger = Ledger(client, self.keys, settings.lease_ttl_s)

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

    def get(self, episode_id: str) -> DeadLetter | None:
        for letter in self.list():
            if letter.episode_id == episode_id:
                return letter
        return None

    def redrive(self, letters: Iterable[DeadLetter]) -> list[str]:
        """Send dead episodes back to the queue: same episode_id and group_id, new attempts.

        The ledger move failed -> queued is the guard: a letter whose episode is no longer
        failed (re-driven by someone else meanwhile) is only removed from the queue.
        """
        sent = []
        for letter in letters:
            m = f"{letter.job_id} {letter.episode_id}"
            job = self.ledger.job_spec(letter.job_id)
            max_attempts = job.max_attempts if job else self.settings.max_attempts
            if self.ledger.move(letter.job_id, letter.episode_id, QUEUED, [FAILED]):
                # A fresh budget of attempts on top of those already used.
                used = self.ledger.attempts(letter.job_id, letter.episode_id)
                self.r.hset(self.keys.job_attempt_limit(letter.job_id), letter.episode_id, used + max_attempts)
                queue = letter.spec.get("queue") or self.settings.queue
                send_episodes(self.r, [(letter.job_id, letter.episode_id, queue)])
                sent.append(letter.episode_id)
            self._remove(m)
        if sent:
            log.info("re-drove %d dead episodes", len(sent))
        return sent

    def purge(self, letters: Iterable[DeadLetter]) -> int:
        """Forget dead letters. The episodes stay failed in the ledger and the database."""
        n = 0
        for letter in letters:
            n += self._remove(f"{letter.job_id} {letter.episode_id}")
        return n

    def _remove(self, m: str) -> int:
        pipe = self.r.pipeline(transaction=True)
        pipe.hdel(self.keys.dlq, m)
        pipe.zrem(self.keys.dlq_index, m)
        return int(pipe.execute()[0])


__all__ = ["DeadLetterQueue", "split_member"]
