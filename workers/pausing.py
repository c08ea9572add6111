"""A worker process's side of paused jobs (broker/pause.py).

* Before START, :meth:`PauseWatch.park` hands back an episode whose job is paused, uncounted.
  Whether a job is paused is read from Redis at most once a second per job and process (a
  cached answer), so a healthy job's deliveries cost no round trip. A job whose attempts
  failed here lately (a streak under way) is asked about at every delivery instead, until one
  of its attempts completes here: once it pauses, this process starts none of it. The parking
  itself is checked in Redis (the pause may just have been lifted), so nothing is parked after
  a resume.
* When an attempt fails, :meth:`PauseWatch.failed` counts its episode towards the job's
  streak (one script: atomic across the fleet) and, when it paused the job, says so in the log.
* When one completes, or completes its first turn (the env and the model answered: the job's
  servers work), :meth:`PauseWatch.succeeded` ends the job's streak. If an attempt of
  the job failed here lately, at once (one round trip); otherwise the job is noted and a duty
  ends the streaks of the noted jobs every 0.2 s in one round trip, so a healthy job's
  successes cost nothing. A reset that comes a moment late leaves a streak longer than it is
  for that moment; a process whose own attempts fail resets at once, so a job where some
  attempts fail and others complete does not pause, while one where every attempt fails (what
  pausing is for) does.

A job with ``pause_after_failures`` 0 is never counted nor checked.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from broker.duty import Duty
from broker.keys import Keys
from broker.pause import NOT_COUNTED, JobPause
from broker.records import JobSpec

log = logging.getLogger("interactor.worker")

_CACHE_S = 1.0
_SUSPECT_S = 60.0  # after a failed attempt of a job, how long its deliveries check Redis each time
_RESET_EVERY_S = 0.2


class _StreakResets(Duty):
    name = "streak-resets"

    def __init__(self, watch: "PauseWatch"):
        super().__init__(_RESET_EVERY_S)
        self.watch = watch

    def tick(self) -> None:
        jobs = self.watch.take_successes()
        if jobs:
            pipe = self.watch.pause.r.pipeline(transaction=False)
            for job_id in jobs:
                pipe.delete(self.watch.pause.k.job_streak(job_id))
            pipe.execute()


class PauseWatch:
    def __init__(self, client: redis.Redis, keys: Keys):
        self.pause = JobPause(client, keys)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[bool, float]] = {}  # job -> (paused, read at)
        self._successes: set[str] = set()
        self._suspect: dict[str, float] = {}  # job -> until when its pause is not cached
        self._resets: _StreakResets | None = None

    def _paused(self, job_id: str) -> bool:
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(job_id)
            suspect = self._suspect.get(job_id, 0.0) > now
        if cached is not None and (cached[0] or not suspect) and now - cached[1] < _CACHE_S:
            return cached[0]
        paused = self.pause.is_paused(job_id)
        with self._lock:
            if len(self._cache) > 1024:
                self._cache.clear()
            self._cache[job_id] = (paused, now)
        return paused

    def park(self, job: JobSpec | None, episode_id: str) -> bool:
        """True when the episode was handed back because its job is paused."""
        if job is None or job.pause_after_failures <= 0 or not self._paused(job.job_id):
            return False
        if self.pause.park(job.job_id, episode_id):
            return True
        with self._lock:  # resumed meanwhile
            self._cache[job.job_id] = (False, time.monotonic())
        return False

    def failed(self, job: JobSpec | None, episode_id: str, reason: str, detail: str) -> None:
        if job is None or job.pause_after_failures <= 0 or reason in NOT_COUNTED:
            return
        try:
            paused = self.pause.record(job.job_id, reason, job.pause_after_failures, detail, episode_id)
        except redis.RedisError as exc:  # never in the way of closing the attempt
            log.warning("job %s: could not count a failed attempt towards pausing it: %s", job.job_id, exc)
            return
        with self._lock:
            if len(self._suspect) > 1024:
                self._suspect.clear()
            self._suspect[job.job_id] = time.monotonic() + _SUSPECT_S
        if paused:
            with self._lock:
                self._cache[job.job_id] = (True, time.monotonic())
            log.error("job %s paused: %d episodes in a row failed with %s; no new episode of it starts until "
                      "`interactor resume %s`", job.job_id, job.pause_after_failures, reason, job.job_id)

    def succeeded(self, job: JobSpec | None) -> None:
        if job is None or job.pause_after_failures <= 0:
            return
        with self._lock:
            now_failing = self._suspect.pop(job.job_id, None) is not None
        if now_failing:
            try:
                self.pause.record(job.job_id, "", job.pause_after_failures)
                return
            except redis.RedisError:
                pass  # the duty's round tries again
        with self._lock:
            self._successes.add(job.job_id)
            if self._resets is None:
                self._resets = _StreakResets(self).start()

    def take_successes(self) -> list[str]:
        with self._lock:
            out, self._successes = list(self._successes), set()
        return out

    def stop(self) -> None:
        if self._resets is not None:
            self._resets.stop()
